"""Time stepping for BOCF: model error against a converged reference and cost per gradient.

What it measures
----------------
The seed paper's BOCF setup (by default): TNNP tissue on an n×n lattice (dx = 1, D = 0.1,
9-point Laplacian, no-flux), the S1–S2 spiral of ``BOCF(initial="s1s2")``, a 10 ms window with a
frame every 0.5 ms (21 frames) of all four fields, the published sharp thresholds
(``--heaviside-width`` to change), float64.

- **Reference**: ``--reference`` (default ``rush_larsen2``) at dt_ref = ``--ref-dt`` (default
  0.005 ms, 1/20 of 0.1 ms), checked against the same scheme at dt_ref/2; the table states that
  check's misfit, which must be far below every scheme's.
- **Model error** of each scheme ``method:dt`` (``--schemes``): the misfit at the true
  parameters against the reference frames, i.e. the loss a fit starts from at the truth
  (``mse``: mean squared difference summed over the four fields, as ``observe.loss=mse``),
  relative to the data's own variation (the same sum of the mean squared change of each field
  from frame 0), and the RMS error of u alone. The yardstick: the reference model's misfit
  with the 10 fitted parameters all ``--param-error`` (0.3 %) off.
- **Gradient cost**: the jitted ``value_and_grad`` of :meth:`pdefit.fitting.problem.FitProblem.loss`
  with respect to the 10 parameters of ``experiment=bocf_recovery`` (revolve, 32 snapshots, as
  the experiment runs), at the truth × 1.05, for every scheme in one process: each is compiled
  and run once, then timed in ``--repeats`` interleaved rounds (so that load from other
  processes falls on all of them alike); the table shows the minimum wall time and the minimum
  process CPU time (all threads; less sensitive to other processes on a shared machine), each
  with its ratio to the first scheme (Rush–Larsen at dt = 0.05 ms, the default before issue 14).

How to run
----------
From the repository root::

    python benchmarks/stepping.py                    # 64², the schemes of docs/results.md
    python benchmarks/stepping.py --size 32 --repeats 3 --schemes rush_larsen:0.05 \\
        rush_larsen2:0.1                             # a quick look

It prints the table (Markdown) and writes ``--out`` (JSON, default
``benchmarks/results/stepping.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pdefit.adjoint import Revolve  # noqa: E402
from pdefit.fitting.observe import Observation, observed_data  # noqa: E402
from pdefit.fitting.problem import Batch, FitProblem  # noqa: E402
from pdefit.model.params import ParameterLayout  # noqa: E402
from pdefit.model.system import check_time_step, stepper  # noqa: E402
from pdefit.numerics.grid import Grid  # noqa: E402
from pdefit.numerics.integrate import simulate  # noqa: E402
from pdefit.systems.bocf import BOCF, parameter_values  # noqa: E402

FITTED = ("u_s", "u_so", "k_so", "tau_so1", "tau_si", "k_s", "u_u", "theta_v", "D", "tau_fi")
FRAME_INTERVAL = 0.5  # ms
# dt = 0.5 ms / k for a whole number of steps per frame: 1/12 ms = 0.0833, 1/14 = 0.0714, 1/6.
DEFAULT_SCHEMES = ("rush_larsen:0.05", "rush_larsen:0.025", "heun:0.05", "rk4:0.05",
                   "rush_larsen2:0.05", "rush_larsen2:0.07142857142857142",
                   "rush_larsen2:0.08333333333333333", "rush_larsen2:0.1",
                   "heun:0.07142857142857142", "heun:0.1", "rk4:0.16666666666666666")


def parse_scheme(text: str) -> tuple[str, float]:
    method, dt = text.split(":")
    return method, float(dt)


def steps_per_frame(dt: float) -> int:
    ratio = FRAME_INTERVAL / dt
    if abs(ratio - round(ratio)) > 1e-9 * ratio:
        raise SystemExit(f"dt={dt} does not divide the frame interval {FRAME_INTERVAL} ms")
    return round(ratio)


def frames_of(system, grid, x0, params, method: str, dt: float, n_frames: int):
    every = steps_per_frame(dt)
    run = jax.jit(simulate, static_argnums=(0, 5, 6))
    frames = run(stepper(system, grid, method), x0, params, 0.0, dt, (n_frames - 1) * every,
                 every)
    return {k: np.asarray(v) for k, v in frames.items()}


def misfit(frames, reference) -> float:
    """Sum over fields of the mean squared difference (``observe.loss=mse``)."""
    return float(sum(np.mean((frames[f] - reference[f]) ** 2) for f in reference))


def variation(reference) -> float:
    """Sum over fields of the mean squared change from frame 0: the scale of the data."""
    return float(sum(np.mean((reference[f] - reference[f][:1]) ** 2) for f in reference))


def gradient_function(system, grid, x0, reference, method: str, dt: float, n_frames: int):
    every = steps_per_frame(dt)
    n_steps = (n_frames - 1) * every
    observation = Observation(system.fields)
    values = {f: reference[f][None] for f in system.fields}
    observed = observed_data(observation, values, {f: None for f in system.fields},
                             [j * every for j in range(n_frames)], n_steps, jnp.float64)
    truth = {**parameter_values("TNNP"), "D": 0.1}
    layout = ParameterLayout.build(system.params, truth, list(FITTED), system_name="bocf")
    problem = FitProblem(system=system, grid=grid, dt=dt, integrator=method, n_steps=n_steps,
                         layout=layout, observation=observation, schedule=Revolve(32))
    batch = Batch(observed, {f: x0[f][None] for f in system.fields})
    start = {**truth, **{n: truth[n] * 1.05 for n in FITTED}}
    theta = {"params": layout.unconstrained(start), "fields": {}}
    grad = jax.jit(jax.value_and_grad(problem.loss))
    return lambda: jax.block_until_ready(grad(theta, batch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--window", type=float, default=10.0, help="ms")
    parser.add_argument("--heaviside-width", type=float, default=0.0)
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                        help="method:dt; the first is the cost baseline")
    parser.add_argument("--reference", default="rush_larsen2")
    parser.add_argument("--ref-dt", type=float, default=0.005)
    parser.add_argument("--param-error", type=float, default=0.003,
                        help="the tolerance's yardstick: the reference model's misfit with "
                             "the 10 fitted parameters all this much (relative) off")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-cost", action="store_true", help="model errors only")
    parser.add_argument("--out", default="benchmarks/results/stepping.json")
    args = parser.parse_args(argv)

    system = BOCF(parameter_set="TNNP", laplacian="9pt", initial="s1s2",
                  heaviside_width=args.heaviside_width)
    grid = Grid((args.size, args.size), (1.0, 1.0), ("neumann", "neumann"))
    truth = {**parameter_values("TNNP"), "D": 0.1}
    params = {k: jnp.asarray(v) for k, v in truth.items()}
    x0 = {k: jnp.asarray(v, jnp.float64) for k, v in
          system.initial_state(grid, truth, seed=1).items()}
    n_frames = round(args.window / FRAME_INTERVAL) + 1
    schemes = [parse_scheme(s) for s in args.schemes]
    for method, dt in schemes:
        check_time_step(system, truth, grid, dt, method)

    started = time.perf_counter()
    reference = frames_of(system, grid, x0, params, args.reference, args.ref_dt, n_frames)
    finer = frames_of(system, grid, x0, params, args.reference, args.ref_dt / 2, n_frames)
    scale = variation(reference)
    check = misfit(reference, finer)
    print(f"reference {args.reference} at dt={args.ref_dt:g} ms vs dt={args.ref_dt / 2:g}: "
          f"misfit {check:.3e} ({check / scale:.2e} of the data's variation {scale:.3e}); "
          f"{time.perf_counter() - started:.1f} s", flush=True)

    off = {k: jnp.asarray(v * (1.0 + args.param_error) if k in FITTED else v)
           for k, v in truth.items()}
    yardstick = misfit(frames_of(system, grid, x0, off, args.reference, args.ref_dt, n_frames),
                       reference)
    print(f"misfit of the reference model with the fitted parameters × "
          f"{1 + args.param_error:g}: {yardstick:.3e}", flush=True)

    rows = []
    for method, dt in schemes:
        frames = frames_of(system, grid, x0, params, method, dt, n_frames)
        error = misfit(frames, reference)
        rows.append({"method": method, "dt": dt, "misfit": error, "relative": error / scale,
                     "u_rms": float(np.sqrt(np.mean((frames["u"] - reference["u"]) ** 2)))})
        print(f"{method}:{dt:g} misfit {error:.3e}", flush=True)

    if not args.no_cost:
        runs = [gradient_function(system, grid, x0, reference, m, dt, n_frames)
                for m, dt in schemes]
        for run in runs:  # compile and warm up
            run()
        walls, cpus = [[] for _ in runs], [[] for _ in runs]
        for _ in range(args.repeats):
            for run, wall, cpu in zip(runs, walls, cpus, strict=True):
                began, began_cpu = time.perf_counter(), time.process_time()
                run()
                wall.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
        for row, wall, cpu in zip(rows, walls, cpus, strict=True):
            row["grad_ms"] = 1e3 * min(wall)
            row["grad_ms_median"] = 1e3 * float(np.median(wall))
            row["grad_cpu_ms"] = 1e3 * min(cpu)
        for row in rows:
            row["cost_ratio"] = row["grad_ms"] / rows[0]["grad_ms"]
            row["cpu_cost_ratio"] = row["grad_cpu_ms"] / rows[0]["grad_cpu_ms"]

    print()
    print(f"BOCF TNNP {args.size}², D = 0.1, {args.window:g} ms window, {n_frames} frames, "
          f"heaviside_width={args.heaviside_width:g}; reference {args.reference} at "
          f"dt = {args.ref_dt:g} ms (its own misfit against dt/2: {check:.1e}); the reference "
          f"model with the 10 fitted parameters × {1 + args.param_error:g}: misfit "
          f"{yardstick:.1e}")
    print()
    print("| scheme | dt (ms) | misfit at truth | / data variation | u RMS error "
          "| ms per value+grad (wall) | cost ratio (wall) | CPU ms | cost ratio (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cost = (f"{row['grad_ms']:.0f} | {row['cost_ratio']:.2f}× | {row['grad_cpu_ms']:.0f} | "
                f"{row['cpu_cost_ratio']:.2f}×" if "grad_ms" in row else "— | — | — | —")
        print(f"| {row['method']} | {row['dt']:g} | {row['misfit']:.2e} | "
              f"{row['relative']:.1e} | {row['u_rms']:.1e} | {cost} |")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    out.write_text(json.dumps({
        "setup": {"size": args.size, "window_ms": args.window, "n_frames": n_frames,
                  "heaviside_width": args.heaviside_width, "reference": args.reference,
                  "ref_dt": args.ref_dt, "reference_check_misfit": check,
                  "data_variation": scale, "param_error": args.param_error,
                  "param_error_misfit": yardstick},
        "rows": rows, "repeats": args.repeats, "commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "device": str(jax.devices()[0]), "loadavg": os.getloadavg()},
        "jax": jax.__version__,
    }, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
