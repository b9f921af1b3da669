"""The pieces every run builds from its typed options (:mod:`pdefit.options`), each checked
as it is built: the precision, the system, its grid and parameters, whether they can be
stepped stably and whether its hooks keep their contract, the device mesh (and whether the
system's operators give the same result on its tiles as on one device), the adjoint's
checkpoint schedule and the regularization.
The fit's assembly (:mod:`pdefit.fitting.assemble`), the synthetic datasets
(:mod:`pdefit.fitting.synthetic`) and the analyses share them, so one bad value gets one
message wherever it is met: a :class:`ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.adjoint import Nested, Revolve, Schedule, StoreAll, snapshots_for_budget
from pdefit.fitting.observe import observable_names
from pdefit.fitting.problem import Regularization, system_penalties
from pdefit.model.params import ParameterError, ParameterLayout
from pdefit.model.system import (
    System,
    SystemCheckError,
    check_system,
    check_system_on,
    check_time_step,
    default_params,
    get_system,
    stepper,
)
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import GATED, INTEGRATORS
from pdefit.options import AdjointConfig, ConfigError, FitConfig, MeshConfig, SystemConfig
from pdefit.parallel.domain import Domain


def set_precision(precision: str) -> Any:
    if precision not in ("float32", "float64"):
        raise ConfigError(f"precision must be float32 or float64, got {precision!r}")
    jax.config.update("jax_enable_x64", precision == "float64")
    return jnp.float64 if precision == "float64" else jnp.float32


def make_grid(cfg: SystemConfig) -> Grid:
    try:
        return Grid(tuple(cfg.grid.shape), tuple(cfg.grid.spacing), tuple(cfg.grid.boundaries))
    except ValueError as err:
        raise ConfigError(f"system.grid: {err}") from None


def make_system(cfg: SystemConfig) -> System:
    try:
        return get_system(cfg.name, **dict(cfg.options))
    except ValueError as err:
        raise ConfigError(f"system: {err}") from None


def system_params(system: System, overrides: Any) -> dict[str, Any]:
    """Defaults with ``system.params`` overrides; unknown names are an error. Array
    parameters come out as arrays of their shape (a scalar default or override fills it).
    The system's static contract is checked first (:func:`check_system`)."""
    check_system(system)
    values = default_params(system)
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ConfigError(f"system.params: unknown parameter(s) {unknown} for {system.name}; "
                          f"it has {sorted(values)}")
    values.update(dict(overrides))
    for name, value in values.items():
        spec = system.params[name]
        try:
            values[name] = spec.full(value)
            spec.check(name, values[name])
        except ParameterError as err:
            raise ConfigError(f"system.params: {name}: {err}") from None
    return values


def observable_fields(system: System, grid: Grid) -> tuple[str, ...]:
    """Names a dataset of this system may hold: its state fields and derived observables."""
    return (*system.fields, *observable_names(system, grid))


def check_dynamics(system: System, params: dict[str, float], grid: Grid, cfg: SystemConfig,
                   ) -> None:
    if cfg.integrator not in INTEGRATORS:
        raise ConfigError(f"system.integrator: unknown {cfg.integrator!r}; choose one of "
                          f"{sorted(INTEGRATORS)}")
    if cfg.integrator in GATED and not hasattr(system, "gates"):
        raise ConfigError(f"system.integrator: {system.name} has no gating variables for "
                          f"{cfg.integrator}")
    check_time_step(system, params, grid, cfg.dt, cfg.integrator)
    try:
        # The hooks' fields, shapes and dtypes on this grid, before anything is simulated.
        check_system_on(system, grid, params, 0, cfg.dt)
    except SystemCheckError:
        raise
    except ValueError as err:  # the system's own refusal of this grid or these options
        raise ConfigError(f"system: {system.name}: {err}") from None


def make_domain(cfg: MeshConfig) -> Domain | None:
    """The device mesh of the config, or None for one device."""
    shape = [cfg.experiments, *cfg.shape]
    if cfg.all_devices:
        shape = [1, 1, jax.device_count()]
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"mesh.shape must be [py, px] of positive sizes, got {list(cfg.shape)}")
    if int(np.prod(shape)) == 1:
        return None
    try:
        return Domain.build(shape)
    except ValueError as err:
        raise ConfigError(f"mesh: {err}") from None


# One step on the tiles of a mesh against one device: grids of this many cells per tile
# axis (a halo error shows at the first tile edge), and the cases that passed.
CHECK_TILE = 8
_TILED_OK: set[tuple[Any, ...]] = set()


def check_tiled_step(system: System, grid: Grid, params: dict[str, Any],
                     devices: tuple[int, int], dt: float, integrator: str) -> None:
    """On a mesh of ``devices`` = (py, px) tiles, the ``rhs`` of ``system`` (or one ``step``)
    on the tiles (halos exchanged between devices) must equal it on one device: checked on a
    small grid of the same spacing and boundaries (the fit's grid where the system cannot use
    that one), from its initial state slightly perturbed, on this process's own devices.
    Operators that ignore the halo (``jnp.roll`` or ``jnp.pad`` on the tile) give each
    tile's edges the wrong neighbours: a :class:`SystemCheckError` pointing to
    :mod:`pdefit.numerics.stencils`. A system that refuses tiles itself (a ValueError) gives
    a ConfigError naming ``mesh.shape``."""
    py, px = devices
    dtype = jnp.result_type(float)
    key = (system, grid, (py, px), float(dt), integrator, str(dtype))
    if py * px == 1 or key in _TILED_OK:
        return
    tiles = _check_tiles((py, px))
    if tiles is None:
        return  # one device per process: nothing to compare on (the fit's tiles are remote)
    small = _check_grid(system, grid, params, tiles, dt, integrator)
    if small is None:
        return
    domain = Domain.build(tiles, jax.local_devices())
    values = {k: jnp.asarray(v, dtype) for k, v in params.items()}

    def local(tile_grid, tile_state, tile_values):
        return _evaluate(system, tile_grid, integrator, dt)(tile_state, tile_values)

    hook = "step" if hasattr(system, "step") else "rhs"
    tiled_fn = jax.jit(lambda s, v: domain.map_tiles(small, local, s, v))
    # Traced first, on shapes: a system that refuses tiles says so before any state is made.
    _on_tiles(system, hook, (py, px),
              lambda: jax.eval_shape(tiled_fn, _abstract_state(system, small), values))
    state = (_perturbed_state(system, small, params) if math.prod(small.shape) <= 1 << 12
             else _random_state(system, small))
    tiled = _on_tiles(system, hook, (py, px), lambda: tiled_fn(state, values))
    untiled = jax.jit(_evaluate(system, small, integrator, dt))(state, values)
    for name in system.fields:
        relative = _relative_difference(tiled[name], untiled[name],
                                        state[name] if hook == "step" else None)
        if relative > 1e3 * float(jnp.finfo(dtype).eps):
            raise SystemCheckError(
                f"system {system.name!r}: its {hook} on the tiles of mesh.shape="
                f"{[py, px]} differs from its {hook} on one device (field {name!r}, "
                f"relative difference {relative:.2g} on grid {list(small.shape)}): its "
                "operators ignore the halo between tiles (e.g. jnp.roll or jnp.pad on the local "
                "tile, which also ignore the grid's boundaries); take derivatives of "
                "grid.pad(u, radius) blocks with pdefit.numerics.stencils (e.g. "
                "laplacian(u, grid)), or fit on one device (mesh.shape=[1, 1])")
    _TILED_OK.add(key)


def _on_tiles(system: System, hook: str, devices: tuple[int, int], call: Any) -> Any:
    """``call()`` (the system on tiles): a ValueError (the system refuses tiles) as a
    ConfigError naming ``mesh.shape``, any other failure as the hook's."""
    try:
        return call()
    except ValueError as err:
        raise ConfigError(f"mesh.shape={list(devices)}: {_first_line(err)}") from None
    except Exception as err:  # the user's code on a tile: any failure is its hook's
        raise SystemCheckError(
            f"system {system.name!r}: {hook} fails on a tile of mesh.shape={list(devices)} "
            f"({type(err).__name__}: {_first_line(err)}); a system computes on the block it "
            "is given, its halo from grid.pad (the operators of pdefit.numerics.stencils)"
        ) from err


def check_mesh_operators(cfg: FitConfig) -> None:
    """:func:`check_tiled_step` for the fitted system on ``mesh.*`` (nothing on one device or
    a mesh over experiments only): for a fit to refuse before its dataset is simulated."""
    domain = make_domain(cfg.mesh)
    if domain is None:
        return
    system = make_system(cfg.system)
    check_tiled_step(system, make_grid(cfg.system), system_params(system, cfg.system.params),
                     domain.shape[1:], cfg.system.dt, cfg.system.integrator)


def _check_tiles(devices: tuple[int, int]) -> tuple[int, int] | None:
    """The tiles the check runs on: the mesh's own where this process has the devices, else
    two along each split axis (one split is enough to show a halo error), or None."""
    available = len(jax.local_devices())
    halved = tuple(min(n, 2) for n in devices)
    for tiles in (devices, halved, (halved[0], 1), (1, halved[1])):
        if 1 < tiles[0] * tiles[1] <= available:
            return tiles
    return None


def _relative_difference(tiled: Any, untiled: Any, state: Any) -> float:
    """max |tiled − untiled| over the field's scale, its largest value (and the state's, for
    a step); NaN where both are NaN is no difference, where one is: infinite."""
    a, b = (np.asarray(x, np.float64) for x in (tiled, untiled))
    scale = float(np.nanmax(np.abs(b), initial=0.0))
    if state is not None:
        scale = max(scale, float(np.max(np.abs(np.asarray(state, np.float64)))))
    scale = scale or 1.0
    error = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    return float(np.nan_to_num(np.max(error), nan=np.inf)) / scale


def _check_grid(system: System, grid: Grid, params: dict[str, Any], tiles: tuple[int, int],
                dt: float, integrator: str) -> Grid | None:
    """The grid :func:`check_tiled_step` compares on: ``CHECK_TILE`` cells per tile where the
    system can use such a grid, else ``grid`` if it splits over ``tiles`` (else None: nothing
    to compare on). Tried by tracing only: nothing is computed for a grid refused."""
    radius = int(system.stencil_radius)
    tile = max(CHECK_TILE, 2 * radius)
    small = dataclasses.replace(grid, shape=tuple(
        n if n <= p * tile and n % p == 0 and n // p >= radius else p * tile
        for n, p in zip(grid.shape, tiles, strict=True)))
    values = {k: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(float))
              for k, v in params.items()}
    try:
        jax.eval_shape(_evaluate(system, small, integrator, dt), _abstract_state(system, small),
                       values)
        return small
    except Exception:  # a grid the system cannot use: take the fit's own
        if small == grid or any(n % p or n // p < radius
                                for n, p in zip(grid.shape, tiles, strict=True)):
            return None
    return grid


def _abstract_state(system: System, grid: Grid) -> dict[str, jax.ShapeDtypeStruct]:
    return {f: jax.ShapeDtypeStruct(grid.shape, jnp.result_type(float)) for f in system.fields}


def _perturbed_state(system: System, grid: Grid, params: dict[str, Any]) -> dict[str, Any]:
    """The initial state, perturbed: no tile edge happens to see what its neighbour holds."""
    dtype = jnp.result_type(float)
    try:
        initial = system.initial_state(grid, dict(params), 0)
    except Exception as err:  # the user's code
        raise SystemCheckError(f"system {system.name!r}: initial_state fails on grid "
                               f"{list(grid.shape)}: {type(err).__name__}: {_first_line(err)}"
                               ) from err
    rng = np.random.default_rng(0)
    state = {}
    for name in system.fields:
        u = np.asarray(initial[name], np.float64)
        size = float(np.max(np.abs(u))) or 1.0
        state[name] = jnp.asarray(u + 1e-2 * size * rng.standard_normal(grid.shape), dtype)
    return state


def _random_state(system: System, grid: Grid) -> dict[str, Any]:
    """Random fields of order one: on a large grid (a system that cannot use a small one) the
    system's initial state may cost a spin-up, and any state shows a halo error."""
    rng = np.random.default_rng(0)
    return {name: jnp.asarray(rng.uniform(0.0, 1.0, grid.shape), jnp.result_type(float))
            for name in system.fields}


def _evaluate(system: System, grid: Any, integrator: str, dt: float) -> Any:
    """What is compared tiled and untiled: ``rhs`` (its error does not shrink with dt), or
    for a system with its own ``step``, one step."""
    if hasattr(system, "step"):
        step = stepper(system, grid, integrator)
        return lambda state, values: step(state, values, 0.0, dt)
    return lambda state, values: system.rhs(state, values, 0.0, grid)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def make_schedule(cfg: AdjointConfig, state_bytes: int) -> Schedule:
    if cfg.kind == "store_all":
        return StoreAll()
    if cfg.kind == "nested":
        return Nested(cfg.levels)
    if cfg.kind == "revolve":
        if cfg.snapshots is not None:
            if cfg.snapshots < 1:
                raise ConfigError(f"adjoint.snapshots must be >= 1, got {cfg.snapshots}")
            return Revolve(cfg.snapshots)
        if cfg.memory_budget_mb is None:
            raise ConfigError("adjoint: give revolve either snapshots or memory_budget_mb")
        return Revolve(snapshots_for_budget(cfg.memory_budget_mb * 2**20, state_bytes))
    raise ConfigError(f"adjoint.kind: unknown {cfg.kind!r}; choose store_all, nested or revolve")


def make_regularization(cfg: FitConfig, layout: ParameterLayout, system: Any = None,
                        grid: Any = None) -> Regularization:
    """The penalties of ``cfg.regularization``, their parameter and penalty names checked."""
    reg = cfg.regularization
    param_l2 = dict(getattr(reg, "param_l2", None) or {})
    smooth = dict(getattr(reg, "smoothness", None) or {})
    system_terms = dict(getattr(reg, "system", None) or {})
    for key, names in (("param_l2", param_l2), ("smoothness", smooth)):
        unknown = sorted(set(names) - set(layout.fitted))
        if unknown:
            raise ConfigError(f"regularization.{key}: {unknown} are not fitted parameters "
                              f"(fitted: {list(layout.fitted)})")
    scalar = sorted(n for n in smooth if not layout.specs[n].shape)
    if scalar:
        raise ConfigError(f"regularization.smoothness: {scalar} are scalars; smoothness applies "
                          "to array parameters")
    if system_terms:
        offered = system_penalties(system, grid) if system is not None else {}
        unknown = sorted(set(system_terms) - set(offered))
        if unknown:
            raise ConfigError(f"regularization.system: {unknown} are not penalties of "
                              f"{getattr(system, 'name', 'the system')} (it has "
                              f"{sorted(offered) or 'none'})")
    return Regularization(float(reg.params), float(reg.fields),
                          tuple(sorted((k, float(v)) for k, v in param_l2.items())),
                          tuple(sorted((k, float(v)) for k, v in smooth.items())),
                          tuple(sorted((k, float(v)) for k, v in system_terms.items())),
                          float(getattr(reg, "field_background", 0.0)),
                          float(getattr(reg, "field_smoothness", 0.0)))
