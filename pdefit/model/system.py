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
  by ``regularization.system`` in a fit;
- optionally ``evaluate_fit(problem, theta, dataset, experiments, out, plots)``: a
  system-specific evaluation of a finished fit against the dataset's truths (numbers for
  ``summary.json``, a printed report, plots in ``out``), returning a :class:`SystemEvaluation`
  or None when it has nothing to say about this fit.
- optionally ``refinable_grid = True``: its fields are cell-centred and nothing in it is tied
  to the cell count, so data may be simulated on a refined grid and a fit checked on one
  (``simulate.refine.grid_factor``, ``fit.discretization_check.grid_factor``);
- optionally ``activity = (field, level)``: a point is active where ``field`` > ``level``
  (e.g. excited tissue), for the evaluator's active fraction and its at-rest flag (without
  it, a point is active while it still changes; see :mod:`pdefit.analysis.activity`);
- optionally, labels for datasets and plots (all default sensibly): ``time_unit`` and
  ``space_unit`` (CF-style unit strings, "1" for dimensionless), ``field_info`` (field or
  observable name → (units, long name)), ``axis_names`` (the grid's two dimension names,
  default ("y", "x")) or, for a grid that is not uniform, ``axes(grid)`` giving both axes as
  (name, coordinate values, units, long name); ``param_dims`` (array parameter name → the
  names of its dimensions).

Systems call the stencils on ``grid.pad(u, radius)`` blocks and never call collectives.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from pdefit.model.params import ParamSpec
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import REAL_AXIS_STABILITY, Step, make_stepper


@runtime_checkable
class System(Protocol):
    """The interface every system implements (the module docstring lists the optional
    hooks)."""

    name: str
    fields: tuple[str, ...]
    params: dict[str, ParamSpec]
    stencil_radius: int

    def max_stable_dt(self, params: dict[str, float], grid: Grid) -> float: ...

    def initial_state(self, grid: Grid, params: dict[str, float], seed: int) -> dict[str, Any]: ...


# Installed packages offer systems under this entry-point group: in their pyproject.toml,
# [project.entry-points."pdefit.systems"] gray_scott = "my_pkg.models:GrayScott".
ENTRY_POINT_GROUP = "pdefit.systems"


class SystemEvaluation(NamedTuple):
    """What a system's ``evaluate_fit`` hook reports: ``summary`` is merged into
    ``summary.json``, ``report`` is printed after the parameter table."""

    summary: dict[str, Any]
    report: str


def system_class(name: str) -> type:
    """The system class called ``name``: a built-in system (``pdefit.systems``), an import path
    ``package.module:Class``, or a name installed under the ``pdefit.systems`` entry-point
    group. Raises ValueError naming the valid built-in and installed names."""
    # The built-in systems are found by name at run time, like any other: the physics imports
    # the engine, never the other way round.
    builtin = importlib.import_module("pdefit.systems").REGISTRY
    if name in builtin:
        return builtin[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"cannot import {module_name!r} for system {name!r}: {err}"
                             ) from None
        cls = getattr(module, attribute, None)
        if not isinstance(cls, type):
            raise ValueError(f"module {module_name!r} has no class {attribute!r} (system "
                             f"{name!r})")
        return cls
    installed = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name in installed:
        return installed[name].load()
    raise ValueError(f"unknown system {name!r}; built in: {sorted(builtin)}; installed "
                     f"({ENTRY_POINT_GROUP} entry points): {sorted(installed)}; or give an "
                     "import path package.module:Class")


def get_system(name: str, **options: Any) -> System:
    """The system called ``name`` (see :func:`system_class`), built with its static
    ``options`` (e.g. ``laplacian="9pt"``); a ValueError names bad options."""
    cls = system_class(name)
    try:
        system = cls(**options)
    except TypeError as err:
        raise ValueError(f"bad options {options} for system {name!r}: {err}") from None
    missing = [a for a in ("name", "fields", "params", "stencil_radius", "max_stable_dt",
                           "initial_state") if not hasattr(system, a)]
    if not (hasattr(system, "rhs") or hasattr(system, "step")):
        missing.append("rhs or step")
    if missing:
        raise ValueError(f"system {name!r} ({cls.__qualname__}) lacks {missing}; see "
                         "pdefit.model.system for what a system provides")
    return system


class UnstableTimeStepError(ValueError):
    """The configured time step exceeds the system's stability limit."""


def check_option(what: str, value: Any, choices: Any) -> None:
    """Raise a ValueError naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {list(choices)}")


def time_unit(system: System) -> str:
    """The unit of the system's time ("" where it declares none)."""
    return getattr(system, "time_unit", "")


def field_attrs(system: System, name: str) -> dict[str, str]:
    """CF-style ``units`` and ``long_name`` of a state field or observable (the name itself
    and no unit where the system does not describe it)."""
    units, long_name = getattr(system, "field_info", {}).get(name, ("", name))
    return {"units": units, "long_name": long_name}


def spatial_axes(system: System, grid: Grid) -> tuple[tuple[str, np.ndarray, str, str], ...]:
    """The grid's two axes as (dimension name, coordinate of each row/column, units, long
    name): the system's ``axes(grid)``, else cell centres (i + ½)·h named by its
    ``axis_names`` in its ``space_unit``."""
    if hasattr(system, "axes"):
        return tuple(system.axes(grid))
    names = getattr(system, "axis_names", ("y", "x"))
    unit = getattr(system, "space_unit", "")
    return tuple((name, (np.arange(n) + 0.5) * h, unit, name)
                 for name, n, h in zip(names, grid.shape, grid.spacing, strict=True))


def image_origin(system: System, grid: Grid) -> str:
    """Matplotlib's ``origin`` that draws the grid's first axis increasing upwards (so a
    latitude axis stored north to south is drawn north up)."""
    values = spatial_axes(system, grid)[0][1]
    return "lower" if values[-1] >= values[0] else "upper"


def dataset_labels(system: System, grid: Grid, fields: Any, params: Any) -> dict[str, Any]:
    """Units, long names and coordinates a dataset of ``fields`` and true ``params`` of this
    system carries (keyword arguments of :class:`pdefit.data.DatasetMeta`)."""
    return {
        "time_unit": time_unit(system),
        "axes": tuple((name, tuple(float(v) for v in values), units, long_name)
                      for name, values, units, long_name in spatial_axes(system, grid)),
        "field_attrs": {f: field_attrs(system, f) for f in fields},
        "param_attrs": {p: {"units": system.params[p].unit, "long_name": system.params[p].doc}
                        for p in params if p in system.params},
        "true_array_dims": {p: list(dims) for p, dims in getattr(system, "param_dims", {}).items()
                            if p in params and system.params[p].shape},
    }


def default_params(system: System) -> dict[str, float]:
    """Each parameter's default value."""
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


def stable_dt_limit(system: System, params: Mapping[str, Any], grid: Grid, method: str,
                    ) -> float:
    """The largest stable time step of ``system`` on ``grid`` with ``method`` (a system with
    its own ``step`` declares its own limit, whatever the method)."""
    limit = system.max_stable_dt(dict(params), grid)
    if not hasattr(system, "step"):
        limit *= REAL_AXIS_STABILITY[method] / REAL_AXIS_STABILITY["euler"]
    return limit


def check_time_step(system: System, params: dict[str, float], grid: Grid, dt: float,
                    method: str) -> float:
    """Raise :class:`UnstableTimeStepError` if ``dt`` is above the stability limit of ``method``;
    return the limit."""
    if not dt > 0:
        raise UnstableTimeStepError(f"time step dt={dt} must be positive")
    limit = stable_dt_limit(system, params, grid, method)
    if dt > limit:
        raise UnstableTimeStepError(
            f"time step dt={dt} exceeds the stability limit {limit:.4g} of {system.name} with "
            f"{method} on a grid with spacing {grid.spacing}; reduce dt or coarsen the grid"
        )
    return limit
