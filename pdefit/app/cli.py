"""Console entry points (Hydra): ``pdefit-simulate``, ``pdefit-fit``, ``pdefit-gradcheck``,
``pdefit-rank`` (``pdefit-evaluate`` is in :mod:`pdefit.analysis.forecast`).

Configs live in the repository's ``conf/`` directory; every value can be overridden on the
command line (``pdefit-fit optim.lr=0.01 adjoint=store_all``) and swept with ``-m``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
import jax
import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pdefit import data as zd
from pdefit import parallel
from pdefit.adjoint.taylor import taylor_test
from pdefit.analysis.reports import (
    describe_loss,
    error_summary,
    format_error_summary,
    format_table,
    parameter_table,
    plot_fields,
    plot_loss,
)
from pdefit.app import batch
from pdefit.app.config import CONF_DIR, register_configs
from pdefit.app.rundir import (
    open_run_record,
    output_dir,
    plain_config,
    register_resolvers,
    simulated_dataset,
)
from pdefit.app.validate import check_hold_counts, validate_discretization_check, validate_fit
from pdefit.fitting import assemble, discretization
from pdefit.fitting.fitted import FITTED_FILE, save_fitted
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.initial_fields import evaluate_initial_fields, format_errors
from pdefit.fitting.ranking import format_ranking, rank_parameters, write_ranking
from pdefit.fitting.train import LEVENBERG_MARQUARDT, resume_mismatch, run_fit
from pdefit.fitting.uncertainty import (
    CurvatureParts,
    curvature_parts,
    known_sigma,
    unavailable_reason,
)
from pdefit.fitting.uncertainty import estimate as estimate_uncertainty
from pdefit.model.system import field_attrs, image_origin, stepper, time_unit
from pdefit.numerics.integrate import simulate
from pdefit.runtime.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointOptions,
    write_json_atomic,
    write_text_atomic,
)
from pdefit.runtime.progress import ProgressOptions
from pdefit.runtime.signals import FIT_SIGNALS, PreemptionFlag, signal_name

log = logging.getLogger("pdefit")
register_configs()
register_resolvers()


def _start_processes(cfg: DictConfig) -> None:
    """Join the other processes of a multi-process run (a no-op for one process)."""
    dist = cfg.distributed
    parallel.initialize(dist.coordinator, dist.num_processes, dist.process_id)


def _dataset_for(cfg: DictConfig, out: Path, dtype: Any) -> Path:
    if cfg.data.path:
        return Path(hydra.utils.to_absolute_path(cfg.data.path))
    log.info("no data.path given: the run simulates its own dataset")

    def simulate_into(path: Path) -> Path:
        _log_simulation_start(cfg)
        return assemble.simulate_dataset(cfg, path, dtype, log=log.info)

    return simulated_dataset(cfg, out / "data.zarr", simulate_into)


def _log_simulation_start(cfg: DictConfig) -> None:
    sim, system = cfg.simulate, cfg.simulate.get("system") or cfg.system
    log.info(f"simulating {sim.n_experiments} experiment(s) of {system.name} on "
             f"{list(system.grid.shape)}: {sim.n_frames} frames × {sim.steps_per_frame} steps "
             f"of dt={system.dt}…")


# ---------------------------------------------------------------------------------------------


@hydra.main(config_path=CONF_DIR, config_name="simulate", version_base="1.3")
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
    dtype = assemble.set_precision(cfg.precision)
    _start_processes(cfg)
    path = Path(hydra.utils.to_absolute_path(cfg.simulate.output))
    sim = cfg.simulate
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
            cfg, tmp, dtype, log=log.info), reuse=False)
    log.info(f"wrote {path}")


# ---------------------------------------------------------------------------------------------


def window_stages(cfg: DictConfig, n_frames: int) -> list[list[int] | None]:
    """The training windows of a staged fit: ``fit.stages`` lists how many of the used frames
    each stage sees (increasing); the last stage always sees them all. Without stages: one
    stage on ``data.frames`` as configured (``None``)."""
    if not cfg.fit.stages:
        return [None]
    frames = list(range(n_frames)) if cfg.data.frames is None else list(cfg.data.frames)
    counts = [int(k) for k in cfg.fit.stages]
    if any(k < 2 for k in counts) or counts != sorted(set(counts)) or counts[-1] > len(frames):
        raise assemble.ConfigError(
            f"fit.stages must be increasing frame counts in [2, {len(frames)}], got {counts}")
    if counts[-1] != len(frames):
        counts.append(len(frames))
    return [frames[:k] for k in counts]


def stage_holds(cfg: DictConfig, n_stages: int) -> list[frozenset[str]]:
    """The parameters each of ``n_stages`` stages holds at their values (``fit.hold``: name
    -> how many leading stages hold it). Every held parameter must be fitted in the last
    stage."""
    hold = {str(name): int(count) for name, count in dict(cfg.fit.hold or {}).items()}
    check_hold_counts(hold, n_stages)
    return [frozenset(n for n, count in hold.items() if index < count)
            for index in range(n_stages)]


def fit(cfg: DictConfig, preemption: PreemptionFlag | None = None) -> dict[str, Any]:
    """Run one fit described by ``cfg``; return the summary (also written to summary.json).

    With ``fit.stages`` the training window grows stage by stage, each stage starting from the
    previous one's best θ: a long window of a chaotic system has many local minima far from
    the truth, a short one is nearly convex, and each lengthening starts close to its minimum.
    Each stage keeps its own checkpoints, metrics and status under ``stage-<i>/``, so an
    interrupted staged fit resumes in the stage where it stopped.

    ``preemption`` (installed by ``fit_main`` for the whole process) is checked between the
    start-up phases, where stopping leaves nothing half-written, and handed to the optimiser
    loop, which checkpoints; a signal during the end phase lets it finish."""
    dtype = assemble.set_precision(cfg.precision)
    _start_processes(cfg)  # first: the validation may use JAX, which must not start before
    validate_fit(cfg, log=log.warning)  # before anything is written or compiled

    def stop_if_signalled(what: str) -> None:
        if preemption is not None:
            preemption.stop_if_requested(what, log.warning)

    stop_if_signalled("during start-up")
    out = output_dir(cfg)
    _refuse_mismatched_resume(cfg, out)  # before the run directory is touched
    open_run_record(out, cfg)
    dataset = _dataset_for(cfg, out, dtype)
    stop_if_signalled("after the dataset was made")
    stages = window_stages(cfg, zd.open_dataset(dataset).meta.n_frames)
    holds = stage_holds(cfg, len(stages))
    lead = jax.process_index() == 0  # one process writes the shared run directory's files
    if lead:
        write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    theta, losses, wall, first, stage_steps = None, [], 0.0, None, []
    restarts, nan_failures = 0, 0
    for index, frames in enumerate(stages):
        stage_cfg = cfg
        if frames is not None:
            stage_cfg = cfg.copy()
            OmegaConf.update(stage_cfg, "data.frames", frames)
        setup = assemble.build_fit(stage_cfg, dataset, dtype)
        if first is None:  # before anything is compiled
            validate_discretization_check(cfg.fit.discretization_check, problem=setup.problem)
            first = setup
        stop_if_signalled("before training" if index == 0 else f"before stage {index + 1}")
        stage_out = out if len(stages) == 1 else out / f"stage-{index}"
        stage_out.mkdir(parents=True, exist_ok=True)
        state, history = _fit_stage(stage_cfg, setup, stage_out, theta, stages, index,
                                    preemption, holds[index])
        theta = history.best_theta
        stage_steps.append(int(state.step))
        # Every stage with a checkpoint restores it when the run starts again, so the run's
        # restarts are the most of any stage; its non-finite steps are all stages'.
        restarts = max(restarts, history.restarts)
        nan_failures += history.nan_failures
        losses += history.losses
        wall += history.wall_time
        if len(stages) > 1:
            log.info(f"stage {index + 1}/{len(stages)} ({len(frames)} frames, "
                     f"{setup.problem.n_steps} steps): loss {history.losses[0]:.3e} → "
                     f"{history.best_loss:.3e}")
    problem = setup.problem
    physical = {k: v for k, v in problem.physical_params(theta).items()
                if k in problem.layout.fitted}
    save_fitted(out / FITTED_FILE, theta, physical)  # for pdefit-evaluate and fit.start_from
    recovered = {k: float(v) for k, v in problem.scalar_values(theta).items()}
    uncertainty, curvature = _uncertainty(cfg, setup, theta, dataset)
    rows = parameter_table(problem.layout.scalars, first.start_values, recovered,
                           setup.reference,
                           {n: problem.layout.specs[n].unit for n in problem.layout.scalars},
                           uncertainty.get("parameters"))
    summary = {
        "system": problem.system.name, "grid": list(problem.grid.shape),
        "n_steps": problem.n_steps, "schedule": str(problem.schedule),
        "stages": [None if f is None else len(f) for f in stages],
        # All stages' steps (each stage counts its own from 0), and each stage's.
        "optimizer_steps": sum(stage_steps), "optimizer_steps_per_stage": stage_steps,
        "stop_reason": history.stop_reason,
        "final_loss": history.losses[-1],
        "best_loss": history.best_loss, "initial_loss": losses[0],
        "wall_time_s": wall, "nan_failures": nan_failures, "restarts": restarts,
        "parameters": rows, **error_summary(rows), "uncertainty": uncertainty,
    }
    summary["discretization_check"] = _discretization_check(cfg, setup, theta, curvature)
    uncertainty = summary["uncertainty"] = discretization.mark_intervals(
        uncertainty, summary["discretization_check"])
    summary.update(_system_evaluation(cfg, setup, theta, dataset, out, lead))
    summary.update(_initial_fields_report(cfg, setup, theta, dataset, out, lead))
    if lead:
        write_json_atomic(out / "summary.json", summary)
    if rows:
        print(format_table(rows))
    if uncertainty.get("note"):
        print(f"parameter intervals: {uncertainty['note']}")
    if summary["mean_rel_error"] is not None:
        print(f"{format_error_summary(summary)}  (loss {losses[0]:.3e} → "
              f"{history.best_loss:.3e}, {wall:.1f} s)")
    if "message" in summary["discretization_check"]:
        print(discretization.format_check(summary["discretization_check"]))
    if cfg.run.plots and lead:
        plot_loss(losses, out / "loss.png", _loss_description(problem))
        if jax.process_count() == 1:  # the forecast plot needs the whole field on one host
            _plot_prediction(problem, setup, theta, out / "fields.png")
    log.info(f"outputs in {out}")
    if preemption is not None and preemption.requested:
        log.warning(f"{signal_name(preemption.signum)} arrived after the last step: the fit "
                    "and its outputs are complete, exiting normally")
    return summary


def _has_checkpoints(out: Path) -> bool:
    directories = [out / CHECKPOINT_DIR, *out.glob(f"stage-*/{CHECKPOINT_DIR}")]
    return any(p.name.isdigit() for d in directories if d.is_dir() for p in d.iterdir())


def _refuse_mismatched_resume(cfg: DictConfig, out: Path) -> None:
    """A run directory with checkpoints is resumed only with the config it was made with
    (up to driving and stopping keys): compared here, before its dataset, config.yaml or
    checkpoints are touched. The checkpoints' own configs are checked again on restore."""
    saved_path = out / "config.yaml"
    if not cfg.run.resume or not saved_path.exists() or not _has_checkpoints(out):
        return
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=True)
    except Exception:  # an unreadable or foreign config.yaml: the restore's check decides
        return
    error = resume_mismatch(saved, plain_config(cfg), out)  # type: ignore[arg-type]
    if error is not None:
        raise error


def _uncertainty(cfg: DictConfig, setup: Any, theta: Any, dataset: Path,
                 ) -> tuple[dict[str, Any], CurvatureParts | None]:
    """Standard errors and intervals of the fitted scalars (pdefit.fitting.uncertainty) on the last
    stage's window, with the dataset's additive noise level when it records one and the data
    come from the fitted system; the reason where there are none. Also the curvature they
    come from (None without them), which the discretization check reuses."""
    if not cfg.fit.uncertainty:
        return {"available": False, "reason": "fit.uncertainty=false"}, None
    reason = unavailable_reason(setup.problem)
    if reason is not None:
        log.info(f"no parameter intervals: {reason}")
        return {"available": False, "reason": reason}, None
    log.info("parameter intervals: one forward-tangent sweep over the training window…")
    noise = None if cfg.data.system else zd.open_dataset(dataset).meta.noise
    parts = curvature_parts(setup.problem, theta, setup.batch)
    return estimate_uncertainty(setup.problem, theta, setup.batch, known_sigma(noise),
                                parts=parts), parts


def _discretization_check(cfg: DictConfig, setup: Any, theta: Any,
                          curvature: CurvatureParts | None) -> dict[str, Any]:
    """The fitted model re-run with a finer time step (and grid) over the training window
    (pdefit.fitting.discretization), for summary.json, reusing the intervals' ``curvature``; a
    warning when the discretization error is not small."""
    options = cfg.fit.discretization_check
    if not options.enabled:
        return {"verdict": discretization.SKIPPED,
                "reason": "fit.discretization_check.enabled=false"}
    result = discretization.check(setup.problem, theta, setup.batch, options, setup.meta,
                                  log=log.info, curvature=curvature)
    if result["verdict"] == discretization.WARNING:
        log.warning(result["message"])
    return result


def _system_evaluation(cfg: DictConfig, setup: Any, theta: Any, dataset: Path, out: Path,
                       lead: bool) -> dict[str, Any]:
    """The system's own evaluation of the fit (its optional ``evaluate_fit`` hook, see
    pdefit.model.system), printed and returned for summary.json; empty without one."""
    evaluate = getattr(setup.problem.system, "evaluate_fit", None)
    if evaluate is None:
        return {}
    result = evaluate(setup.problem, theta, dataset, cfg.data.experiments, out,
                      plots=bool(cfg.run.plots and lead))
    if result is None:
        return {}
    if result.report:
        print(result.report)
    return dict(result.summary)


def _stage_progress(cfg: DictConfig, n_steps: int, stages: list[list[int] | None],
                    index: int) -> ProgressOptions:
    """Progress of stage ``index``: labelled "stage i/n (k frames)" in a staged fit, with the
    later stages' work (each up to optim.steps steps, costing in proportion to its frames)
    for the estimate of the whole fit's remaining time."""
    frames = stages[index]
    if frames is None or len(stages) == 1:
        label, later = "fit", 0.0
    else:
        label = f"stage {index + 1}/{len(stages)} ({len(frames)} frames)"
        later = sum(cfg.optim.steps * len(f) / len(frames) for f in stages[index + 1:])
    return ProgressOptions(label=label, every=cfg.run.log_every, enabled=cfg.run.progress,
                           rollout_steps=n_steps, later_work=later)


def _initial_fields_report(cfg: DictConfig, setup: Any, theta: Any, dataset: Path, out: Path,
                          lead: bool) -> dict[str, Any]:
    """Fitted initial fields against the dataset's first frame (pdefit.fitting.initial_fields),
    printed and returned for summary.json; empty when no field is fitted."""
    result = evaluate_initial_fields(setup.problem, theta, setup.batch, cfg, dataset, out,
                                     plots=bool(cfg.run.plots and lead))
    if result:
        print(format_errors(result["initial_fields"]))
    return result


def _fit_stage(cfg: DictConfig, setup: assemble.FitSetup, out: Path, theta0: Any,
               stages: list[list[int] | None] | None = None, index: int = 0,
               preemption: PreemptionFlag | None = None, hold: frozenset[str] = frozenset()):
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
    curvature = None
    if cfg.optim.name == LEVENBERG_MARQUARDT:
        try:
            curvature = gauss_newton(problem)
        except ValueError as err:
            raise assemble.ConfigError(f"optim: {err}") from None
    return run_fit(problem.loss, setup.theta0 if theta0 is None else theta0, setup.batch,
                   cfg.optim, describe=problem.scalar_values,
                   metrics_path=out / "metrics.jsonl",
                   progress=_stage_progress(cfg, problem.n_steps, stages or [None], index),
                   log=log.info, checkpoint=checkpoint, resume=cfg.run.resume,
                   config=plain_config(cfg), status_path=out / "status.json",
                   curvature=curvature, preemption=preemption, hold=hold)


def _loss_description(problem) -> str:
    """What the fit minimised: the observation misfit and the active penalties."""
    reg = problem.regularization
    terms = [name for name, on in (
        ("parameter L2", reg.params or any(w for _, w in reg.param_l2)),
        ("field L2", reg.fields), ("smoothness", any(w for _, w in reg.smoothness))) if on]
    terms += [name for name, weight in reg.system if weight]
    return describe_loss(problem.observation.loss, problem.observation.fields, terms,
                         dict(problem.observation.field_weights))


def _plot_prediction(problem, setup, theta, path: Path) -> None:
    """Observed vs predicted frames and their difference (first experiment) at four times of
    the window; unobserved points are left blank."""
    obs = setup.batch.observed
    slots = np.flatnonzero(np.asarray(obs.slot_of_step) >= 0)
    picks = np.unique(np.linspace(0, len(slots) - 1, 4).round().astype(int))
    x0 = jax.tree.map(lambda a: a[0], problem.initial_state(theta, setup.batch))
    params = problem.experiment_params(theta, 0)
    # Keep only every `every`-th state, the largest interval that still hits every frame.
    every = int(np.gcd.reduce(slots[1:])) if len(slots) > 1 else problem.n_steps
    frames = jax.jit(simulate, static_argnums=(0, 5, 6))(
        stepper(problem.system, problem.grid, problem.integrator), x0, params, problem.t0,
        problem.dt, problem.n_steps, every)
    steps = slots[picks]
    observed = {f: np.where(parallel.host_array(obs.weights[f])[0][picks] > 0,
                            parallel.host_array(obs.values[f])[0][picks], np.nan)
                for f in problem.observation.fields}
    predicted = {f: np.asarray(v)[steps // every]
                 for f, v in problem.observation.project(frames).items()}
    system = problem.system
    plot_fields(observed, predicted, [problem.t0 + s * problem.dt for s in steps], path,
                units={f: field_attrs(system, f)["units"] for f in observed},
                time_unit=time_unit(system), origin=image_origin(system, problem.grid))


@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
def fit_main(cfg: DictConfig) -> None:
    """pdefit-fit: fit parameters (and initial fields) of a PDE system to observed frames by
    gradient descent through the simulation (an exact discrete adjoint with checkpointing).
    Without data.path it first simulates its own dataset (the demo: Aliev-Panfilov spirals on
    64x64, six reaction parameters started 50 % off). Writes to the run directory (run.dir,
    else runs/fit/<run.name or the overrides>): summary.json, metrics.jsonl, status.json,
    checkpoints/ (a rerun resumes), fitted.npz, loss.png, fields.png, fit.log, .hydra/.

    Main keys: system=<name>, data.path (a Zarr dataset; data.frames, data.experiments),
    observe.fields, fit.params, fit.initial_fields.<field>=fit, fit.stages, fit.hold,
    optim=<name> (optim.steps, optim.lr), adjoint=<schedule>, mesh=<layout>, precision,
    run.name, run.dir, run.resume, run.plots, run.progress, run.log_every.

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
    flag = PreemptionFlag(FIT_SIGNALS).__enter__()
    try:
        fit(cfg, flag)
    finally:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            flag.__exit__(None, None, None)
        else:
            flag.ignore_from_now()


# ---------------------------------------------------------------------------------------------


def gradcheck(cfg: DictConfig) -> list[dict[str, float]]:
    """Taylor test of the configured problem's gradient at its starting point."""
    dtype = assemble.set_precision(cfg.precision)
    out = output_dir(cfg)
    open_run_record(out, cfg)
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


@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
def gradcheck_main(cfg: DictConfig) -> None:
    """pdefit-gradcheck: Taylor test of the configured fit's gradient at its starting point:
    prints |L(θ+εv) − L(θ) − ε∇L·v| for halving ε (an exact gradient shows order 2) and writes
    gradcheck.json to the run directory. Takes every pdefit-fit key (same config).

    Example:
      pdefit-gradcheck precision=float64 adjoint=revolve"""
    gradcheck(cfg)


# ---------------------------------------------------------------------------------------------


def rank(cfg: DictConfig) -> list[dict[str, Any]]:
    """Rank the system's parameters by how much the simulated window (``simulate.*``, first
    experiment's seed) moves when each is multiplied by ``rank.factor``."""
    dtype = assemble.set_precision(cfg.precision)
    out = output_dir(cfg)
    open_run_record(out, cfg)
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


@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
def rank_main(cfg: DictConfig) -> None:
    """pdefit-rank: rank the system's parameters by how much the simulated window moves when
    each is multiplied by rank.factor (trajectory mean absolute deviation), to choose which to
    fit. Writes ranking.json/txt/png to the run directory and prints a ready fit.params list.
    Takes every pdefit-fit key (same config).

    Main keys: system=<name>, rank.factor (1.5), rank.params (default: all), rank.top,
    simulate.n_frames, simulate.steps_per_frame, simulate.seed.

    Example:
      pdefit-rank experiment=bocf_recovery"""
    rank(cfg)
