"""Realistic recordings (issue 24): voltage only, noisy, made by another solver.

What it measures
----------------
``experiment=bocf_from_voltage`` (or ``ap_from_voltage``) as shipped: only u observed, the data
stepped 10 × finer than the fit (``simulate.refine.dt_factor=10``, so not a twin), the hidden
fields at t = 0 (BOCF's gates v, w, s, and u(0)) fitted with the parameters from the system's
first guess. For each noise level of ``--sigmas`` (additive Gaussian noise on u; σ = 0 none)
the dataset is simulated once and shared by the start seeds ``fit.perturb.seed`` = each of
``--seeds`` (``data.path``); each fit runs in this process through ``pdefit.app.cli.fit``, the
same code as ``pdefit-fit``, then its forecast through ``pdefit.analysis.forecast`` (the code
of ``pdefit-evaluate``) to ``--forecast`` ms.

Per fit: the mean, median and max relative error of the fitted parameters; the residual's
verdict and reduced χ² (``summary.json`` ``residual``); the coverage of the 95 % intervals (is
the truth inside the fit's ``ci95_low``–``ci95_high``, else recovered ± 1.96 · std_error; "—"
where the fit gives none); the relative L2 error of each fitted initial field (against the
dataset's first frame with its drawn noise taken off again: the truth) and the share of its
values the data determine (its degrees of freedom for signal, ``pdefit.fitting.signal``); how
long the forecast stays valid (``valid_for``: normalised MAE below ``evaluate.threshold``;
``valid_while_active`` stops at the truth's rest); the stop reason, optimiser steps, wall
and process CPU time of the fit (the dataset's simulation and the forecast excluded); and
run-off: a recovered parameter more than 10 × or less than 0.1 × its truth, or a fit stopped
as diverged.

The targets of issue 24 it checks (section "targets" of the output, each reached / missed /
not measured, with its numbers):
  * no run-off in any fit (20 with the defaults: 4 σ × 5 seeds; a fit that fails counts);
  * at σ = 0.02: mean relative error of the parameters ≤ 2 % (mean over the seeds), median ≤ 1 %
    (median of the seeds' medians), reduced χ² in [0.8, 1.5] in every fit, hidden fields at
    t = 0 within 10 % relative L2 in every fit, forecast valid ≥ 500 ms (while the truth is
    active) in every fit;
  * at every σ > 0: the 95 % intervals cover the truth in 85–100 % of the parameter × seed pairs.

How to run
----------
    nice -n 5 python benchmarks/realistic.py                       # BOCF 64², 4 σ × 5 seeds
    python benchmarks/realistic.py --experiment ap_from_voltage    # the Aliev–Panfilov analogue
    python benchmarks/realistic.py --experiment ap_from_voltage --grid 16 --sigmas 0 0.02 \\
        --seeds 0 --forecast 20 -- optim.steps=2                    # quick (~1.5 min)
    python benchmarks/realistic.py --sigmas 0.02 --seeds 0 --forecast 10 \\
        -- optim.steps=1 'fit.stages=[2,3]' simulate.n_frames=3     # quick BOCF (~2 min)

``--start truth`` starts every fitted value at the truth instead (the dataset's parameters
and its first frame with the drawn noise taken off, through ``fit.start_from``): a diagnostic
that separates "the fit cannot find the optimum" from "the optimum is not at the truth"
(the staged windows keep their short first stages; ``-- fit.stages=null`` fits the whole
window at once):

    python benchmarks/realistic.py --sigmas 0.02 --seeds 0 --start truth

BOCF's S1–S2 spiral needs the default 64² or more: on 16² and 32² the tissue is at rest
before the data start and the dataset is refused (every seed of that σ records the error).

Extra Hydra overrides go after ``--`` (``run.resume=false`` is the default: a rerun fits
afresh instead of returning an old run's summary); ``--fit-only`` overrides change the fits
but not the dataset, e.g. the fit's model smoothed while the data stay the sharp model's
(``--fit-only system.options.heaviside_width=0.01 --forecast 0``). Writes
``benchmarks/results/realistic_<experiment>.json`` (``--output``), one record per fit as soon
as it finishes, and the table as Markdown next to it (``.md``); run directories under
``--runs`` (``sigma-<σ>/data.zarr`` and ``sigma-<σ>/seed-<seed>/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# The sibling benchmark's config and noise overrides (this directory is on the path when
# the script runs).
from bocf_robustness import config, noise_overrides, simulate

from pdefit import data as zd
from pdefit.analysis.forecast import evaluate_fit
from pdefit.app import cli
from pdefit.app.evaluate import load_run_config
from pdefit.fitting import components
from pdefit.fitting.initial_fields import true_initial_fields
from pdefit.fitting.train import TrainingDivergedError

RUN_OFF_FACTOR = 10.0  # recovered / true beyond this (or below its inverse): run off
Z95 = 1.959963984540054  # the normal 97.5 % quantile
TARGET_SIGMA = 0.02
MEAN_TARGET, MEDIAN_TARGET = 0.02, 0.01
CHI2_TARGET = (0.8, 1.5)
COVERAGE_TARGET = (0.85, 1.0)
FIELD_TARGET = 0.10
FORECAST_TARGET = 500.0  # ms


# -- one fit's record ---------------------------------------------------------------------------


def parameter_errors(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean, median and max relative error of the fitted parameters with a truth, and whether
    one ran off (recovered beyond ×10 or ×0.1 of its truth, or not finite)."""
    errors = [r["rel_error"] for r in rows if r.get("rel_error") is not None]
    ratios = [r["recovered"] / r["true"] for r in rows if r.get("true")]
    run_off = any(not math.isfinite(q) or q > RUN_OFF_FACTOR or q < 1 / RUN_OFF_FACTOR
                  for q in ratios)
    if not errors:
        return {"mean_rel_error": None, "median_rel_error": None, "max_rel_error": None,
                "run_off": run_off}
    return {"mean_rel_error": float(np.mean(errors)),
            "median_rel_error": float(np.median(errors)),
            "max_rel_error": float(np.max(errors)), "run_off": run_off}


def interval_coverage(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Per parameter with a truth and an interval: whether its 95 % interval holds the truth.
    The fit's own ``ci95_low``/``ci95_high`` (mapped from the fit's θ-space, so possibly
    asymmetric) where given, else recovered ± 1.96 · std_error; parameters without either are
    left out (an empty dict: no intervals)."""
    covered = {}
    for r in rows:
        true, low, high = r.get("true"), r.get("ci95_low"), r.get("ci95_high")
        se = r.get("std_error")
        if true is None:
            continue
        if low is not None and high is not None and math.isfinite(low) and math.isfinite(high):
            covered[r["name"]] = bool(low <= true <= high)
        elif se is not None and math.isfinite(se):
            covered[r["name"]] = bool(abs(r["recovered"] - true) <= Z95 * se)
    return covered


def summary_record(summary: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark keeps of a fit's ``summary.json``."""
    rows = summary.get("parameters") or []
    residual = summary.get("residual") or {}
    record = parameter_errors(rows)
    record.update(
        stop_reason=summary.get("stop_reason"),
        run_off=record["run_off"] or summary.get("stop_reason") == "diverged",
        steps=summary.get("optimizer_steps"),
        verdict=residual.get("verdict"), reduced_chi2=residual.get("reduced_chi2"),
        rms_residual=residual.get("rms_residual"), noise_sigma=residual.get("noise_sigma"),
        residual_message=residual.get("message"),
        coverage=interval_coverage(rows),
        bootstrap_coverage=bootstrap_coverage(summary),
        initial_fields={name: e.get("rel_l2_error")
                        for name, e in (summary.get("initial_fields") or {}).items()},
        determined={name: row["determined_fraction"] for name, row in (
            (summary.get("uncertainty") or {}).get("field_signal") or {"fields": {}}
        )["fields"].items()},
        # each fitted field's rms distance from its first guess over the background prior's
        # σ_b (pdefit.fitting.background): above 2 the prior is too narrow for the guess
        background_ratio={name: row["ratio"] for name, row in (
            (summary.get("uncertainty") or {}).get("field_background") or {"fields": {}}
        )["fields"].items()},
        parameters={r["name"]: {k: r.get(k) for k in (
            "start", "recovered", "true", "rel_error", "std_error", "ci95_low", "ci95_high",
            "flag")} for r in rows})
    return record


def bootstrap_coverage(summary: dict[str, Any]) -> dict[str, bool]:
    """Whether each bias-corrected interval of ``fit.bootstrap`` holds the truth (empty
    without a bootstrap)."""
    block = ((summary.get("uncertainty") or {}).get("bootstrap") or {}).get("parameters", {})
    truth = {r["name"]: r.get("true") for r in summary.get("parameters") or []}
    return {name: bool(row["ci95_low"] <= truth[name] <= row["ci95_high"])
            for name, row in block.items() if truth.get(name) is not None}


def failure_record(err: BaseException) -> dict[str, Any]:
    """The record of a fit (or its dataset) that raised: its failure text; a divergence counts
    as run-off."""
    diverged = isinstance(err, TrainingDivergedError)
    return {"failure": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(limit=-3),
            "stop_reason": "diverged" if diverged else "failed", "run_off": diverged,
            "mean_rel_error": None, "median_rel_error": None, "max_rel_error": None,
            "verdict": None, "reduced_chi2": None, "coverage": {}, "initial_fields": {},
            "steps": None}


def forecast_validity(run_dir: Path, horizon: float | None,
                      log: Callable[[str], None]) -> dict[str, Any]:
    """How long the fitted model's forecast from ``run_dir`` stays valid against the truth,
    to ``horizon`` ms (None: pdefit-evaluate's default), by
    ``pdefit.analysis.forecast.evaluate_fit`` (evaluation.json and plots in ``run_dir``)."""
    # The run fitted data.path, which pdefit simulated with the run's own settings: the
    # forecast re-simulates that truth (pdefit.analysis.forecast.simulated_truth checks it).
    cfg = load_run_config(run_dir, [] if horizon is None else [f"evaluate.horizon={horizon}"])
    result = evaluate_fit(run_dir, cfg, log=log)
    return {"forecast_valid_ms": result["valid_for"],
            "forecast_valid_active_ms": result["valid_while_active"],
            "forecast_into_rest": result["forecast_runs_into_rest"],
            "forecast_horizon_ms": result["horizon"],
            "lyapunov_exponent": result["lyapunov_exponent"],
            "forecast_wall_s": result["wall_time_s"]}


def one_fit(base: list[str], dataset: Path, seed: int, run_dir: Path,
            horizon: float | None) -> dict[str, Any]:
    """One fit from start seed ``seed`` on ``dataset``, then its forecast to ``horizon`` ms
    (0: none; None: pdefit-evaluate's default, 4 × the training window): its record. A fit
    or forecast that raises leaves its failure in the record."""
    cfg = config([*base, f"data.path={dataset}", f"fit.perturb.seed={seed}",
                  f"run.dir={run_dir}"])
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        record = summary_record(cli.fit(cfg))
    except Exception as err:  # a record of its own; the other fits go on
        record = failure_record(err)
    record.update(seed=seed, wall_s=time.perf_counter() - wall,
                  cpu_s=time.process_time() - cpu, run_dir=str(run_dir))
    if horizon != 0 and "failure" not in record:
        try:
            record.update(forecast_validity(run_dir, horizon,
                                            log=lambda line: print(f"  {line}", flush=True)))
        except Exception as err:  # the fit's record stays
            record["forecast_error"] = f"{type(err).__name__}: {err}"
    return record


# -- the table ----------------------------------------------------------------------------------


def percent(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{100 * x:.2e}" if x < 1e-3 else f"{100 * x:.3f}" if x < 10 else f"{100 * x:.1e}"


def number(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


def coverage_text(covered: dict[str, bool]) -> str:
    return f"{sum(covered.values())}/{len(covered)}" if covered else "—"


def forecast_text(r: dict[str, Any]) -> str:
    if r.get("forecast_error"):
        return "failed"
    valid = r.get("forecast_valid_ms")
    if valid is None:
        return "—"
    # A validity that runs into resting truth counts only to the rest's onset.
    active = r.get("forecast_valid_active_ms")
    return f"{valid:g}" if not r.get("forecast_into_rest") else f"{valid:g} ({active:g} active)"


def table_header(fields: Sequence[str]) -> list[str]:
    columns = ["σ", "seed", "mean %", "median %", "max %", "red. χ²", "verdict", "95 % cover",
               *[f"{f}(0) L2 % / determined %" for f in fields], "forecast valid (model time)",
               "stop", "steps",
               "wall s", "CPU s"]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def table_row(r: dict[str, Any], fields: Sequence[str]) -> str:
    stop = r["stop_reason"] or "—"
    if r.get("failure"):
        stop = f"{stop}: {r['failure'][:80]}"
    elif r.get("run_off"):
        stop = f"{stop} (run-off)"
    cells = [f"{r['sigma']:g}", str(r["seed"]), percent(r["mean_rel_error"]),
             percent(r["median_rel_error"]), percent(r["max_rel_error"]),
             number(r["reduced_chi2"]), r["verdict"] or "—", coverage_text(r["coverage"])
             + (f", bootstrap {coverage_text(r['bootstrap_coverage'])}"
                if r.get("bootstrap_coverage") else ""),
             *[f"{percent(r['initial_fields'].get(f))} / "
               f"{percent((r.get('determined') or {}).get(f))}" for f in fields],
             forecast_text(r), stop,
             number(r["steps"], "d"), f"{r['wall_s']:.0f}", f"{r['cpu_s']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def pooled_coverage(records: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(covered, total) over all parameter × seed pairs with an interval."""
    flags = [c for r in records for c in r["coverage"].values()]
    return sum(flags), len(flags)


def sigma_line(sigma: float, records: Sequence[dict[str, Any]]) -> str:
    """A noise level's summary: mean of the seeds' mean errors, median of their medians,
    the pooled interval coverage and the run-offs."""
    means = [r["mean_rel_error"] for r in records if r["mean_rel_error"] is not None]
    medians = [r["median_rel_error"] for r in records if r["median_rel_error"] is not None]
    covered, total = pooled_coverage(records)
    failed = sum(1 for r in records if r.get("failure"))
    return (f"σ = {sigma:g}: mean error {percent(float(np.mean(means)) if means else None)} %"
            f" (mean over {len(means)} seeds), median "
            f"{percent(float(np.median(medians)) if medians else None)} %, coverage "
            f"{covered}/{total}{f' = {covered / total:.0%}' if total else ''}, run-offs "
            f"{sum(bool(r['run_off']) for r in records)}/{len(records)}"
            + (f", failed {failed}" if failed else "") + _bootstrap_text(records))


def _bootstrap_text(records: Sequence[dict[str, Any]]) -> str:
    flags = [c for r in records for c in (r.get("bootstrap_coverage") or {}).values()]
    return f", bootstrap coverage {sum(flags)}/{len(flags)}" if flags else ""


def overall_line(records: Sequence[dict[str, Any]]) -> str:
    noisy = [r for r in records if r["sigma"] > 0]
    covered, total = pooled_coverage(noisy)
    return (f"all: run-offs {sum(bool(r['run_off']) for r in records)}/{len(records)} fits, "
            f"coverage over σ > 0 {covered}/{total}"
            f"{f' = {covered / total:.0%}' if total else ''}")


def by_sigma(records: Sequence[dict[str, Any]]) -> dict[float, list[dict[str, Any]]]:
    groups: dict[float, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["sigma"], []).append(r)
    return groups


def table(records: Sequence[dict[str, Any]], fields: Sequence[str]) -> str:
    lines = table_header(fields) + [table_row(r, fields) for r in records]
    lines += ["", *[f"- {sigma_line(s, rs)}" for s, rs in by_sigma(records).items()],
              f"- {overall_line(records)}"]
    return "\n".join(lines)


# -- the targets of issue 24 --------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "reached" if ok else "missed"


def all_within(values: Sequence[float | None], low: float, high: float) -> bool | None:
    """Whether every value is in [low, high]; a missing one misses; None: no values."""
    if not values:
        return None
    return all(v is not None and low <= v <= high for v in values)


def run_off_target(records: Sequence[dict[str, Any]]) -> tuple[str, str]:
    run_offs = sum(bool(r["run_off"]) for r in records)
    failed = sum(1 for r in records if r.get("failure") and not r["run_off"])
    ok = None if not records else run_offs == 0 and failed == 0
    return (verdict(ok), f"{run_offs} run-offs, {failed} other failures in {len(records)} fits")


def error_targets(at: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Mean ≤ 2 % and median ≤ 1 % at σ = 0.02, over the fits that finished (a failed fit
    misses both)."""
    means = [r["mean_rel_error"] for r in at if r["mean_rel_error"] is not None]
    medians = [r["median_rel_error"] for r in at if r["median_rel_error"] is not None]
    mean = float(np.mean(means)) if means else None
    median = float(np.median(medians)) if medians else None
    complete = bool(at) and len(means) == len(at)
    over = f"over {len(means)} of {len(at)} seeds"
    return [
        ("mean error ≤ 2 % (σ = 0.02)",
         verdict(None if not at else complete and mean <= MEAN_TARGET),
         f"{percent(mean)} % {over}"),
        ("median error ≤ 1 % (σ = 0.02)",
         verdict(None if not at else complete and median <= MEDIAN_TARGET),
         f"{percent(median)} % {over}")]


def worst_field(record: dict[str, Any], hidden: Sequence[str]) -> float | None:
    """The largest relative L2 error of the hidden fields at t = 0; None if one is missing."""
    errors = [record["initial_fields"].get(f) for f in hidden]
    return None if None in errors else max(errors)


def fit_targets(at: Sequence[dict[str, Any]], hidden: Sequence[str],
                forecast: bool) -> list[tuple[str, str, str]]:
    """χ², hidden fields and forecast, each in every fit at σ = 0.02."""
    chi2 = [r["reduced_chi2"] for r in at]
    fields = [worst_field(r, hidden) for r in at] if hidden else []
    valid = [r.get("forecast_valid_active_ms") for r in at]
    return [
        ("reduced χ² in [0.8, 1.5] (σ = 0.02)", verdict(all_within(chi2, *CHI2_TARGET)),
         ", ".join(number(c) for c in chi2) or "—"),
        (f"hidden fields {'/'.join(hidden) or '—'} at t = 0 ≤ 10 % L2 (σ = 0.02)",
         verdict(all_within(fields, 0.0, FIELD_TARGET) if hidden else None),
         "worst per fit " + (", ".join(percent(f) for f in fields) or "—") + " %"),
        ("forecast valid ≥ 500 ms (σ = 0.02)",
         verdict(all_within(valid, FORECAST_TARGET, math.inf) if forecast else None),
         ", ".join(number(v, "g") for v in valid) + " ms" if forecast else "--forecast 0"),
    ]


def coverage_targets(records: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """85–100 % of the parameter × seed pairs covered, at each σ > 0."""
    rows = []
    for sigma, rs in by_sigma(records).items():
        if sigma == 0:
            continue
        covered, total = pooled_coverage(rs)
        # A fit without intervals misses it: the issue asks for intervals that hold.
        ok = all_within([covered / total], *COVERAGE_TARGET) if total else False
        rows.append((f"95 % intervals cover 85–100 % (σ = {sigma:g})", verdict(ok),
                     f"{covered}/{total}" if total else "no intervals"))
    return rows


def targets(records: Sequence[dict[str, Any]], hidden: Sequence[str],
            forecast: bool) -> list[tuple[str, str, str]]:
    """(target, reached / missed / not measured, the numbers) for each target of issue 24."""
    at = [r for r in records if math.isclose(r["sigma"], TARGET_SIGMA)]
    return [("no run-off in any fit", *run_off_target(records)), *error_targets(at),
            *fit_targets(at, hidden, forecast), *coverage_targets(records)]


def targets_text(rows: Sequence[tuple[str, str, str]]) -> str:
    return "\n".join(["targets (issue 24):",
                      *[f"- {name}: **{status}** ({numbers})" for name, status, numbers in rows]])


# -- the run ------------------------------------------------------------------------------------


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.01, 0.02, 0.05])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs", type=Path, default=None,
                        help="run directories (default runs/bench/realistic/<experiment>)")
    parser.add_argument("--output", type=Path, default=None,
                        help="default benchmarks/results/realistic_<experiment>.json")
    parser.add_argument("--forecast", type=float, default=None,
                        help="forecast horizon in ms (default the experiment's "
                             "evaluate.horizon; 0: no forecast)")
    parser.add_argument("--start", choices=("perturbed", "truth"), default="perturbed",
                        help="perturbed: the experiment's start (fit.perturb.seed = each seed); "
                             "truth: every fitted value at the truth (the dataset's parameters "
                             "and its first frame without noise), a diagnostic: does the fit "
                             "stay there?")
    parser.add_argument("--fit-only", nargs="+", default=[], metavar="OVERRIDE",
                        help="Hydra overrides for the fits but not the dataset (e.g. a "
                             "smoothed model fitted to the sharp model's data); with a "
                             "changed model use --forecast 0, since the forecast's truth "
                             "is simulated with the fit's config")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    args.runs = args.runs or Path("runs/bench/realistic") / args.experiment
    args.output = args.output or Path(f"benchmarks/results/realistic_{args.experiment}.json")
    return args


def truth_start(cfg, dataset: Path, where: Path) -> Path:
    """A ``fitted.npz`` for ``fit.start_from`` that holds the truth: the fitted parameters at
    the dataset's ``true_params``, the fitted initial fields at its first frame with the drawn
    noise taken off (``pdefit.fitting.initial_fields.true_initial_fields``)."""
    system = components.make_system(cfg.system)
    true = zd.open_dataset(dataset).meta.true_params
    specs = system.params
    arrays = {}
    for name in cfg.fit.params:
        arrays[f"physical/{name}"] = np.float64(true[name])
        arrays[f"params/{name}"] = np.asarray(specs[name].to_unconstrained(true[name]))
    fields, _ = fitted_fields(cfg)
    for name, value in true_initial_fields(dataset, fields, None, 0).items():
        arrays[f"fields/{name}"] = np.asarray(value)
    where.mkdir(parents=True, exist_ok=True)
    np.savez(where / "fitted.npz", **arrays)
    return where


def fitted_fields(cfg) -> tuple[list[str], list[str]]:
    """(the fitted initial fields, those of them not observed: the hidden ones)."""
    fitted = [f for f, how in (cfg.fit.initial_fields or {}).items() if how == "fit"]
    return fitted, [f for f in fitted if f not in cfg.observe.fields]


def write(result: dict[str, Any], output: Path, fields: list[str], hidden: list[str],
          forecast: bool) -> str:
    """The JSON (every record so far) and its Markdown table with the targets; the text."""
    text = (f"{table(result['records'], fields)}\n\n"
            f"{targets_text(targets(result['records'], hidden, forecast))}")
    result.update(load_average=os.getloadavg(), table=text)  # docs/make_results.py shows it
    output.write_text(json.dumps(result, indent=1))
    output.with_suffix(".md").write_text(
        f"# realistic: {result['experiment']} on {result['grid']}²\n\n{text}\n")
    return text


def main() -> None:
    args = arguments()
    base = [f"experiment={args.experiment}", f"system.grid.shape=[{args.grid},{args.grid}]",
            "run.progress=false", "run.plots=false", "run.resume=false", *args.overrides]
    cfg = config(base)
    # None (neither --forecast nor evaluate.horizon): pdefit-evaluate's 4 × the training window.
    horizon = args.forecast if args.forecast is not None else cfg.evaluate.horizon
    fields, hidden = fitted_fields(cfg)
    result = {"experiment": args.experiment, "grid": args.grid, "overrides": args.overrides,
              "fit_only": args.fit_only, "start": args.start,
              "forecast_horizon_ms": horizon, "fitted_fields": fields, "hidden_fields": hidden,
              "host": platform.node(), "cpus": os.cpu_count(), "records": []}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for sigma in args.sigmas:
        runs = args.runs / f"sigma-{sigma:g}"
        try:
            dataset, failed = simulate(base, sigma, runs), None
        except Exception as err:  # every seed of this σ gets the failure; the others go on
            dataset, failed = None, failure_record(err)
            print(f"σ = {sigma:g}: no data: {failed['failure']}", flush=True)
        start = ([f"fit.start_from={truth_start(cfg, dataset, runs / 'truth')}"]
                 if dataset and args.start == "truth" else [])
        for seed in args.seeds:
            record = {"sigma": sigma, **(
                one_fit([*base, *noise_overrides(sigma), *start, *args.fit_only], dataset, seed,
                        runs / f"seed-{seed}",
                        horizon) if dataset else
                {**failed, "seed": seed, "wall_s": 0.0, "cpu_s": 0.0, "run_dir": None})}
            result["records"].append(record)
            write(result, args.output, fields, hidden, horizon != 0)
            print(table_header(fields)[0], table_row(record, fields), sep="\n", flush=True)
    print(write(result, args.output, fields, hidden, horizon != 0))
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
