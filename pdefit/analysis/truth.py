"""Which truth a finished fit is evaluated against, and whether two fits share it.

``pdefit-evaluate`` re-simulates the truth (the simulation that made a run's data, without
noise). Runs compared with ``evaluate.compare`` must forecast the same one: their truth
descriptions (:func:`truth_description`: the data-making system resolved, its grid, time step,
integrator, precision, seed and window start) and the first frames of their noise-free
datasets are checked before anything is simulated. Also the evaluation's own settings
(:func:`check_evaluate_settings`) and its error, :class:`EvaluationError`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdefit.analysis.reports import validity_horizon
from pdefit.data import open_dataset
from pdefit.fitting import assemble
from pdefit.fitting.fitted import FITTED_FILE
from pdefit.options import EvaluateConfig, FitConfig


class EvaluationError(ValueError):
    """A run that cannot be evaluated (unfinished, or without a known truth)."""


def check_evaluate_settings(ev: EvaluateConfig) -> None:
    """``evaluate.*`` values that cannot work, named before anything is simulated."""
    for key in ("horizon", "frame_interval", "threshold", "lyapunov_perturbation"):
        value = getattr(ev, key)
        if value is not None and not (math.isfinite(float(value)) and float(value) > 0):
            raise EvaluationError(f"evaluate.{key} must be a positive number, got {value!r}")


def truth_description(cfg: FitConfig, experiment: int = 0) -> dict[str, tuple[str, Any]]:
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
        out["options"] = (f"{prefix}.options", dict(sys_cfg.options))
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
        out[key] = (f"simulate.{key}", dict(getattr(cfg.simulate, key)))
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


def check_same_truth(cfg: FitConfig, other_cfg: FitConfig, run_dir: Path, other_dir: Path,
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


def check_compared_run(saved: FitConfig, other_cfg: FitConfig, run_dir: Path, other: Path,
                       experiment: int = 0) -> None:
    """An EvaluationError unless the run ``other`` (its saved config ``other_cfg``) of
    ``evaluate.compare`` can be evaluated against the same truth as ``run_dir`` (its saved
    config ``saved``): a finished fit of re-simulated data with the same truth description
    (:func:`check_same_truth`) and the same first frame of its dataset
    (:func:`check_same_data`)."""
    if not (other / FITTED_FILE).exists():
        raise EvaluationError(f"evaluate.compare: {other} has no {FITTED_FILE}: not a "
                              "finished pdefit-fit run")
    if other_cfg.data.path is not None:
        raise EvaluationError(f"evaluate.compare: {other} fits data.path="
                              f"{other_cfg.data.path}; its truth cannot be re-simulated")
    check_same_truth(saved, other_cfg, run_dir, other, experiment)
    check_same_data(run_dir, other, experiment)


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
    _check_same_frames(result, others, fields, times)
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


def _check_same_frames(result: Mapping[str, Any], others: Sequence[Mapping[str, Any]],
                       fields: Sequence[str], times: np.ndarray) -> None:
    """An EvaluationError unless ``others`` were forecast on ``result``'s frames and their
    truths span the same range of each of ``fields`` at every frame."""
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
