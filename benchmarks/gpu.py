"""One command for the accelerator measurements of issue 17: forward, adjoint, fit step and
small systems, in one table headed with the device, and one JSON file.

What it measures
----------------
- ``bandwidth``: the device's copy bandwidths (read + write; :func:`forward.copy_bandwidth`,
  256 MiB; 16 MiB with ``--quick``, which may sit in a CPU's cache).
- ``forward``: BOCF TNNP, Rush–Larsen, float32 (:mod:`forward`), steps per second at each n and
  the fraction of the copy-bandwidth bound (32 n² bytes per step).
- ``adjoint``: Aliev–Panfilov, forward Euler, float32 (:mod:`adjoint`), store-all, nested and
  revolve with each executor (``segments``, ``branch_free``; see :class:`pdefit.adjoint.
  Revolve`): forward and gradient time, gradient / forward, and for revolve ``/model``, the
  gradient time over the work its plan cannot avoid (advances × one step + N × one step's
  VJP); ``/nested`` compares the two checkpointing schedules at equal N.
- ``fit step``: the default fit (Aliev–Panfilov, revolve) run by
  :func:`pdefit.fitting.train.run_fit`
  with L-BFGS and with Adam: seconds per optimiser step (the loop's own timestamps, compile
  excluded), loss evaluations per step (from ``metrics.jsonl``'s ``evaluations``, line search
  included), the time of one jitted value-and-gradient, and ``step / evaluations``: the step
  time over (evaluations per step × one evaluation), 1 when the loop adds nothing.
- ``small``: Rayleigh–Bénard (``experiment=rb_temperature_from_velocity``, 100²) and the sphere
  (``experiment=sphere_force_recovery``, 12 experiments on 32 × 64), via :func:`sphere.build`:
  the forward per time step (the jitted loss over its steps), value-and-gradient with
  revolve and with store-all, and the launches, FFTs, dots, custom calls and loops one step
  and its VJP execute in this device's optimised HLO (:func:`small_systems.op_columns`).

Every timed function runs once to compile; the table shows the best of ``--repeats`` runs.

How to run
----------
    python benchmarks/gpu.py              # the issue's sizes (on a GPU: a few minutes)
    python benchmarks/gpu.py --quick      # small sizes, runs on 2 CPU cores in about a minute
    python benchmarks/gpu.py --quick --only bandwidth forward

Writes ``benchmarks/results/gpu-<backend>.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adjoint as adjoint_bench  # the sibling scripts, reused
import forward as forward_bench
import small_systems
import sphere as sphere_bench

SECTIONS = ("bandwidth", "forward", "adjoint", "fit", "small")

FULL = {"copy_mib": 256, "forward_sizes": [256, 512, 1024, 2048], "forward_steps": 1000,
        "adjoint_sizes": [256, 512], "adjoint_steps": [1000, 4000], "snapshots": 32,
        "fit": [], "fit_steps": 30,
        "rb": [], "sphere": []}
QUICK = {"copy_mib": 16, "forward_sizes": [64], "forward_steps": 50,
         "adjoint_sizes": [32], "adjoint_steps": [100], "snapshots": 8,
         "fit": ["system.grid.shape=[24,24]", "simulate.n_frames=5",
                 "simulate.steps_per_frame=10"], "fit_steps": 8,
         "rb": ["system.grid.shape=[25,25]", "system.grid.spacing=[0.04,0.04]",
                "simulate.n_frames=4",
                "simulate.steps_per_frame=5"],
         "sphere": ["system.grid.shape=[16,32]", "simulate.n_experiments=2",
                    "simulate.n_frames=4", "simulate.steps_per_frame=2"]}

Row = dict[str, Any]


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of ``fn()`` (blocked on) over ``repeats`` runs after one warm-up."""
    jax.block_until_ready(fn())
    return min(sphere_bench.timed(fn) for _ in range(repeats))


def row(section: str, case: str, quantity: str, value: float | None, unit: str) -> Row:
    return {"section": section, "case": case, "quantity": quantity, "value": value,
            "unit": unit}


# -- sections ------------------------------------------------------------------------------------


def bandwidth_rows(state: dict[str, Any], mib: int) -> list[Row]:
    bandwidth = forward_bench.copy_bandwidth(mib * 2**20)
    state["bandwidth"] = max(bandwidth.values())
    return [row("bandwidth", kind, "read + write", value / 1e9, "GB/s")
            for kind, value in bandwidth.items()]


def forward_rows(state: dict[str, Any], sizes: Sequence[int], n_steps: int,
                 repeats: int, mib: int) -> list[Row]:
    if "bandwidth" not in state:
        bandwidth_rows(state, mib)
    rows = []
    for n in sizes:
        run = forward_bench.pdefit_runner(n, n_steps)
        x = {k: jax.numpy.asarray(v) for k, v in forward_bench.random_state(n).items()}
        rate = n_steps / best_time(lambda run=run, x=x: run(x), repeats)
        bound = state["bandwidth"] / (forward_bench.BYTES_PER_CELL * n * n)
        rows += [row("forward", f"BOCF {n}²", "steps/s", rate, "1/s"),
                 row("forward", f"BOCF {n}²", "of copy bound", 100 * rate / bound, "%")]
    return rows


def adjoint_rows(sizes: Sequence[int], steps: Sequence[int], snapshots: int,
                 repeats: int) -> list[Row]:
    args = adjoint_bench.parse_args([
        "--sizes", *map(str, sizes), "--steps", *map(str, steps), "--no-diffrax",
        "--schedules", "store_all", "nested", "revolve_segments", "revolve_branch_free",
        "--snapshots", str(snapshots), "--repeats", str(repeats), "--every",
        str(min(20, min(steps)))])
    rows = []
    for size in args.sizes:
        costs = None
        for n_steps in args.steps:
            setup = adjoint_bench.make_setup(size, n_steps, args.dt, args.every)
            costs = costs or adjoint_bench.step_costs(setup, args.repeats)
            results = {r.method: r for r in adjoint_bench.run_configuration(setup, costs, args)}
            case = f"AP {size}² N={n_steps}"
            for name, r in results.items():
                rows += [row("adjoint", case, f"{name} forward", r.forward.best_s * 1e3, "ms"),
                         row("adjoint", case, f"{name} gradient",
                             _scaled(r.gradient.best_s, 1e3), "ms"),
                         row("adjoint", case, f"{name} grad/fwd", r.grad_over_forward, "")]
            nested = results["nested"]
            for name in adjoint_bench.REVOLVE_EXECUTORS:
                revolve = results[name]
                if revolve.work_model_s and revolve.gradient.best_s:
                    rows.append(row("adjoint", case, f"{name} /model",
                                    revolve.gradient.best_s / revolve.work_model_s, ""))
                if revolve.gradient.best_s and nested.gradient.best_s:
                    rows.append(row("adjoint", case, f"{name}/nested",
                                    revolve.gradient.best_s / nested.gradient.best_s, ""))
    return rows


def fit_rows(overrides: Sequence[str], n_steps: int, repeats: int) -> list[Row]:
    from pdefit.fitting.train import run_fit
    from pdefit.options import OptimConfig

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        setup = sphere_bench.build(Path(tmp), [*overrides, "run.progress=false"], "revolve",
                                   experiment=None)
        problem, theta0, batch = setup.problem, setup.theta0, setup.batch
        value_and_grad = jax.jit(jax.value_and_grad(problem.loss))
        evaluation = best_time(lambda: value_and_grad(theta0, batch), repeats)
        case = f"AP {'×'.join(map(str, problem.grid.shape))} N={problem.n_steps}"
        rows.append(row("fit step", case, "value and gradient", evaluation * 1e3, "ms"))
        for name in ("lbfgs", "adam"):
            cfg = OptimConfig(name=name, steps=n_steps, grad_tol=0.0)
            _, history = run_fit(problem.loss, theta0, batch, cfg, progress=False,
                                 describe=problem.scalar_values, log=lambda _: None)
            records = history.records
            # Each difference is one step (the first record's time includes compiling).
            times = [b["time"] - a["time"] for a, b in itertools.pairwise(records)]
            per_step = statistics.median(times) if times else None
            evaluations = (float(np.mean([r["evaluations"] for r in records[1:]]))
                           if len(records) > 1 else None)
            rows += [row("fit step", case, f"{name} step", _scaled(per_step, 1e3), "ms"),
                     row("fit step", case, f"{name} evaluations/step", evaluations, ""),
                     row("fit step", case, f"{name} step/evaluations",
                         None if per_step is None else per_step / (evaluations * evaluation),
                         "")]
    return rows


def small_rows(experiment: str, label: str, overrides: Sequence[str],
               repeats: int) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        common = [*overrides, "run.progress=false", "run.plots=false"]
        setups = {s: sphere_bench.build(Path(tmp), common, s, experiment)
                  for s in ("revolve", "store_all")}
        problem = setups["revolve"].problem
        theta, batch = setups["revolve"].theta0, setups["revolve"].batch
        loss = jax.jit(problem.loss)
        forward = best_time(lambda: loss(theta, batch), repeats)
        case = f"{label} {'×'.join(map(str, problem.grid.shape))} N={problem.n_steps}"
        rows = [row("small", case, "forward per step", forward / problem.n_steps * 1e6, "µs")]
        for name, (fn, args) in small_systems.programs(setups).items():
            if name.startswith("step"):  # launches per step in this device's optimised HLO
                ops = small_systems.op_columns(fn.lower(*args).compile().as_text())
                rows += [row("small", case, f"{name}: {column}", ops[column], "")
                         for column in ("launches", "fft", "dot", "custom-call", "while")]
        for schedule, s in setups.items():
            grad = jax.jit(s.problem.value_and_grad)
            seconds = best_time(lambda grad=grad: grad(theta, batch), repeats)
            rows.append(row("small", case, f"value and gradient, {schedule}", seconds * 1e3,
                            "ms"))
    return rows


def _scaled(x: float | None, factor: float) -> float | None:
    return None if x is None else x * factor


# -- report --------------------------------------------------------------------------------------


def device_line() -> str:
    device = jax.devices()[0]
    return (f"device: {device.device_kind} (backend {jax.default_backend()}, "
            f"{jax.device_count()} device(s)); jax {jax.__version__}; {os.cpu_count()} CPUs")


def table(rows: Sequence[Row]) -> str:
    cells = [(r["section"], r["case"], r["quantity"],
              "-" if r["value"] is None else f"{r['value']:.4g}", r["unit"]) for r in rows]
    header = ("section", "case", "quantity", "value", "unit")
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]

    def render(line: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i == 3 else c.ljust(w)
                         for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()

    return "\n".join([render(header), "  ".join("-" * w for w in widths),
                      *(render(c) for c in cells)])


def run(sections: Sequence[str], sizes: dict[str, Any], repeats: int) -> list[Row]:
    state: dict[str, Any] = {}
    rows: list[Row] = []
    for section in sections:
        print(f"[{section}] …", flush=True)
        if section == "bandwidth":
            rows += bandwidth_rows(state, sizes["copy_mib"])
        elif section == "forward":
            rows += forward_rows(state, sizes["forward_sizes"], sizes["forward_steps"], repeats,
                                 sizes["copy_mib"])
        elif section == "adjoint":
            rows += adjoint_rows(sizes["adjoint_sizes"], sizes["adjoint_steps"],
                                 sizes["snapshots"], repeats)
        elif section == "fit":
            rows += fit_rows(sizes["fit"], sizes["fit_steps"], repeats)
        elif section == "small":
            rows += small_rows("rb_temperature_from_velocity", "RB", sizes["rb"], repeats)
            rows += small_rows("sphere_force_recovery", "sphere", sizes["sphere"], repeats)
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs after the warm-up (default 5; 1 with --quick)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON (default benchmarks/results/gpu-<backend>.json)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    sizes = QUICK if args.quick else FULL
    output = args.output or (Path(__file__).parent / "results"
                             / f"gpu-{jax.default_backend()}.json")
    started = time.perf_counter()
    print(device_line(), flush=True)
    rows = run(args.only, sizes, repeats)
    result = {
        "benchmark": "gpu", "command": [sys.executable, *sys.argv], "quick": args.quick,
        "repeats": repeats, "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(), "device_count": jax.device_count(),
        "jax": jax.__version__, "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0],
        "source": adjoint_bench.source_info(), "rows": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    print()
    print(device_line())
    print(table(rows))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output} in {result['elapsed_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
