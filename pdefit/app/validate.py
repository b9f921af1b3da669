"""Validation of every numeric setting of a fit against its meaning, in one place, before
anything is written or compiled.

The structured config (:mod:`pdefit.app.config`) checks types; this module checks values: a
negative learning rate is a float all the same, but it climbs the loss. Each error names the
offending key (:class:`pdefit.fitting.assemble.ConfigError`); settings that are legal but almost
certainly wrong (a grid too small for the initial-state generator, a checkpoint after every
step) give a warning instead. Keys that depend on the chosen system or the host (parameter and
field names, the observation stride, the adjoint's budget, the grid's memory, the mesh) are
checked here too, by :mod:`pdefit.app.preflight`; those that depend on the dataset's contents
(frames, missing values) where it is read, in :mod:`pdefit.fitting.assemble`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from omegaconf import DictConfig

from pdefit.app.config import as_options
from pdefit.app.preflight import check_fit_against_system, check_simulation_against_system
from pdefit.fitting import discretization
from pdefit.fitting.assemble import refine_factors
from pdefit.options import (
    ConfigError,
    FitConfig,
    GridConfig,
    ObserveConfig,
    OptimConfig,
    RegularizationConfig,
    SimulateConfig,
    SimulateMainConfig,
)

OPTIMIZERS = ("adam", "adamw", "sgd", "lbfgs", "levenberg_marquardt")
SCHEDULES = ("constant", "cosine", "exponential")


def _number(key: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return x


def _positive(key: str, value: Any) -> float:
    x = _number(key, value)
    if x <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")
    return x


def _non_negative(key: str, value: Any) -> float:
    x = _number(key, value)
    if x < 0:
        raise ConfigError(f"{key} must be >= 0, got {value!r}")
    return x


def _at_least(key: str, value: Any, low: int) -> int:
    x = _number(key, value)
    if x < low or x != int(x):
        raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")
    return int(x)


def _weights(key: str, weights: Any) -> dict[str, float]:
    return {name: _non_negative(f"{key}.{name}", w) for name, w in dict(weights or {}).items()}


def validate_optim(cfg: OptimConfig) -> None:
    """``optim.*``: also used by :func:`pdefit.fitting.train.run_fit` callers that bypass the
    CLI."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown {cfg.name!r}; choose one of {list(OPTIMIZERS)}")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule: unknown {cfg.schedule!r}; choose one of "
                          f"{list(SCHEDULES)}")
    _positive("optim.lr", cfg.lr)
    steps = _at_least("optim.steps", cfg.steps, 1)
    warmup = _at_least("optim.warmup_steps", cfg.warmup_steps, 0)
    if warmup >= steps:
        raise ConfigError(f"optim.warmup_steps ({warmup}) must be less than optim.steps "
                          f"({steps})")
    fraction = _number("optim.final_lr_fraction", cfg.final_lr_fraction)
    low = 0.0 if cfg.schedule != "exponential" else math.ulp(0.0)
    if not low <= fraction <= 1:
        raise ConfigError(f"optim.final_lr_fraction must be in [0, 1] ((0, 1] for the "
                          f"exponential schedule), got {cfg.final_lr_fraction!r}")
    if cfg.clip is not None:
        _positive("optim.clip", cfg.clip)
    factor = _number("optim.nan_lr_factor", cfg.nan_lr_factor)
    if not 0 < factor < 1:
        raise ConfigError(f"optim.nan_lr_factor must be in (0, 1), got {cfg.nan_lr_factor!r}")
    _at_least("optim.max_nan_failures", cfg.max_nan_failures, 0)
    _non_negative("optim.grad_tol", cfg.grad_tol)
    if cfg.patience is not None:
        _at_least("optim.patience", cfg.patience, 1)
    if cfg.max_log_step is not None:
        _positive("optim.max_log_step", cfg.max_log_step)
    if cfg.divergence_factor is not None and _number(
            "optim.divergence_factor", cfg.divergence_factor) <= 1:
        raise ConfigError(f"optim.divergence_factor must be > 1 (or null to disable), got "
                          f"{cfg.divergence_factor!r}")
    if cfg.max_steps_at_bound is not None:
        _at_least("optim.max_steps_at_bound", cfg.max_steps_at_bound, 1)
    _at_least("optim.krylov_iterations", cfg.krylov_iterations, 1)
    _positive("optim.initial_damping", cfg.initial_damping)
    if not 0 < _number("optim.krylov_rtol", cfg.krylov_rtol) < 1:
        raise ConfigError(f"optim.krylov_rtol must be in (0, 1), got {cfg.krylov_rtol!r}")
    if cfg.krylov_preconditioner not in ("parameter_block", "diagonal"):
        raise ConfigError("optim.krylov_preconditioner must be 'parameter_block' or "
                          f"'diagonal', got {cfg.krylov_preconditioner!r}")
    if cfg.parameter_step not in ("joint", "reduced"):
        raise ConfigError("optim.parameter_step must be 'joint' or 'reduced', got "
                          f"{cfg.parameter_step!r}")
    for key in ("reduced_field_steps", "reduced_solve_iterations", "reduced_tries"):
        _at_least(f"optim.{key}", getattr(cfg, key), 1)
    if cfg.reduced_steps is not None:
        _at_least("optim.reduced_steps", cfg.reduced_steps, 1)
    if not _number("optim.reduced_radius", cfg.reduced_radius) > 0:
        raise ConfigError(f"optim.reduced_radius must be > 0, got {cfg.reduced_radius!r}")


def validate_fit(cfg: FitConfig | DictConfig, log: Callable[[str], None] = print) -> None:
    """Raise :class:`ConfigError` for the first setting of ``cfg`` (a fit config: typed
    options, or a composed config, converted first) that cannot work; ``log`` the ones that
    are legal but almost certainly wrong."""
    cfg = as_options(cfg)
    validate_optim(cfg.optim)
    _positive("system.dt", cfg.system.dt)
    _grid(cfg.system.grid)
    _observe(cfg.observe)
    _fit(cfg)
    _regularization(cfg.regularization)
    _run(cfg, log)
    if not cfg.data.path:
        _simulation_counts(cfg.simulate)
    check_fit_against_system(cfg)  # names, stride, adjoint budget, memory, mesh
    _simulation(cfg, log)


def validate_simulate(cfg: SimulateMainConfig) -> None:
    """Raise :class:`ConfigError` for the first setting of ``pdefit-simulate`` that cannot make
    a dataset ``pdefit-fit`` can fit, before anything is simulated or written."""
    _positive("system.dt", cfg.system.dt)
    _grid(cfg.system.grid)
    _simulation_counts(cfg.simulate)
    sim = cfg.simulate
    tasks = _at_least("simulate.tasks", sim.tasks, 1)
    task = _at_least("simulate.task", sim.task, 0)
    if task >= tasks:
        raise ConfigError(f"simulate.task={task} must be less than simulate.tasks={tasks}")
    refine_factors(cfg)
    check_simulation_against_system(cfg)


def _simulation_counts(sim: SimulateConfig) -> None:
    """The counts of a synthetic dataset: at least two frames (the first is the initial
    state; a fit needs a later one to compare with)."""
    frames = _number("simulate.n_frames", sim.n_frames)
    if frames < 2:
        raise ConfigError(f"simulate.n_frames={sim.n_frames}: a dataset needs at least 2 "
                          "frames to fit (the first is the initial state, the fit compares "
                          "the later ones); use simulate.n_frames=2 or more")
    _at_least("simulate.n_frames", sim.n_frames, 2)
    _at_least("simulate.steps_per_frame", sim.steps_per_frame, 1)
    _at_least("simulate.n_experiments", sim.n_experiments, 1)
    _at_least("simulate.frames_per_shard", sim.frames_per_shard, 1)
    if sim.noise is not None:
        _non_negative("simulate.noise.sigma", sim.noise.sigma)


def _observe(obs: ObserveConfig) -> None:
    _at_least("observe.stride", obs.stride, 1)
    if not list(obs.fields):
        raise ConfigError("observe.fields is empty: a fit needs at least one observed field")
    weights = _weights("observe.field_weights", obs.field_weights)
    unknown = sorted(set(weights) - set(obs.fields))
    if unknown:
        raise ConfigError(f"observe.field_weights: {unknown} are not observed fields "
                          f"(observe.fields={list(obs.fields)})")
    if weights and all(weights.get(f, 1.0) == 0 for f in obs.fields):
        raise ConfigError("observe.field_weights: every observed field has weight 0")


def _fit(cfg: FitConfig) -> None:
    """``fit.*``: something to fit, the start's perturbation, the stages and holds, the
    discretization check."""
    fit = cfg.fit
    fitted_fields = [f for f, source in dict(fit.initial_fields or {}).items()
                     if source == "fit"]
    if not list(fit.params) and not fitted_fields:
        raise ConfigError("fit.params is empty and no fit.initial_fields is 'fit': there is "
                          "nothing to fit")
    if fit.perturb is not None:
        low = _positive("fit.perturb.low", fit.perturb.low)
        high = _positive("fit.perturb.high", fit.perturb.high)
        if low > high:
            raise ConfigError(f"fit.perturb.low ({low}) must not exceed fit.perturb.high "
                              f"({high})")
    if fit.stages is not None:
        for i, k in enumerate(fit.stages):
            _at_least(f"fit.stages[{i}]", k, 2)
    _hold(cfg)
    _starts(cfg)
    _bootstrap(cfg)
    _shooting(cfg)
    _recentre(cfg)
    _reduced_steps(cfg, fitted_fields)
    validate_discretization_check(fit.discretization_check)


def _reduced_steps(cfg: FitConfig, fitted_fields: list[str]) -> None:
    """``optim.parameter_step=reduced``: Levenberg–Marquardt steps of parameters on the
    fields' Schur complement, so fitted fields, parameters and one trajectory."""
    if cfg.optim.parameter_step != "reduced":
        return
    if (cfg.optim.name != "levenberg_marquardt" or not fitted_fields or not list(cfg.fit.params)
            or cfg.fit.shooting.segments > 1):
        raise ConfigError("optim.parameter_step=reduced steps the parameters with the fitted "
                          "initial fields eliminated: it needs optim=levenberg_marquardt, "
                          "fit.params, fit.initial_fields.<field>=fit and "
                          "fit.shooting.segments=1")


def _shooting(cfg: FitConfig) -> None:
    """``fit.shooting``: a segment count ≥ 1, a positive continuity weight, one device (no
    more segments than steps: checked with the problem, by
    :func:`pdefit.fitting.assemble.build_fit`)."""
    segments = _at_least("fit.shooting.segments", cfg.fit.shooting.segments, 1)
    _positive("fit.shooting.continuity", cfg.fit.shooting.continuity)
    mesh = cfg.mesh
    if segments > 1 and (math.prod(mesh.shape) > 1 or mesh.experiments > 1
                         or mesh.all_devices):
        raise ConfigError(f"fit.shooting.segments={segments}: multiple shooting runs on one "
                          "device; use mesh=single or fit.shooting.segments=1")


def _recentre(cfg: FitConfig) -> None:
    """``fit.recentre_background``: a count ≥ 0 of refits that move a background prior of
    fitted fields, one trajectory each."""
    count = _at_least("fit.recentre_background", cfg.fit.recentre_background, 0)
    if not count:
        return
    fitted = [f for f, source in dict(cfg.fit.initial_fields or {}).items() if source == "fit"]
    if not fitted or not cfg.regularization.field_background > 0:
        raise ConfigError(f"fit.recentre_background={count} moves the background prior of "
                          "fitted initial fields: it needs fit.initial_fields.<field>=fit and "
                          "regularization.field_background > 0")
    if cfg.fit.shooting.segments > 1:
        raise ConfigError(f"fit.recentre_background={count} refits one trajectory; with "
                          f"fit.shooting.segments={cfg.fit.shooting.segments} use 0")


def _bootstrap(cfg: FitConfig) -> None:
    """``fit.bootstrap``: 0 or a replicate count ≥ 2, with the intervals whose noise level the
    replicates take."""
    count = _at_least("fit.bootstrap", cfg.fit.bootstrap, 0)
    if count == 1:
        raise ConfigError("fit.bootstrap=1: a bootstrap needs at least 2 replicates (its spread "
                          "is their standard deviation); use 0 for none")
    if count and not cfg.fit.uncertainty:
        raise ConfigError(f"fit.bootstrap={count} takes its noise level from the intervals, "
                          "which fit.uncertainty=false skips: set fit.uncertainty=true")


def _starts(cfg: FitConfig) -> None:
    """``fit.starts`` and ``fit.start_probe_steps``: the extra starts are drawn from
    ``fit.perturb``, and a probe is shorter than the fit."""
    starts = _at_least("fit.starts", cfg.fit.starts, 1)
    if cfg.fit.start_probe_steps is not None:
        probe = _at_least("fit.start_probe_steps", cfg.fit.start_probe_steps, 1)
        if probe > cfg.optim.steps:
            raise ConfigError(f"fit.start_probe_steps ({probe}) must not exceed optim.steps "
                              f"({cfg.optim.steps})")
    if starts > 1 and cfg.fit.perturb is None:
        raise ConfigError(f"fit.starts={starts} draws its extra starts from fit.perturb, which "
                          "is null: set fit.perturb (e.g. {low: 0.5, high: 1.5, seed: 0}) or "
                          "fit.starts=1")


def _regularization(reg: RegularizationConfig) -> None:
    _non_negative("regularization.params", reg.params)
    _non_negative("regularization.fields", reg.fields)
    _non_negative("regularization.field_background", reg.field_background)
    _non_negative("regularization.field_smoothness", reg.field_smoothness)
    for key in ("param_l2", "smoothness", "system"):
        _weights(f"regularization.{key}", getattr(reg, key))


def _run(cfg: FitConfig, log: Callable[[str], None]) -> None:
    run = cfg.run
    every = _at_least("run.checkpoint_every", run.checkpoint_every, 1)
    _at_least("run.checkpoint_keep", run.checkpoint_keep, 1)
    _at_least("run.log_every", run.log_every, 1)
    if every == 1 and cfg.optim.steps > 1:
        log("run.checkpoint_every=1 writes a checkpoint after every optimiser step, which "
            "can make a small fit several times slower; 10-50 is usually enough")


def _hold(cfg: FitConfig) -> None:
    """``fit.hold``: fitted names, each held for 0 (not held) up to the number of listed
    stages, not every fitted parameter at once, and none into the last stage (checked here
    when the frame count is known without the dataset, else by :func:`pdefit.app.cli.stage_holds`
    once it is open)."""
    fit = cfg.fit
    held: dict[str, int] = {}  # name -> stages held, for the names actually held
    for name, count in dict(fit.hold or {}).items():
        key = f"fit.hold.{name}"
        count = _at_least(key, count, 0)
        if count == 0:  # not held (how an override switches off an experiment's hold)
            continue
        if name not in list(fit.params):
            raise ConfigError(f"{key}: {name!r} is not a fitted parameter (fit.params="
                              f"{list(fit.params)}); only fitted parameters can be held "
                              f"({key}=0 drops the hold)")
        held[str(name)] = count
    if held and not fit.stages:  # all at once: an experiment's hold may name ten parameters
        drop = " ".join(f"fit.hold.{n}=0" for n in held)
        raise ConfigError(f"fit.hold: holding {', '.join(held)} needs a staged fit "
                          f"(fit.stages); without stages they would never be fitted "
                          f"(fit.hold=null drops the whole hold, {drop} one by one)")
    for name, count in held.items():
        if count > len(fit.stages):
            raise ConfigError(f"fit.hold.{name}={count}: there are {len(fit.stages)} listed "
                              f"stages (fit.stages={list(fit.stages)}) and the last one must "
                              "fit it")
    held_first = set(held)
    fits_fields = any(str(v) == "fit" for v in dict(fit.initial_fields or {}).values())
    if fit.params and held_first >= {str(n) for n in fit.params} and not fits_fields:
        raise ConfigError(f"fit.hold holds every fitted parameter ({sorted(held_first)}) in "
                          "the first stage, which would then fit nothing; hold fewer")
    if fit.hold and fit.stages and (cfg.data.path is None or cfg.data.frames is not None):
        # The frame count is known before any dataset is opened: check the stage count now.
        n_frames = (len(cfg.data.frames) if cfg.data.frames is not None
                    else int(cfg.simulate.n_frames))
        n_stages = len(fit.stages) + (int(fit.stages[-1]) != n_frames)
        check_hold_counts(fit.hold, n_stages)


def check_hold_counts(hold: Any, n_stages: int) -> None:
    """Every held parameter (``fit.hold``) must be fitted in the last of ``n_stages``."""
    for name, count in dict(hold or {}).items():
        if int(count) >= n_stages:
            raise ConfigError(
                f"fit.hold.{name}={count}: the fit has {n_stages} stage(s) on these data, so "
                f"{name} would never be fitted; hold it for at most {n_stages - 1}")


def validate_discretization_check(check: Any, key: str = "fit.discretization_check",
                                  problem: Any = None) -> None:
    """The numbers of ``fit.discretization_check`` (pdefit.fitting.discretization); with the fit's
    ``problem`` (once assembled, before compiling) also what the check cannot do for it:
    ``grid_factor`` > 1 on a grid that cannot be refined, ``parameters`` without the
    Gauss–Newton curvature. Nothing to check when the check is off."""
    if not check.enabled:
        return
    _at_least(f"{key}.dt_factor", check.dt_factor, 2)
    _at_least(f"{key}.grid_factor", check.grid_factor, 1)
    _positive(f"{key}.tolerance", check.tolerance)
    _non_negative(f"{key}.negligible", check.negligible)
    _positive(f"{key}.parameter_tolerance", check.parameter_tolerance)
    refused = None if problem is None else discretization.unsupported(problem, check, key)
    if refused is not None:
        raise ConfigError(refused)


def _grid(grid: GridConfig) -> None:
    shape = list(grid.shape)
    for i, n in enumerate(shape):
        _at_least(f"system.grid.shape[{i}]", n, 1)
    for i, h in enumerate(grid.spacing):
        _positive(f"system.grid.spacing[{i}]", h)


def _simulation(cfg: FitConfig, log: Callable[[str], None]) -> None:
    """The embedded default's dataset (no ``data.path``): counts, and a warning when the
    initial state the system generates on this grid is (nearly) constant, which happens when
    the grid is smaller than the generator's pattern: there is then nothing to fit."""
    if cfg.data.path:
        return
    refine_factors(cfg)
    flat = _flat_fields(cfg)
    if flat:
        log(f"system.grid.shape={list(cfg.system.grid.shape)}: the initial state of "
            f"{cfg.system.name} is (nearly) constant in {flat} on this grid, which is probably "
            "smaller than its initial-state generator needs; the data will show little or no "
            "dynamics to fit")


def _flat_fields(cfg: FitConfig) -> list[str]:
    from pdefit.fitting import assemble

    system_cfg = cfg.simulate.system or cfg.system
    system, grid = assemble.make_system(system_cfg), assemble.make_grid(system_cfg)
    if int(np.prod(grid.shape)) > 1 << 12:  # bigger grids are never too small; skip the work
        return []
    params = assemble.system_params(system, system_cfg.params)
    try:
        state = system.initial_state(grid, params, int(cfg.simulate.seed))
    except Exception:  # the simulation reports its own errors, with their keys
        return []
    return [name for name, value in _items(state) if _nearly_constant(np.asarray(value))]


def _items(state: Any) -> Iterable[tuple[str, Any]]:
    return state.items() if isinstance(state, dict) else []


def _nearly_constant(a: np.ndarray) -> bool:
    if a.size < 2 or not np.all(np.isfinite(a)):
        return False
    scale = max(float(np.max(np.abs(a))), 1.0)
    return float(np.ptp(a)) <= 1e-3 * scale
