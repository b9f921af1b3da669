"""The estimate after a fit of initial fields: its field solves batched, against one at a time.

What it measures
----------------
After a fit with fitted initial fields, pdefit solves the field block of the Gauss–Newton
matrix for k + 1 right-hand sides (the Schur complement's columns and the reduced gradient,
:mod:`pdefit.fitting.marginal`) and for the degrees of freedom for signal's probes
(:mod:`pdefit.fitting.signal`). Each solve is up to ``marginal.ITERATIONS`` conjugate-gradient
steps, each step one tangent and one adjoint sweep of the model. ``batch_size`` runs several
solves under one ``vmap``: their tangents and adjoints share one primal sweep, and a GPU runs
them side by side. This script times both parts at each ``--batch-sizes`` (0: all at once;
1: one after another, as before) in one process on one problem, the first call (compiling
included) and a second one, and checks that the results agree.

The problem: ``--experiment`` at ``--grid`` with ``--frames`` frames (its data simulated
here), at its starting point (the first guess; the solves cost the same at any point when
they run to their cap, which ``--iterations`` sets for every mode alike).

How to run
----------
    python benchmarks/estimate_batching.py --experiment bocf_from_voltage --grid 64
    python benchmarks/estimate_batching.py --experiment ap_from_voltage --grid 32 --frames 41

Prints a table and writes ``benchmarks/results/estimate_batching.json`` (``--output``).
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
from hydra import compose, initialize_config_dir

from pdefit.app.config import as_options, register_configs
from pdefit.fitting import assemble, marginal, signal

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def setup(experiment: str, grid: int, frames: int, workdir: Path,
          overrides: tuple[str, ...] = ()) -> assemble.FitSetup:
    """The experiment's fit at ``grid``² over ``frames`` frames (one stage), its data
    simulated in ``workdir``; ``overrides`` more Hydra overrides."""
    overrides = [f"experiment={experiment}", f"system.grid.shape=[{grid},{grid}]",
                 f"simulate.n_frames={frames}", "fit.stages=null", f"run.dir={workdir}",
                 *overrides]
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = as_options(compose(config_name="fit", overrides=overrides))
    dtype = assemble.set_precision(cfg.precision)
    dataset = workdir / "data.zarr"
    assemble.simulate_dataset(cfg, dataset, dtype, log=lambda _: None)
    return assemble.build_fit(cfg, dataset, dtype)


def timed(call: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call()
    jax.block_until_ready(jax.tree.leaves(result))
    return result, time.perf_counter() - started


def measure(fit: assemble.FitSetup, batch_size: int | None, iterations: int,
            ) -> dict[str, Any]:
    problem, batch, theta = fit.problem, fit.batch, fit.theta0
    record: dict[str, Any] = {"batch_size": batch_size or "all"}
    for part, call in (
            ("schur", lambda: marginal.marginal_parts(problem, theta, batch, iterations,
                                                      batch_size)),
            ("signal", lambda: signal.field_signal(problem, theta, batch,
                                                   iterations=iterations,
                                                   batch_size=batch_size))):
        result, first = timed(call)
        _, second = timed(call)
        record[part] = {"first_s": first, "second_s": second}
        record[f"{part}_result"] = result
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--iterations", type=int, default=marginal.ITERATIONS)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/estimate_batching.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        fit = setup(args.experiment, args.grid, args.frames, Path(workdir))
        records = [measure(fit, size or None, args.iterations) for size in args.batch_sizes]
    reference = records[0]["schur_result"].schur
    for record in records:
        schur = record.pop("schur_result").schur
        block = record.pop("signal_result")
        record["schur_max_rel_diff"] = float(np.max(np.abs(schur - reference))
                                             / np.max(np.abs(reference)))
        record["signal_dof"] = block["signal_dof"]
        record["solves_at_cap"] = block["solves_at_cap"]
    lines = ["| batch | Schur first s | Schur second s | signal first s | signal second s | "
             "Schur max rel diff | signal dof |", "|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['batch_size']} | {r['schur']['first_s']:.1f} | "
                     f"{r['schur']['second_s']:.1f} | {r['signal']['first_s']:.1f} | "
                     f"{r['signal']['second_s']:.1f} | {r['schur_max_rel_diff']:.1e} | "
                     f"{r['signal_dof']:.6g} |")
    table = "\n".join(lines)
    print(f"{args.experiment} {args.grid}², {args.frames} frames, {fit.problem.n_steps} steps, "
          f"CG at most {args.iterations} iterations, {jax.devices()[0].device_kind}")
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "experiment": args.experiment, "grid": args.grid, "frames": args.frames,
        "steps": fit.problem.n_steps, "iterations": args.iterations,
        "device": jax.devices()[0].device_kind, "host": platform.node(),
        "cpus": os.cpu_count(), "records": records, "table": table}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
