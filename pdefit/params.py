"""Parameter specs, transforms and the split between fitted and fixed parameters.

The optimiser works on unconstrained values ``z``; the physics sees physical values ``p``:
- ``identity``: p = scale · z (scale brings the value to order one);
- ``log``:      p = exp(z), for positive quantities that span decades;
- ``bounded``:  p = lower + (upper − lower) · sigmoid(z), for quantities with hard limits.
Bounds of identity/log parameters are enforced on the starting values (an error, not a clip).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp

TRANSFORMS = ("identity", "log", "bounded")


class ParameterError(ValueError):
    """A parameter name, value or transform that cannot be used."""


@dataclass(frozen=True)
class ParamSpec:
    """One scalar parameter of a system."""

    default: float
    transform: str = "identity"
    lower: float = -math.inf
    upper: float = math.inf
    scale: float = 1.0
    unit: str = ""
    doc: str = ""

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

    def check(self, name: str, value: float) -> None:
        """Raise if ``value`` is not a valid physical value for this parameter."""
        if not math.isfinite(value):
            raise ParameterError(f"parameter {name!r}: value {value} is not finite")
        if self.transform == "log" and value <= 0:
            raise ParameterError(f"parameter {name!r} has a log transform and needs a value > 0, "
                                 f"got {value}")
        strict = self.transform in ("bounded", "log")
        inside = (self.lower < value < self.upper) if strict else (
            self.lower <= value <= self.upper)
        if not inside:
            raise ParameterError(
                f"parameter {name!r}: value {value} is outside its bounds "
                f"[{self.lower}, {self.upper}]"
            )

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
    """Which parameters are fitted (and how), and the values of the fixed ones."""

    specs: Mapping[str, ParamSpec]
    fitted: tuple[str, ...]
    fixed: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def build(cls, specs: Mapping[str, ParamSpec], values: Mapping[str, float],
              fitted: Sequence[str], transforms: Mapping[str, str] | None = None,
              system_name: str = "system") -> ParameterLayout:
        """Validate names and values: ``values`` are physical values for every parameter
        (defaults filled in by the caller), ``fitted`` the names to fit."""
        unknown = [n for n in [*values, *fitted, *(transforms or {})] if n not in specs]
        if unknown:
            raise ParameterError(
                f"unknown parameter(s) {sorted(set(unknown))} for {system_name}; "
                f"it has {sorted(specs)}"
            )
        if len(set(fitted)) != len(fitted):
            raise ParameterError(f"fitted parameters listed twice: {list(fitted)}")
        new_specs = dict(specs)
        for name, kind in (transforms or {}).items():
            new_specs[name] = replace(specs[name], transform=kind)
        for name in specs:
            new_specs[name].check(name, float(values[name]))
        fixed = {n: float(values[n]) for n in specs if n not in fitted}
        return cls(specs=new_specs, fitted=tuple(fitted), fixed=fixed)

    def unconstrained(self, values: Mapping[str, float]) -> dict[str, jnp.ndarray]:
        """Optimiser coordinates of the fitted parameters at these physical values."""
        for name in self.fitted:
            self.specs[name].check(name, float(values[name]))
        return {n: jnp.asarray(self.specs[n].to_unconstrained(float(values[n])))
                for n in self.fitted}

    def physical(self, z: Mapping[str, Any]) -> dict[str, Any]:
        """Physical values of all parameters (fitted from ``z``, the others fixed)."""
        out: dict[str, Any] = dict(self.fixed)
        for name in self.fitted:
            out[name] = self.specs[name].to_physical(z[name])
        return out
