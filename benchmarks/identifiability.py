"""How well the data determine the parameters at all: the Laplace bound at the truth.

What it measures
----------------
A fit's error has two parts: where the optimum of the data lies (noise and the fit's model
error move it off the truth) and how far the optimiser stops from that optimum. This script
measures the first, with no optimiser. It simulates the experiment's dataset (as
``benchmarks/realistic.py`` does: the finer stepping, additive noise σ), puts the fit at the
truth — the dataset's true parameters and its noise-free first frame of every fitted field
(``realistic.truth_start``) — and, for each window of ``--frames`` frames, forms the Schur
complement S of the parameters with the initial fields marginalised over
(:mod:`pdefit.fitting.marginal`, the fit's own prior on the fields, its field solves capped
at ``--iterations``), then reads from the fit's own estimate
(:func:`pdefit.fitting.uncertainty.estimate`, σ known):

- **std %**: each parameter's standard error relative to its value, σ·√(a S⁻¹)ᵢᵢ through its
  transform — the spread of the optimum over noise draws (a Cramér–Rao-type bound in the
  Gauss–Newton approximation: no unbiased fit does better on average);
- **to the optimum %**: the Gauss–Newton step from the truth to this dataset's optimum,
  −½ S⁻¹ g (g: the reduced gradient at the truth), relative to the value — where a fit that
  found the optimum would stand for this noise draw;
- **std within %**: the bracket of the std % that holds however far the field solves got
  (``std_error_bounds`` of the estimate, :func:`pdefit.fitting.marginal.marginal_parts`):
  from below by the variational Schur complement S⁺ ⪰ S, from above by S⁻ ⪯ S from the
  solves' residuals and the prior's curvature floor ("∞": S⁻ does not bound it). Where the
  solves do not resolve S the estimate gives no std, but the bracket still says what the
  data can and cannot tell: a lower end above 2 % puts the target out of reach, an upper end
  below it within;
- the unresolved solves and the near-singular directions the estimate names.

Where a parameter's std % is above the issue's 2 %, no fit reaches 2 % on it but by luck. The
window's field prior is the experiment's σ_b (``--background-sd``, 0.3 per cell), set per
window as field_background = σ² / (n σ_b²) for n frames, as the experiment's comment does for
its 101. Extra Hydra overrides after ``--`` go to the dataset and every window's problem (e.g.
``system.options.heaviside_gradient_width=0.01``: the sharp model's derivatives through a
logistic, as the all-fields reduced steps use; without it the thresholds' derivatives are the
exact ones, zero almost everywhere).

How to run
----------
    python benchmarks/identifiability.py                                 # bocf_from_voltage 64²
    python benchmarks/identifiability.py --frames 21 41 101 -- \\
        system.options.heaviside_gradient_width=0.01
    python benchmarks/identifiability.py --experiment ap_from_voltage --grid 32

Prints a Markdown table per window and writes
``benchmarks/results/identifiability_<experiment>.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

# The sibling benchmarks' config, dataset and truth (this directory is on the path).
from bocf_robustness import config, noise_overrides, simulate
from realistic import truth_start

from pdefit.app.config import as_options
from pdefit.fitting import assemble, uncertainty


def window_overrides(frames: int, sigma: float, background_sd: float) -> list[str]:
    """One window of ``frames`` frames from t = 0, one stage, at the truth, its field prior
    of ``background_sd`` per cell."""
    listed = ",".join(str(i) for i in range(frames))
    return [f"data.frames=[{listed}]", "fit.stages=null", "fit.hold={}",
            "fit.perturb.low=1.0", "fit.perturb.high=1.0",
            f"regularization.field_background={sigma**2 / (frames * background_sd**2):.6g}"]


def one_window(base: list[str], dataset: Path, truth: Path, frames: int, sigma: float,
               background_sd: float, iterations: int) -> dict[str, Any]:
    """The estimate at the truth on the first ``frames`` frames of ``dataset``."""
    cfg = as_options(config([*base, f"data.path={dataset}", f"fit.start_from={truth}",
                             *window_overrides(frames, sigma, background_sd)]))
    dtype = assemble.set_precision(cfg.precision)
    fit = assemble.build_fit(cfg, dataset, dtype)
    started = {n: fit.start_values[n] / fit.reference[n] - 1.0 for n in fit.start_values}
    if max(abs(e) for e in started.values()) > 1e-9:
        raise RuntimeError(f"the fit does not start at the truth: {started}")
    wall, cpu = time.perf_counter(), time.process_time()
    parts = uncertainty.curvature_parts(fit.problem, fit.theta0, fit.batch, iterations)
    block = uncertainty.estimate(fit.problem, fit.theta0, fit.batch, sigma=sigma, parts=parts)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows = {}
    for name, row in block["parameters"].items():
        truth_value = fit.reference[name]
        rel = row["rel_std_error"]
        offset = None
        if row["std_error"] is not None and row["to_optimum"] is not None:
            offset = row["to_optimum"] * row["std_error"] / abs(truth_value)
        low, high = row.get("std_error_bounds") or (None, None)
        rows[name] = {"truth": truth_value, "rel_std_error": rel, "to_optimum_rel": offset,
                      "to_optimum_std_errors": row["to_optimum"], "flag": row["flag"],
                      "rel_std_bounds": [None if b is None else b / abs(truth_value)
                                         for b in (low, high)]}
    return {"frames": frames, "steps": fit.problem.n_steps, "parameters": rows,
            "schur": np.asarray(parts.bread).tolist(),
            "schur_lower": None if parts.lower is None else np.asarray(parts.lower[0]).tolist(),
            "unresolved": list(parts.unresolved), "condition_number": block["condition_number"],
            "near_singular_directions": block["near_singular_directions"],
            "reduced_chi2_at_truth": parts.rss / parts.n_values / sigma**2 if sigma else None,
            "wall_s": wall, "cpu_s": cpu}


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.3g}"


def bracket(bounds: list[float | None]) -> str:
    """The std error's bracket in % ("0.05–∞": no upper bound from these solves)."""
    low, high = bounds
    return "—" if low is None else f"{100 * low:.3g}–" + ("∞" if high is None else
                                                           f"{100 * high:.3g}")


def table(records: list[dict[str, Any]]) -> str:
    names = list(records[0]["parameters"])
    head = "| parameter | " + " | ".join(
        f"{r['frames']} frames: std % | std within % | to the optimum %" for r in records) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(records)]
    for name in names:
        cells = []
        for r in records:
            row = r["parameters"][name]
            std = (percent(row["rel_std_error"]) if row["rel_std_error"] is not None
                   else "unresolved" if "resolved" in row["flag"] else row["flag"] or "—")
            cells += [std, bracket(row["rel_std_bounds"]), percent(row["to_optimum_rel"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| (misfit at the truth / σ², estimate s) | " + " | ".join(
        f"{r['reduced_chi2_at_truth']:.3g} | | {r['wall_s']:.0f} s" for r in records) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=0.02)
    parser.add_argument("--frames", type=int, nargs="+", default=[21, 41, 101])
    parser.add_argument("--iterations", type=int, default=200,
                        help="conjugate-gradient iterations at most per field solve")
    parser.add_argument("--background-sd", type=float, default=0.3,
                        help="the fields' prior standard deviation per cell")
    parser.add_argument("--output", type=Path)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = parser.parse_args()
    output = args.output or Path(f"benchmarks/results/identifiability_{args.experiment}.json")
    base = [f"experiment={args.experiment}", f"system.grid.shape=[{args.grid},{args.grid}]",
            *noise_overrides(args.sigma), *args.overrides]
    records = []
    with tempfile.TemporaryDirectory() as workdir:
        runs = Path(workdir)
        dataset = simulate(base, args.sigma, runs)
        truth = truth_start(as_options(config([*base, f"data.path={dataset}"])), dataset,
                            runs / "truth")
        for frames in args.frames:
            records.append(one_window(base, dataset, truth, frames, args.sigma,
                                      args.background_sd, args.iterations))
            print(f"{frames} frames: {records[-1]['wall_s']:.0f} s, unresolved "
                  f"{records[-1]['unresolved']}\n{table(records[-1:])}", flush=True)
    text = table(records)
    print(f"{args.experiment} {args.grid}², σ = {args.sigma:g}, at the truth, field solves "
          f"≤ {args.iterations} iterations, {' '.join(args.overrides) or 'no overrides'}, "
          f"{jax.devices()[0].device_kind}")
    print(text)
    for r in records:
        for d in r["near_singular_directions"]:
            print(f"{r['frames']} frames, near-singular: relative eigenvalue "
                  f"{d['relative_eigenvalue']:.2g}: " + ", ".join(
                      f"{n} {v:+.2f}" for n, v in d["parameters"].items()))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({
        "experiment": args.experiment, "grid": args.grid, "sigma": args.sigma,
        "iterations": args.iterations, "background_sd": args.background_sd,
        "overrides": args.overrides, "records": records, "table": text,
        "device": jax.devices()[0].device_kind, "host": platform.node(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg()}, indent=1, default=float))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
