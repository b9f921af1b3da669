"""How much of a state is active, and from when a trajectory is at rest.

A forecast of resting tissue is no evidence of a good model: it agrees with any model that also
comes to rest. The evaluator therefore records the truth's active fraction per frame. What
counts as active is the system's to say; the engine never names a system:

- a system may declare ``activity = (field, level)``: a point is active where that field is
  above ``level`` (cardiac models: the excited tissue, e.g. ``("u", 0.5)``);
- otherwise a point is active where the ``fallback_field`` (the evaluated, observed field)
  changes over one frame by more than ``CHANGE`` × that field's range in the first frame (1
  where the range is zero): anything still moving counts, a state at rest does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

CHANGE = 0.01  # generic measure: a change over one frame above this share of the range


def activity_measure(system: Any, fallback_field: str, first: Mapping[str, Any],
                     ) -> tuple[Callable[[Mapping, Mapping], Any], str]:
    """``(fraction(before, after), description)``: the share of points active in the state
    ``before`` (``after`` is the next frame's state, for the generic measure), usable inside
    jit, and what it measures in words (for reports and axis labels). ``first`` is the first
    frame's state, which sets the generic measure's scale."""
    declared = getattr(system, "activity", None)
    if declared is not None:
        field, level = declared
        if field not in system.fields:
            raise ValueError(f"{system.name}.activity names field {field!r}, not one of "
                             f"{list(system.fields)}")
        return (lambda before, after: jnp.mean(before[field] > level),
                f"{field} > {level:g}")
    values = np.asarray(first[fallback_field])
    scale = float(np.max(values) - np.min(values)) or 1.0
    change = CHANGE * scale
    return (lambda before, after: jnp.mean(
        jnp.abs(after[fallback_field] - before[fallback_field]) > change),
        f"|Δ{fallback_field}| per frame > {CHANGE:g} × its range")


def quiescent_from(times: np.ndarray, fraction: np.ndarray, minimum: float) -> float | None:
    """The time from which the active ``fraction`` stays below ``minimum`` to the last frame
    (the trajectory has come to rest within the horizon), or None if it does not."""
    below = np.asarray(fraction) < minimum
    if not below[-1]:
        return None
    active = np.flatnonzero(~below)
    return float(np.asarray(times)[0 if active.size == 0 else active[-1] + 1])
