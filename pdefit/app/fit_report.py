"""What a finished fit reports (``pdefit-fit``'s last phase): ``summary.json`` (the recovered
parameters and their errors, the intervals, the discretization check, the system's own
evaluation, the fitted initial fields), the printed table and the plots (``loss.png``,
``fields.png``). The fit itself, stage by stage, is :func:`pdefit.app.cli.fit`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from pdefit import data as zd
from pdefit import parallel
from pdefit.analysis.reports import (
    describe_loss,
    error_summary,
    format_error_summary,
    format_table,
    parameter_table,
    plot_fields,
    plot_loss,
)
from pdefit.app.config import plain
from pdefit.fitting import background, bootstrap, discretization, outcome
from pdefit.fitting.assemble import ConfigError, FitSetup
from pdefit.fitting.fitted import FITTED_FILE, save_fitted
from pdefit.fitting.initial_fields import evaluate_initial_fields, format_errors
from pdefit.fitting.krylov import curvature_for
from pdefit.fitting.train import LEVENBERG_MARQUARDT, FitHistory, run_fit
from pdefit.fitting.uncertainty import CurvatureParts
from pdefit.model.system import field_attrs, image_origin, stepper, time_unit
from pdefit.numerics.integrate import simulate
from pdefit.options import FitConfig
from pdefit.runtime.checkpoint import CHECKPOINT_DIR, CheckpointOptions, write_json_atomic
from pdefit.runtime.signals import PreemptionFlag

log = logging.getLogger("pdefit")


class StagedFit(NamedTuple):
    """A fit's stages taken together: the last stage's setup and history, and what the
    summary counts over all stages."""

    windows: list[list[int] | None]  # each stage's training frames (None: data.frames)
    first: FitSetup  # the first stage's (its start values are the fit's)
    setup: FitSetup  # the last stage's
    history: FitHistory  # the last stage's
    theta: Any  # the last stage's best θ
    losses: list[float]  # every stage's, in order
    wall: float
    stage_steps: list[int]  # each stage counts its own from 0
    restarts: int
    nan_failures: int
    start: Any = None  # the last stage's start θ (None: its setup's theta0)
    hold: frozenset[str] = frozenset()  # the parameters the last stage held
    # With fit.recentre_background: the batch (the data's background), start θ and holds of
    # the stage the re-centred refits follow, which the bootstrap's replicates repeat.
    recentre_base: tuple[Any, Any, frozenset[str]] | None = None


def summarize(cfg: FitConfig, fit: StagedFit, dataset: Path, out: Path, lead: bool,
              preemption: PreemptionFlag | None = None) -> dict[str, Any]:
    """The fit's summary, written to ``summary.json`` by the ``lead`` process: the parameter
    table with intervals, the discretization check, the system's own evaluation and the
    initial fields (the last two print their reports). A ``preemption`` signal during the
    bootstrap ends the run (status 75) between replicates (which ``out/bootstrap.json``
    keeps) or, within a replicate's refit, once its checkpoint (``out/bootstrap/``) is on
    disk; the same command goes on from there."""
    problem, setup, theta = fit.setup.problem, fit.setup, fit.theta
    recovered = {k: float(v) for k, v in problem.scalar_values(theta).items()}
    uncertainty, curvature = _uncertainty(cfg, setup, theta, dataset)
    if cfg.fit.bootstrap and uncertainty.get("available"):
        uncertainty = {**uncertainty, "bootstrap": _bootstrap(cfg, fit, uncertainty, out,
                                                              preemption)}
    rows = parameter_table(problem.layout.scalars, fit.first.start_values, recovered,
                           setup.reference,
                           {n: problem.layout.specs[n].unit for n in problem.layout.scalars},
                           uncertainty.get("parameters"))
    summary = _summary(fit, rows, uncertainty)
    if cfg.fit.shooting.segments > 1:  # every stage but the last (one trajectory) shot
        summary["shooting"] = {"segments": int(cfg.fit.shooting.segments),
                               "continuity": float(cfg.fit.shooting.continuity),
                               "stages": len(fit.windows) - 1}
    summary["discretization_check"] = _discretization_check(cfg, setup, theta, curvature)
    summary["uncertainty"] = discretization.mark_intervals(
        uncertainty, summary["discretization_check"])
    summary["residual"] = outcome.residual_verdict(summary["uncertainty"])
    summary.update(_system_evaluation(cfg, setup, theta, dataset, out, lead))
    summary.update(_initial_fields_report(cfg, setup, theta, dataset, out, lead))
    if lead:
        write_json_atomic(out / "summary.json", summary)
    return summary


def _summary(fit: StagedFit, rows: list[dict[str, Any]],
             uncertainty: dict[str, Any]) -> dict[str, Any]:
    problem, history = fit.setup.problem, fit.history
    return {
        "system": problem.system.name, "grid": list(problem.grid.shape),
        "n_steps": problem.n_steps, "schedule": str(problem.schedule),
        "stages": [None if f is None else len(f) for f in fit.windows],
        # All stages' steps (each stage counts its own from 0), and each stage's.
        "optimizer_steps": sum(fit.stage_steps), "optimizer_steps_per_stage": fit.stage_steps,
        "stop_reason": history.stop_reason,
        "final_loss": history.losses[-1],
        "best_loss": history.best_loss, "initial_loss": fit.losses[0],
        "wall_time_s": fit.wall, "nan_failures": fit.nan_failures, "restarts": fit.restarts,
        "parameters": rows, **error_summary(rows), "uncertainty": uncertainty,
    }


def print_report(summary: dict[str, Any], fit: StagedFit) -> None:
    """The parameter table, the intervals' note, the errors and the discretization check."""
    rows, uncertainty = summary["parameters"], summary["uncertainty"]
    if rows:
        print(format_table(rows))
    if uncertainty.get("note"):
        print(f"parameter intervals: {uncertainty['note']}")
    if "bootstrap" in uncertainty:
        print(bootstrap.format_block(uncertainty["bootstrap"]))
    if summary["mean_rel_error"] is not None:
        print(f"{format_error_summary(summary)}  (loss {fit.losses[0]:.3e} → "
              f"{fit.history.best_loss:.3e}, {fit.wall:.1f} s)")
    if "message" in summary["discretization_check"]:
        print(discretization.format_check(summary["discretization_check"]))
    residual = summary["residual"]
    if residual["verdict"] != outcome.UNKNOWN:
        print(f"residual: {residual['message']}")
    if residual["verdict"] in (outcome.ABOVE_NOISE, outcome.MODEL_ERROR):
        log.warning(f"the model does not explain the data at their noise level: "
                    f"{residual['message']}")


def plot(fit: StagedFit, out: Path) -> None:
    """``loss.png`` over all stages and, on one host, ``fields.png``."""
    problem = fit.setup.problem
    plot_loss(fit.losses, out / "loss.png", _loss_description(problem))
    if jax.process_count() == 1:  # the forecast plot needs the whole field on one host
        _plot_prediction(problem, fit.setup, fit.theta, out / "fields.png")


def _uncertainty(cfg: FitConfig, setup: FitSetup, theta: Any, dataset: Path,
                 ) -> tuple[dict[str, Any], CurvatureParts | None]:
    """Standard errors and intervals of the fitted scalars (pdefit.fitting.uncertainty) on the last
    stage's window, with the dataset's additive noise level when it records one and the data
    come from the fitted system; the reason where there are none. Also the curvature they
    come from (None without them), which the discretization check reuses."""
    if not cfg.fit.uncertainty:
        return {"available": False, "reason": "fit.uncertainty=false"}, None
    noise = None if cfg.data.system else zd.open_dataset(dataset).meta.noise
    return outcome.intervals(setup.problem, theta, setup.batch, noise, log=log.info)


def stage_curvature(cfg: FitConfig, problem: Any) -> Any:
    """Levenberg–Marquardt's Gauss–Newton product for a stage's ``problem`` (None for another
    optimiser); a ConfigError naming ``optim`` where the problem has none."""
    if cfg.optim.name != LEVENBERG_MARQUARDT:
        return None
    try:
        return curvature_for(problem)
    except ValueError as err:
        raise ConfigError(f"optim: {err}") from None


def _bootstrap(cfg: FitConfig, fit: StagedFit, uncertainty: dict[str, Any], out: Path,
               preemption: PreemptionFlag | None) -> dict[str, Any]:
    """``fit.bootstrap`` replicates of the last stage's data at the intervals' noise level,
    each refitted as that stage was: from its start, with its optimiser and holds. After
    re-centred refits (``fit.recentre_background``) each replicate repeats them: the stage
    they follow, with the prior's background remade from the replicate's own first frame,
    then as many refits with it moved (a replicate started at the data's re-centred
    background, near its own truth, would not see the prior's pull the data's fit saw).
    Kept replicates are in ``out/bootstrap.json``; the one under way checkpoints in
    ``out/bootstrap/replicate-<i>``."""
    problem = fit.setup.problem
    sigma = uncertainty.get("sigma_per_field") or {
        f: uncertainty["sigma"] for f in problem.observation.fields}
    curvature = stage_curvature(cfg, problem)
    steps: dict = {}  # the refits' compiled steps, shared: their arrays have one shape

    def once(hold: frozenset[str]) -> bootstrap.Refit:
        return lambda replicate, theta0, where: run_fit(
            problem.loss, theta0, replicate, cfg.optim, progress=False, log=log.debug,
            curvature=curvature, hold=hold, layout=problem.layout,
            field_bounds=problem.field_bounds, preemption=preemption,
            checkpoint=None if where is None else CheckpointOptions(
                where / CHECKPOINT_DIR, cfg.run.checkpoint_every),
            config={"optim": plain(cfg.optim), "hold": sorted(hold)}, steps=steps)[1].best_theta

    def stop(what: str) -> None:
        if preemption is not None:
            preemption.stop_if_requested(what, log.warning)

    batch, start, hold = fit.recentre_base or (
        fit.setup.batch, fit.setup.theta0 if fit.start is None else fit.start, fit.hold)
    refit = background.with_recentring(once(hold), once(fit.hold),
                                       cfg.fit.recentre_background)
    log.info(f"bootstrap: {cfg.fit.bootstrap} replicates of the data, each refitted as "
             + (f"the stage before the re-centred ones, then re-centred "
                f"{cfg.fit.recentre_background} times" if cfg.fit.recentre_background
                else "the last stage"))
    fitted = bootstrap.replicates(problem, batch, start, fit.theta, sigma, cfg.fit.bootstrap,
                                  refit, start_params=problem.physical_params(fit.first.theta0),
                                  log=log.info, store=out / "bootstrap.json", stop=stop,
                                  scratch=out / "bootstrap")
    return bootstrap.summary(problem, fit.theta, fitted)


def save_fitted_values(out: Path, staged: StagedFit) -> None:
    """fitted.npz (for pdefit-evaluate and fit.start_from): the last stage's best θ with the
    fitted parameters' physical values."""
    problem = staged.setup.problem
    physical = {k: v for k, v in problem.physical_params(staged.theta).items()
                if k in problem.layout.fitted}
    save_fitted(out / FITTED_FILE, staged.theta, physical)


def _discretization_check(cfg: FitConfig, setup: FitSetup, theta: Any,
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


def _system_evaluation(cfg: FitConfig, setup: FitSetup, theta: Any, dataset: Path, out: Path,
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


def _initial_fields_report(cfg: FitConfig, setup: FitSetup, theta: Any, dataset: Path,
                           out: Path, lead: bool) -> dict[str, Any]:
    """Fitted initial fields against the dataset's first frame (pdefit.fitting.initial_fields),
    printed and returned for summary.json; empty when no field is fitted."""
    result = evaluate_initial_fields(setup.problem, theta, setup.batch, cfg, dataset, out,
                                     plots=bool(cfg.run.plots and lead))
    if result:
        print(format_errors(result["initial_fields"]))
    return result


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
