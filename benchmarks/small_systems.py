"""Launches and CPU time per step of the latency-bound systems (issue 17, item 4):
Rayleigh–Bénard (``experiment=rb_temperature_from_velocity``, 100²) and the sphere
(``experiment=sphere_force_recovery``, 12 experiments on 32 × 64).

What it measures
----------------
For each system, built through the configs by :func:`sphere.build` (one dataset, simulated
once into ``--data``):

- ``ops``: the operations of the optimised HLO (``jit(f).lower(...).compile().as_text()``)
  that one time step executes, for the step of all experiments (``step``) and for its VJP
  (``step vjp``, one reversed step of the adjoint: the step again and its transpose). Each
  top-level instruction of the entry, of loop bodies and of branches counts as one launch
  (a fusion is one, whatever it fuses); loop bodies count as many times as their known trip
  count. Columns: ``fft``, ``dot`` and ``custom-call`` (also those inside fusions: a GPU runs
  each as a library call; a GPU compiler may turn dots into custom calls to its BLAS),
  ``fusion``, ``while``, and ``launches``, every top-level instruction but parameters,
  constants, tuples, ``get-tuple-element`` and bitcasts. On the CPU backend the counts come
  from the CPU compiler, whose fusion decisions differ from a GPU's; ``benchmarks/gpu.py``
  prints the same counts from the device it runs on.
- ``time``: process CPU time (all threads) of the jitted misfit over the window, per step
  (``forward``), and of one value-and-gradient with revolve and with store-all; the minimum
  over ``--repeats`` interleaved runs after a compile run. Wall time is recorded beside it.

``--baseline PYTHON`` measures the same with another interpreter too (a checkout of the old
code with its own environment, e.g. ``git worktree add /tmp/base <ref> && make -C /tmp/base
setup``), alternating rounds of fresh processes between the two, and prints both side by side:
before/after in one run on a shared machine.

How to run
----------
    python benchmarks/small_systems.py                          # issue sizes (minutes on 2 cores)
    python benchmarks/small_systems.py --quick                  # small sizes, about a minute
    python benchmarks/small_systems.py --baseline /tmp/base/.venv/bin/python --rounds 3

Writes ``benchmarks/results/small_systems.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CASES = {  # name → (experiment, overrides at the size, overrides of --quick)
    "rb": ("rb_temperature_from_velocity", [],
           ["system.grid.shape=[25,25]", "system.grid.spacing=[0.04,0.04]",
            "simulate.n_frames=4", "simulate.steps_per_frame=5"]),
    "sphere": ("sphere_force_recovery", [],
               ["system.grid.shape=[16,32]", "simulate.n_experiments=2", "simulate.n_frames=4",
                "simulate.steps_per_frame=2"]),
}
COLUMNS = ("fft", "dot", "custom-call", "fusion", "while", "launches")
LIBRARY = frozenset({"fft", "dot", "custom-call"})
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})
OPCODE = re.compile(r" = .*?\s([a-z][a-z0-9\-]*)\(")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


# -- HLO op counts -------------------------------------------------------------------------------


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of each computation of an HLO module's text, and the entry's
    name."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        match = COMPUTATION.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and " = " in line:
            bodies[current].append(line)
    return bodies, entry


def executed_ops(hlo: str) -> Counter:
    """Opcode → how many times one run of the module executes it at the top level: loop
    bodies weighted by their known trip count (1 where it is not known), the larger branch of
    a conditional; fusions and reducers count as their one instruction."""
    bodies, entry = _computations(hlo)

    def walk(name: str, weight: int, counts: Counter, fused: bool = False) -> None:
        for line in bodies.get(name, []):
            match = OPCODE.search(re.sub(r"/\*.*?\*/", "", line))
            if not match:
                continue
            opcode = match.group(1)
            if fused:  # inside a fusion only what a GPU runs as a library call counts
                counts[f"fused {opcode}"] += weight if opcode in LIBRARY else 0
                continue
            counts[opcode] += weight
            if opcode == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", line)
                if callee:
                    walk(callee.group(1), weight, counts, fused=True)
            elif opcode == "while":
                trips = TRIP_COUNT.search(line)
                n = int(trips.group(1)) if trips else 1
                body = re.search(r"body=%?([\w.\-]+)", line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                if body:
                    walk(body.group(1), weight * n, counts)
                if cond:
                    walk(cond.group(1), weight * (n + 1), counts)
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")]
                         if branches else re.findall(r"_computation=%?([\w.\-]+)", line))
                sub = []
                for b in names:
                    c: Counter = Counter()
                    walk(b, weight, c)
                    sub.append(c)
                if sub:
                    counts.update(max(sub, key=lambda c: sum(c.values())))
            elif opcode == "call":
                callee = re.search(r"to_apply=%?([\w.\-]+)", line)
                if callee:
                    walk(callee.group(1), weight, counts)

    counts: Counter = Counter()
    walk(entry, 1, counts)
    return counts


def op_columns(hlo: str) -> dict[str, int]:
    """The table's columns: ``fft`` and ``dot`` count those inside fusions too (the CPU
    compiler fuses dots with their operands; a GPU calls a library for each)."""
    counts = executed_ops(hlo)
    launches = sum(n for op, n in counts.items() if op not in FREE and not op.startswith("fused"))
    columns = {c: counts.get(c, 0) + counts.get(f"fused {c}", 0) for c in COLUMNS[:-1]}
    return {**columns, "launches": launches}


# -- the programs --------------------------------------------------------------------------------


def programs(setups: dict[str, Any]) -> dict[str, tuple[Callable, tuple]]:
    """name → (jitted function, arguments): one step of all experiments and its VJP, the
    misfit over the window, and value-and-gradient with each schedule."""
    import jax
    import jax.numpy as jnp

    setup = setups["revolve"]
    problem, theta, batch = setup.problem, setup.theta0, setup.batch
    shared, own = problem.layout.split(problem.physical_params(theta))
    x0 = problem.initial_state(theta, batch)
    chain = problem.chain()

    def step_all(x, shared, own, n):
        return jax.vmap(lambda x_e, own_e: chain.step(x_e, {**shared, **own_e}, n))(x, own)

    def step_vjp(x, shared, own, n, cotangent):
        _, vjp = jax.vjp(lambda x_, s, o: step_all(x_, s, o, n), x, shared, own)
        return vjp(cotangent)

    n = jnp.asarray(1, jnp.int32)
    out = {"step": (jax.jit(step_all), (x0, shared, own, n)),
           "step vjp": (jax.jit(step_vjp), (x0, shared, own, n, x0)),
           "forward": (jax.jit(problem.loss), (theta, batch))}
    for schedule, s in setups.items():
        out[f"value and gradient, {schedule}"] = (jax.jit(s.problem.value_and_grad),
                                                  (s.theta0, s.batch))
    return out


def cpu_and_wall(fn: Callable[[], Any]) -> tuple[float, float]:
    import jax

    cpu, wall = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(case: str, quick: bool, data: Path, repeats: int, count_ops: bool) -> dict[str, Any]:
    """One worker's measurements of one system (see the module docstring)."""
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sphere as sphere_bench

    experiment, full, small = CASES[case]
    overrides = [*(small if quick else full), "run.progress=false", "run.plots=false"]
    data.mkdir(parents=True, exist_ok=True)
    setups = {s: sphere_bench.build(data, overrides, s, experiment)
              for s in ("revolve", "store_all")}
    problem = setups["revolve"].problem
    timed = programs(setups)
    result: dict[str, Any] = {
        "case": case, "grid": list(problem.grid.shape), "n_steps": problem.n_steps,
        "n_experiments": int(jax.tree.leaves(setups["revolve"].batch.observed.values)[0]
                             .shape[0]),
        "dtype": str(jax.tree.leaves(problem.initial_state(setups["revolve"].theta0,
                                                           setups["revolve"].batch))[0].dtype),
        "ops": {}, "cpu_s": {}, "wall_s": {}}
    if count_ops:
        for name in ("step", "step vjp"):
            fn, args = timed[name]
            result["ops"][name] = op_columns(fn.lower(*args).compile().as_text())
    calls = {name: (lambda fn=fn, args=args: fn(*args)) for name, (fn, args) in timed.items()
             if not name.startswith("step")}
    for call in calls.values():
        jax.block_until_ready(call())  # compile
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            runs[name].append(cpu_and_wall(call))
    for name, values in runs.items():
        result["cpu_s"][name] = min(c for c, _ in values)
        result["wall_s"][name] = min(w for _, w in values)
    return result


# -- driver --------------------------------------------------------------------------------------


def worker(python: str, case: str, args: argparse.Namespace, data: Path,
           count_ops: bool) -> dict[str, Any]:
    command = [python, str(Path(__file__).resolve()), "--worker", case, "--data", str(data),
               "--repeats", str(args.repeats)]
    command += ["--quick"] if args.quick else []
    command += ["--count-ops"] if count_ops else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one interpreter and case: op counts of the round that counted them, the
    minimum time of every round."""
    out = dict(results[0])
    out["ops"] = next((r["ops"] for r in results if r["ops"]), {})
    for key in ("cpu_s", "wall_s"):
        out[key] = {name: min(r[key][name] for r in results) for name in results[0][key]}
    return out


def table(measured: dict[str, dict[str, dict[str, Any]]]) -> str:
    versions = list(measured)
    lines = []
    for case in next(iter(measured.values())):
        first = measured[versions[0]][case]
        lines.append(f"\n{case}: {'×'.join(map(str, first['grid']))}, "
                     f"{first['n_experiments']} experiment(s), {first['n_steps']} steps, "
                     f"{first['dtype']}")
        lines.append(f"{'HLO ops per step':24s} {'version':9s}"
                     + "".join(f"{c:>12s}" for c in COLUMNS))
        for program in first["ops"]:
            for v in versions:
                ops = measured[v][case]["ops"][program]
                lines.append(f"{program:24s} {v:9s}" + "".join(f"{ops[c]:12d}" for c in COLUMNS))
        lines.append(f"{'time (min over runs)':40s} {'version':9s} {'CPU':>12s} {'wall':>12s}")
        for program in first["cpu_s"]:
            per_step = program == "forward"
            scale, unit = (1e6 / first["n_steps"], "µs/step") if per_step else (1e3, "ms")
            for v in versions:
                r = measured[v][case]
                lines.append(f"{program + ' (' + unit + ')':40s} {v:9s} "
                             f"{r['cpu_s'][program] * scale:12.1f} "
                             f"{r['wall_s'][program] * scale:12.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per round")
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per version")
    parser.add_argument("--baseline", default=None, metavar="PYTHON",
                        help="also measure with this interpreter (the old code), alternating")
    parser.add_argument("--data", type=Path, default=None,
                        help="directory for the simulated datasets (default: a temporary one)")
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "small_systems.json")
    parser.add_argument("--worker", choices=list(CASES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--count-ops", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = measure(args.worker, args.quick, args.data, args.repeats, args.count_ops)
        print(json.dumps(result))
        return result

    pythons = {"new": sys.executable}
    if args.baseline:
        pythons = {"old": args.baseline, **pythons}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp)
        rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
            v: {c: [] for c in args.cases} for v in pythons}
        for k in range(args.rounds):
            for case in args.cases:
                for version, python in pythons.items():
                    rounds[version][case].append(
                        worker(python, case, args, data / case, count_ops=k == 0))
    measured = {v: {c: merge(r) for c, r in cases.items()} for v, cases in rounds.items()}
    result = {"benchmark": "small_systems", "command": [sys.executable, *sys.argv],
              "quick": args.quick, "repeats": args.repeats, "rounds": args.rounds,
              "pythons": pythons, "load_average": os.getloadavg()[0],
              "cpu_count": os.cpu_count(), "results": measured,
              "elapsed_s": time.perf_counter() - started}
    print(table(measured))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output} in {result['elapsed_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
