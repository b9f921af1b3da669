"""Parameter specs, transforms and the split between fitted and fixed parameters.

The optimiser works on unconstrained values ``z``; the physics sees physical values ``p``:
- ``identity``: p = scale · z (scale brings the value to order one);
- ``log``:      p = exp(z), for positive quantities that span decades;
- ``bounded``:  p = lower + (upper − lower) · sigmoid(z), for quantities with hard limits.
Bounds of identity/log parameters are enforced on the starting values (an error, not a clip)
and, during a fit, by the step control (:func:`ParamSpec.unconstrained_bounds`: the optimiser's
steps are projected onto them, pdefit.fitting.optimisers).

Parameters are scalars unless their spec has a ``shape`` (e.g. a force field on space–time
nodes); the transform then applies elementwise and a scalar value means "that value
everywhere". A fitted parameter may be *per experiment*: its unconstrained value then carries
a leading experiment axis, ``(n_exp, *shape)``, and each experiment's rollout sees its own row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TRANSFORMS = ("identity", "log", "bounded")


class ParameterError(ValueError):
    """A parameter name, value or transform that cannot be used."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a system: a scalar, or an array of ``shape`` whose elements share the
    default, transform and bounds. ``smooth_axes`` are the axes along which neighbouring
    elements are nodes of a smooth function (what a smoothness penalty differences; the
    others, e.g. vector components, are not), ``periodic_axes`` those of them that wrap."""

    default: float
    transform: str = "identity"
    lower: float = -math.inf
    upper: float = math.inf
    scale: float = 1.0
    unit: str = ""
    doc: str = ""
    shape: tuple[int, ...] = ()
    smooth_axes: tuple[int, ...] = ()
    periodic_axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ParameterError(
                f"unknown transform {self.transform!r}; choose one of {TRANSFORMS}")
        if self.transform == "bounded" and not (
            math.isfinite(self.lower) and math.isfinite(self.upper) and self.lower < self.upper
        ):
            raise ParameterError("a bounded parameter needs finite lower < upper")
        if self.transform == "log" and self.lower < 0:
            object.__setattr__(self, "lower", 0.0)
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if any(n < 1 for n in self.shape):
            raise ParameterError(f"parameter shape must have positive sizes, got {self.shape}")
        bad = [a for a in (*self.smooth_axes, *self.periodic_axes)
               if not 0 <= a < len(self.shape)]
        if bad:
            raise ParameterError(f"smooth/periodic axes {bad} outside shape {self.shape}")

    def full(self, value: Any) -> np.ndarray | float:
        """``value`` (a scalar or an array of ``shape``) as this parameter's value: a float for
        a scalar parameter, else an array of ``shape``."""
        if not self.shape:
            if np.ndim(value) != 0:
                raise ParameterError(f"a scalar parameter got an array of shape "
                                     f"{np.shape(value)}")
            return float(value)
        if np.shape(value) not in ((), self.shape):
            raise ParameterError(f"an array parameter of shape {self.shape} got shape "
                                 f"{np.shape(value)} (give a scalar or that shape)")
        return np.broadcast_to(np.asarray(value, np.float64), self.shape).copy()

    def valid(self, values: np.ndarray) -> np.ndarray:
        """Elementwise: finite, > 0 under a log transform, and inside the bounds (strictly
        for the bounded transform, whose unconstrained value is infinite there; a log
        parameter may sit on a finite positive bound, where a fit's step control may have
        left it)."""
        values = np.asarray(values, np.float64)
        ok = np.isfinite(values)
        if self.transform == "log":
            ok &= values > 0
        if self.transform == "bounded":
            return ok & (values > self.lower) & (values < self.upper)
        return ok & (values >= self.lower) & (values <= self.upper)

    def unconstrained_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the unconstrained value that keep the physical value inside
        [lower, upper]: ±inf where a side is open (and for the bounded transform, whose
        sigmoid never reaches its bounds)."""
        if self.transform == "bounded":
            return -math.inf, math.inf
        if self.transform == "log":
            return (math.log(self.lower) if self.lower > 0 else -math.inf,
                    math.log(self.upper) if math.isfinite(self.upper) else math.inf)
        ends = sorted((self.lower / self.scale, self.upper / self.scale))
        return ends[0], ends[1]

    def check(self, name: str, value: Any) -> None:
        """Raise if ``value`` (a scalar, or an array of values) is not a valid physical value
        for this parameter, naming the first offending element of an array."""
        flat = np.atleast_1d(np.asarray(value, np.float64)).ravel()
        bad = ~self.valid(flat)
        if not np.any(bad):
            return
        index = int(np.argmax(bad))
        label = name if np.ndim(value) == 0 else f"{name}[{index}]"
        value = float(flat[index])
        if not math.isfinite(value):
            raise ParameterError(f"parameter {label!r}: value {value} is not finite")
        if self.transform == "log" and value <= 0:
            raise ParameterError(f"parameter {label!r} has a log transform and needs a value > "
                                 f"0, got {value}")
        raise ParameterError(f"parameter {label!r}: value {value} is outside its bounds "
                             f"[{self.lower}, {self.upper}]")

    def to_unconstrained(self, value: Any) -> Any:
        if self.transform == "log":
            return jnp.log(value)
        if self.transform == "bounded":
            frac = (value - self.lower) / (self.upper - self.lower)
            return jnp.log(frac) - jnp.log1p(-frac)
        return value / self.scale

    def to_physical(self, z: Any) -> Any:
        if self.transform == "log":
            return jnp.exp(z)
        if self.transform == "bounded":
            return self.lower + (self.upper - self.lower) * jax.nn.sigmoid(z)
        return self.scale * z


@dataclass(frozen=True)
class ParameterLayout:
    """Which parameters are fitted (and how), which of those are per experiment, and the values
    of the fixed ones (floats, or arrays for array parameters)."""

    specs: Mapping[str, ParamSpec]
    fitted: tuple[str, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    per_experiment: tuple[str, ...] = ()
    # Per-experiment parameters whose physical values have zero mean over the experiments
    # (value = row − mean of rows): removes the common offset a shared parameter can absorb.
    centered: tuple[str, ...] = ()

    @classmethod
    def build(cls, specs: Mapping[str, ParamSpec], values: Mapping[str, Any],
              fitted: Sequence[str], transforms: Mapping[str, str] | None = None,
              system_name: str = "system", per_experiment: Sequence[str] = (),
              centered: Sequence[str] = ()) -> ParameterLayout:
        """Validate names and values: ``values`` are physical values for every parameter
        (defaults filled in by the caller; scalars broadcast over array parameters),
        ``fitted`` the names to fit, ``per_experiment`` those of them fitted separately for
        every experiment."""
        unknown = [n for n in [*values, *fitted, *(transforms or {}), *per_experiment]
                   if n not in specs]
        if unknown:
            raise ParameterError(
                f"unknown parameter(s) {sorted(set(unknown))} for {system_name}; "
                f"it has {sorted(specs)}"
            )
        if len(set(fitted)) != len(fitted):
            raise ParameterError(f"fitted parameters listed twice: {list(fitted)}")
        not_fitted = [n for n in per_experiment if n not in fitted]
        if not_fitted:
            raise ParameterError(f"per-experiment parameter(s) {not_fitted} are not fitted; "
                                 f"add them to the fitted parameters {list(fitted)}")
        loose = [n for n in centered if n not in per_experiment]
        if loose:
            raise ParameterError(f"centred parameter(s) {loose} are not per-experiment "
                                 f"parameters {list(per_experiment)}")
        new_specs = dict(specs)
        for name, kind in (transforms or {}).items():
            new_specs[name] = replace(specs[name], transform=kind)
        fixed = {}
        for name in specs:
            # Per-experiment values may carry an experiment axis: checked in unconstrained().
            if name in per_experiment:
                continue
            try:
                value = new_specs[name].full(values[name])
            except ParameterError as err:
                raise ParameterError(f"parameter {name!r}: {err}") from None
            new_specs[name].check(name, value)
            if name not in fitted:
                fixed[name] = value
        return cls(specs=new_specs, fitted=tuple(fitted), fixed=fixed,
                   per_experiment=tuple(n for n in fitted if n in per_experiment),
                   centered=tuple(n for n in fitted if n in centered))

    @property
    def shared(self) -> tuple[str, ...]:
        """Fitted parameters common to all experiments."""
        return tuple(n for n in self.fitted if n not in self.per_experiment)

    @property
    def scalars(self) -> tuple[str, ...]:
        """Fitted shared scalar parameters (those a table of numbers can show)."""
        return tuple(n for n in self.shared if not self.specs[n].shape)

    def unconstrained(self, values: Mapping[str, Any], n_experiments: int = 1,
                      ) -> dict[str, jnp.ndarray]:
        """Optimiser coordinates of the fitted parameters at these physical values. A
        per-experiment value is a scalar/array of the spec's shape (the same start for every
        experiment) or has a leading axis of ``n_experiments``."""
        out = {}
        for name in self.fitted:
            spec = self.specs[name]
            value = values[name]
            if name in self.per_experiment:
                shape = (n_experiments, *spec.shape)
                if np.shape(value) not in ((), spec.shape, shape):
                    raise ParameterError(
                        f"per-experiment parameter {name!r} needs a value of shape () "
                        f"{spec.shape or ''} or {shape}, got {np.shape(value)}")
                value = np.broadcast_to(np.asarray(value, np.float64), shape)
            else:
                try:
                    value = spec.full(value)
                except ParameterError as err:
                    raise ParameterError(f"parameter {name!r}: {err}") from None
            spec.check(name, value)
            out[name] = jnp.asarray(spec.to_unconstrained(value))
        return out

    def physical(self, z: Mapping[str, Any]) -> dict[str, Any]:
        """Physical values of all parameters (fitted from ``z``, the others fixed);
        per-experiment ones keep their experiment axis."""
        out: dict[str, Any] = dict(self.fixed)
        for name in self.fitted:
            out[name] = self.specs[name].to_physical(z[name])
            if name in self.centered:
                out[name] = out[name] - jnp.mean(out[name], axis=0)
        return out

    def split(self, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, per-experiment) parts of a dict of physical values."""
        per = {n: params[n] for n in self.per_experiment}
        return {n: v for n, v in params.items() if n not in per}, per
