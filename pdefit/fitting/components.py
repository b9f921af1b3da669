"""The pieces every run builds from its typed options (:mod:`pdefit.options`), each checked
as it is built: the precision, the system, its grid and parameters and whether they can be
stepped stably, the device mesh, the adjoint's checkpoint schedule and the regularization.
The fit's assembly (:mod:`pdefit.fitting.assemble`), the synthetic datasets
(:mod:`pdefit.fitting.synthetic`) and the analyses share them, so one bad value gets one
message wherever it is met: a :class:`ConfigError` naming the key."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.adjoint import Nested, Revolve, Schedule, StoreAll, snapshots_for_budget
from pdefit.fitting.observe import observable_names
from pdefit.fitting.problem import Regularization, system_penalties
from pdefit.model.params import ParameterError, ParameterLayout
from pdefit.model.system import System, check_time_step, default_params, get_system
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
    parameters come out as arrays of their shape (a scalar default or override fills it)."""
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
                          tuple(sorted((k, float(v)) for k, v in system_terms.items())))
