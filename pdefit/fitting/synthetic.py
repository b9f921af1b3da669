"""Synthetic (twin) datasets: the truth a fit should recover, simulated from typed options
(``system`` and ``simulate`` of :class:`pdefit.options.FitConfig`, or ``pdefit-simulate``'s
:class:`pdefit.options.SimulateMainConfig`) and written in the dataset format of
:mod:`pdefit.data`, with a record of how they were made (the dataset's metadata and
provenance). The options are checked as the metadata are made, before anything is written:
the simulating system (``simulate.system`` for a surrogate fit), the frames, the noise, the
written fields, a finer discretization (``simulate.refine``), per-experiment and array truths;
the observation mask (``simulate.mask``) as each experiment is written. A bad value raises
:class:`ConfigError` naming its key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit import data as zd
from pdefit.fitting import discretization
from pdefit.fitting.components import (
    check_dynamics,
    check_mesh_operators,
    make_grid,
    make_system,
    observable_fields,
    system_params,
)
from pdefit.model.params import ParameterError
from pdefit.model.system import (
    System,
    UnstableTimeStepError,
    check_time_step,
    dataset_labels,
    stepper,
    system_reference,
)
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.options import ConfigError, FitConfig, SimulateMainConfig, SystemConfig

# The options a dataset is simulated from: a fit's (the embedded default dataset, forecasts'
# truths) or pdefit-simulate's.
SimulationOptions = FitConfig | SimulateMainConfig


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


def refine_factors(cfg: SimulationOptions) -> tuple[int, int]:
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


def check_refine(cfg: SimulationOptions, system: System, grid: Grid, params: dict[str, Any],
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


def draw_per_experiment(cfg: SimulationOptions, system: System, n_experiments: int,
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


def synthetic_arrays(cfg: SimulationOptions, system: System) -> dict[str, np.ndarray]:
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


def data_system_config(cfg: SimulationOptions) -> SystemConfig:
    """The system config that makes the data: ``simulate.system`` for a surrogate fit, else
    the fitted ``system``."""
    other = getattr(cfg.simulate, "system", None)
    return cfg.system if other is None else other


def dataset_meta(cfg: SimulationOptions,
                 ) -> tuple[zd.DatasetMeta, System, Grid, dict[str, float]]:
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
        noise.update(sigma=float(sim.noise.sigma), seed=int(sim.noise.seed),
                     streams=zd.PER_FIELD)
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
        system=system_reference(system), fields=fields, grid_shape=grid.shape,
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


def write_experiment(cfg: SimulationOptions, path: Path, meta: zd.DatasetMeta, system: System,
                     grid: Grid, params: dict[str, float], experiment: int, dtype: Any) -> None:
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
                                       experiment=experiment, frame_start=shard.frame_start,
                                       stream=meta.fields.index(name))
            zd.write_block(path, name, block, experiment=experiment,
                           frame_start=shard.frame_start,
                           mask=None if mask is None else mask[shard.frame_start:
                                                               shard.frame_stop])


def observation_mask(cfg: SimulationOptions, system: System, grid: Grid, meta: zd.DatasetMeta,
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


def simulate_dataset(cfg: SimulationOptions, path: Path, dtype: Any,
                     log: Callable[[str], None] = print) -> Path:
    """Write a synthetic dataset for ``cfg.system`` / ``cfg.simulate`` to ``path``.

    Metadata once, before any writer; then every JAX process simulates its own experiments
    (rank, rank + P, ...) and writes whole shards of them, so no two writers share a shard."""
    meta, system, grid, params = dataset_meta(cfg)
    if isinstance(cfg, FitConfig):  # a fit that cannot run on its mesh: before simulating
        check_mesh_operators(cfg)
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


def _plain(options: Any) -> Any:
    """The options as plain dicts and lists (the provenance a dataset keeps): typed options
    through ``dataclasses.asdict``; a mapping (a config not yet typed) key by key, its values
    resolved as it gives them."""
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        options = dataclasses.asdict(options)
    if isinstance(options, Mapping):
        return {key: _plain(value) for key, value in options.items()}
    if isinstance(options, Sequence) and not isinstance(options, str | bytes):
        return [_plain(value) for value in options]
    return options
