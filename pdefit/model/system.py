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
- optionally ``initial_guess(observed, params)``: a first guess of unobserved state fields
  (name → array) from the observed fields' first frames (``observed``: name → array, any
  leading axes) and the fit's start parameters, where a fit estimates them
  (``fit.initial_fields.<f>=fit``): its starting point and the background of its prior
  (``regularization.field_background``), never a known initial state (e.g. BOCF's gates at
  their quasi-steady values for the observed u);
- optionally ``field_bounds``: field name → (lower, upper), a range the model's flow keeps
  the field in (an invariant set: BOCF's gates in [0, 1]); a fit that estimates that field's
  initial state keeps it there (``fit.bound_fields``; every step projects onto the range);
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

A system is checked before it is used: :func:`get_system` checks the static contract
(:func:`check_system`), :func:`check_system_on` its hooks' fields, shapes and dtypes on a grid
(by tracing, nothing computed); each failure is a :class:`SystemCheckError` naming the system
and the hook. A dataset names its system by :func:`system_reference` (an import path for a
user's system), which :func:`get_system` finds again.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
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
        raise SystemCheckError(f"system {name!r} ({cls.__qualname__}) lacks {missing}; see "
                               "pdefit.model.system for what a system provides")
    check_system(system)
    return system


# The largest grid (cells) on which a hook that cannot be traced on shapes is computed to be
# checked.
COMPUTED_CHECK_CELLS = 1 << 12


class SystemCheckError(ValueError):
    """A system's hook breaks the contract of :class:`System` (a missing field in what ``rhs``
    returns, a parameter that is not a :class:`~pdefit.model.params.ParamSpec`, an initial
    state of the wrong shape, operators that ignore the halo on a mesh); the message names the
    system and the hook."""


def _who(system: Any) -> str:
    """"system 'name'" for messages (the class name where the name is unusable)."""
    name = getattr(system, "name", None)
    if isinstance(name, str) and name:
        return f"system {name!r}"
    return f"system {type(system).__qualname__}"


def check_system(system: Any) -> None:
    """Raise :class:`SystemCheckError` unless ``system`` keeps the static contract of
    :class:`System`: a non-empty ``name``, ``fields`` a non-empty tuple of distinct names,
    ``params`` a dict of name → :class:`ParamSpec`, ``stencil_radius`` an integer ≥ 0,
    callable hooks, and hashable (jitted code caches on the system: a frozen dataclass)."""
    who = _who(system)
    if not isinstance(getattr(system, "name", None), str) or not system.name:
        raise SystemCheckError(f"{who}: name must be a non-empty string, got "
                               f"{getattr(system, 'name', None)!r}")
    fields = getattr(system, "fields", None)
    if (not isinstance(fields, tuple | list) or not fields
            or not all(isinstance(f, str) and f for f in fields)):
        raise SystemCheckError(f"{who}: fields must be a non-empty tuple of field names (str), "
                               f"got {fields!r}")
    repeated = sorted({f for f in fields if list(fields).count(f) > 1})
    if repeated:
        raise SystemCheckError(f"{who}: fields {list(fields)} name {repeated} more than once")
    params = getattr(system, "params", None)
    if not isinstance(params, Mapping):
        raise SystemCheckError(f"{who}: params must be a dict of parameter name -> "
                               f"pdefit.ParamSpec, got {type(params).__name__}")
    for name, spec in params.items():
        if not isinstance(spec, ParamSpec):
            hint = f"ParamSpec({spec!r})" if isinstance(spec, int | float) else "ParamSpec(...)"
            raise SystemCheckError(f"{who}: parameter {name!r} is a {type(spec).__name__} "
                                   f"({spec!r}), not a pdefit.ParamSpec; write {name!r}: {hint}")
    radius = getattr(system, "stencil_radius", None)
    if not isinstance(radius, int | np.integer) or isinstance(radius, bool) or radius < 0:
        raise SystemCheckError(f"{who}: stencil_radius must be an integer >= 0 (the halo its "
                               f"operators read), got {radius!r}")
    _check_field_bounds(who, getattr(system, "field_bounds", None), fields)
    hooks = [h for h in ("max_stable_dt", "initial_state")
             if not callable(getattr(system, h, None))]
    if not any(callable(getattr(system, h, None)) for h in ("rhs", "step")):
        hooks.append("rhs or step")
    if hooks:
        raise SystemCheckError(f"{who}: {hooks} must be methods")
    try:
        hash(system)
    except TypeError:
        raise SystemCheckError(f"{who}: {type(system).__qualname__} is not hashable (jitted "
                               "code caches on the system): make it @dataclass(frozen=True)"
                               ) from None


def _check_field_bounds(who: str, bounds: Any, fields: Sequence[str]) -> None:
    """``field_bounds`` (if any) maps fields of the system to (lower, upper), lower < upper."""
    if bounds is None:
        return
    if not isinstance(bounds, Mapping):
        raise SystemCheckError(f"{who}: field_bounds must be a dict of field -> (lower, upper), "
                               f"got {type(bounds).__name__}")
    for name, pair in bounds.items():
        if name not in fields:
            raise SystemCheckError(f"{who}: field_bounds names {name!r}, not one of its fields "
                                   f"{list(fields)}")
        try:
            low, high = (float(x) for x in pair)
        except (TypeError, ValueError):
            raise SystemCheckError(f"{who}: field_bounds[{name!r}] must be (lower, upper), got "
                                   f"{pair!r}") from None
        if not low < high:
            raise SystemCheckError(f"{who}: field_bounds[{name!r}] = {pair!r} is not a range "
                                   "(lower < upper)")


# (system, grid, precision) whose hooks passed check_system_on: checked once each.
_CHECKED_ON: set[tuple[Any, ...]] = set()


def check_system_on(system: System, grid: Grid, params: Mapping[str, Any], seed: int = 0,
                    dt: float = 1e-3) -> None:
    """Raise :class:`SystemCheckError` unless the system's hooks keep the contract on
    ``grid``: ``initial_state`` returns exactly the system's fields, each of the grid's shape
    in a floating dtype, and ``rhs`` (or ``step``) returns every field with the state's shape
    and dtype. Shapes only (``jax.eval_shape``): nothing is computed, at any grid size. A
    ValueError the system raises itself (a grid it cannot use) passes through unchanged."""
    dtype = jnp.result_type(float)  # the run's precision
    key = (system, grid, str(dtype))
    if key in _CHECKED_ON:
        return
    who, shape = _who(system), tuple(grid.shape)
    # An initial state that cannot be traced on shapes (one that spins up with Python control
    # flow) is computed, but only on a small grid: on a large one that could cost the whole
    # spin-up again, and the simulation computes it anyway.
    initial = _hook_shapes(system, "initial_state",
                           lambda: system.initial_state(grid, dict(params), seed),
                           compute=math.prod(shape) <= COMPUTED_CHECK_CELLS)
    if initial is not None:
        _check_fields(who, "initial_state", initial, system.fields, shape, None)
    state = {f: jax.ShapeDtypeStruct(shape, dtype) for f in system.fields}
    values = {k: jax.ShapeDtypeStruct(np.shape(v), dtype) for k, v in params.items()}
    time = jax.ShapeDtypeStruct((), dtype)
    if hasattr(system, "step"):
        hook = "step"
        out = _hook_shapes(system, hook, lambda: jax.eval_shape(
            lambda s, p, t: system.step(s, p, t, dt, grid), state, values, time))
    else:
        hook = "rhs"
        out = _hook_shapes(system, hook, lambda: jax.eval_shape(
            lambda s, p, t: system.rhs(s, p, t, grid), state, values, time))
    _check_fields(who, hook, out, system.fields, shape, dtype)
    _CHECKED_ON.add(key)


def _hook_shapes(system: System, hook: str, call: Callable[[], Any],
                 compute: bool = True) -> Any:
    """What ``call`` (a hook's call) returns, as shapes: traced abstractly where the hook
    allows, else (a hook that needs concrete values) computed. A failure other than the
    system's own ValueError becomes a :class:`SystemCheckError` naming the hook."""
    try:
        try:
            return jax.eval_shape(call)
        except jax.errors.JAXTypeError:
            if not compute:
                return None  # not traceable and too large to compute for a check
            return jax.tree.map(lambda v: jax.ShapeDtypeStruct(
                np.shape(v), v.dtype if hasattr(v, "dtype") else np.result_type(v)), call())
    except SystemCheckError:
        raise
    except ValueError:
        raise
    except Exception as err:  # the user's code: any failure is the hook's
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise SystemCheckError(f"{_who(system)}: {hook} failed: {type(err).__name__}: "
                               f"{message}") from err


def _check_fields(who: str, hook: str, out: Any, fields: Sequence[str],
                  shape: tuple[int, ...], dtype: Any) -> None:
    """``out`` (shapes of a hook's result) has exactly ``fields``, each of ``shape`` and
    ``dtype`` (None: any floating dtype)."""
    if not isinstance(out, Mapping):
        raise SystemCheckError(f"{who}: {hook} returned a {type(out).__name__}, not a dict of "
                               f"field name -> array for fields {list(fields)}")
    missing = [f for f in fields if f not in out]
    extra = [f for f in out if f not in fields]
    if missing or extra:
        need = ("every field needs its time derivative" if hook == "rhs" else
                "it must return exactly the system's fields")
        raise SystemCheckError(f"{who}: {hook} returned fields {list(out)} for state fields "
                               f"{list(fields)} (missing {missing}, extra {extra}): {need}")
    for name in fields:
        value = out[name]
        got_shape, got_dtype = tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)
        if got_shape != shape:
            raise SystemCheckError(f"{who}: {hook} returned field {name!r} of shape {got_shape}; "
                                   f"the grid's shape is {shape}")
        floating = got_dtype is not None and jnp.issubdtype(got_dtype, jnp.floating)
        if not floating or (dtype is not None and got_dtype != dtype):
            want = "a floating dtype" if dtype is None else f"the state's dtype {dtype}"
            raise SystemCheckError(f"{who}: {hook} returned field {name!r} of dtype "
                                   f"{got_dtype}; it needs {want}")


def system_reference(system: System) -> str:
    """The name that finds ``system``'s class again (:func:`system_class`): its own name where
    that is built in or installed as this class, else the import path
    ``package.module:QualName`` of its class (what a dataset records as its ``system``)."""
    cls = type(system)
    try:
        if system_class(system.name) is cls:
            return system.name
    except Exception:  # an unresolvable name (or a failing import): the import path answers
        pass
    return f"{cls.__module__}:{cls.__qualname__}"


def made_by(recorded: str, system: System) -> bool:
    """Whether a dataset whose ``system`` is ``recorded`` was made by (a system called like)
    ``system``: its name, its reference (:func:`system_reference`), or an import path to a
    class of the same name."""
    if recorded in (system.name, system_reference(system)):
        return True
    if ":" not in recorded:
        return False
    try:
        return getattr(system_class(recorded), "name", None) == system.name
    except Exception:  # a path that no longer imports made nothing this system can claim
        return False


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
