"""``pdefit-evaluate RUN_DIR``: forecast a finished fit past its training window.

The fitted model (recovered parameters, fitted initial fields) and the truth (the simulation
that made the data, re-run without noise) are advanced side by side from the start of the
training window, together with copies of the truth offset by tiny perturbations in several
seeded random directions, whose separations from the truth give the maximal Lyapunov exponent
and its spread (:func:`pdefit.analysis.reports.lyapunov_estimate`). All run in one jitted scan (the
twins vmapped) that keeps, per frame, only the error statistics, the truth's active fraction
(:mod:`pdefit.analysis.activity`) and one field's images, so a forecast of thousands of frames fits
in memory. A validity that runs into resting truth is reported as such (``valid_while_active``,
``truth_quiescent_from``). Metrics and plots are in :mod:`pdefit.analysis.reports`.

``evaluate.compare=[RUN_DIR, ...]`` adds the forecasts of other fits of the same truth (e.g. a
BOCF refit next to its Aliev–Panfilov surrogate, the seed paper's Fig. 2c): each run's truth
description and its dataset's first frame are checked before anything is simulated, the others
are forecast over this run's frames at its precision, their truths are checked frame by frame
(the range of each field), and the MAE curves of the
fields all runs compare, each run's validity on them and the training windows go into
``evaluation.json`` (``comparison``) and ``forecast_compare.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from pdefit.analysis.activity import activity_measure, quiescent_from
from pdefit.analysis.reports import (
    activation_time_error,
    error_summary,
    format_lyapunov,
    format_percent,
    lyapunov_estimate,
    plot_activity,
    plot_comparison,
    plot_fields,
    plot_forecast,
    plot_traces,
    unit_label,
    validity_horizon,
)
from pdefit.data.dataset import open_dataset
from pdefit.fitting import assemble
from pdefit.fitting.fitted import FITTED_FILE, FittedFileError, load_fitted
from pdefit.model.system import image_origin, stepper
from pdefit.options import FitConfig


class EvaluationError(ValueError):
    """A run that cannot be evaluated (unfinished, or without a known truth)."""


# -- the joint rollout --------------------------------------------------------------------------


def rms_separation(a: Mapping[str, Any], b: Mapping[str, Any]) -> jnp.ndarray:
    """The RMS difference of two states over all their fields (each field weighted alike)."""
    return jnp.sqrt(jnp.mean(jnp.stack([jnp.mean((b[f] - a[f]) ** 2) for f in a])))


def advance(step: Callable, state, params, t0, dt, n_steps: int):
    """``n_steps`` steps of ``step`` from time ``t0`` (a ``fori_loop``, for use inside jit)."""
    def body(i, s):
        return step(s, params, t0 + i * dt, dt)
    return jax.lax.fori_loop(0, n_steps, body, state)


def perturbed_twins(state: Mapping[str, Any], field: str, size: float, n: int, dtype: Any,
                    seed: int = 12345) -> dict[str, jnp.ndarray]:
    """``n`` copies of ``state`` (stacked on a leading axis) whose ``field`` is offset by
    ``size`` × a seeded N(0, 1) field each: the perturbation directions of a Lyapunov
    estimate."""
    rng = np.random.default_rng(seed)
    shape = np.shape(state[field])
    twins = {f: jnp.broadcast_to(v, (n, *np.shape(v))) for f, v in state.items()}
    return {**twins, field: twins[field] + jnp.asarray(
        size * rng.standard_normal((n, *shape)), dtype)}


def unrelated_separation(state: Mapping[str, Any]) -> float:
    """The RMS separation of two unrelated states with this one's statistics: √2 × the RMS of
    each field's deviation from its mean, averaged over the fields like the separation."""
    return float(np.sqrt(2.0 * np.mean([np.var(np.asarray(v, np.float64))
                                        for v in state.values()])))


def forecast_rollout(truth_step: Callable, model_step: Callable, k_truth: int, k_model: int,
                     n_frames: int, compare: Sequence[str], image: str,
                     activity: Callable) -> Callable:
    """A jitted ``run(truth, model, twins, p_truth, p_model, t_truth, t_model, dt_truth,
    dt_model)`` giving, at ``n_frames`` frames ``k_truth`` truth steps (``k_model`` model steps)
    apart: the MAE of each compared field, the truth's min/max of them, the RMS separation of
    each twin (``twins`` stacked on a leading axis, advanced together by vmap) from the truth
    over all its fields, the truth's ``activity(state, next_state)`` and the ``image`` field
    of truth and model."""
    compare = tuple(compare)

    @jax.jit
    def run(truth, model, twins, p_truth, p_model, t_truth, t_model, dt_truth, dt_model):
        def frame(carry, j):
            truth, model, twins = carry
            t_t = t_truth + j * k_truth * dt_truth
            t_m = t_model + j * k_model * dt_model
            next_truth = advance(truth_step, truth, p_truth, t_t, dt_truth, k_truth)
            out = {
                "mae": jnp.stack([jnp.mean(jnp.abs(model[f] - truth[f])) for f in compare]),
                "low": jnp.stack([jnp.min(truth[f]) for f in compare]),
                "high": jnp.stack([jnp.max(truth[f]) for f in compare]),
                "separation": jax.vmap(lambda twin: rms_separation(truth, twin))(twins),
                "active": activity(truth, next_truth),
                "truth_image": truth[image],
                "model_image": model[image],
            }
            carry = (next_truth,
                     advance(model_step, model, p_model, t_m, dt_model, k_model),
                     jax.vmap(lambda twin: advance(truth_step, twin, p_truth, t_t, dt_truth,
                                                   k_truth))(twins))
            return carry, out

        return jax.lax.scan(frame, (truth, model, twins), jnp.arange(n_frames))[1]

    return run


def _steps_per(interval: float, dt: float, what: str) -> int:
    ratio = interval / dt
    k = round(ratio)
    if k < 1 or abs(ratio - k) > 1e-6 * ratio:
        raise EvaluationError(f"the evaluation frame interval is {interval} {what} time units, "
                              f"not a multiple of its dt = {dt}; set evaluate.frame_interval")
    return k


# -- the evaluation -----------------------------------------------------------------------------


def load_run_config(run_dir: Path, overrides: Sequence[str] = ()) -> Any:
    """The run's saved config on the current schema; ``overrides`` (``evaluate.*=...`` or
    ``precision=...``) apply on top. Other keys would change the fit itself and are refused."""
    path = run_dir / "config.yaml"
    if not path.exists():
        raise EvaluationError(f"{run_dir} has no config.yaml: is it a pdefit-fit run directory?")
    bad = [o for o in overrides if not (o.startswith("evaluate.") or o.startswith("precision="))]
    if bad:
        raise EvaluationError(f"only evaluate.* and precision may be overridden, got {bad}")
    cfg = OmegaConf.merge(OmegaConf.structured(FitConfig), OmegaConf.load(path))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    _check_evaluate_settings(cfg.evaluate)
    return cfg


def _check_evaluate_settings(ev: Any) -> None:
    """``evaluate.*`` values that cannot work, named before anything is simulated."""
    for key in ("horizon", "frame_interval", "threshold", "lyapunov_perturbation"):
        value = getattr(ev, key)
        if value is not None and not (math.isfinite(float(value)) and float(value) > 0):
            raise EvaluationError(f"evaluate.{key} must be a positive number, got {value!r}")


# -- runs that forecast one truth ---------------------------------------------------------------


def truth_description(cfg: Any, experiment: int = 0) -> dict[str, tuple[str, Any]]:
    """What fixes the truth a run is evaluated against, as ``role → (config key, value)``:
    the data-making system with every option and parameter resolved (defaults included), its
    grid, time step and integrator, the precision it was simulated at (a chaotic truth made in
    float32 parts from one made in float64), the seed of the experiment and the training
    window's start. ``cfg`` is the run's saved config (no evaluation overrides).
    Roles are the same for a surrogate fit (``simulate.system.*``) and a fit of the data's own
    system (``system.*``), so the two compare."""
    sys_cfg = assemble.data_system_config(cfg)
    prefix = "system" if getattr(cfg.simulate, "system", None) is None else "simulate.system"
    system = assemble.make_system(sys_cfg)
    out: dict[str, tuple[str, Any]] = {"name": (f"{prefix}.name", system.name)}
    if dataclasses.is_dataclass(system):
        out.update({f"options.{f.name}": (f"{prefix}.options.{f.name}", getattr(system, f.name))
                    for f in dataclasses.fields(system)})
    else:
        out["options"] = (f"{prefix}.options", OmegaConf.to_container(sys_cfg.options))
    out.update({f"params.{k}": (f"{prefix}.params.{k}", np.asarray(v).tolist())
                for k, v in assemble.system_params(system, sys_cfg.params).items()})
    out.update({f"grid.{k}": (f"{prefix}.grid.{k}", list(getattr(sys_cfg.grid, k)))
                for k in ("shape", "spacing", "boundaries")})
    out["dt"] = (f"{prefix}.dt", float(sys_cfg.dt))
    out["refine"] = ("simulate.refine (dt_factor, grid_factor)",
                     list(assemble.refine_factors(cfg)))
    out["integrator"] = (f"{prefix}.integrator", sys_cfg.integrator)
    out["precision"] = ("precision", cfg.precision)
    experiments = (list(range(cfg.simulate.n_experiments)) if cfg.data.experiments is None
                   else list(cfg.data.experiments))
    out["seed"] = ("simulate.seed (+ data.experiments)",
                   int(cfg.simulate.seed) + experiments[experiment])
    for key in ("per_experiment", "arrays"):
        out[key] = (f"simulate.{key}", OmegaConf.to_container(getattr(cfg.simulate, key)))
    first = 0 if cfg.data.frames is None else int(cfg.data.frames[0])
    out["start"] = ("data.frames[0] × simulate.steps_per_frame × dt (the window's start)",
                    first * int(cfg.simulate.steps_per_frame) * float(sys_cfg.dt))
    return out


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(
            a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    return a == b


def check_same_truth(cfg: Any, other_cfg: Any, run_dir: Path, other_dir: Path,
                     experiment: int = 0) -> None:
    """An EvaluationError naming each config key where ``other_dir``'s truth differs from
    ``run_dir``'s (:func:`truth_description`)."""
    mine, theirs = truth_description(cfg, experiment), truth_description(other_cfg, experiment)
    missing = ("—", "(not set)")
    differences = []
    for role in [*mine, *(r for r in theirs if r not in mine)]:
        (key, value), (other_key, other_value) = mine.get(role, missing), theirs.get(
            role, missing)
        if not _same_value(value, other_value):
            differences.append(f"{key} = {value!r} in {run_dir}, {other_key} = "
                               f"{other_value!r} in {other_dir}")
    if differences:
        raise EvaluationError(f"evaluate.compare: {other_dir} is evaluated against another truth "
                              f"than {run_dir}: " + "; ".join(differences))


def check_same_data(run_dir: Path, other_dir: Path, experiment: int = 0) -> None:
    """Where both runs simulated noise-free datasets, an EvaluationError unless the fields both
    hold agree at the first frame: the datasets the fits saw show the same truth."""
    paths = [run_dir / "data.zarr", other_dir / "data.zarr"]
    if not all(p.exists() for p in paths):
        return
    mine, theirs = (open_dataset(p) for p in paths)
    if any(d.meta.noise.get("kind", "none") != "none" for d in (mine, theirs)):
        return
    for name in (f for f in mine.meta.fields if f in theirs.meta.fields):
        a, b = (d.read(name, experiments=experiment, frames=0) for d in (mine, theirs))
        if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
            gap = (float(np.nanmax(np.abs(a - b))) if a.shape == b.shape
                   else f"shapes {a.shape} and {b.shape}")
            raise EvaluationError(f"evaluate.compare: the datasets of {run_dir} and {other_dir} "
                                  f"differ at their first frame ({name}: max |Δ| {gap}): "
                                  "their fits saw different truths")


def compared_runs(cfg: Any, run_dir: Path, experiment: int = 0,
                  ) -> list[Path]:
    """The finished fits ``evaluate.compare`` names, each checked to be
    evaluable against the same truth as ``run_dir`` (before anything is simulated): the same
    truth description (:func:`check_same_truth`) and the same first frame of their datasets
    (:func:`check_same_data`)."""
    if not cfg.evaluate.compare:
        return []
    saved = load_run_config(run_dir)  # the precision its data were made at, not overridden
    others = []
    for name in cfg.evaluate.compare:
        other = Path(name)
        try:
            other_cfg = load_run_config(other)
        except EvaluationError as err:
            raise EvaluationError(f"evaluate.compare: {err}") from None
        if not (other / FITTED_FILE).exists():
            raise EvaluationError(f"evaluate.compare: {other} has no {FITTED_FILE}: not a "
                                  "finished pdefit-fit run")
        if other_cfg.data.path is not None:
            raise EvaluationError(f"evaluate.compare: {other} fits data.path="
                                  f"{other_cfg.data.path}; its truth cannot be re-simulated")
        check_same_truth(saved, other_cfg, run_dir, other, experiment)
        check_same_data(run_dir, other, experiment)
        others.append(other)
    return others


def _first_difference(a: Sequence[float], b: Sequence[float]) -> int | None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    off = np.flatnonzero(~np.isclose(a, b, rtol=1e-6, atol=1e-9))
    return int(off[0]) if off.size else None


def compare_forecasts(result: Mapping[str, Any], others: Sequence[Mapping[str, Any]],
                      threshold: float) -> dict[str, Any]:
    """``result`` (this run's evaluation) and ``others`` (other runs' evaluations over the same
    frames) on the fields they all compare: each run's MAE per field, its normalised MAE (MAE
    over the truth's range, averaged over those fields) and how long that stays at or below
    ``threshold`` (``valid_for``; ``valid_while_active`` cut at the truth's rest), with its
    training window. An EvaluationError if the frames or the truths differ."""
    times = np.asarray(result["curves"]["time"])
    fields = [f for f in result["compared_fields"]
              if all(f in o["compared_fields"] for o in others)]
    if not fields:
        raise EvaluationError("evaluate.compare: the runs compare no field in common")
    for other in others:
        if len(other["curves"]["time"]) != times.size or _first_difference(
                other["curves"]["time"], times) is not None:
            raise EvaluationError(f"evaluate.compare: {other['run_dir']} was forecast on other "
                                  "frames")
        for f in fields:
            for key in ("truth_min", "truth_max"):
                at = _first_difference(other["curves"][key][f], result["curves"][key][f])
                if at is not None:
                    raise EvaluationError(
                        f"evaluate.compare: the truth of {other['run_dir']} differs from "
                        f"{result['run_dir']}'s at t = {times[at]:g} ({key} of {f})")
    span = {f: max(result["curves"]["truth_max"][f]) - min(result["curves"]["truth_min"][f])
            for f in fields}
    runs = []
    for run in (result, *others):
        mae = {f: list(run["curves"]["mae"][f]) for f in fields}
        normalised = np.mean([np.asarray(mae[f]) / max(span[f], 1e-30) for f in fields], axis=0)
        valid = validity_horizon(times, normalised, threshold)
        rest = run["truth_quiescent_from"]
        runs.append({
            "run_dir": run["run_dir"], "model_system": run["model_system"],
            "label": f"{run['model_system']} refit ({Path(run['run_dir']).name})",
            "training_window": list(run["training_window"]), "valid_for": valid,
            "valid_while_active": valid if rest is None else max(
                0.0, min(valid, rest - float(times[0]))),
            "mae": mae, "normalised_mae": normalised.tolist()})
    return {"fields": fields, "threshold": threshold, "truth_system": result["truth_system"],
            "truth_quiescent_from": result["truth_quiescent_from"], "runs": runs}


# -- the evaluation -----------------------------------------------------------------------------


def evaluate_run(run_dir: Path, overrides: Sequence[str] = (), experiment: int = 0,
                 log: Callable[[str], None] = print, write: bool = True) -> dict[str, Any]:
    """Forecast, metrics, plots and ``evaluation.json`` for the finished fit in ``run_dir``
    (``write=False``: the result only, nothing written), with the runs of
    ``evaluate.compare`` forecast alongside (:func:`compare_forecasts`)."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir, overrides)
    ev = cfg.evaluate
    others = compared_runs(cfg, run_dir, experiment)
    if int(ev.lyapunov_directions) < 1:
        raise EvaluationError(f"evaluate.lyapunov_directions={ev.lyapunov_directions}: need "
                              "at least one perturbation direction")
    if not 0.0 <= float(ev.min_active_fraction) < 1.0:
        raise EvaluationError(f"evaluate.min_active_fraction={ev.min_active_fraction}: need "
                              "a fraction in [0, 1)")
    dtype = assemble.set_precision(cfg.precision)
    if cfg.data.path is not None:
        raise EvaluationError(
            "pdefit-evaluate needs the truth beyond the training window; it re-simulates it for "
            "runs on simulated data (data.path unset). Recorded datasets are not supported yet.")
    setup = assemble.build_fit(cfg, run_dir / "data.zarr", dtype)
    problem = setup.problem
    try:
        theta = load_fitted(run_dir / FITTED_FILE, dtype)
    except FittedFileError as err:
        raise EvaluationError(str(err)) from None

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
    n_frames = round(horizon / interval) + 1
    # The same system: every field, observed or not (the unobserved ones are what a fit of
    # initial fields is about); a surrogate: the observed fields, the only shared meaning.
    same = truth_system.name == problem.system.name
    compare = list(truth_system.fields) if same else list(cfg.observe.fields)
    image = ev.field or cfg.observe.fields[0]
    if image not in compare:
        raise EvaluationError(f"evaluate.field={image!r} is not one of the compared fields "
                              f"{compare}")

    # This experiment's truth and fit, per-experiment values (alignments) included.
    p_true = assemble.experiment_params(meta, p_true, index)
    p_truth = {k: jnp.asarray(v, dtype) for k, v in p_true.items()}
    truth_step = stepper(truth_system, grid, truth_cfg.integrator)
    x_truth = {k: jnp.asarray(v, dtype) for k, v in
               truth_system.initial_state(grid, p_true, cfg.simulate.seed + index).items()}
    start_steps = round(t_first / truth_dt)
    x_truth = jax.jit(advance, static_argnums=(0, 5))(
        truth_step, x_truth, p_truth, 0.0, truth_dt, start_steps)
    twins = perturbed_twins(x_truth, image, float(ev.lyapunov_perturbation),
                            int(ev.lyapunov_directions), dtype)
    activity, active_means = activity_measure(truth_system, image, x_truth)
    x_model = jax.tree.map(lambda a: a[experiment], problem.initial_state(theta, setup.batch))
    p_model = problem.experiment_params(theta, experiment)

    log(f"forecast {n_frames} frames every {interval} from t = {t_first} ({horizon} in all): "
        f"{truth_system.name} truth and {ev.lyapunov_directions} perturbed twins, "
        f"{problem.system.name} model")
    run = forecast_rollout(truth_step, stepper(problem.system, problem.grid, problem.integrator),
                           k_truth, k_model, n_frames, compare, image, activity)
    out = jax.device_get(run(x_truth, x_model, twins, p_truth, p_model, t_first,
                             problem.t0, truth_dt, problem.dt))
    times = t_first + interval * np.arange(n_frames)

    mae = np.asarray(out["mae"], dtype=np.float64)  # (n_frames, n_compare)
    span = np.max(out["high"], axis=0) - np.min(out["low"], axis=0)
    normalised = np.mean(mae / np.maximum(span, 1e-30), axis=1)
    valid = validity_horizon(times, normalised, ev.threshold)
    activation = (None if ev.activation_level is None else activation_time_error(
        out["truth_image"], out["model_image"], times, ev.activation_level))
    separation = np.asarray(out["separation"], dtype=np.float64)  # (n_frames, directions)
    lyapunov = lyapunov_estimate(times - t_first, separation, unrelated_separation(x_truth))
    exponent = lyapunov["exponent"]
    active = np.asarray(out["active"], dtype=np.float64)
    at_rest = quiescent_from(times, active, float(ev.min_active_fraction))
    # A forecast that stays valid into resting truth is no evidence beyond the rest's onset.
    into_rest = at_rest is not None and t_first + valid > at_rest
    valid_active = valid if at_rest is None else max(0.0, min(valid, at_rest - t_first))
    if at_rest is not None:
        log(f"warning: the truth is at rest ({active_means} on fewer than "
            f"{ev.min_active_fraction:.0%} of the points) from t = {at_rest:g}"
            + (f"; the forecast's validity ({valid:g}) runs into it and counts only "
               f"{valid_active:g}" if into_rest else ""))

    summary_path = run_dir / "summary.json"
    fit_summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rows = fit_summary.get("parameters", [])
    deviations = error_summary(rows) if rows else {}
    window = t_last - t_first
    result = {
        "run_dir": str(run_dir), "experiment": index,
        "truth_system": truth_system.name, "model_system": problem.system.name,
        "training_window": [t_first, t_last], "frame_interval": interval,
        "time_unit": meta.time_unit,
        "horizon": horizon, "threshold": ev.threshold, "compared_fields": compare,
        "valid_for": valid, "valid_while_active": valid_active,
        "forecast_runs_into_rest": into_rest, "truth_quiescent_from": at_rest,
        "active_measure": active_means, "min_active_fraction": float(ev.min_active_fraction),
        "truth_active_fraction_min": float(active.min()),
        "lyapunov_exponent": exponent, "lyapunov_fit": lyapunov,
        "lyapunov_undetermined_reason": lyapunov["reason"] if exponent is None else None,
        "training_window_lyapunov_times": None if exponent is None else window * exponent,
        "valid_for_lyapunov_times": None if exponent is None else valid * exponent,
        "valid_while_active_lyapunov_times": (None if exponent is None
                                              else valid_active * exponent),
        "image_field": image,
        "activation_time_error_mean": None if activation is None else activation["overall"],
        "activation_time_missed": None if activation is None else activation["missed"],
        "parameters": rows, **{f"parameter_{k}": v for k, v in deviations.items()},
        "curves": {
            "time": times.tolist(),
            "mae": {f: mae[:, i].tolist() for i, f in enumerate(compare)},
            "truth_min": {f: np.asarray(out["low"])[:, i].tolist() for i, f in enumerate(compare)},
            "truth_max": {f: np.asarray(out["high"])[:, i].tolist()
                          for i, f in enumerate(compare)},
            "normalised_mae": normalised.tolist(),
            "time_lyapunov": None if exponent is None else (
                (times - t_first) * exponent).tolist(),
            "separation": separation.tolist(),
            "truth_active_fraction": active.tolist(),
            "activation_bin_centres": None if activation is None else activation[
                "bin_centres"].tolist(),
            "activation_error": None if activation is None else [
                None if not np.isfinite(x) else float(x) for x in activation["mean_error"]],
        },
        "wall_time_s": None,
    }
    if others:
        # The others on this run's frames and precision (a float32 and a float64 truth part
        # ways in a chaotic system), with one twin each: their Lyapunov fits are not used.
        same = [f"precision={cfg.precision}", f"evaluate.horizon={horizon}",
                f"evaluate.frame_interval={interval}", "evaluate.lyapunov_directions=1",
                "evaluate.compare=[]"]
        evaluations = []
        for other in others:
            log(f"evaluate.compare: forecasting {other}")
            evaluations.append(evaluate_run(other, same, experiment, log, write=False))
        result["comparison"] = compare_forecasts(result, evaluations, float(ev.threshold))
    if not write:
        result["wall_time_s"] = time.perf_counter() - started
        return result

    centre = (grid.shape[0] // 2, grid.shape[1] // 2)
    truth_images = np.asarray(out["truth_image"])
    model_images = np.asarray(out["model_image"])
    # Times are the dataset's (the truth's clock), in its unit.
    time_axis = unit_label("time", meta.time_unit)
    image_unit = meta.field_attrs.get(image, {}).get("units", "")
    plot_forecast(times, {**{f"MAE {f}": mae[:, i] for i, f in enumerate(compare)},
                          "normalised MAE": normalised}, t_last, run_dir / "forecast_mae.png",
                  xlabel=time_axis)
    if exponent is not None:
        plot_forecast((times - t_first) * exponent, {f"MAE {f}": mae[:, i] for i, f in
                                                     enumerate(compare)},
                      (t_last - t_first) * exponent, run_dir / "forecast_mae_lyapunov.png",
                      xlabel="time (Lyapunov times since the window's start)")
    if activation is not None:
        plot_forecast(activation["bin_centres"], {"mean |Δ activation time|": activation[
            "mean_error"]}, t_last, run_dir / "activation_error.png",
            ylabel=unit_label("activation-time error", meta.time_unit), xlabel=time_axis)
    plot_forecast(times, {f"twin {i + 1}": separation[:, i] for i in range(
        separation.shape[1])}, t_last, run_dir / "separation.png",
        ylabel="|twin − truth| (RMS over the grid)", xlabel=time_axis)
    plot_activity(times, active, float(ev.min_active_fraction), at_rest, t_last,
                  f"active fraction of the truth ({active_means})", run_dir / "activity.png",
                  xlabel=time_axis)
    plot_traces(times, truth_images[:, centre[0], centre[1]],
                model_images[:, centre[0], centre[1]], t_last,
                unit_label(f"{image} at the centre pixel", image_unit),
                run_dir / "centre_trace.png", xlabel=time_axis)
    maps_at = list(ev.maps_at) if ev.maps_at else list(
        np.linspace(t_first, times[-1], 5)[1:])
    picks = [int(np.argmin(np.abs(times - t))) for t in maps_at]
    plot_fields({image: truth_images[picks]}, {image: model_images[picks]},
                [times[i] for i in picks], run_dir / "difference_maps.png",
                units={image: image_unit}, time_unit=meta.time_unit,
                labels=("truth", "model"), origin=image_origin(truth_system, grid))
    if others:
        plot_comparison(times, result["comparison"], run_dir / "forecast_compare.png",
                        time_unit=meta.time_unit,
                        field_units={f: meta.field_attrs.get(f, {}).get("units", "")
                                     for f in result["comparison"]["fields"]})
    result["wall_time_s"] = time.perf_counter() - started
    (run_dir / "evaluation.json").write_text(json.dumps(result, indent=2))
    return result


def format_evaluation(result: Mapping[str, Any]) -> str:
    unit = result.get("time_unit", "")
    unit = "" if unit in ("", "1") else f" {unit}"
    lines = [f"training window {result['training_window'][0]:g}–{result['training_window'][1]:g}"
             f"{unit}, forecast over {result['horizon']:g}{unit} (frames every "
             f"{result['frame_interval']:g})"]
    lam = result["lyapunov_exponent"]
    lyapunov = format_lyapunov(result["lyapunov_fit"], unit)
    if lam is not None:
        lyapunov += (f"; training window = {result['training_window_lyapunov_times']:.3g} "
                     "Lyapunov times")
    lines.append(lyapunov)
    if result["truth_quiescent_from"] is None:
        lines.append(f"truth active ({result['active_measure']}) on ≥ "
                     f"{result['truth_active_fraction_min']:.1%} of the points at every frame")
    else:
        lines.append(f"the truth is at rest ({result['active_measure']} on fewer than "
                     f"{result['min_active_fraction']:.0%} of the points) from t = "
                     f"{result['truth_quiescent_from']:g}{unit}")
    valid = (f"forecast valid for {result['valid_for']:g}{unit} (normalised MAE ≤ "
             f"{result['threshold']})")
    if lam is not None:
        valid += f" = {result['valid_for_lyapunov_times']:.3g} Lyapunov times"
    if result["forecast_runs_into_rest"]:
        valid = (f"forecast valid until t = {result['training_window'][0] + result['valid_for']:g}"
                 f"{unit}, but the truth is at rest from t = {result['truth_quiescent_from']:g}"
                 f"{unit}: valid while active for {result['valid_while_active']:g}{unit} only")
    lines.append(valid)
    if result["activation_time_error_mean"] is not None:
        lines.append(f"mean activation-time error {result['activation_time_error_mean']:.4g}"
                     f"{unit} "
                     f"({result['activation_time_missed']} truth activations unmatched)")
    final = {f: values[-1] for f, values in result["curves"]["mae"].items()}
    lines.append("MAE at the horizon: " + ", ".join(f"{f} {v:.3g}" for f, v in final.items()))
    if result.get("parameter_mean_rel_error") is not None:
        lines.append(f"parameters: mean |rel. deviation| "
                     f"{format_percent(result['parameter_mean_rel_error'])}, median "
                     f"{format_percent(result['parameter_median_rel_error'])}")
    comparison = result.get("comparison")
    if comparison:
        lines.append(f"compared on {', '.join(comparison['fields'])} (normalised MAE ≤ "
                     f"{comparison['threshold']}):")
        for run in comparison["runs"]:
            whole = run["valid_for"] >= result["curves"]["time"][-1] - result["curves"]["time"][0]
            lines.append(f"  {run['label']}: valid for {run['valid_for']:g}{unit}"
                         + (" (the whole horizon)" if whole else "")
                         + f" from the training window's start (window "
                         f"{run['training_window'][0]:g}–{run['training_window'][1]:g}{unit})")
    return "\n".join(lines)


EVALUATE_HELP = """\
usage: pdefit-evaluate RUN_DIR [evaluate.<key>=<value> ...] [precision=float64]

Forecast a finished fit (RUN_DIR of pdefit-fit) past its training window against the truth:
re-simulates the data's system and runs the fitted model and evaluate.lyapunov_directions
twins of the truth perturbed by evaluate.lyapunov_perturbation in one jitted scan. Prints how
long the forecast stays valid (normalised MAE below evaluate.threshold), the truth's active
fraction and whether it comes to rest (a validity that runs into resting truth is reported
as such), the Lyapunov exponent of the truth with its spread over the directions (or
"undetermined" and why) and the activation-time error; writes RUN_DIR/evaluation.json and
plots (forecast_mae.png, centre_trace.png, difference_maps.png, separation.png, activity.png,
activation_error.png).

keys: horizon (default 4 x the training window), frame_interval, threshold (0.05), field,
activation_level, maps_at, lyapunov_perturbation, lyapunov_directions (4),
min_active_fraction (0.05), compare (pdefit/options.py EvaluateConfig)

evaluate.compare=[RUN_DIR2,...] forecasts other fits of the same truth alongside (refused,
naming the differing keys, if their truth is not the same) and plots every run's MAE of the
fields they share on one log axis with the training windows marked (forecast_compare.png;
the curves and each run's validity under "comparison" in evaluation.json).

examples:
  pdefit-fit experiment=bocf_recovery run.name=bocf
  pdefit-evaluate runs/fit/bocf evaluate.horizon=2000
  pdefit-fit experiment=ap_from_bocf run.name=ap
  pdefit-fit experiment=bocf_refit_for_ap run.name=bocf_for_ap
  pdefit-evaluate runs/fit/ap evaluate.compare=[runs/fit/bocf_for_ap]"""


def main(argv: Sequence[str] | None = None) -> None:
    """``pdefit-evaluate RUN_DIR [evaluate.horizon=2000 ...]``"""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(EVALUATE_HELP)
        raise SystemExit(0 if args else 2)
    try:
        result = evaluate_run(Path(args[0]), args[1:])
    except (EvaluationError, assemble.ConfigError) as err:
        print(f"pdefit-evaluate: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_evaluation(result))
    print(f"wrote {Path(args[0]) / 'evaluation.json'} and plots ({result['wall_time_s']:.1f} s)")
