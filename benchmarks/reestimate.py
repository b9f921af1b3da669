"""Re-estimate finished fits' 95 % intervals and score them against their dataset's truth.

What it measures
----------------
For each run directory given (a finished ``pdefit-fit`` run on a simulated dataset: its
``config.yaml``, ``summary.json`` and ``fitted.npz``), the fit is rebuilt at its end
(``fit.start_from=<run>``, one window, no stage holds) and the parameter intervals of
:func:`pdefit.fitting.uncertainty.estimate` are computed again, with the noise level the fit
itself took (``observe.noise_sigma`` or the dataset's record), once per ``--iterations`` cap
of the field solves (fitted initial fields only: :mod:`pdefit.fitting.marginal`). Against the
dataset's true parameters it prints, per run and cap:

* the fit's mean error and that of the Gauss–Newton optimum θ + δ the estimate points to
  (``optimum`` per parameter), with its median and max;
* how many of the 95 % intervals hold the truth: *centred* on the fitted value (θ ± q σ_θ,
  mapped through each parameter's transform), and *spanned* as shipped (from θ and θ + δ,
  q σ_θ beyond each: docs/design-decisions.md, "Parameter uncertainty");
* how many std errors are lower bounds only (their bracket open: the field solves stopped
  at their cap) and the estimate's wall time.

It is how docs/benchmarks.md, "Intervals that span the optimum", measured the coverage of the
``bocf_recovery`` fits, and how the field-solve cap's effect on the std errors was read.

How to run
----------
    python benchmarks/bocf_robustness.py --grid 64 --seeds 1 --sigmas 0.01 ...   # a fit
    python benchmarks/reestimate.py runs/bench/bocf_robustness/sigma-0.01/seed-1 \\
        --iterations 60 240

Writes ``benchmarks/results/reestimate.json`` (``--output``; the per-parameter rows too).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from omegaconf import OmegaConf

from pdefit import data as zd
from pdefit.app.config import as_options
from pdefit.fitting import assemble, marginal, outcome, uncertainty
from pdefit.options import ConfigError


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="finished run directories")
    parser.add_argument("--iterations", type=int, nargs="+", default=[marginal.ITERATIONS],
                        help="caps of the field solves' conjugate-gradient iterations")
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/reestimate.json"))
    args = parser.parse_args()
    for run in args.runs:
        for name in ("config.yaml", "summary.json", "fitted.npz"):
            if not (run / name).is_file():
                parser.error(f"{run}: no {name} (a finished pdefit-fit run directory)")
    if min(args.iterations) < 1:
        parser.error("--iterations: at least 1")
    return args


def rebuilt(run: Path) -> tuple[Any, dict[str, float], Any]:
    """(the fit rebuilt at the run's end, the dataset's true parameters, its noise record)."""
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.fit.start_from, cfg.fit.stages, cfg.fit.hold = str(run.absolute()), None, {}
    options = as_options(cfg)
    # A run that simulated its own data keeps them as <run>/data.zarr (data.path unset).
    path = Path(cfg.data.path) if cfg.data.get("path") else run / "data.zarr"
    cfg.data.path = str(path.absolute())
    setup = assemble.build_fit(options, path, assemble.set_precision(options.precision))
    # The rebuilt start must be the fitted point the run reported, or the scores are not its.
    reported = {r["name"]: r["recovered"] for r in
                json.loads((run / "summary.json").read_text())["parameters"]}
    for name, value in setup.start_values.items():
        if name in reported and not math.isclose(value, reported[name], rel_tol=1e-6):
            raise ConfigError(f"{run}: fit.start_from gives {name} = {value:.9g}, its "
                              f"summary.json {reported[name]:.9g}")
    meta = zd.open_dataset(path).meta
    if not meta.true_params:
        raise ConfigError(f"{run}: its dataset {path} records no true parameters to score")
    return setup, {k: float(v) for k, v in meta.true_params.items()}, meta.noise


def centred(spec: Any, z: float, std_error: float, quantile: float) -> list[float]:
    """The interval θ ± q σ_θ mapped to physical units (σ_θ from the delta method's std error)."""
    with jax.enable_x64(True):
        slope = uncertainty.mapped(spec, z)[1]
        return uncertainty.mapped(spec, z, quantile * std_error / abs(slope))[2]


def scored(setup: Any, block: dict[str, Any], truth: dict[str, float]) -> dict[str, Any]:
    """Each parameter's errors and whether its intervals hold the truth, and their totals."""
    quantile = block["quantile"]
    rows, specs = {}, setup.problem.layout.specs
    for name, row in block["parameters"].items():
        true = truth[name]
        has_interval = row["ci95_low"] is not None and row["std_error"]
        ends = (centred(specs[name], float(setup.theta0["params"][name]), row["std_error"],
                        quantile) if has_interval else None)
        rows[name] = {
            "value": row["value"], "true": true, "error": row["value"] / true - 1.0,
            "optimum_error": None if row["optimum"] is None else row["optimum"] / true - 1.0,
            "std_error": row["std_error"], "to_optimum": row["to_optimum"],
            "bracket_open": name in block["open_brackets"],
            "centred": ends, "centred_holds": bool(ends and ends[0] <= true <= ends[1]),
            "spanned": [row["ci95_low"], row["ci95_high"]] if has_interval else None,
            "spanned_holds": bool(has_interval and row["ci95_low"] <= true <= row["ci95_high"]),
            "flag": row["flag"]}
    errors = np.abs([r["error"] for r in rows.values()])
    optima = np.abs([r["optimum_error"] for r in rows.values() if r["optimum_error"] is not None])
    return {"parameters": rows, "mean_error": float(errors.mean()),
            "optimum_mean_error": float(optima.mean()) if optima.size else math.nan,
            "optimum_median_error": float(np.median(optima)) if optima.size else math.nan,
            "optimum_max_error": float(optima.max()) if optima.size else math.nan,
            "centred_holds": sum(r["centred_holds"] for r in rows.values()),
            "spanned_holds": sum(r["spanned_holds"] for r in rows.values()),
            "open_brackets": sum(r["bracket_open"] for r in rows.values()),
            "count": len(rows)}


def reestimate(run: Path, caps: list[int]) -> list[dict[str, Any]]:
    """One scored estimate of ``run`` per field-solve cap."""
    setup, truth, noise = rebuilt(run)
    problem, theta, batch = setup.problem, setup.theta0, setup.batch
    sigma, source = outcome.noise_level(problem, noise)
    results = []
    for cap in caps if problem.fitted_fields else caps[:1]:
        started = time.perf_counter()
        parts = uncertainty.curvature_parts(problem, theta, batch, cap)
        block = uncertainty.estimate(problem, theta, batch, sigma, parts=parts, source=source)
        if not block.get("available"):
            raise ConfigError(f"{run}: no intervals ({block.get('reason')})")
        results.append({"run": str(run), "iterations": cap if problem.fitted_fields else None,
                        "wall_s": time.perf_counter() - started, "sigma": block["sigma"],
                        "noise_source": source, **scored(setup, block, truth)})
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| run | solve cap | fit mean % | optimum mean % (median / max) | 95 % cover, "
             "centred | spanned | open brackets | estimate wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['run']} | {r['iterations'] or '—'} | {100 * r['mean_error']:.3g} | "
            f"{100 * r['optimum_mean_error']:.3g} ({100 * r['optimum_median_error']:.3g} / "
            f"{100 * r['optimum_max_error']:.3g}) | {r['centred_holds']}/{r['count']} | "
            f"{r['spanned_holds']}/{r['count']} | {r['open_brackets']} | {r['wall_s']:.0f} |")
    by_cap: dict[Any, list[dict[str, Any]]] = {}
    for r in results:
        by_cap.setdefault(r["iterations"], []).append(r)
    for cap, group in by_cap.items():
        pairs = sum(r["count"] for r in group)
        lines.append(f"\n- solve cap {cap or '—'}, {len(group)} run(s): centred "
                     f"{sum(r['centred_holds'] for r in group)}/{pairs}, spanned "
                     f"{sum(r['spanned_holds'] for r in group)}/{pairs}")
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    results = []
    for run in args.runs:
        for result in reestimate(run, sorted(set(args.iterations))):
            results.append(result)
            print(f"{run} (cap {result['iterations']}): centred {result['centred_holds']}/"
                  f"{result['count']}, spanned {result['spanned_holds']}/{result['count']}, "
                  f"{result['wall_s']:.0f} s", flush=True)
    print(table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
