"""Observation noise: the noise description a dataset stores (checked by
:func:`check_noise`) and the noise it describes, drawn reproducibly from its seed
(:func:`add_noise`, and per frame :func:`add_noise_block`).

``sigma`` is one number for every field or a mapping field → number.
A description without a seed records a measured level only (a recording's noise, written by
``pdefit.write_dataset(..., noise_sigma=...)`` or ``pdefit-import --noise-sigma``): the fit
weighs and judges its residual by it, but it cannot be drawn again."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pdefit.data.checks import DatasetError, is_int, is_real

__all__ = ["add_noise", "add_noise_block", "check_noise", "recorded_noise"]

# Keys each noise kind accepts; anything else is most likely a typo (e.g. "sigam") that
# would otherwise silently produce noise-free data.
_NOISE_KEYS = {
    "none": frozenset({"kind"}),
    "additive": frozenset({"kind", "sigma", "seed", "streams"}),
    "relative": frozenset({"kind", "sigma", "seed", "streams"}),
}
# ``streams``: PER_FIELD where each field has its own random stream (datasets written before
# it existed drew the same numbers for every field, and are still drawn that way).
PER_FIELD = "per_field"


def check_noise(noise: Mapping[str, Any]) -> None:
    """Raise DatasetError unless ``noise`` is a valid noise description.

    A random kind with a ``seed`` regenerates the same data; without one it only records the
    level of noise that was measured, not drawn here (a recording's).
    """
    if not isinstance(noise, Mapping) or "kind" not in noise:
        raise DatasetError(f"noise must be a dict with a 'kind' key, got {noise!r}")
    kind = noise["kind"]
    if kind not in _NOISE_KEYS:
        raise DatasetError(f"unknown noise kind {kind!r}; expected one of {sorted(_NOISE_KEYS)}")
    extra = set(noise) - _NOISE_KEYS[kind]
    if extra:
        raise DatasetError(
            f"noise kind {kind!r} takes keys {sorted(_NOISE_KEYS[kind])}, got unexpected "
            f"{sorted(extra)}"
        )
    if kind == "none":
        return
    sigma = noise.get("sigma")
    levels = sigma.values() if isinstance(sigma, Mapping) and sigma else [sigma]
    if not all(is_real(s) and math.isfinite(s) and s >= 0 for s in levels):
        raise DatasetError(f"noise sigma must be a finite float >= 0 or a mapping field -> "
                           f"such a float, got {sigma!r}")
    if noise.get("streams", PER_FIELD) != PER_FIELD:
        raise DatasetError(f"noise streams must be {PER_FIELD!r}, got {noise['streams']!r}")
    seed = noise.get("seed")
    if seed is not None and (not is_int(seed) or seed < 0):
        raise DatasetError(f"noise kind {kind!r} needs an int seed >= 0, got {seed!r}")


def recorded_noise(sigma: float | Mapping[str, float], fields: Sequence[str]) -> dict[str, Any]:
    """The description of additive noise of level ``sigma`` (a number, or field → number for
    some of ``fields``) measured in a recording (no seed: it is not drawn again)."""
    if isinstance(sigma, Mapping):
        unknown = sorted(set(sigma) - set(fields))
        if unknown:
            raise DatasetError(f"noise_sigma names unknown field(s) {unknown}; fields are "
                               f"{list(fields)}")
        level: Any = {str(f): float(v) if is_real(v) else v for f, v in sigma.items()}
    else:
        level = float(sigma) if is_real(sigma) else sigma
    noise = {"kind": "additive", "sigma": level}
    check_noise(noise)
    return noise


def add_noise(
    values: np.ndarray, noise: Mapping[str, Any], *, key: Sequence[int] = ()
) -> np.ndarray:
    """Return ``values`` with noise applied, as float32.

    ``"additive"``: ``values + sigma * N(0, 1)``; ``"relative"``: ``values * (1 + sigma *
    N(0, 1))``; ``"none"``: unchanged.  The generator is ``np.random.default_rng(seed)``, or
    ``default_rng([seed, *key])`` when ``key`` is given, which gives independent streams
    for different parts of a dataset (see :func:`add_noise_block`).
    """
    check_noise(noise)
    values = np.asarray(values)
    if noise["kind"] == "none":
        return values.astype(np.float32)
    if noise.get("seed") is None or isinstance(noise["sigma"], Mapping):
        raise DatasetError(f"noise {dict(noise)!r} records a measured level (no seed, or one "
                           "level per field) and cannot be drawn: drawing needs an int seed "
                           "and one sigma")
    seed = int(noise["seed"])
    rng = np.random.default_rng([seed, *map(int, key)] if key else seed)
    # Draw in float64 so float32 inputs do not change the random stream or its precision.
    scaled = float(noise["sigma"]) * rng.standard_normal(values.shape)
    if noise["kind"] == "additive":
        return (values + scaled).astype(np.float32)
    return (values * (1.0 + scaled)).astype(np.float32)


def add_noise_block(
    values: np.ndarray, noise: Mapping[str, Any], *, experiment: int, frame_start: int,
    stream: int = 0,
) -> np.ndarray:
    """Noise for a ``(n, ny, nx)`` block of frames, identical however frames are blocked.

    Each frame gets its own stream keyed by (experiment, frame), so a dataset written by
    parallel shard writers carries the same noise as one written in a single pass, and
    writers never reuse each other's random numbers. ``stream``: the field's position in the
    dataset; where ``noise["streams"]`` is ``"per_field"`` it keys the stream too, so that
    fields carry independent noise (the first field keeps the key it always had).
    """
    values = np.asarray(values)
    out = np.empty(values.shape, dtype=np.float32)
    own = stream if noise.get("streams") == PER_FIELD else 0
    for i, frame in enumerate(values):
        key = (experiment, frame_start + i, *((own,) if own else ()))
        out[i] = add_noise(frame, noise, key=key)
    return out
