"""The misfit at the truth: how much of a fit's residual its own time stepping makes.

What it measures
----------------
An experiment's dataset is simulated as ``benchmarks/realistic.py`` makes it (the
experiment's stepping refined by ``simulate.refine.dt_factor``, additive noise σ = ``--sigma``).
Then, for each fit stepping of ``--steppings`` (``integrator:steps per frame``), the data
misfit of the fit's model **at the truth** — the dataset's true parameters and its first frame
of every field with the drawn noise taken off (``realistic.truth_start``) — over the whole
window, in units of σ² (per observed value; the experiment's loss is a mean over values).
No optimiser runs: this is the floor a fit at that stepping cannot go below at the truth. Near
1 the stepping is fine enough for the residual to be noise; well above 1 a fit either ends with
a reduced χ² above the noise or moves the parameters away from the truth to make up for the
stepping (a bias the intervals do not contain).

How to run
----------
    python benchmarks/truth_misfit.py                              # bocf_from_voltage, 64²
    python benchmarks/truth_misfit.py --experiment ap_from_voltage --grid 32 \\
        --steppings heun:20 heun:40 euler:20

Extra Hydra overrides after ``--`` go to the dataset and every fit. Prints a Markdown table and
writes ``benchmarks/results/truth_misfit_<experiment>.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax

# The sibling benchmarks' config, dataset and truth (this directory is on the path when the
# script runs).
from bocf_robustness import config, noise_overrides, simulate
from realistic import truth_start

from pdefit import data as zd
from pdefit.app.config import to_options
from pdefit.fitting import assemble
from pdefit.options import FitConfig


def misfit_at_truth(base: list[str], dataset: Path, truth: Path, integrator: str,
                    per_frame: int, frame_interval: float) -> float:
    """The data misfit (mean over observed values) of the truth (``truth``: its
    ``fitted.npz``) stepped by ``integrator`` at ``frame_interval / per_frame``; the whole
    window as one stage."""
    # One window (assemble.build_fit applies no stage holds; null drops them).
    stepping = [f"data.path={dataset}", "fit.stages=null", "fit.hold=null",
                f"system.dt={frame_interval / per_frame!r}", f"system.integrator={integrator}",
                f"fit.start_from={truth}"]
    options = to_options(config([*base, *stepping]), FitConfig)
    setup = assemble.build_fit(options, dataset, assemble.set_precision(options.precision))
    return float(jax.jit(setup.problem.data_loss)(setup.theta0, setup.batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=0.02)
    parser.add_argument("--steppings", nargs="+",
                        default=["heun:7", "heun:14", "heun:28", "heun:70", "euler:14",
                                 "rush_larsen:14"])
    parser.add_argument("--runs", type=Path, default=Path("runs/bench/truth_misfit"))
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    output = args.output or Path(f"benchmarks/results/truth_misfit_{args.experiment}.json")
    base = [f"experiment={args.experiment}", f"system.grid.shape=[{args.grid},{args.grid}]",
            "run.progress=false", "run.plots=false", *noise_overrides(args.sigma),
            *args.overrides]
    dataset = simulate(base, args.sigma, args.runs / args.experiment)
    meta = zd.open_dataset(dataset).meta
    frame_interval = meta.dt * meta.steps_per_frame
    # The truth does not depend on the fit's stepping: one file for every row.
    truth = truth_start(config([*base, f"data.path={dataset}"]), dataset,
                        args.runs / args.experiment / "truth")
    rows = []
    print(f"{args.experiment} {args.grid}², σ = {args.sigma:g}, data at dt = {meta.dt:.4g} "
          f"({meta.steps_per_frame} steps per frame of {frame_interval:g})")
    print("| integrator | steps per frame | dt | misfit at the truth | / σ² | s |")
    print("|---|---|---|---|---|---|")
    for stepping in args.steppings:
        integrator, per_frame = stepping.split(":")
        started = time.perf_counter()
        misfit = misfit_at_truth(base, dataset, truth, integrator, int(per_frame),
                                 frame_interval)
        seconds = time.perf_counter() - started
        ratio = misfit / args.sigma**2 if args.sigma else None
        rows.append({"integrator": integrator, "steps_per_frame": int(per_frame),
                     "dt": frame_interval / int(per_frame), "misfit": misfit,
                     "misfit_over_sigma2": ratio, "seconds": seconds})
        print(f"| {integrator} | {per_frame} | {frame_interval / int(per_frame):.4g} | "
              f"{misfit:.4g} | {'—' if ratio is None else f'{ratio:.3f}'} | {seconds:.1f} |",
              flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"experiment": args.experiment, "grid": args.grid,
                                  "sigma": args.sigma, "data_dt": meta.dt,
                                  "frame_interval": frame_interval, "host": platform.node(),
                                  "overrides": args.overrides, "rows": rows}, indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
