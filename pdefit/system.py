"""What the engine expects of a physical system (see design.md §2).

A system is a small frozen dataclass holding static options only (never arrays), so it can be
closed over by jitted functions. It provides:

- ``name``, ``fields`` (state field names) and ``params`` (name → :class:`ParamSpec`);
- ``stencil_radius``: the halo width its operators need;
- either ``rhs(state, params, t, grid)`` (method of lines; any integrator applies, and
  ``gates(...)`` enables Rush–Larsen) or ``step(state, params, t, dt, grid)`` (systems that
  need a projection or a split step);
- ``max_stable_dt(params, grid)``: the largest stable forward-Euler step of ``rhs``, or, for a
  system with its own ``step``, the largest stable step of that step (it is not rescaled by
  :func:`check_time_step`, and the configured integrator is ignored);
- optionally ``cfl_dt(state, params, grid)``: a state-dependent advective limit, for systems
  whose stability depends on the flow (it cannot be checked before there is a state);
- ``initial_state(grid, params, seed)``: a seeded generator of a typical state;
- optionally ``penalties(grid)``: name → function of the physical parameters returning a
  scalar, priors only the physics can state (e.g. "the force has no gradient part"), weighted
  by ``regularization.system`` in a fit.

Systems call the stencils on ``grid.pad(u, radius)`` blocks and never call collectives.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

from .grid import Grid
from .integrate import REAL_AXIS_STABILITY, Step, make_stepper
from .params import ParamSpec


@runtime_checkable
class System(Protocol):
    name: str
    fields: tuple[str, ...]
    params: dict[str, ParamSpec]
    stencil_radius: int

    def max_stable_dt(self, params: dict[str, float], grid: Grid) -> float: ...

    def initial_state(self, grid: Grid, params: dict[str, float], seed: int) -> dict[str, Any]: ...


class UnstableTimeStepError(ValueError):
    """The configured time step exceeds the system's stability limit."""


def check_option(what: str, value: Any, choices: Any) -> None:
    """Raise a ValueError naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {list(choices)}")


def default_params(system: System) -> dict[str, float]:
    return {name: spec.default for name, spec in system.params.items()}


@lru_cache(maxsize=64)
def stepper(system: System, grid: Grid, method: str) -> Step:
    """``step(state, params, t, dt)`` for this system on this grid. Cached (systems and grids
    are frozen, hashable values): the same function object comes back for the same inputs, so
    jitted callers that take it as a static argument hit their compilation cache instead of
    re-tracing, e.g. once per simulated experiment."""
    if hasattr(system, "step"):
        def own_step(state, params, t, dt):
            return system.step(state, params, t, dt, grid)
        return own_step

    def rhs(state, params, t):
        return system.rhs(state, params, t, grid)

    gates = None
    if hasattr(system, "gates"):
        def gates(state, params, t):
            return system.gates(state, params, t, grid)
    return make_stepper(method, rhs, gates)


def check_time_step(system: System, params: dict[str, float], grid: Grid, dt: float,
                    method: str) -> float:
    """Raise :class:`UnstableTimeStepError` if ``dt`` is above the stability limit of ``method``;
    return the limit."""
    if not dt > 0:
        raise UnstableTimeStepError(f"time step dt={dt} must be positive")
    limit = system.max_stable_dt(params, grid)
    if not hasattr(system, "step"):
        limit *= REAL_AXIS_STABILITY[method] / REAL_AXIS_STABILITY["euler"]
    if dt > limit:
        raise UnstableTimeStepError(
            f"time step dt={dt} exceeds the stability limit {limit:.4g} of {system.name} with "
            f"{method} on a grid with spacing {grid.spacing}; reduce dt or coarsen the grid"
        )
    return limit
