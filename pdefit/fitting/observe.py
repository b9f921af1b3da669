"""Observation operators and misfit losses.

An :class:`Observation` says which fields are observed (state fields, or quantities derived
from the state by the system's ``observables(state)``, e.g. a velocity from a vorticity), at
which spatial stride, and how the misfit is normalised. :func:`observed_data` turns dataset
arrays into the device-side :class:`ObservedData` the loss reads inside the time loop:
observed frames are addressed by a step → slot table, so frames need not be equally spaced
and the predicted trajectory is never stored. Missing values are carried by weights (0 where
not observed), never by NaN.

Noise: where the observed fields' additive noise levels σ_f are known (``observe.noise_sigma``
or the dataset's record, :func:`noise_levels`), each field's misfit is weighted by 1/σ_f²
relative to their mean (:func:`noise_weights`, :func:`weighted_by_noise`): one field, or equal
levels, leave the loss as it is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.parallel.processes import host_array

LOSSES = ("mse", "relative_mse")


class ObservedData(NamedTuple):
    """What the in-loop loss reads; arrays have a leading experiment axis except
    ``slot_of_step`` (shared by all experiments)."""

    values: dict[str, jnp.ndarray]   # field -> (n_exp, n_slots, ny', nx'), zero where missing
    weights: dict[str, jnp.ndarray]  # field -> same shape, 1 where observed, else 0
    scale: dict[str, jnp.ndarray]    # field -> (n_exp,), 1 / normaliser of that field's misfit
    slot_of_step: jnp.ndarray        # (n_steps + 1,) int32, slot of the frame at that step or -1


@dataclass(frozen=True)
class Observation:
    """Which fields are observed and how the misfit is measured.

    ``loss="mse"`` averages squared errors over observed points (summed over fields, each with
    its own mean); ``"relative_mse"`` divides each field's squared error by the mean square of
    its observations, so fields of different magnitude weigh alike. ``derive`` (the system's
    ``observables``) computes the observed names that are not state fields.
    """

    fields: tuple[str, ...]
    stride: int = 1
    loss: str = "mse"
    field_weights: tuple[tuple[str, float], ...] = ()
    derive: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    # The noise level σ of each observed field the weights include (empty: none known), and
    # where it comes from ("observe.noise_sigma" or "dataset").
    noise_sigma: tuple[tuple[str, float], ...] = ()
    noise_source: str = ""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {LOSSES}")
        if self.stride < 1:
            raise ValueError(f"observation stride must be >= 1, got {self.stride}")
        if not self.fields:
            raise ValueError("observe at least one field")

    def on_grid(self, grid: Any) -> Observation:
        """This observation of states on ``grid`` (the whole grid, or one tile of a mesh): a
        ``derive`` that takes a ``grid`` keyword (``observables(state, grid)``, for quantities
        derived by global transforms) is handed it."""
        if self.derive is None or "grid" not in inspect.signature(self.derive).parameters:
            return self
        return replace(self, derive=functools.partial(self.derive, grid=grid))

    def project(self, state: Mapping[str, jnp.ndarray]) -> dict[str, jnp.ndarray]:
        """The observed part of a model state."""
        s = self.stride
        if self.derive is not None and any(f not in state for f in self.fields):
            state = {**state, **self.derive(state)}
        return {f: state[f][..., ::s, ::s] for f in self.fields}

    def misfit(self, state: Mapping[str, jnp.ndarray], data: ObservedData, slot: Any,
               ) -> jnp.ndarray:
        """Weighted squared error of one state against observed frame ``slot`` (one experiment:
        ``data`` arrays here have no experiment axis)."""
        weights = dict(self.field_weights)
        total = jnp.zeros((), jnp.result_type(*jax.tree.leaves(state)))
        for name, predicted in self.project(state).items():
            obs = data.values[name][slot]
            w = data.weights[name][slot]
            total = total + weights.get(name, 1.0) * data.scale[name] * jnp.sum(
                w * (predicted - obs) ** 2)
        return total

    @staticmethod
    def observed(data: ObservedData, n: Any) -> jnp.ndarray:
        """Whether a frame is observed at step ``n``."""
        return data.slot_of_step[n] >= 0

    def cost(self, state, data: ObservedData, n: Any) -> jnp.ndarray:
        """The loss term at step ``n`` (zero where no frame is observed)."""
        slot = data.slot_of_step[n]
        return jax.lax.cond(
            slot >= 0,
            lambda: self.misfit(state, data, jnp.maximum(slot, 0)),
            lambda: zero_like_state(state),
        )


NOISE_KEY = "observe.noise_sigma"


def check_noise_sigma(value: Any, fields: Sequence[str]) -> dict[str, float] | None:
    """``observe.noise_sigma`` (a number, or field → number) as σ per observed field (None
    when not given); ValueError naming the key where a level is not a positive number or a
    mapping misses or adds a field."""
    if value is None:
        return None
    levels = dict(value) if isinstance(value, Mapping) else dict.fromkeys(fields, value)
    extra = sorted(set(levels) - set(fields))
    missing = [f for f in fields if f not in levels]
    if extra or missing:
        raise ValueError(f"{NOISE_KEY}: give one number, or a level for every observed field "
                         f"(observe.fields={list(fields)}); unknown {extra}, missing {missing}")
    out = {}
    for name, level in levels.items():
        try:
            out[name] = float(level)
        except (TypeError, ValueError):
            out[name] = float("nan")
        if not (np.isfinite(out[name]) and out[name] > 0) or isinstance(level, bool):
            raise ValueError(f"{NOISE_KEY}: the level of {name!r} must be a positive number, "
                             f"got {level!r}")
    return out


def noise_levels(override: Any, recorded: Mapping[str, Any] | None, fields: Sequence[str],
                 ) -> tuple[dict[str, float] | None, str]:
    """(σ per observed field, its source): ``observe.noise_sigma`` (``override``) where
    given, else the dataset's record of additive noise (``recorded``, its ``noise``
    attribute) where it gives a level for every observed field; (None, "") otherwise."""
    given = check_noise_sigma(override, fields)
    if given is not None:
        return given, NOISE_KEY
    if not recorded or recorded.get("kind") != "additive":
        return None, ""
    sigma = recorded.get("sigma")
    levels = ({f: sigma.get(f) for f in fields} if isinstance(sigma, Mapping)
              else dict.fromkeys(fields, sigma))
    if any(v is None for v in levels.values()):
        return None, ""
    return {f: float(v) for f, v in levels.items()}, "dataset"


def noise_weights(sigma: Mapping[str, float]) -> dict[str, float]:
    """Relative weights 1/σ_f² of the fields' misfits, scaled to mean 1 over the fields: one
    field, or equal levels, weigh 1 (the loss unchanged). Empty where a level is not positive
    (noise-free data weigh nothing more than the others)."""
    inverse = {f: 1.0 / s**2 for f, s in sigma.items() if s > 0}
    if not inverse or len(inverse) != len(sigma):
        return {}
    mean = sum(inverse.values()) / len(inverse)
    return {f: v / mean for f, v in inverse.items()}


def weighted_by_noise(observation: Observation, sigma: Mapping[str, float] | None,
                      source: str) -> Observation:
    """``observation`` with each field's weight multiplied by its noise weight
    (:func:`noise_weights`) and the levels recorded (unchanged without ``sigma``)."""
    if not sigma:
        return observation
    weights = dict(observation.field_weights)
    relative = noise_weights(sigma)
    if any(abs(w - 1.0) > 1e-12 for w in relative.values()):
        weights = {f: weights.get(f, 1.0) * relative[f] for f in observation.fields}
    return replace(observation, field_weights=tuple(sorted(weights.items())),
                   noise_sigma=tuple(sorted(sigma.items())), noise_source=source)


def observable_names(system: Any, grid: Any) -> tuple[str, ...]:
    """Names ``system.observables(state)`` returns (none without that method): the system's
    ``observable_names`` if it declares them, else found by tracing shapes only."""
    declared = getattr(system, "observable_names", None)
    if declared is not None:
        return tuple(declared)
    if not hasattr(system, "observables"):
        return ()
    state = {f: jax.ShapeDtypeStruct(tuple(grid.shape), jnp.float32) for f in system.fields}
    return tuple(jax.eval_shape(system.observables, state))


def zero_like_state(state) -> jnp.ndarray:
    """A scalar zero that is typed like a reduction of the state: inside ``shard_map`` it is
    "varying" over the same mesh axes as the state (a plain ``zeros(())`` is not, and control
    flow then refuses to join the two), and it costs nothing (a sum over an empty slice)."""
    leaf = jax.tree.leaves(state)[0]
    return jnp.sum(leaf[..., :0, :0])


def observed_data(observation: Observation, values: Mapping[str, Any],
                  masks: Mapping[str, Any | None], frame_steps: Sequence[int],
                  n_steps: int, dtype: Any) -> ObservedData:
    """Device arrays for the in-loop loss. ``values[f]`` is (n_exp, n_frames, ny, nx) already
    strided like the model projection (NumPy or a sharded global array: the result keeps its
    placement); ``masks[f]`` is a bool array of the same shape or None; ``frame_steps[j]`` is
    the step index of frame j."""
    slot_of_step = np.full(n_steps + 1, -1, np.int32)
    for slot, step in enumerate(frame_steps):
        if not 0 <= step <= n_steps:
            raise ValueError(f"frame at step {step} lies outside the rollout [0, {n_steps}]")
        slot_of_step[step] = slot
    vals, weights, scale = {}, {}, {}
    for name in observation.fields:
        v = jnp.asarray(values[name], dtype)
        m = masks.get(name)
        w = jnp.ones(v.shape, bool) if m is None else jnp.asarray(m, bool)
        v, count, norm = _zero_missing_and_normalisers(v, w)
        count, norm = host_array(count), host_array(norm)
        if np.any(count == 0):
            raise ValueError(f"field {name!r} has an experiment with no observed value")
        if observation.loss == "relative_mse":
            if np.any(norm == 0):
                raise ValueError(f"relative_mse needs nonzero observations of {name!r}")
        else:
            norm = count
        vals[name] = v
        weights[name] = w.astype(dtype)
        scale[name] = jnp.asarray(1.0 / norm, dtype)
    return ObservedData(vals, weights, scale, jnp.asarray(slot_of_step))


def unobserved_after_first(masks: Mapping[str, Any | None]) -> list[str]:
    """The fields whose mask (n_exp, n_frames, ...; None: all observed) has no observed point
    after the first frame of the window: the first frame is the initial state (the data
    themselves where they are not fitted), so such a field constrains nothing and a fit on it
    stops at once at its start values."""
    return [name for name, mask in masks.items()
            if mask is not None and int(host_array(_observed_after_first(mask))) == 0]


@jax.jit
def _observed_after_first(mask):
    return jnp.sum(mask[:, 1:])


@jax.jit
def _zero_missing_and_normalisers(values, weights):
    values = jnp.where(weights, values, 0.0)
    axes = tuple(range(1, values.ndim))
    return values, jnp.sum(weights, axis=axes), jnp.sum(values**2, axis=axes)
