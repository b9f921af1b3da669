"""From a validated config to the objects a run needs: system, grid, schedule, datasets and
the fit problem. Every check that can fail on user input runs here, before anything is
compiled, and raises :class:`ConfigError` (or the data module's ``DatasetError``) naming the
offending key or value."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from pdefit import data as zd
from pdefit.adjoint.revolve import Nested, Revolve, Schedule, StoreAll, snapshots_for_budget
from pdefit.fitting import discretization
from pdefit.fitting.fitted import FittedFileError, fitted_path, read_fitted
from pdefit.fitting.observe import LOSSES, Observation, observable_names, observed_data
from pdefit.fitting.problem import Batch, FitProblem, Regularization, system_penalties
from pdefit.model.params import ParameterError, ParameterLayout
from pdefit.model.system import (
    System,
    UnstableTimeStepError,
    check_time_step,
    dataset_labels,
    default_params,
    get_system,
    stepper,
)
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import GATED, INTEGRATORS, simulate
from pdefit.options import (
    AdjointConfig,
    ConfigError,  # re-exported: assemble.ConfigError
    FitConfig,
    MeshConfig,
    SystemConfig,
)
from pdefit.parallel.domain import FIELD, FRAMES, PER_EXPERIMENT, REPLICATED, Domain
from pdefit.parallel.processes import dataset_array, host_scalar

log = logging.getLogger("pdefit")


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


# ---------------------------------------------------------------------------------------------
# Simulation.


def simulate_frames(system: System, grid: Grid, params: dict[str, float], dt: float,
                    integrator: str, n_frames: int, steps_per_frame: int, seed: int,
                    dtype: Any, fields: Any = None, dt_factor: int = 1,
                    grid_factor: int = 1) -> dict[str, np.ndarray]:
    """One experiment: a seeded initial state and its frames, (n_frames, ny, nx) per name of
    ``fields`` (state fields or the system's observables; None: the state fields).

    With ``dt_factor``/``grid_factor`` above 1 the simulation runs at dt/dt_factor on the
    grid refined grid_factor times, from the generated initial state prolonged to it, and
    every frame is block-averaged back to ``grid`` (pdefit.fitting.discretization)."""
    state = system.initial_state(grid, params, seed)
    fine_grid = discretization.refined_grid(grid, grid_factor)
    state = {k: discretization.prolong(jnp.asarray(v, dtype), grid_factor, grid.boundaries)
             for k, v in state.items()}
    p = {k: jnp.asarray(v, dtype) for k, v in params.items()}
    step = stepper(system, fine_grid, integrator)
    n_steps = (n_frames - 1) * steps_per_frame * dt_factor
    run = jax.jit(simulate, static_argnums=(0, 5, 6))
    frames = run(step, state, p, 0.0, dt / dt_factor, n_steps, steps_per_frame * dt_factor)
    names = tuple(system.fields if fields is None else fields)
    if any(n not in frames for n in names):
        frames = {**frames, **jax.jit(jax.vmap(system.observables))(frames)}
    return {k: np.asarray(discretization.restrict(frames[k], grid_factor)) for k in names}


def refine_factors(cfg: Any) -> tuple[int, int]:
    """(dt_factor, grid_factor) of ``simulate.refine`` (1, 1 without it)."""
    refine = getattr(cfg.simulate, "refine", None)
    if refine is None:
        return 1, 1
    factors = []
    for key in ("dt_factor", "grid_factor"):
        value = getattr(refine, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"simulate.refine.{key} must be an integer >= 1, got {value!r}")
        factors.append(value)
    return factors[0], factors[1]


def check_refine(cfg: Any, system: System, grid: Grid, params: dict[str, Any],
                 sys_cfg: SystemConfig) -> dict[str, Any]:
    """Validate ``simulate.refine`` for this system and return the dataset's record of how it
    was made (provenance ``discretization``)."""
    dt_factor, grid_factor = refine_factors(cfg)
    fine_grid = discretization.refined_grid(grid, grid_factor)
    if grid_factor > 1:
        reason = discretization.refinement_unsupported(system)
        if reason is not None:
            raise ConfigError(f"simulate.refine.grid_factor={grid_factor}: {reason}; use "
                              "simulate.refine.grid_factor=1")
    dt = float(sys_cfg.dt) / dt_factor
    if dt_factor > 1 or grid_factor > 1:
        try:
            check_time_step(system, params, fine_grid, dt, sys_cfg.integrator)
        except UnstableTimeStepError as err:
            raise ConfigError(f"simulate.refine: on the refined grid {err}; raise "
                              "simulate.refine.dt_factor") from None
    return {"dt": dt, "integrator": str(sys_cfg.integrator),
            "grid_shape": list(fine_grid.shape), "dt_factor": dt_factor,
            "grid_factor": grid_factor,
            "transfer": ("initial state: conservative linear prolongation; frames: block "
                         "average of each observed cell") if grid_factor > 1 else None}


def draw_per_experiment(cfg: Any, system: System, n_experiments: int,
                        ) -> dict[str, list[float]]:
    """Per-experiment true values of ``simulate.per_experiment`` (name -> {low, high}),
    uniform and seeded by ``simulate.seed``; centred on zero mean if asked."""
    sim = cfg.simulate
    rng = np.random.default_rng([int(sim.seed), 7919])  # a stream apart from the states'
    out = {}
    for name, dist in dict(getattr(sim, "per_experiment", None) or {}).items():
        spec = system.params.get(name)
        if spec is None or spec.shape:
            raise ConfigError(f"simulate.per_experiment: {name!r} is not a scalar parameter of "
                              f"{system.name}; it has {sorted(system.params)}")
        dist = dict(dist)
        if set(dist) != {"low", "high"} or not float(dist["low"]) <= float(dist["high"]):
            raise ConfigError(f"simulate.per_experiment.{name} must be {{low, high}} with "
                              f"low <= high, got {dist}")
        values = rng.uniform(float(dist["low"]), float(dist["high"]), n_experiments)
        if getattr(sim, "center_per_experiment", True):
            values = values - values.mean()
        for value in values:
            try:
                spec.check(name, float(value))
            except ParameterError as err:
                raise ConfigError(f"simulate.per_experiment: {err}") from None
        out[name] = [float(v) for v in values]
    return out


def synthetic_arrays(cfg: Any, system: System) -> dict[str, np.ndarray]:
    """Array truths of ``simulate.arrays`` (name -> options of system.synthetic_param)."""
    out = {}
    for name, options in dict(getattr(cfg.simulate, "arrays", None) or {}).items():
        spec = system.params.get(name)
        if spec is None or not spec.shape or not hasattr(system, "synthetic_param"):
            raise ConfigError(f"simulate.arrays: {system.name} has no array parameter {name!r} "
                              "with a synthetic generator")
        try:
            value = np.asarray(system.synthetic_param(name, **dict(options or {})))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"simulate.arrays.{name}: {err}") from None
        if value.shape != spec.shape:
            raise ConfigError(f"simulate.arrays.{name}: generated shape {value.shape}, the "
                              f"parameter has {spec.shape}")
        out[name] = value
    return out


def experiment_params(meta: zd.DatasetMeta, params: dict[str, Any], experiment: int,
                      ) -> dict[str, Any]:
    """The true parameters of one experiment: the shared ones with its per-experiment values."""
    own = {k: v[experiment] for k, v in (meta.true_per_experiment or {}).items()}
    return {**params, **own}


def data_system_config(cfg: Any) -> SystemConfig:
    """The system config that makes the data: ``simulate.system`` for a surrogate fit, else
    the fitted ``system``."""
    other = getattr(cfg.simulate, "system", None)
    return cfg.system if other is None else other


def dataset_meta(cfg: Any) -> tuple[zd.DatasetMeta, System, Grid, dict[str, float]]:
    """The metadata of the dataset ``cfg.simulate`` (and the data-making system) describe,
    validated, with the system, grid and true parameters that will produce it."""
    sys_cfg = data_system_config(cfg)
    system, grid = make_system(sys_cfg), make_grid(sys_cfg)
    params = system_params(system, sys_cfg.params)
    check_dynamics(system, params, grid, sys_cfg)
    sim = cfg.simulate
    if sim.n_frames < 1 or sim.steps_per_frame < 1 or sim.n_experiments < 1:
        raise ConfigError("simulate: n_frames, steps_per_frame and n_experiments must be >= 1")
    noise = {"kind": sim.noise.kind}
    if sim.noise.kind != "none":
        noise.update(sigma=float(sim.noise.sigma), seed=int(sim.noise.seed))
    try:
        zd.check_noise(noise)
    except zd.DatasetError as err:
        raise ConfigError(f"simulate.noise: {err}") from None
    fields = tuple(system.fields if getattr(sim, "fields", None) is None else sim.fields)
    known = observable_fields(system, grid)
    unknown = [f for f in fields if f not in known]
    if unknown or not fields:
        raise ConfigError(f"simulate.fields: unknown {unknown} for {system.name}; it can write "
                          f"{list(known)}")
    made = check_refine(cfg, system, grid, params, sys_cfg)
    params.update(synthetic_arrays(cfg, system))
    per_experiment = draw_per_experiment(cfg, system, int(sim.n_experiments))
    scalars = {k: v for k, v in params.items()
               if not system.params[k].shape and k not in per_experiment}
    meta = zd.DatasetMeta(
        system=system.name, fields=fields, grid_shape=grid.shape,
        grid_spacing=grid.spacing, boundaries=grid.boundaries, dt=made["dt"],
        steps_per_frame=int(sim.steps_per_frame) * made["dt_factor"], t0=0.0,
        n_frames=int(sim.n_frames), n_experiments=int(sim.n_experiments),
        true_params=scalars, noise=noise,
        provenance={**zd.make_provenance(_plain(cfg)), "discretization": made},
        true_per_experiment=per_experiment or None,
        true_arrays={k: list(system.params[k].shape) for k in params
                     if system.params[k].shape},
        **dataset_labels(system, grid, fields, params))
    return meta, system, grid, params


def write_experiment(cfg: Any, path: Path, meta: zd.DatasetMeta, system: System, grid: Grid,
                     params: dict[str, float], experiment: int, dtype: Any) -> None:
    """Simulate one experiment and write its whole shards (the caller owns them). Noise is
    seeded by (experiment, frame), so the data do not depend on who writes which shard."""
    sim, sys_cfg = cfg.simulate, data_system_config(cfg)
    if experiment == 0:  # one writer for the array truths (single-chunk arrays)
        for name in meta.true_arrays:
            zd.write_true_array(path, name, np.asarray(params[name]))
    dt_factor, grid_factor = refine_factors(cfg)
    frames = simulate_frames(system, grid, experiment_params(meta, params, experiment),
                             sys_cfg.dt, sys_cfg.integrator, sim.n_frames,
                             sim.steps_per_frame, sim.seed + experiment, dtype, meta.fields,
                             dt_factor, grid_factor)
    mask = observation_mask(cfg, system, grid, meta)
    for name, values in frames.items():
        if not np.all(np.isfinite(values)):
            raise ConfigError(f"simulation of {name!r} blew up (non-finite values); "
                              "reduce system.dt")
        for shard in zd.plan_shards(1, sim.n_frames, sim.frames_per_shard):
            block = zd.add_noise_block(values[shard.frame_start:shard.frame_stop], meta.noise,
                                       experiment=experiment, frame_start=shard.frame_start)
            zd.write_block(path, name, block, experiment=experiment,
                           frame_start=shard.frame_start,
                           mask=None if mask is None else mask[shard.frame_start:
                                                               shard.frame_stop])


def observation_mask(cfg: Any, system: System, grid: Grid, meta: zd.DatasetMeta,
                     ) -> np.ndarray | None:
    """The (n_frames, ny, nx) observation mask of ``simulate.mask`` (the same for every
    experiment and field), or None without one."""
    options = dict(getattr(cfg.simulate, "mask", None) or {})
    if not options:
        return None
    if not hasattr(system, "observation_mask"):
        raise ConfigError(f"simulate.mask: {system.name} has no observation_mask")
    try:
        mask = np.asarray(system.observation_mask(grid, meta.times, **options), bool)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"simulate.mask: {err}") from None
    if mask.shape != (meta.n_frames, *grid.shape) or not mask.any(axis=(1, 2)).all():
        raise ConfigError(f"simulate.mask: every frame needs an observed point (mask shape "
                          f"{mask.shape})")
    return mask


def simulate_dataset(cfg: Any, path: Path, dtype: Any, log=print) -> Path:
    """Write a synthetic dataset for ``cfg.system`` / ``cfg.simulate`` to ``path``.

    Metadata once, before any writer; then every JAX process simulates its own experiments
    (rank, rank + P, ...) and writes whole shards of them, so no two writers share a shard."""
    meta, system, grid, params = dataset_meta(cfg)
    rank, n_processes = jax.process_index(), jax.process_count()
    if rank == 0:
        zd.create_dataset(path, meta, frames_per_shard=cfg.simulate.frames_per_shard,
                          overwrite=True,
                          masks=bool(getattr(cfg.simulate, "mask", None)))
    _barrier("pdefit-dataset-created")
    for experiment in range(rank, meta.n_experiments, n_processes):
        write_experiment(cfg, path, meta, system, grid, params, experiment, dtype)
        log(f"simulated experiment {experiment}: {meta.n_frames} frames of "
            f"{list(meta.fields)} on {grid.shape}")
    _barrier("pdefit-dataset-written")
    return path


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _plain(cfg: Any) -> Any:
    try:
        from omegaconf import OmegaConf
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # a plain dataclass config in tests
        return {}


# ---------------------------------------------------------------------------------------------
# The fit problem.


@jax.jit
def _first_frame(frames):
    return frames[:, 0]


@jax.jit
def _all_finite(x):
    return jnp.all(jnp.isfinite(x))


@jax.jit
def _finite_and(values, mask):
    finite = jnp.isfinite(values)
    return finite if mask is None else finite & mask


@jax.jit
def _non_finite_observed(values, mask):
    bad = ~jnp.isfinite(values)
    if mask is not None:
        bad = bad & mask
    return jnp.sum(bad), jnp.argmax(bad.reshape(-1))


def _check_finite(ds: zd.Dataset, name: str, values, mask) -> None:
    count, first = _non_finite_observed(values, mask)
    count = int(host_scalar(count))
    if count:
        where = np.unravel_index(int(host_scalar(first)), values.shape)
        raise zd.DatasetError(
            f"dataset {ds.path} field {name!r}: {count} NaN/Inf value(s) at observed points, "
            f"first at (experiment, frame, y, x) = {tuple(int(i) for i in where)} of the "
            "selection; mask them or use observe.nan=mask to treat NaN as missing")


def _check_missing(ds: zd.Dataset, name: str, experiments: list[int], frames: list[int],
                   policy: str) -> None:
    """Frames whose shard files are gone are missing data, not NaN: an error, or with
    ``observe.nan=mask`` unobserved frames, said so."""
    missing = ds.missing_frames(name, experiments, frames)
    if not missing:
        return
    listed = "; ".join(f"experiment {e}: frame(s) {zd.index_ranges(f)}"
                       for e, f in missing.items())
    count = sum(len(f) for f in missing.values())
    if policy != "mask":
        raise zd.DatasetError(
            f"dataset {ds.path} field {name!r}: missing data — {count} frame(s) of the "
            f"selection are not on disk (shard files deleted or never written): {listed}. "
            "Re-create or copy the dataset again, choose other data.frames, or use "
            "observe.nan=mask to fit without them")
    log.warning(
        f"dataset {ds.path} field {name!r}: {count} frame(s) are missing on disk ({listed}); "
        "observe.nan=mask: they are treated as unobserved")


@jax.jit
def _mask_counts(mask):
    observed_per_frame = jnp.sum(mask, axis=(2, 3))
    return jnp.sum(mask), mask.size, jnp.sum(observed_per_frame == 0), observed_per_frame.size


def _report_masked(ds: zd.Dataset, name: str, mask) -> None:
    """With ``observe.nan=mask``: how much of the window is unobserved, and an error when a
    field has no data in it at all (the fit would see nothing of it)."""
    observed, total, empty, frames = (int(host_scalar(x)) for x in _mask_counts(mask))
    if observed == 0:
        raise zd.DatasetError(
            f"dataset {ds.path} field {name!r}: no observed (finite, unmasked) value in the "
            "training window; choose other data.frames or data.experiments, or drop it "
            "from observe.fields")
    if observed < total:
        log.warning(
            f"observe.nan=mask: field {name!r}: {total - observed} of {total} points masked "
            f"({empty} of {frames} frames have no data)")


class FitSetup(NamedTuple):
    """A fit ready to run (:func:`build_fit`, :func:`pdefit.build_problem`): the problem, the
    batch of data it reads, the starting point ``theta0`` (unconstrained), the starting values
    of the shared scalars in physical units, and the dataset's true parameters if known."""

    problem: FitProblem
    batch: Batch
    theta0: dict[str, Any]
    start_values: dict[str, float]
    reference: dict[str, float] | None  # the dataset's true parameters, if it has them
    reads: list  # the dataset windows this process read: (field, experiments, frames, y, x)
    meta: zd.DatasetMeta | None = None  # the dataset's metadata (how it was made)


def build_fit(cfg: FitConfig, dataset_path: Path, dtype: Any,
              system: System | None = None) -> FitSetup:
    """Validate config and dataset against each other and assemble the fit. ``cfg`` is the
    Hydra config or the same schema (:mod:`pdefit.app.config`) filled in by :func:`pdefit.api.
    build_problem`; ``system`` is a system object to use instead of building one from
    ``cfg.system.name`` and its options."""
    system = make_system(cfg.system) if system is None else system
    grid = make_grid(cfg.system)
    params = system_params(system, cfg.system.params)
    check_dynamics(system, params, grid, cfg.system)
    ds = zd.open_dataset(dataset_path)
    obs_cfg = cfg.observe
    derived = observable_names(system, grid)
    unknown = [f for f in obs_cfg.fields if f not in system.fields and f not in derived]
    if unknown:
        raise ConfigError(f"observe.fields: unknown field(s) {unknown} for {system.name}; it "
                          f"has fields {list(system.fields)} and observables {list(derived)}")
    if obs_cfg.loss not in LOSSES:
        raise ConfigError(f"observe.loss: unknown {obs_cfg.loss!r}; choose one of {LOSSES}")
    if obs_cfg.nan not in ("error", "mask"):
        raise ConfigError(f"observe.nan must be 'error' or 'mask', got {obs_cfg.nan!r}")
    fit_fields = dict(cfg.fit.initial_fields)
    for name, source in fit_fields.items():
        if name not in system.fields or source not in ("data", "fit"):
            raise ConfigError(f"fit.initial_fields: {name}={source} — fields are "
                              f"{list(system.fields)}, sources are data or fit")
    fitted_fields = tuple(f for f in system.fields if fit_fields.get(f) == "fit")
    # A surrogate fit reads a dataset of another system: only the observed fields mean the
    # same thing in both (e.g. the voltage-like u), so only those are taken from it.
    surrogate = cfg.data.system is not None and cfg.data.system != system.name
    time_scale = float(cfg.data.time_scale)
    if not time_scale > 0:
        raise ConfigError(f"data.time_scale must be positive, got {time_scale}")
    # Values are checked for NaN/Inf below, on the windows this process loads anyway.
    zd.validate_dataset(ds, system=cfg.data.system or system.name, fields=list(obs_cfg.fields),
                        grid_shape=grid.shape, grid_spacing=grid.spacing,
                        boundaries=grid.boundaries, check_finite=False)
    meta = ds.meta
    data_fields = tuple(obs_cfg.fields) if surrogate else meta.fields

    # Frames and time steps: each used frame must fall on a step of the fit's dt.
    frames = list(range(meta.n_frames)) if cfg.data.frames is None else list(cfg.data.frames)
    if not frames or sorted(set(frames)) != frames or frames[0] < 0 or frames[-1] >= meta.n_frames:
        raise ConfigError(f"data.frames must be increasing indices in [0, {meta.n_frames}), "
                          f"got {frames}")
    ratio = meta.frame_interval / time_scale / cfg.system.dt
    steps_per_frame = round(ratio)
    if steps_per_frame < 1 or abs(ratio - steps_per_frame) > 1e-6 * ratio:
        raise ConfigError(f"frames are {meta.frame_interval / time_scale} model time units "
                          f"apart (dataset interval {meta.frame_interval} / data.time_scale "
                          f"{time_scale}), not a multiple of system.dt={cfg.system.dt}")
    frame_steps = [(f - frames[0]) * steps_per_frame for f in frames]
    n_steps = frame_steps[-1]
    experiments = (list(range(meta.n_experiments)) if cfg.data.experiments is None
                   else list(cfg.data.experiments))
    if not experiments or min(experiments) < 0 or max(experiments) >= meta.n_experiments:
        raise ConfigError(f"data.experiments must index [0, {meta.n_experiments}), got "
                          f"{experiments}")

    stride = obs_cfg.stride
    domain = make_domain(cfg.mesh)
    if domain is not None:
        try:
            domain.check(grid, len(experiments), stride, system.stencil_radius)
        except ValueError as err:
            raise ConfigError(f"mesh: {err}") from None
    frames_placement = (domain.sharding(FRAMES) if domain is not None
                        else SingleDeviceSharding(jax.devices()[0]))
    reads: list = []
    values, masks = {}, {}
    for name in obs_cfg.fields:
        _check_missing(ds, name, experiments, frames, obs_cfg.nan)
        v = dataset_array(ds, name, experiments, frames, stride, frames_placement,
                          dtype=np.dtype(dtype), reads=reads)
        m = (dataset_array(ds, name, experiments, frames, stride, frames_placement, mask=True,
                           reads=reads) if ds.has_mask(name) else None)
        if obs_cfg.nan == "mask":
            m = _finite_and(v, m)
            _report_masked(ds, name, m)
        else:
            _check_finite(ds, name, v, m)
        values[name], masks[name] = v, m
    observation = Observation(tuple(obs_cfg.fields), stride, obs_cfg.loss,
                              tuple(sorted(dict(obs_cfg.field_weights).items())),
                              system.observables if derived else None)
    observed = observed_data(observation, values, masks, frame_steps, n_steps, dtype)
    initial = {f: _first_frame(dataset_array(ds, f, experiments, frames[:1], 1, frames_placement,
                                             dtype=np.dtype(dtype), reads=reads))
               for f in system.fields if f in data_fields and f not in fitted_fields}
    from_observed = _state_from_first_frames(system, grid, ds, data_fields, experiments,
                                             frames, frames_placement, dtype, reads)
    initial.update({f: v for f, v in from_observed.items()
                    if f not in initial and f not in fitted_fields})
    missing = [f for f in system.fields if f not in fitted_fields and f not in initial]
    if missing:
        raise ConfigError(f"initial field(s) {missing} are not in the dataset: fit them "
                          f"(fit.initial_fields.{missing[0]}=fit)")
    for name, field in initial.items():
        if not host_scalar(_all_finite(field)):
            raise ConfigError(f"the initial frame of {name!r} has missing values: fit it "
                              f"(fit.initial_fields.{name}=fit)")

    # Parameters: which are fitted, and where they start.
    # Another system's true parameters are no reference for this one's.
    reference = dict(meta.true_params) if meta.true_params and not surrogate else None
    fitted = list(cfg.fit.params)
    per_experiment = list(getattr(cfg.fit, "per_experiment", None) or [])
    start_values = dict(params)
    # Perturbed starts are for shared scalars; arrays and per-experiment values start from
    # their defaults (zero force, no rotation) unless fit.start says otherwise.
    perturbed = [n for n in fitted if n in system.params and not system.params[n].shape
                 and n not in per_experiment]
    if cfg.fit.perturb is not None and perturbed:
        rng = np.random.default_rng(cfg.fit.perturb.seed)
        factors = rng.uniform(cfg.fit.perturb.low, cfg.fit.perturb.high, len(perturbed))
        base = reference or params
        for name, factor in zip(perturbed, factors, strict=True):
            if name in base:
                start_values[name] = float(base[name]) * float(factor)
    for name in fitted:
        spec = system.params.get(name)
        if spec is not None and (spec.shape or name in per_experiment):
            start_values[name] = spec.full(spec.default)
    warm = _warm_start(cfg, system, fitted, per_experiment, len(experiments))
    start_values.update(warm["physical"])
    for name, value in dict(cfg.fit.start).items():
        start_values[name] = value
    unknown = sorted((set(cfg.fit.start) | set(fitted)) - set(system.params))
    if unknown:
        raise ConfigError(f"fit: unknown parameter(s) {unknown} for {system.name}; it has "
                          f"{sorted(system.params)}")
    unknown = sorted(set(per_experiment) - set(fitted))
    if unknown:
        raise ConfigError(f"fit.per_experiment: {unknown} are not fitted parameters (fit.params "
                          f"is {fitted}); a per-experiment parameter must also be fitted")
    try:
        layout = ParameterLayout.build(system.params, start_values, fitted,
                                       dict(cfg.fit.transforms), system.name, per_experiment,
                                       list(getattr(cfg.fit, "centered", None) or []))
        z0 = layout.unconstrained(start_values, len(experiments))
    except ParameterError as err:
        raise ConfigError(f"fit: {err}") from None
    z0 = {k: jnp.asarray(v, dtype) for k, v in z0.items()}
    fields0 = {}
    for name in fitted_fields:
        # Start a fitted field from its first observed frame when there is one, else from
        # what the system derives from the observed first frame, else zero.
        # An unobserved field's values in the dataset (a synthetic dataset stores every
        # field) are the truth the fit should find, never its starting guess.
        guess = None
        if name in data_fields and name in obs_cfg.fields:
            guess = _first_frame(dataset_array(ds, name, experiments, frames[:1], 1,
                                               frames_placement, dtype=np.dtype(dtype),
                                               reads=reads))
            guess = jnp.where(jnp.isfinite(guess), guess, 0.0)
        elif name in from_observed:
            guess = from_observed[name]
        if guess is None:
            guess = jnp.zeros((len(experiments), *grid.shape), dtype)
        previous = warm["fields"].get(name)
        if previous is not None and previous.shape == (len(experiments), *grid.shape):
            guess = jnp.asarray(previous, dtype)
        elif previous is not None:
            log.warning(f"fit.start_from: the fitted field {name!r} has shape "
                        f"{previous.shape}, this fit's is {(len(experiments), *grid.shape)}: "
                        "it starts as without start_from")
        fields0[name] = guess
    theta0 = {"params": z0, "fields": fields0}
    if domain is not None:
        # Global arrays on the mesh: every argument of the jitted update must live there
        # (with several processes, a value on one local device is not a valid argument).
        shared, own = layout.split(z0)
        theta0 = {"params": {**jax.device_put(shared, domain.sharding(REPLICATED)),
                             **jax.device_put(own, domain.sharding(PER_EXPERIMENT))},
                  "fields": jax.device_put(fields0, domain.sharding(FIELD))}

    state_bytes = sum(np.prod(grid.shape) * jnp.dtype(dtype).itemsize for _ in system.fields)
    schedule = make_schedule(cfg.adjoint, int(state_bytes))
    problem = FitProblem(
        system=system, grid=grid, dt=float(cfg.system.dt), integrator=cfg.system.integrator,
        n_steps=n_steps, layout=layout, observation=observation, schedule=schedule,
        fitted_fields=fitted_fields, t0=float(meta.times[frames[0]]) / time_scale,
        regularization=make_regularization(cfg, layout, system, grid), domain=domain)
    if n_steps == 0:
        raise ConfigError("the training window has no time steps: use at least two frames")
    batch = Batch(observed, initial)
    # The table of start/recovered values shows numbers: shared scalars only.
    return FitSetup(problem, batch, theta0, {n: float(start_values[n]) for n in layout.scalars},
                    reference, reads, meta)


def _warm_start(cfg: FitConfig, system: System, fitted: list[str], per_experiment: list[str],
                n_experiments: int) -> dict[str, dict[str, Any]]:
    """{"physical": start values, "fields": fitted fields} of ``fit.start_from`` (empty
    without it), for the parameters this fit fits; shapes checked against this fit's."""
    location = getattr(cfg.fit, "start_from", None)
    if not location:
        return {"physical": {}, "fields": {}}
    try:
        stored = read_fitted(Path(location))
    except FittedFileError as err:
        raise ConfigError(f"fit.start_from: {err}") from None
    if not stored["physical"] and stored["params"]:
        raise ConfigError(f"fit.start_from: {fitted_path(Path(location))} holds no physical "
                          "values (written by an older pdefit): run that fit once more with its "
                          "own config, which resumes at its last step and rewrites the file")
    physical = {}
    for name in fitted:
        if name not in stored["physical"] or name not in system.params:
            continue
        value = stored["physical"][name]
        shape = tuple(system.params[name].shape)
        want = (n_experiments, *shape) if name in per_experiment else shape
        if value.shape != want:
            raise ConfigError(f"fit.start_from: {name!r} there has shape {value.shape}, this "
                              f"fit needs {want}")
        physical[name] = float(value) if not want else value
    if not physical and not stored["fields"]:
        raise ConfigError(f"fit.start_from: {fitted_path(Path(location))} fitted none of "
                          f"{fitted}")
    log.info(f"fit.start_from {location}: {sorted(physical)} start from its values")
    return {"physical": physical, "fields": stored["fields"]}


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


def _state_from_first_frames(system: System, grid: Grid, ds: zd.Dataset, data_fields: Any,
                             experiments, frames, placement, dtype, reads) -> dict[str, Any]:
    """State fields the system derives from the observed first frames (e.g. a vorticity from
    a velocity), for fields the dataset does not hold; empty if it cannot."""
    derive = getattr(system, "state_from_observables", None)
    names = observable_names(system, grid)
    if derive is None or not names or any(n not in data_fields for n in names):
        return {}
    if all(f in data_fields for f in system.fields):
        return {}
    first = {}
    for n in names:
        values = _first_frame(dataset_array(ds, n, experiments, frames[:1], 1, placement,
                                            dtype=np.dtype(dtype), reads=reads))
        if ds.has_mask(n):
            # Unobserved points carry no information: zero, not whatever the file holds.
            mask = _first_frame(dataset_array(ds, n, experiments, frames[:1], 1, placement,
                                              mask=True, reads=reads))
            values = jnp.where(mask, values, 0.0)
        first[n] = jnp.where(jnp.isfinite(values), values, 0.0)
    derived = jax.jit(derive)(first)
    return {f: jnp.asarray(v, dtype) for f, v in derived.items() if f not in data_fields}
