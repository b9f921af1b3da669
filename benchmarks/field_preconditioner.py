"""The field solves of the estimate and the reduced steps: preconditioned cell by cell or per field.

What it measures
----------------
The Schur complement of the fitted initial fields (:mod:`pdefit.fitting.marginal`, shared by
the intervals, the degrees of freedom for signal and ``optim.parameter_step=reduced``) solves
the fields' Gauss–Newton block G_xx for the k parameters' columns G_xp e_i by conjugate
gradients. This script solves those k systems twice on one problem, in one process: with
G_xx's diagonal cell by cell as the preconditioner (``marginal.field_block``, probed with
``marginal.PROBE_SPACING``² lattice probes per field, as shipped) and with one number per
field (the scaling of the fit's Levenberg–Marquardt steps, ``krylov.MatrixFree.diagonal``,
which the solves used before), and prints per column the iterations each took under the
shipped stopping test (lineax's: every entry of the residual within ``marginal.RTOL`` of the
right-hand side's, ``--cap`` at most; ``optim.reduced_solve_iterations`` is 100) and the
relative residual ‖G_xx x − b‖₂ / ‖b‖₂ where it stopped, with the time of both sets of
solves and of the probes. Columns the data do not see at this point (b = 0) need none.

The problem: ``--experiment`` at ``--grid`` with ``--frames`` frames (its data simulated
here, as ``benchmarks/estimate_batching.py`` makes them), at its start (the first guess of
the fields); ``--truth`` puts the parameters at the dataset's truth (the fields stay the
first guess).

How to run
----------
    python benchmarks/field_preconditioner.py --experiment bocf_from_voltage --grid 64 --frames 21
    python benchmarks/field_preconditioner.py --experiment ap_from_voltage --grid 32 --frames 41

Prints a table and writes ``benchmarks/results/field_preconditioner.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# The sibling benchmark's problem set-up (this directory is on the path).
from estimate_batching import setup, timed
from jax.flatten_util import ravel_pytree

from pdefit.fitting import krylov, marginal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--cap", type=int, default=100, help="iterations at most per solve")
    parser.add_argument("--truth", action="store_true",
                        help="the parameters at the dataset's truth")
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/field_preconditioner.json"))
    args = parser.parse_args()
    overrides = ("fit.perturb.low=1.0", "fit.perturb.high=1.0") if args.truth else ()
    with tempfile.TemporaryDirectory() as workdir:
        fit = setup(args.experiment, args.grid, args.frames, Path(workdir), overrides)
    problem, batch, theta = fit.problem, fit.batch, fit.theta0
    zero = jax.tree.map(jnp.zeros_like, theta)
    flat, unravel = ravel_pytree(theta["params"])
    # the columns in ravel_pytree's order (a dict's keys sorted), not the layout's
    names = [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in
             jax.tree_util.tree_leaves_with_path(theta["params"])]
    (fields_only, cells), probe_s = timed(lambda: marginal.field_block(problem, theta, batch))
    per_field = krylov.MatrixFree(problem).diagonal(theta, batch, jax.random.key(0),
                                                   np.arange(0))["fields"]

    def column(unit):
        return krylov.gauss_newton_product(problem, theta, batch,
                                           {**zero, "params": unravel(unit)})["fields"]

    columns = marginal.batched(column, jnp.eye(flat.shape[0], dtype=flat.dtype), None, batch)
    def norm(tree):
        return jnp.sqrt(sum(jnp.vdot(leaf, leaf) for leaf in jax.tree.leaves(tree)))

    steps, residuals, seconds = {}, {}, {}
    for kind, scale in (("cells", cells), ("per field", per_field)):
        def solve(rhs, scale=scale):
            solution = marginal.field_solution(fields_only, rhs, scale, args.cap)
            left = jax.tree.map(jnp.subtract, fields_only(solution.value), rhs)
            return solution.stats["num_steps"], norm(left) / jnp.maximum(norm(rhs), 1e-300)
        (counts, relative), seconds[kind] = timed(
            lambda solve=solve: marginal.batched(solve, columns, None, batch))
        steps[kind] = [int(n) for n in counts]
        residuals[kind] = [float(r) if n > 0 else 0.0 for n, r in zip(counts, relative,
                                                                      strict=True)]
    spread = {f: [float(jnp.min(d)), float(jnp.median(d)), float(jnp.max(d))]
              for f, d in cells.items()}
    def cell(kind, i):
        n = steps[kind][i]
        return f"{n}{'+' if n >= args.cap else ''}, {residuals[kind][i]:.1e}"

    lines = ["| column | cells: iterations, ‖r‖/‖b‖ | per field: iterations, ‖r‖/‖b‖ |",
             "|---|---|---|"]
    lines += [f"| {name} | {cell('cells', i)} | {cell('per field', i)} |"
              for i, name in enumerate(names)]
    lines.append(f"| all k solves, s | {seconds['cells']:.1f} (+ {probe_s:.1f} probes, "
                 f"{marginal.probe_count(theta['fields'])} products) | "
                 f"{seconds['per field']:.1f} |")
    table = "\n".join(lines)
    print(f"{args.experiment} {args.grid}², {args.frames} frames, {problem.n_steps} steps, "
          f"{'truth' if args.truth else 'start'} parameters, first-guess fields; to relative "
          f"residual {marginal.RTOL:g} entry by entry ('+': stopped at the cap of {args.cap}), "
          f"{jax.devices()[0].device_kind}")
    print(table)
    print("cells' diagonal, min / median / max per field: " + "; ".join(
        f"{f} {lo:.2g} / {mid:.2g} / {hi:.2g}" for f, (lo, mid, hi) in spread.items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "experiment": args.experiment, "grid": args.grid, "frames": args.frames,
        "steps": problem.n_steps, "truth": args.truth, "cap": args.cap, "rtol": marginal.RTOL,
        "columns": names, "iterations": steps, "relative_residual": residuals,
        "solve_s": seconds, "probe_s": probe_s,
        "diagonal_min_median_max": spread, "device": jax.devices()[0].device_kind,
        "host": platform.node(), "cpus": os.cpu_count(), "table": table}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
