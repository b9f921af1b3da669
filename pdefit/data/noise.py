"""Observation noise: the noise description a dataset stores (checked by
:func:`check_noise`) and the noise it describes, drawn reproducibly from its seed
(:func:`add_noise`, and per frame :func:`add_noise_block`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pdefit.data.checks import DatasetError, is_int, is_real

__all__ = ["add_noise", "add_noise_block", "check_noise"]

# Keys each noise kind accepts; anything else is most likely a typo (e.g. "sigam") that
# would otherwise silently produce noise-free data.
_NOISE_KEYS = {
    "none": frozenset({"kind"}),
    "additive": frozenset({"kind", "sigma", "seed"}),
    "relative": frozenset({"kind", "sigma", "seed"}),
}


def check_noise(noise: Mapping[str, Any]) -> None:
    """Raise DatasetError unless ``noise`` is a valid noise description.

    A seed is required for random kinds: the description is stored with the dataset, and
    it is only worth storing if it regenerates the same data.
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
    if not is_real(sigma) or not math.isfinite(sigma) or sigma < 0:
        raise DatasetError(f"noise sigma must be a finite float >= 0, got {sigma!r}")
    seed = noise.get("seed")
    if not is_int(seed) or seed < 0:
        raise DatasetError(f"noise kind {kind!r} needs an int seed >= 0, got {seed!r}")


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
    seed = int(noise["seed"])
    rng = np.random.default_rng([seed, *map(int, key)] if key else seed)
    # Draw in float64 so float32 inputs do not change the random stream or its precision.
    scaled = float(noise["sigma"]) * rng.standard_normal(values.shape)
    if noise["kind"] == "additive":
        return (values + scaled).astype(np.float32)
    return (values * (1.0 + scaled)).astype(np.float32)


def add_noise_block(
    values: np.ndarray, noise: Mapping[str, Any], *, experiment: int, frame_start: int
) -> np.ndarray:
    """Noise for a ``(n, ny, nx)`` block of frames, identical however frames are blocked.

    Each frame gets its own stream keyed by (experiment, frame), so a dataset written by
    parallel shard writers carries the same noise as one written in a single pass, and
    writers never reuse each other's random numbers.
    """
    values = np.asarray(values)
    out = np.empty(values.shape, dtype=np.float32)
    for i, frame in enumerate(values):
        out[i] = add_noise(frame, noise, key=(experiment, frame_start + i))
    return out
