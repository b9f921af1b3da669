"""Console entry points (Hydra): ``pdefit-simulate``, ``pdefit-fit``, ``pdefit-gradcheck``,
``pdefit-rank`` (``pdefit-evaluate`` is in :mod:`pdefit.app.evaluate`).

Configs live in the repository's ``conf/`` directory; every value can be overridden on the
command line (``pdefit-fit optim.lr=0.01 adjoint=store_all``) and swept with ``-m``. Each
entry point turns its composed config into typed options once (:mod:`pdefit.app.config`) and
hands those on. Here too: the fit command's start-up and its stages; what a finished fit
reports is :mod:`pdefit.app.fit_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import hydra
import jax
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pdefit import data as zd
from pdefit import parallel
from pdefit.adjoint.taylor import taylor_test
from pdefit.app import batch, fit_report, from_dataset
from pdefit.app.config import CONF_DIR, as_options, register_configs, to_options, to_yaml
from pdefit.app.errors import one_line_errors, task_errors
from pdefit.app.fit_report import StagedFit
from pdefit.app.rundir import (
    finished_fit,
    lock_run_dir,
    open_run_record,
    output_dir,
    plain_config,
    refuse_mismatched_resume,
    refuse_replacing,
    refuse_replacing_run_data,
    register_resolvers,
    simulated_dataset,
)
from pdefit.app.validate import (
    check_hold_counts,
    validate_discretization_check,
    validate_fit,
    validate_simulate,
)
from pdefit.fitting import assemble, background, multistart, shooting
from pdefit.fitting.ranking import format_ranking, rank_parameters, write_ranking
from pdefit.fitting.train import FitHistory, TrainState, run_fit
from pdefit.options import FitConfig, SimulateMainConfig
from pdefit.runtime.checkpoint import CHECKPOINT_DIR, CheckpointOptions, write_text_atomic
from pdefit.runtime.compile_cache import use_compilation_cache
from pdefit.runtime.lock import DirectoryLock
from pdefit.runtime.progress import ProgressOptions
from pdefit.runtime.signals import FIT_SIGNALS, PreemptionFlag, signal_name

log = logging.getLogger("pdefit")
register_configs()
register_resolvers()


def _start_processes(cfg: FitConfig | SimulateMainConfig) -> None:
    """Join the other processes of a multi-process run (a no-op for one process)."""
    dist = cfg.distributed
    parallel.initialize(dist.coordinator, dist.num_processes, dist.process_id)


def _dataset_for(cfg: FitConfig, out: Path, dtype: Any) -> Path:
    if cfg.data.path:
        return Path(hydra.utils.to_absolute_path(cfg.data.path))
    log.info("no data.path given: the run simulates its own dataset")

    def simulate_into(path: Path) -> Path:
        _log_simulation_start(cfg)
        return assemble.simulate_dataset(cfg, path, dtype, log=log.info)

    return simulated_dataset(cfg, out / "data.zarr", simulate_into)


def _log_simulation_start(cfg: FitConfig | SimulateMainConfig) -> None:
    sim, system = cfg.simulate, cfg.simulate.system or cfg.system
    log.info(f"simulating {sim.n_experiments} experiment(s) of {system.name} on "
             f"{list(system.grid.shape)}: {sim.n_frames} frames × {sim.steps_per_frame} steps "
             f"of dt={system.dt}…")


# ---------------------------------------------------------------------------------------------


@one_line_errors("pdefit-simulate", SimulateMainConfig)
@hydra.main(config_path=CONF_DIR, config_name="simulate", version_base="1.3")
@task_errors
def simulate_main(cfg: DictConfig) -> None:
    """pdefit-simulate: simulate the configured system and write a synthetic Zarr dataset
    (fields, true parameters, provenance) to simulate.output, a path relative to the directory
    the command is started in. An existing dataset is replaced only with
    simulate.overwrite=true, and then only once the new one is complete.

    Main keys: system=<name> (aliev_panfilov, bocf, rayleigh_benard, sphere_ns, …;
    system.params.*, system.grid.*, system.dt), simulate.output,
    simulate.n_experiments, simulate.n_frames, simulate.steps_per_frame, simulate.seed,
    simulate.noise.kind/sigma, precision; simulate.task/tasks split the experiments over a
    job array (the tasks add to one dataset).

    Example:
      pdefit-simulate simulate.output=ap.zarr simulate.n_experiments=4
      pdefit-fit data=zarr data.path=ap.zarr"""
    use_compilation_cache()
    options = to_options(cfg, SimulateMainConfig)
    validate_simulate(options)  # before anything is simulated or written
    simulate(options)


def simulate(cfg: SimulateMainConfig) -> None:
    """Write the dataset ``pdefit-simulate`` describes: this task's share of a job array, or
    all of it, replacing an existing one only with ``simulate.overwrite`` and only if it is a
    pdefit dataset (never a folder, a file, a run directory or the current directory)."""
    dtype = assemble.set_precision(cfg.precision)
    _start_processes(cfg)
    path = Path(hydra.utils.to_absolute_path(cfg.simulate.output))
    sim = cfg.simulate
    if path.exists() and (sim.overwrite or sim.tasks > 1):
        refuse_replacing(path)  # before simulating; checked again before the rename
    if sim.tasks > 1:
        batch.simulate_share(cfg, path, dtype, sim.task, sim.tasks, log=log.info)
    else:
        if path.exists() and not sim.overwrite:
            raise assemble.ConfigError(
                f"simulate.output: {path} exists; choose another simulate.output or replace "
                "it with simulate.overwrite=true")
        if path.exists():
            log.info(f"simulate.overwrite=true: replacing {path} once the new dataset is "
                     "complete")
        _log_simulation_start(cfg)
        simulated_dataset(cfg, path, lambda tmp: assemble.simulate_dataset(
            cfg, tmp, dtype, log=log.info), reuse=False, overwrite=sim.overwrite)
    log.info(f"wrote {path}")


# ---------------------------------------------------------------------------------------------


def window_stages(cfg: FitConfig, n_frames: int) -> list[list[int] | None]:
    """The training windows of a staged fit: ``fit.stages`` lists how many of the used frames
    each stage sees (increasing); the last stage always sees them all. Without stages: one
    stage on ``data.frames`` as configured (``None``). Then ``fit.recentre_background`` more."""
    if not cfg.fit.stages:
        return [None] * (1 + cfg.fit.recentre_background)
    frames = list(range(n_frames)) if cfg.data.frames is None else list(cfg.data.frames)
    counts = [int(k) for k in cfg.fit.stages]
    if any(k < 2 for k in counts) or counts != sorted(set(counts)) or counts[-1] > len(frames):
        raise assemble.ConfigError(
            f"fit.stages must be increasing frame counts in [2, {len(frames)}], got {counts}")
    if counts[-1] != len(frames):
        counts.append(len(frames))
    return [frames[:k] for k in counts] + [frames] * cfg.fit.recentre_background


def stage_holds(cfg: FitConfig, n_stages: int) -> list[frozenset[str]]:
    """The parameters each of ``n_stages`` stages holds at their values (``fit.hold``: name
    -> how many leading stages hold it). Every held parameter must be fitted in the last
    stage."""
    hold = {str(name): int(count) for name, count in dict(cfg.fit.hold or {}).items()}
    check_hold_counts(hold, n_stages)
    return [frozenset(n for n, count in hold.items() if index < count)
            for index in range(n_stages)]


class FitRun(NamedTuple):
    """A fit's run directory and data, ready for its stages."""

    out: Path
    dataset: Path
    dtype: Any
    windows: list[list[int] | None]  # each stage's training frames (None: data.frames)
    holds: list[frozenset[str]]  # each stage's held parameters
    lead: bool  # the process that writes the shared run directory's files
    lock: DirectoryLock  # held on the run directory until the fit ends
    finished: dict[str, Any] | None = None  # the summary of a fit this one would only repeat


def fit(cfg: FitConfig | DictConfig, preemption: PreemptionFlag | None = None) -> dict[str, Any]:
    """Run one fit described by ``cfg`` (typed options; a composed config is converted
    first); return the summary (also written to summary.json).

    With ``fit.stages`` the training window grows stage by stage, each stage starting from the
    previous one's best θ: a long window of a chaotic system has many local minima far from
    the truth, a short one is nearly convex, and each lengthening starts close to its minimum.
    Each stage keeps its own checkpoints, metrics and status under ``stage-<i>/``, so an
    interrupted staged fit resumes in the stage where it stopped.

    ``preemption`` (installed by ``fit_main`` for the whole process) is checked between the
    start-up phases, where stopping leaves nothing half-written, and handed to the optimiser
    loop, which checkpoints; a signal during the end phase lets it finish, except during
    ``fit.bootstrap``, whose finished replicates are kept (``bootstrap.json``) and whose
    refits checkpoint (``bootstrap/``), both reused."""
    cfg = as_options(cfg)
    cfg = from_dataset.complete(cfg)  # the dataset's grid, a named system's own defaults
    run = _prepare_fit(cfg, preemption)
    with run.lock:
        if run.finished is not None:
            return run.finished
        staged = _run_stages(cfg, run, preemption)
        fit_report.save_fitted_values(run.out, staged)
        summary = fit_report.summarize(cfg, staged, run.dataset, run.out, run.lead,
                                       preemption)
        summary = multistart.add_to_summary(summary, run.out, run.lead)
        fit_report.print_report(summary, staged)
        if cfg.run.plots and run.lead:
            fit_report.plot(staged, run.out)
    log.info(f"outputs in {run.out}")
    if preemption is not None and preemption.requested:
        log.warning(f"{signal_name(preemption.signum)} arrived after the last step: the fit "
                    "and its outputs are complete, exiting normally")
    return summary


def _stop_if_signalled(preemption: PreemptionFlag | None, what: str) -> None:
    if preemption is not None:
        preemption.stop_if_requested(what, log.warning)


def _prepare_fit(cfg: FitConfig, preemption: PreemptionFlag | None) -> FitRun:
    """The fit's start-up: validate, take the run directory (locked for the fit; refusing a
    resume with another config before touching it), make or open the dataset, and write
    config.yaml. A fit that would only repeat a finished one stops here (``finished``)."""
    dtype = assemble.set_precision(cfg.precision)
    _start_processes(cfg)  # first: the validation may use JAX, which must not start before
    validate_fit(cfg, log=log.warning)  # before anything is written or compiled
    _stop_if_signalled(preemption, "during start-up")
    out = output_dir(cfg)
    lock = lock_run_dir(out)
    try:
        return _take_run_dir(cfg, out, dtype, lock, preemption)
    except BaseException:
        lock.release()
        raise


def _take_run_dir(cfg: FitConfig, out: Path, dtype: Any, lock: DirectoryLock,
                  preemption: PreemptionFlag | None) -> FitRun:
    """:func:`_prepare_fit` once the run directory is locked."""
    lead = jax.process_index() == 0  # one process writes the shared run directory's files
    refuse_mismatched_resume(cfg, out)  # before the run directory is touched
    finished = finished_fit(cfg, out)
    if finished is not None:
        log.info(f"run.dir: {out} holds this fit, finished ({finished.get('stop_reason')} "
                 f"after {finished.get('optimizer_steps')} steps); nothing to do, its results "
                 "are kept. To fit again: run.resume=false or another run.dir; to go on: a "
                 "larger optim.steps")
        return FitRun(out, out, dtype, [], [], lead, lock, finished)
    if not cfg.data.path:
        refuse_replacing_run_data(cfg, out / "data.zarr")  # before the directory is touched
    open_run_record(out, cfg)
    dataset = _dataset_for(cfg, out, dtype)
    _stop_if_signalled(preemption, "after the dataset was made")
    windows, _ = shooting.stages(cfg.fit.shooting.segments,
                                 window_stages(cfg, zd.open_dataset(dataset).meta.n_frames))
    holds = stage_holds(cfg, len(windows))
    if lead:
        write_text_atomic(out / "config.yaml", to_yaml(cfg))
    return FitRun(out, dataset, dtype, windows, holds, lead, lock)


def _run_stages(cfg: FitConfig, run: FitRun, preemption: PreemptionFlag | None) -> StagedFit:
    """The optimiser on each training window in turn, each stage from the previous one's
    best θ, checkpointed in its own directory (``stage-<i>/`` when there are several)."""
    theta, first, setup, results, base = None, None, None, [], None
    recentring = cfg.fit.recentre_background  # the last stages, with the prior moved
    _, segments = shooting.stages(cfg.fit.shooting.segments, run.windows)
    for index, frames in enumerate(run.windows):
        stage_cfg = cfg if frames is None else dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, frames=frames))
        stage_cfg = dataclasses.replace(stage_cfg, fit=dataclasses.replace(
            stage_cfg.fit, shooting=dataclasses.replace(stage_cfg.fit.shooting,
                                                        segments=segments[index])))
        setup = assemble.build_fit(stage_cfg, run.dataset, run.dtype)
        if index >= len(run.windows) - recentring:
            setup = setup._replace(batch=background.recentred(setup.batch, theta))
        if theta is not None:  # the segments' starts from the run of the previous result
            theta = shooting.with_segments(setup.problem, theta, setup.batch)
        if first is None:  # before anything is compiled
            validate_discretization_check(cfg.fit.discretization_check, problem=setup.problem)
            setup = multistart.choose_start(stage_cfg, setup, run.dataset, run.dtype,
                                            run.holds[0], run.out, run.lead, log.info)
            first = setup
        _stop_if_signalled(preemption,
                           "before training" if index == 0 else f"before stage {index + 1}")
        stage_out = run.out if len(run.windows) == 1 else run.out / f"stage-{index}"
        stage_out.mkdir(parents=True, exist_ok=True)
        start = setup.theta0 if theta is None else theta
        if recentring and index == len(run.windows) - recentring - 1:
            base = (setup.batch, start, run.holds[index])  # for the bootstrap's replicates
        state, history = _fit_stage(stage_cfg, setup, stage_out, theta, run.windows, index,
                                    preemption, run.holds[index])
        theta = history.best_theta
        results.append((int(state.step), history))
        if len(run.windows) > 1:
            counted = "all" if frames is None else len(frames)
            shot = f", {segments[index]} segments" if segments[index] > 1 else ""
            log.info(f"stage {index + 1}/{len(run.windows)} ({counted} frames, "
                     f"{setup.problem.n_steps} steps{shot}): loss {history.losses[0]:.3e} → "
                     f"{history.best_loss:.3e}")
    return _staged(run.windows, first, setup, results)._replace(start=start, hold=run.holds[-1],
                                                                recentre_base=base)


def _staged(windows: list[list[int] | None], first: Any, last: Any,
            results: list[tuple[int, FitHistory]]) -> StagedFit:
    """The stages taken together from each one's (steps, history) (the caller adds the last
    stage's start and holds)."""
    histories = [history for _, history in results]
    return StagedFit(
        windows=windows, first=first, setup=last, history=histories[-1],
        theta=histories[-1].best_theta,
        losses=[loss for history in histories for loss in history.losses],
        wall=sum((history.wall_time for history in histories), 0.0),
        stage_steps=[steps for steps, _ in results],
        # Every stage with a checkpoint restores it when the run starts again, so the run's
        # restarts are the most of any stage; its non-finite steps are all stages'.
        restarts=max([0, *(history.restarts for history in histories)]),
        nan_failures=sum(history.nan_failures for history in histories))


def _stage_progress(cfg: FitConfig, n_steps: int, stages: list[list[int] | None],
                    index: int) -> ProgressOptions:
    """Progress of stage ``index``: labelled "stage i/n (k frames)" in a staged fit, with the
    later stages' work (each up to optim.steps steps, costing in proportion to its frames)
    for the estimate of the whole fit's remaining time."""
    frames = stages[index]
    if len(stages) == 1:
        label, later = "fit", 0.0
    elif frames is None:  # multiple shooting, then one trajectory, on the same window
        label = f"stage {index + 1}/{len(stages)}"
        later = float(cfg.optim.steps * (len(stages) - index - 1))
    else:
        label = f"stage {index + 1}/{len(stages)} ({len(frames)} frames)"
        later = sum(cfg.optim.steps * len(f) / len(frames) for f in stages[index + 1:])
    return ProgressOptions(label=label, every=cfg.run.log_every, enabled=cfg.run.progress,
                           rollout_steps=n_steps, later_work=later)


def _fit_stage(cfg: FitConfig, setup: assemble.FitSetup, out: Path, theta0: Any,
               stages: list[list[int] | None] | None = None, index: int = 0,
               preemption: PreemptionFlag | None = None,
               hold: frozenset[str] = frozenset()) -> tuple[TrainState, FitHistory]:
    """One run of the optimiser on ``setup`` (from ``theta0`` if given), checkpointed in
    ``out``; stage ``index`` of ``stages`` (for its progress label); the parameters in
    ``hold`` keep their values."""
    problem = setup.problem
    held = f" (holding {sorted(hold)})" if hold else ""
    log.info(f"fit {list(problem.layout.fitted)}{held} + fields {list(problem.fitted_fields)} "
             f"of {problem.system.name} on {problem.grid.shape}: {problem.n_steps} steps of "
             f"dt={problem.dt}, schedule {problem.schedule}")
    checkpoint = CheckpointOptions(out / CHECKPOINT_DIR, cfg.run.checkpoint_every,
                                   cfg.run.checkpoint_keep)
    curvature = fit_report.stage_curvature(cfg, problem)
    return run_fit(problem.loss, setup.theta0 if theta0 is None else theta0, setup.batch,
                   cfg.optim, describe=problem.scalar_values,
                   metrics_path=out / "metrics.jsonl",
                   progress=_stage_progress(cfg, problem.n_steps, stages or [None], index),
                   log=log.info, checkpoint=checkpoint, resume=cfg.run.resume,
                   config=plain_config(cfg), status_path=out / "status.json",
                   curvature=curvature, preemption=preemption, hold=hold,
                   layout=problem.layout, field_bounds=problem.field_bounds)


@one_line_errors("pdefit-fit")
@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
@task_errors
def fit_main(cfg: DictConfig) -> None:
    """pdefit-fit: fit parameters (and initial fields) of a PDE system to observed frames by
    gradient descent through the simulation (an exact discrete adjoint with checkpointing).
    Without data.path it first simulates its own dataset (the demo: Aliev-Panfilov spirals on
    64x64, six reaction parameters started 50 % off). Writes to the run directory (run.dir,
    else runs/fit/<run.name or the overrides>): summary.json, metrics.jsonl, status.json,
    checkpoints/ (a rerun resumes), fitted.npz, loss.png, fields.png, fit.log, .hydra/.

    Main keys: system=<name>, data.path (a Zarr dataset; data.frames, data.experiments),
    observe.fields, fit.params, fit.initial_fields.<field>=fit, fit.stages, fit.hold,
    fit.shooting.segments, optim=<name> (optim.steps, optim.lr), adjoint=<schedule>,
    mesh=<layout>, precision, run.name, run.dir, run.resume, run.plots, run.progress,
    run.log_every.

    Examples:
      pdefit-fit                                   # the demo, about a minute on a laptop
      pdefit-fit fit.params=[k,a] run.name=two     # fit two parameters, in runs/fit/two
      pdefit-fit experiment=bocf_recovery run.dir=runs/bocf"""
    # Signals are held from here to the exit of the process (and from the package import
    # before, see pdefit.runtime.signals.hold_early): checkpoint and exit 75 (130 for Ctrl-C), never
    # die midway. Once the fit has ended they are ignored: one during the interpreter's
    # shutdown must not turn a decided exit status into a death by signal. In a multirun the
    # process goes on (to the next point, or back to the sweep): the handlers from before are
    # given back instead.
    use_compilation_cache()
    flag = PreemptionFlag(FIT_SIGNALS).__enter__()
    try:
        fit(to_options(cfg), flag)
    finally:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            flag.__exit__(None, None, None)
        else:
            flag.ignore_from_now()


# ---------------------------------------------------------------------------------------------


class CommandRun(NamedTuple):
    """A command's completed options, precision and locked run directory."""

    cfg: FitConfig
    dtype: Any
    out: Path


@contextlib.contextmanager
def _command_run(cfg: FitConfig) -> Iterator[CommandRun]:
    """The start-up of a command that works in a run directory (gradcheck, rank): the
    dataset's grid and a named system's own defaults, the precision, the run directory
    locked for the command's life, and its record written."""
    cfg = from_dataset.complete(cfg)
    dtype = assemble.set_precision(cfg.precision)
    out = output_dir(cfg)
    with lock_run_dir(out):
        open_run_record(out, cfg)
        yield CommandRun(cfg, dtype, out)


def gradcheck(cfg: FitConfig | DictConfig) -> list[dict[str, float]]:
    """Taylor test of the configured problem's gradient at its starting point (``cfg``:
    typed options; a composed config is converted first)."""
    cfg = as_options(cfg)
    with _command_run(cfg) as (cfg, dtype, out):
        setup = assemble.build_fit(cfg, _dataset_for(cfg, out, dtype), dtype)
        loss = jax.jit(setup.problem.loss)
        grad = jax.jit(jax.grad(setup.problem.loss))
        log.info(f"gradcheck: compiling the loss and gradient ({setup.problem.n_steps} time "
                 "steps) and evaluating it at 6 step sizes…")
        rows = taylor_test(lambda th: loss(th, setup.batch), lambda th: grad(th, setup.batch),
                           setup.theta0, seed=0)
        print(f"{'eps':>10} {'|L(θ+εv) − L(θ)|':>18} {'|… − ε∇L·v|':>14} {'order':>6}")
        for r in rows:
            order = "" if r["order"] is None else f"{r['order']:.2f}"
            print(f"{r['eps']:10.3e} {r['first_order']:18.6e} {r['remainder']:14.6e} {order:>6}")
        (out / "gradcheck.json").write_text(json.dumps(rows, indent=2))
    return rows


@one_line_errors("pdefit-gradcheck")
@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
@task_errors
def gradcheck_main(cfg: DictConfig) -> None:
    """pdefit-gradcheck: Taylor test of the configured fit's gradient at its starting point:
    prints |L(θ+εv) − L(θ) − ε∇L·v| for halving ε (an exact gradient shows order 2) and writes
    gradcheck.json to the run directory. Takes every pdefit-fit key (same config).

    Example:
      pdefit-gradcheck precision=float64 adjoint=revolve"""
    use_compilation_cache()
    gradcheck(to_options(cfg))


# ---------------------------------------------------------------------------------------------


def rank(cfg: FitConfig | DictConfig) -> list[dict[str, Any]]:
    """Rank the system's parameters by how much the simulated window (``simulate.*``, first
    experiment's seed) moves when each is multiplied by ``rank.factor`` (``cfg``: typed
    options; a composed config is converted first)."""
    cfg = as_options(cfg)
    with _command_run(cfg) as (cfg, dtype, out):
        system, grid = assemble.make_system(cfg.system), assemble.make_grid(cfg.system)
        params = assemble.system_params(system, cfg.system.params)
        assemble.check_dynamics(system, params, grid, cfg.system)
        names = list(system.params) if cfg.rank.params is None else list(cfg.rank.params)
        unknown = [n for n in names if n not in params]
        if unknown:
            raise assemble.ConfigError(f"rank.params: unknown parameter(s) {unknown} for "
                                       f"{system.name}")
        n_steps = (cfg.simulate.n_frames - 1) * cfg.simulate.steps_per_frame
        x0 = system.initial_state(grid, params, cfg.simulate.seed)
        rows = rank_parameters(system, grid, params, cfg.system.dt, cfg.system.integrator, x0,
                               n_steps, cfg.simulate.steps_per_frame, cfg.rank.factor, names, dtype,
                               log=log.info)
        write_ranking(rows, cfg.rank.factor, out, extra={
            "system": system.name, "grid": list(grid.shape), "n_steps": n_steps,
            "dt": cfg.system.dt, "seed": cfg.simulate.seed})
        print(format_ranking(rows, cfg.rank.factor))
        top = [r["name"] for r in rows[: cfg.rank.top]]
        print(f"top {len(top)}: fit.params=[{','.join(top)}]")
        log.info(f"ranking in {out}")
    return rows


@one_line_errors("pdefit-rank")
@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
@task_errors
def rank_main(cfg: DictConfig) -> None:
    """pdefit-rank: rank the system's parameters by how much the simulated window moves when
    each is multiplied by rank.factor (trajectory mean absolute deviation), to choose which to
    fit. Writes ranking.json/txt/png to the run directory and prints a ready fit.params list.
    Takes every pdefit-fit key (same config).

    Main keys: system=<name>, rank.factor (1.5), rank.params (default: all), rank.top,
    simulate.n_frames, simulate.steps_per_frame, simulate.seed.

    Example:
      pdefit-rank experiment=bocf_recovery"""
    use_compilation_cache()
    rank(to_options(cfg))
