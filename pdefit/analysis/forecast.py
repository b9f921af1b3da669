"""Forecast a finished fit past its training window (the work of ``pdefit-evaluate``, whose
command line is :mod:`pdefit.app.evaluate`).

The fitted model (recovered parameters, fitted initial fields) and the truth (the simulation
that made the data, re-run without noise) are advanced side by side from the start of the
training window, together with copies of the truth offset by tiny perturbations in several
seeded random directions, whose separations from the truth give the maximal Lyapunov exponent
and its spread (:func:`pdefit.analysis.lyapunov.lyapunov_estimate`). All run in one jitted scan
(the twins vmapped, :mod:`pdefit.analysis.rollout`) that keeps, per frame, only the error
statistics, the truth's active fraction (:mod:`pdefit.analysis.activity`) and one field's
images, so a forecast of thousands of frames fits in memory. A validity that runs into resting
truth is reported as such (``valid_while_active``, ``truth_quiescent_from``). Metrics, plots
and the printed summary (:func:`pdefit.analysis.reports.format_evaluation`) are in
:mod:`pdefit.analysis.reports`.

``evaluate.compare=[RUN_DIR, ...]`` adds the forecasts of other fits of the same truth (e.g. a
BOCF refit next to its Aliev–Panfilov surrogate, the seed paper's Fig. 2c): each run's truth
description and its dataset's first frame are checked before anything is simulated
(:mod:`pdefit.analysis.truth`), the others are forecast over this run's frames at its
precision, their truths are checked frame by frame (the range of each field), and the MAE
curves of the fields all runs compare, each run's validity on them and the training windows go
into ``evaluation.json`` (``comparison``) and ``forecast_compare.png``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.analysis.activity import activity_measure, quiescent_from
from pdefit.analysis.lyapunov import lyapunov_estimate
from pdefit.analysis.reports import (
    activation_time_error,
    error_summary,
    plot_activity,
    plot_comparison,
    plot_fields,
    plot_forecast,
    plot_traces,
    unit_label,
    validity_horizon,
)
from pdefit.analysis.rollout import advance, forecast_rollout, perturbed_twins, unrelated_separation
from pdefit.analysis.truth import EvaluationError, check_evaluate_settings, compare_forecasts
from pdefit.data import DatasetError, DatasetMeta, open_dataset
from pdefit.fitting import assemble
from pdefit.fitting.fitted import FITTED_FILE, FittedFileError, load_fitted
from pdefit.model.system import System, image_origin, stepper
from pdefit.numerics.grid import Grid
from pdefit.options import EvaluateConfig, FitConfig, SystemConfig


class FittedRun(NamedTuple):
    """A finished fit: its problem on its dataset (with the batch it reads) and the fitted θ."""

    setup: Any  # pdefit.fitting.assemble.FitSetup
    theta: Any

    @property
    def problem(self) -> Any:
        return self.setup.problem


class Plan(NamedTuple):
    """What is forecast: the truth (the data-making system of one experiment), on which frames
    (``n_frames`` every ``interval`` from the training window's start ``t_first``) and which
    fields are compared."""

    meta: DatasetMeta
    system: System  # the truth's
    grid: Grid
    params: dict[str, Any]  # the true parameters shared by the experiments
    sys_cfg: SystemConfig
    truth_dt: float
    index: int  # the experiment's index in the dataset
    t_first: float
    t_last: float
    interval: float
    horizon: float
    n_frames: int
    k_truth: int  # truth steps per frame
    k_model: int  # model steps per frame
    compare: list[str]
    image: str  # the field of the maps and traces


class Start(NamedTuple):
    """The states and parameters the forecast starts from, at the training window's start."""

    truth: dict[str, Any]
    p_truth: dict[str, Any]
    truth_step: Callable
    twins: dict[str, Any]
    activity: Callable
    active_means: str
    model: dict[str, Any]
    p_model: dict[str, Any]


class Scores(NamedTuple):
    """The forecast's scores per frame and in all."""

    times: np.ndarray
    mae: np.ndarray  # (n_frames, n_compare)
    normalised: np.ndarray
    valid: float
    activation: dict[str, Any] | None
    separation: np.ndarray  # (n_frames, directions)
    lyapunov: dict[str, Any]
    active: np.ndarray
    at_rest: float | None
    into_rest: bool
    valid_active: float


def _steps_per(interval: float, dt: float, what: str) -> int:
    ratio = interval / dt
    k = round(ratio)
    if k < 1 or abs(ratio - k) > 1e-6 * ratio:
        raise EvaluationError(f"the evaluation frame interval is {interval} {what} time units, "
                              f"not a multiple of its dt = {dt}; set evaluate.frame_interval")
    return k


# -- the evaluation -----------------------------------------------------------------------------


def evaluate_fit(run_dir: Path, cfg: FitConfig,
                 others: Sequence[tuple[Path, FitConfig]] = (), experiment: int = 0,
                 log: Callable[[str], None] = print, write: bool = True,
                 started: float | None = None) -> dict[str, Any]:
    """Forecast, metrics, plots and ``evaluation.json`` for the finished fit in ``run_dir``
    whose saved config, with evaluation overrides, is ``cfg`` (``write=False``: the result
    only, nothing written), with the runs of ``evaluate.compare`` forecast alongside
    (``others``: each run with its saved config, checked by
    :func:`pdefit.analysis.truth.check_compared_run`; :func:`compare_forecasts`).
    ``started``: the ``time.perf_counter()`` the wall time counts from (default: now)."""
    started = time.perf_counter() if started is None else started
    run_dir = Path(run_dir)
    _check_forecast_settings(cfg.evaluate)
    dtype = assemble.set_precision(cfg.precision)
    cfg, dataset = simulated_truth(run_dir, cfg)
    fit = load_fit(run_dir, cfg, dtype, dataset)
    plan = forecast_plan(cfg, fit.problem, experiment)
    start = starting_states(cfg, plan, fit, experiment, dtype)
    out = run_forecast(plan, fit.problem, start, cfg.evaluate, log)
    scores = score(plan, out, start, cfg.evaluate)
    _warn_of_rest(scores, start, cfg.evaluate, log)
    result = evaluation_result(run_dir, plan, fit.problem, out, scores, start, cfg.evaluate)
    if others:
        result["comparison"] = _forecast_others(cfg, plan, others, result, experiment, log)
    if write:
        plot_evaluation(run_dir, plan, out, scores, start, cfg.evaluate, result)
    result["wall_time_s"] = time.perf_counter() - started
    if write:
        (run_dir / "evaluation.json").write_text(json.dumps(result, indent=2))
    return result


def _check_forecast_settings(ev: EvaluateConfig) -> None:
    check_evaluate_settings(ev)
    if int(ev.lyapunov_directions) < 1:
        raise EvaluationError(f"evaluate.lyapunov_directions={ev.lyapunov_directions}: need "
                              "at least one perturbation direction")
    if not 0.0 <= float(ev.min_active_fraction) < 1.0:
        raise EvaluationError(f"evaluate.min_active_fraction={ev.min_active_fraction}: need "
                              "a fraction in [0, 1)")


# The provenance keys of a simulated dataset that do not change its truth (where it was
# written and how the writing was shared out).
NOT_THE_TRUTH = {"simulate": ("output", "frames_per_shard", "task", "tasks")}


def simulated_truth(run_dir: Path, cfg: FitConfig) -> tuple[FitConfig, Path]:
    """(the config the truth is re-simulated from, the dataset the fit read). A run on its
    own simulated data (data.path unset) as it is; a run on ``data.path`` where pdefit
    simulated that dataset with the run's ``system`` and ``simulate`` settings (its
    provenance says so): the run's config with data.path unset, and that dataset; else an
    EvaluationError naming what differs."""
    if cfg.data.path is None:
        return cfg, run_dir / "data.zarr"
    path = Path(cfg.data.path)
    cannot = ("pdefit-evaluate needs the truth beyond the training window; it re-simulates "
              "it for data pdefit simulated")
    try:
        made = open_dataset(path).meta.provenance.get("config") or {}
    except DatasetError as err:
        raise EvaluationError(f"data.path={path}: {err}") from None
    if not all(isinstance(made.get(k), Mapping) for k in ("system", "simulate")):
        raise EvaluationError(f"{cannot}; data.path={path} was not (its provenance holds no "
                              "system and simulate settings): a recording has no truth to "
                              "forecast against")
    differences = [f"{section}.{key}: {made[section].get(key)!r} in the dataset, "
                   f"{mine.get(key)!r} in the run"
                   for section in ("system", "simulate")
                   for mine in [json.loads(json.dumps(dataclasses.asdict(getattr(cfg, section))))]
                   for key in sorted(set(made[section]) | set(mine))
                   if key not in NOT_THE_TRUTH.get(section, ())
                   and made[section].get(key) != mine.get(key)]
    if differences:
        raise EvaluationError(f"{cannot} with the run's own settings, and data.path={path} was "
                              "simulated with others: " + "; ".join(differences))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=None)), path


def load_fit(run_dir: Path, cfg: FitConfig, dtype: Any, dataset: Path | None = None,
             ) -> FittedRun:
    """The run's fit problem on its dataset (default: the run directory's data.zarr) and its
    fitted θ."""
    if cfg.data.path is not None:
        raise EvaluationError("load_fit takes the config of simulated_truth (data.path unset)")
    setup = assemble.build_fit(cfg, run_dir / "data.zarr" if dataset is None else dataset,
                               dtype)
    try:
        theta = load_fitted(run_dir / FITTED_FILE, dtype)
    except FittedFileError as err:
        raise EvaluationError(str(err)) from None
    return FittedRun(setup, theta)


def forecast_plan(cfg: FitConfig, problem: Any, experiment: int) -> Plan:
    """The truth of ``experiment``, the forecast's frames on both clocks and the fields
    compared."""
    ev = cfg.evaluate
    # The truth: the data-making system from its seeded initial state, at the window's start.
    meta, truth_system, grid, p_true = assemble.dataset_meta(cfg)
    truth_cfg = assemble.data_system_config(cfg)
    # Data made by `simulate.refine` had a finer truth than the fit's discretization: the
    # forecast's truth is stepped the same way, or it would be the fit's own (twin) model.
    dt_factor, grid_factor = assemble.refine_factors(cfg)
    if grid_factor > 1:
        raise EvaluationError(
            f"simulate.refine.grid_factor={grid_factor}: pdefit-evaluate re-simulates the truth "
            "on the observed grid only; data made on a refined grid cannot be forecast yet")
    truth_dt = float(truth_cfg.dt) / dt_factor
    frames = list(range(meta.n_frames)) if cfg.data.frames is None else list(cfg.data.frames)
    experiments = (list(range(meta.n_experiments)) if cfg.data.experiments is None
                   else list(cfg.data.experiments))
    index = experiments[experiment]
    t_first, t_last = float(meta.times[frames[0]]), float(meta.times[frames[-1]])
    time_scale = float(cfg.data.time_scale)
    interval = float(ev.frame_interval or meta.frame_interval)
    k_truth = _steps_per(interval, truth_dt, "dataset")
    k_model = _steps_per(interval / time_scale, problem.dt, "model")
    horizon = float(ev.horizon) if ev.horizon is not None else 4.0 * (t_last - t_first)
    compare, image = _compared_fields(cfg, truth_system, problem.system)
    return Plan(meta, truth_system, grid, p_true, truth_cfg, truth_dt, index, t_first, t_last,
                interval, horizon, round(horizon / interval) + 1, k_truth, k_model, compare,
                image)


def _compared_fields(cfg: FitConfig, truth_system: System,
                     model_system: System) -> tuple[list[str], str]:
    """The fields compared and the one of the maps and traces."""
    # The same system: every field, observed or not (the unobserved ones are what a fit of
    # initial fields is about); a surrogate: the observed fields, the only shared meaning.
    same = truth_system.name == model_system.name
    compare = list(truth_system.fields) if same else list(cfg.observe.fields)
    image = cfg.evaluate.field or cfg.observe.fields[0]
    if image not in compare:
        raise EvaluationError(f"evaluate.field={image!r} is not one of the compared fields "
                              f"{compare}")
    return compare, image


def starting_states(cfg: FitConfig, plan: Plan, fit: FittedRun, experiment: int,
                    dtype: Any) -> Start:
    """The truth advanced to the window's start, its perturbed twins, its activity measure and
    the fitted model's start."""
    ev = cfg.evaluate
    # This experiment's truth and fit, per-experiment values (alignments) included.
    p_true = assemble.experiment_params(plan.meta, plan.params, plan.index)
    p_truth = {k: jnp.asarray(v, dtype) for k, v in p_true.items()}
    truth_step = stepper(plan.system, plan.grid, plan.sys_cfg.integrator)
    x_truth = {k: jnp.asarray(v, dtype) for k, v in plan.system.initial_state(
        plan.grid, p_true, cfg.simulate.seed + plan.index).items()}
    start_steps = round(plan.t_first / plan.truth_dt)
    x_truth = jax.jit(advance, static_argnums=(0, 5))(
        truth_step, x_truth, p_truth, 0.0, plan.truth_dt, start_steps)
    twins = perturbed_twins(x_truth, plan.image, float(ev.lyapunov_perturbation),
                            int(ev.lyapunov_directions), dtype)
    activity, active_means = activity_measure(plan.system, plan.image, x_truth)
    problem = fit.problem
    x_model = jax.tree.map(lambda a: a[experiment], problem.initial_state(fit.theta,
                                                                          fit.setup.batch))
    p_model = problem.experiment_params(fit.theta, experiment)
    return Start(x_truth, p_truth, truth_step, twins, activity, active_means, x_model, p_model)


def run_forecast(plan: Plan, problem: Any, start: Start, ev: EvaluateConfig,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """Truth, twins and model advanced together over the plan's frames (one jitted scan)."""
    log(f"forecast {plan.n_frames} frames every {plan.interval} from t = {plan.t_first} "
        f"({plan.horizon} in all): {plan.system.name} truth and {ev.lyapunov_directions} "
        f"perturbed twins, {problem.system.name} model")
    run = forecast_rollout(start.truth_step,
                           stepper(problem.system, problem.grid, problem.integrator),
                           plan.k_truth, plan.k_model, plan.n_frames, plan.compare, plan.image,
                           start.activity)
    return jax.device_get(run(start.truth, start.model, start.twins, start.p_truth,
                              start.p_model, plan.t_first, problem.t0, plan.truth_dt,
                              problem.dt))


def score(plan: Plan, out: Mapping[str, Any], start: Start, ev: EvaluateConfig) -> Scores:
    """MAE and its validity, activation-time error, Lyapunov exponent and the truth's rest."""
    times = plan.t_first + plan.interval * np.arange(plan.n_frames)
    mae = np.asarray(out["mae"], dtype=np.float64)  # (n_frames, n_compare)
    span = np.max(out["high"], axis=0) - np.min(out["low"], axis=0)
    normalised = np.mean(mae / np.maximum(span, 1e-30), axis=1)
    valid = validity_horizon(times, normalised, ev.threshold)
    activation = (None if ev.activation_level is None else activation_time_error(
        out["truth_image"], out["model_image"], times, ev.activation_level))
    separation = np.asarray(out["separation"], dtype=np.float64)  # (n_frames, directions)
    lyapunov = lyapunov_estimate(times - plan.t_first, separation,
                                 unrelated_separation(start.truth))
    active = np.asarray(out["active"], dtype=np.float64)
    at_rest = quiescent_from(times, active, float(ev.min_active_fraction))
    # A forecast that stays valid into resting truth is no evidence beyond the rest's onset.
    into_rest = at_rest is not None and plan.t_first + valid > at_rest
    valid_active = valid if at_rest is None else max(0.0, min(valid, at_rest - plan.t_first))
    return Scores(times, mae, normalised, valid, activation, separation, lyapunov, active,
                  at_rest, into_rest, valid_active)


def _warn_of_rest(scores: Scores, start: Start, ev: EvaluateConfig,
                  log: Callable[[str], None]) -> None:
    if scores.at_rest is not None:
        log(f"warning: the truth is at rest ({start.active_means} on fewer than "
            f"{ev.min_active_fraction:.0%} of the points) from t = {scores.at_rest:g}"
            + (f"; the forecast's validity ({scores.valid:g}) runs into it and counts only "
               f"{scores.valid_active:g}" if scores.into_rest else ""))


def evaluation_result(run_dir: Path, plan: Plan, problem: Any, out: Mapping[str, Any],
                      scores: Scores, start: Start, ev: EvaluateConfig) -> dict[str, Any]:
    """``evaluation.json`` (its ``wall_time_s`` still None, no ``comparison``)."""
    summary_path = run_dir / "summary.json"
    fit_summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rows = fit_summary.get("parameters", [])
    deviations = error_summary(rows) if rows else {}
    window = plan.t_last - plan.t_first
    valid, valid_active, activation = scores.valid, scores.valid_active, scores.activation
    exponent = scores.lyapunov["exponent"]

    def in_lyapunov_times(duration: float) -> float | None:
        return None if exponent is None else duration * exponent

    return {
        "run_dir": str(run_dir), "experiment": plan.index,
        "truth_system": plan.system.name, "model_system": problem.system.name,
        "training_window": [plan.t_first, plan.t_last], "frame_interval": plan.interval,
        "time_unit": plan.meta.time_unit,
        "horizon": plan.horizon, "threshold": ev.threshold, "compared_fields": plan.compare,
        "valid_for": valid, "valid_while_active": valid_active,
        "forecast_runs_into_rest": scores.into_rest, "truth_quiescent_from": scores.at_rest,
        "active_measure": start.active_means,
        "min_active_fraction": float(ev.min_active_fraction),
        "truth_active_fraction_min": float(scores.active.min()),
        "lyapunov_exponent": exponent, "lyapunov_fit": scores.lyapunov,
        "lyapunov_undetermined_reason": (scores.lyapunov["reason"] if exponent is None
                                         else None),
        "training_window_lyapunov_times": in_lyapunov_times(window),
        "valid_for_lyapunov_times": in_lyapunov_times(valid),
        "valid_while_active_lyapunov_times": in_lyapunov_times(valid_active),
        "image_field": plan.image,
        "activation_time_error_mean": None if activation is None else activation["overall"],
        "activation_time_missed": None if activation is None else activation["missed"],
        "parameters": rows, **{f"parameter_{k}": v for k, v in deviations.items()},
        "curves": _curves(plan, out, scores),
        "wall_time_s": None,
    }


def _curves(plan: Plan, out: Mapping[str, Any], scores: Scores) -> dict[str, Any]:
    """The per-frame curves of ``evaluation.json``."""
    compare, times, activation = plan.compare, scores.times, scores.activation
    exponent = scores.lyapunov["exponent"]
    return {
        "time": times.tolist(),
        "mae": {f: scores.mae[:, i].tolist() for i, f in enumerate(compare)},
        "truth_min": {f: np.asarray(out["low"])[:, i].tolist() for i, f in enumerate(compare)},
        "truth_max": {f: np.asarray(out["high"])[:, i].tolist() for i, f in enumerate(compare)},
        "normalised_mae": scores.normalised.tolist(),
        "time_lyapunov": None if exponent is None else (
            (times - plan.t_first) * exponent).tolist(),
        "separation": scores.separation.tolist(),
        "truth_active_fraction": scores.active.tolist(),
        "activation_bin_centres": None if activation is None else activation[
            "bin_centres"].tolist(),
        "activation_error": None if activation is None else [
            None if not np.isfinite(x) else float(x) for x in activation["mean_error"]],
    }


# -- runs that forecast one truth ---------------------------------------------------------------


def on_these_frames(other_cfg: FitConfig, precision: str, horizon: float,
                    interval: float) -> FitConfig:
    """Another run's saved config forecast on this run's frames and precision, with one twin
    and nothing compared in turn."""
    evaluate = dataclasses.replace(other_cfg.evaluate, horizon=horizon, frame_interval=interval,
                                   lyapunov_directions=1, compare=[])
    return dataclasses.replace(other_cfg, precision=precision, evaluate=evaluate)


def _forecast_others(cfg: FitConfig, plan: Plan, others: Sequence[tuple[Path, FitConfig]],
                     result: Mapping[str, Any], experiment: int,
                     log: Callable[[str], None]) -> dict[str, Any]:
    """The ``comparison`` of ``evaluation.json``."""
    # The others on this run's frames and precision (a float32 and a float64 truth part
    # ways in a chaotic system), with one twin each: their Lyapunov fits are not used.
    evaluations = []
    for other, other_cfg in others:
        log(f"evaluate.compare: forecasting {other}")
        same = on_these_frames(other_cfg, cfg.precision, plan.horizon, plan.interval)
        evaluations.append(evaluate_fit(other, same, (), experiment, log, write=False))
    return compare_forecasts(result, evaluations, float(cfg.evaluate.threshold))


# -- plots and the printed summary --------------------------------------------------------------


def plot_evaluation(run_dir: Path, plan: Plan, out: Mapping[str, Any], scores: Scores,
                    start: Start, ev: EvaluateConfig, result: Mapping[str, Any]) -> None:
    """The evaluation's figures in ``run_dir``; times are the dataset's (the truth's clock),
    in its unit."""
    meta = plan.meta
    time_axis = unit_label("time", meta.time_unit)
    _plot_curves(run_dir, plan, scores, start, ev, time_axis)
    _plot_images(run_dir, plan, out, scores, ev, time_axis)
    if "comparison" in result:
        plot_comparison(scores.times, result["comparison"], run_dir / "forecast_compare.png",
                        time_unit=meta.time_unit,
                        field_units={f: meta.field_attrs.get(f, {}).get("units", "")
                                     for f in result["comparison"]["fields"]})


def _plot_curves(run_dir: Path, plan: Plan, scores: Scores, start: Start, ev: EvaluateConfig,
                 time_axis: str) -> None:
    """MAE (on the clock and in Lyapunov times), activation error, separation, activity."""
    times, mae, t_first, t_last = scores.times, scores.mae, plan.t_first, plan.t_last
    exponent, activation = scores.lyapunov["exponent"], scores.activation
    plot_forecast(times, {**{f"MAE {f}": mae[:, i] for i, f in enumerate(plan.compare)},
                          "normalised MAE": scores.normalised}, t_last,
                  run_dir / "forecast_mae.png", xlabel=time_axis)
    if exponent is not None:
        plot_forecast((times - t_first) * exponent, {f"MAE {f}": mae[:, i] for i, f in
                                                     enumerate(plan.compare)},
                      (t_last - t_first) * exponent, run_dir / "forecast_mae_lyapunov.png",
                      xlabel="time (Lyapunov times since the window's start)")
    if activation is not None:
        plot_forecast(activation["bin_centres"], {"mean |Δ activation time|": activation[
            "mean_error"]}, t_last, run_dir / "activation_error.png",
            ylabel=unit_label("activation-time error", plan.meta.time_unit), xlabel=time_axis)
    separation = scores.separation
    plot_forecast(times, {f"twin {i + 1}": separation[:, i] for i in range(
        separation.shape[1])}, t_last, run_dir / "separation.png",
        ylabel="|twin − truth| (RMS over the grid)", xlabel=time_axis)
    plot_activity(times, scores.active, float(ev.min_active_fraction), scores.at_rest, t_last,
                  f"active fraction of the truth ({start.active_means})",
                  run_dir / "activity.png", xlabel=time_axis)


def _plot_images(run_dir: Path, plan: Plan, out: Mapping[str, Any], scores: Scores,
                 ev: EvaluateConfig, time_axis: str) -> None:
    """The image field at the centre pixel over time, and truth and model at a few times."""
    image, times, grid = plan.image, scores.times, plan.grid
    centre = (grid.shape[0] // 2, grid.shape[1] // 2)
    truth_images = np.asarray(out["truth_image"])
    model_images = np.asarray(out["model_image"])
    image_unit = plan.meta.field_attrs.get(image, {}).get("units", "")
    plot_traces(times, truth_images[:, centre[0], centre[1]],
                model_images[:, centre[0], centre[1]], plan.t_last,
                unit_label(f"{image} at the centre pixel", image_unit),
                run_dir / "centre_trace.png", xlabel=time_axis)
    maps_at = list(ev.maps_at) if ev.maps_at else list(
        np.linspace(plan.t_first, times[-1], 5)[1:])
    picks = [int(np.argmin(np.abs(times - t))) for t in maps_at]
    plot_fields({image: truth_images[picks]}, {image: model_images[picks]},
                [times[i] for i in picks], run_dir / "difference_maps.png",
                units={image: image_unit}, time_unit=plan.meta.time_unit,
                labels=("truth", "model"), origin=image_origin(plan.system, grid))
