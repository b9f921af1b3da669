"""Benchmark of pdefit's adjoint schedules against diffrax's checkpointed adjoint.

What it measures
----------------
One Aliev–Panfilov fit problem per (grid size n, number of steps N): an n×n grid with dx = 1 and
no-flux boundaries, forward Euler with dt = 0.05, float32, the spiral initial state of
``AlievPanfilov().initial_state(grid, AP96, seed=0)``; u and v observed every 20 steps (the
initial state included) against reference frames made by one forward run with the AP96
parameters; an MSE misfit as in :mod:`pdefit.fitting.observe`; the loss is evaluated and
differentiated with respect to the 7 scalar parameters (and, with ``--grad-x0``, the initial
field) at a point perturbed by a few percent from AP96, so the gradient is not zero.

For each pdefit schedule (``StoreAll``, ``Nested(levels)``, ``Revolve(snapshots)``) the loss chain
is built exactly as :class:`pdefit.fitting.problem.FitProblem` builds it: ``step`` is
``pdefit.model.system.stepper(system, grid, "euler")`` at t = n·dt, and ``cost`` is
``Observation.cost``, which looks the step up in a step → slot table and adds the misfit under
``lax.cond`` inside the time loop, so pdefit never stores a trajectory.

The diffrax run solves the same ODE system (the same ``AlievPanfilov.rhs``) with
``diffrax.Euler()``, the same dt, ``t0 = 0``, ``t1 = N·dt``, ``max_steps = N`` and
``adjoint=RecursiveCheckpointAdjoint(checkpoints=s)`` with s = ``--snapshots`` (the Revolve
snapshot count). Its observation loss is computed from ``SaveAt(ts=observation times)``: the saved
frames (N/20 + 1 states) are materialised, because that is how an observation loss is written
with diffrax; their memory is part of its temporary memory. The two codes integrate the same
scheme: the table's last two columns give the relative difference of the loss and of the gradient
(componentwise for the parameters; relative to the largest entry for an initial-field gradient)
against pdefit's ``StoreAll`` (or ``Revolve`` where ``StoreAll`` was skipped).

For every method it reports: compile time (lower + compile of the gradient function), forward
time (the jitted loss alone), gradient time (the jitted ``value_and_grad``), their ratio, the
temporary memory of the compiled gradient (``compiled.memory_analysis().temp_size_in_bytes``;
inputs and outputs are not included), and for pdefit the gradient time relative to diffrax's.
Once per grid size it also times the two kernels every schedule is made of (one step with its
cost, one step's VJP) in plain ``lax.scan`` loops; for Revolve the column ``/model`` divides the
gradient time by advances × step + N × VJP, the work its plan cannot avoid, so what remains is
executor overhead. Every method is compiled and run once (warm-up), then the methods are timed
in ``--repeats`` interleaved rounds (gradient once, forward three times per round), each run
ended by ``jax.block_until_ready``, so that load from other processes falls on all of them alike.
The table shows the minimum (``--statistic median`` for the median; both are in the JSON),
because the machine may be shared: the JSON records the load average after each configuration,
the commit and the package files modified at start.

Targets (from the issue) checked at the end: Revolve gradient time ≤ 0.7 × diffrax at equal
snapshots; Revolve gradient/forward ≤ (N + extra)/N + 2, where extra is the number of
recomputed steps beyond the first forward sweep (``revolve_recomputations(N, s)`` counts every
advance of the plan, the first sweep's N − 1 included, so extra = that − (N − 1)); Revolve
memory flat in N.

``StoreAll`` keeps every state; where its compiled gradient would need more than
``--max-store-all-gb`` of temporary memory it is compiled (to report the memory) but not run.

How to run
----------
From the repository root, with the ``bench`` extra (diffrax, equinox) installed::

    python benchmarks/adjoint.py --quick               # smoke test, 64², N ∈ {200, 400}
    python benchmarks/adjoint.py --sizes 128           # 128², N ∈ {500, 1000, 2000, 4000}
    python benchmarks/adjoint.py                       # the issue's grid: 128² and 256²

Options: ``--steps``, ``--snapshots``, ``--schedules``, ``--nested-levels``, ``--repeats``,
``--statistic``, ``--every``, ``--dt``, ``--grad-x0``, ``--max-store-all-gb``, ``--no-diffrax``,
``--out`` (JSON, default ``benchmarks/results/adjoint.json``; it is rewritten after every
configuration, so an interrupted run keeps what it finished).
On the 2-core development machine (shared, load 2–4) the full default grid took about 7 minutes:
128² about 2.5, 256² about 4.5 (``StoreAll`` runs at 128² up to N = 2000 and at 256² only for
N = 500; it needs about 1.1 MiB per step at 128²). ``--sizes 128`` and ``--sizes 256`` can be run
separately.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.adjoint import LossChain, Nested, Revolve, StoreAll, revolve_recomputations
from pdefit.fitting.observe import Observation, ObservedData, observed_data
from pdefit.fitting.problem import FitProblem
from pdefit.model.params import ParameterLayout
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov

SCHEDULES = ("store_all", "nested", "revolve")
# Revolve with a named executor ("revolve" is Revolve's default, "auto": segments on a CPU).
REVOLVE_EXECUTORS = ("revolve_segments", "revolve_branch_free")
FIELDS = ("u", "v")
DTYPE = jnp.float32
MiB = 2.0**20
GiB = 2.0**30
# The forward is cheap next to the gradient and is the denominator of grad/forward: time it
# more often so that its statistic is as steady as the gradient's.
FORWARD_RUNS_PER_ROUND = 3

Pytree = Any


# ---------------------------------------------------------------------------------------------
# The problem.


@dataclass(frozen=True)
class Setup:
    """Everything one (size, N) configuration needs, arrays included."""

    size: int
    n_steps: int
    dt: float
    every: int
    grid: Grid
    system: AlievPanfilov
    x0: dict[str, jax.Array]
    theta: dict[str, jax.Array]      # where the loss is evaluated (perturbed AP96)
    data: ObservedData               # pdefit's in-loop observation data (one experiment)
    frames: dict[str, jax.Array]     # the same observed frames, (n_frames, n, n), for diffrax
    frame_steps: tuple[int, ...]
    observation: Observation


_INITIAL_STATES: dict[int, dict[str, jax.Array]] = {}


def initial_state(system: AlievPanfilov, grid: Grid) -> dict[str, jax.Array]:
    """The seeded spiral of the AP system, cached per grid size."""
    size = grid.shape[0]
    if size not in _INITIAL_STATES:
        state = system.initial_state(grid, AP96, seed=0)
        _INITIAL_STATES[size] = {f: jnp.asarray(state[f], DTYPE) for f in FIELDS}
    return _INITIAL_STATES[size]


def make_setup(size: int, n_steps: int, dt: float, every: int) -> Setup:
    if n_steps % every:
        raise ValueError(f"N={n_steps} is not a multiple of the observation interval {every}")
    system = AlievPanfilov()
    grid = Grid((size, size), (1.0, 1.0))
    x0 = initial_state(system, grid)
    true = {k: jnp.asarray(v, DTYPE) for k, v in AP96.items()}
    factors = np.random.default_rng(1).uniform(0.95, 1.05, len(AP96))
    theta = {k: jnp.asarray(v * f, DTYPE) for (k, v), f in zip(AP96.items(), factors, strict=True)}
    step = stepper(system, grid, "euler")
    frames = jax.jit(simulate, static_argnums=(0, 5, 6))(step, x0, true, 0.0, dt, n_steps, every)
    frames = {f: frames[f] for f in FIELDS}
    frame_steps = tuple(range(0, n_steps + 1, every))
    observation = Observation(FIELDS)
    observed = observed_data(observation, {f: np.asarray(frames[f])[None] for f in FIELDS},
                             dict.fromkeys(FIELDS), frame_steps, n_steps, DTYPE)
    data = ObservedData(  # drop the experiment axis: one experiment, as FitProblem does per vmap
        {f: v[0] for f, v in observed.values.items()},
        {f: w[0] for f, w in observed.weights.items()},
        {f: s[0] for f, s in observed.scale.items()},
        observed.slot_of_step,
    )
    return Setup(size, n_steps, dt, every, grid, system, x0, theta, data, frames, frame_steps,
                 observation)


def pdefit_chain(setup: Setup) -> LossChain:
    """The loss chain exactly as a fit builds it
    (:meth:`pdefit.fitting.problem.FitProblem.chain`)."""
    layout = ParameterLayout.build(setup.system.params, AP96, [])
    problem = FitProblem(system=setup.system, grid=setup.grid, dt=setup.dt, integrator="euler",
                         n_steps=setup.n_steps, layout=layout, observation=setup.observation,
                         schedule=StoreAll())
    return problem.chain()


def make_schedule(name: str, snapshots: int, levels: int) -> StoreAll | Nested | Revolve:
    if name == "store_all":
        return StoreAll()
    if name == "nested":
        return Nested(levels)
    if name == "revolve":
        return Revolve(snapshots)
    if name in REVOLVE_EXECUTORS:
        return Revolve(snapshots, name.removeprefix("revolve_"))
    raise ValueError(f"unknown schedule {name!r}; choose from {SCHEDULES}")


def pdefit_loss(setup: Setup, schedule: StoreAll | Nested | Revolve
                ) -> Callable[[Pytree, Pytree, ObservedData], jax.Array]:
    chain = pdefit_chain(setup)
    n_steps = setup.n_steps

    def loss(theta, x0, data):
        return schedule.loss(chain, x0, theta, data, n_steps)

    return loss


def diffrax_loss(setup: Setup, checkpoints: int
                 ) -> Callable[[Pytree, Pytree, dict[str, jax.Array]], jax.Array]:
    import diffrax  # the `bench` extra; imported here so --no-diffrax works without it

    system, grid = setup.system, setup.grid
    term = diffrax.ODETerm(lambda t, y, args: system.rhs(y, args, t, grid))
    ts = jnp.asarray(setup.frame_steps, DTYPE) * jnp.asarray(setup.dt, DTYPE)
    t1 = setup.n_steps * setup.dt

    def loss(theta, x0, frames):
        solution = diffrax.diffeqsolve(
            term, diffrax.Euler(), t0=0.0, t1=t1, dt0=setup.dt, y0=x0, args=theta,
            saveat=diffrax.SaveAt(ts=ts),
            adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=checkpoints),
            max_steps=setup.n_steps,
        )
        # pdefit's "mse": per field, the mean square error over all observed points and frames.
        total = jnp.zeros((), DTYPE)
        for f in FIELDS:
            total = total + jnp.mean((solution.ys[f] - frames[f]) ** 2)
        return total

    return loss


# ---------------------------------------------------------------------------------------------
# Measuring.


@dataclass
class Timing:
    compile_s: float
    best_s: float | None  # the reported statistic (--statistic) of runs_s
    median_s: float | None
    min_s: float | None
    runs_s: list[float]
    temp_bytes: int | None


class Compiled(NamedTuple):
    executable: Any
    compile_s: float
    temp_bytes: int | None


def compile_for(fn: Callable, args: Sequence[Any]) -> Compiled:
    """``jax.jit(fn)`` lowered and compiled for ``args``, with the time that took and the
    compiled program's temporary memory."""
    start = time.perf_counter()
    executable = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    analysis = executable.memory_analysis()
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)
    return Compiled(executable, seconds, temp)


def time_once(executable: Any, args: Sequence[Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(executable(*args))
    return time.perf_counter() - start


def summarise(compiled: Compiled, runs: list[float], statistic: str) -> Timing:
    if not runs:
        return Timing(compiled.compile_s, None, None, None, [], compiled.temp_bytes)
    median, fastest = statistics.median(runs), min(runs)
    best = fastest if statistic == "min" else median
    return Timing(compiled.compile_s, best, median, fastest, runs, compiled.temp_bytes)


def max_relative_difference(a: Pytree, b: Pytree) -> float:
    """Largest over leaves of max|a − b| / max|b|: componentwise for the scalar parameters, and
    relative to the field's largest entry for a gradient field (whose many near-zero entries
    would make a pointwise ratio meaningless)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.abs(y).max()), float(np.finfo(np.float32).tiny))
        worst = max(worst, float(np.abs(x - y).max()) / scale)
    return worst


@dataclass
class StepCosts:
    """Per-step times of the two kernels every schedule is made of, from a plain ``lax.scan``
    of ``n_steps`` steps: one step with its in-loop cost, and one step's VJP (recomputing the
    step's linearisation, then the backward pass) with respect to the state and θ."""

    n_steps: int
    step_s: float
    vjp_s: float


def step_costs(setup: Setup, repeats: int, n_steps: int = 200) -> StepCosts:
    chain = pdefit_chain(setup)
    n_steps = min(n_steps, setup.n_steps)
    steps = jnp.arange(n_steps)

    def forward(theta, x0, data):
        def body(carry, n):
            x, total = carry
            return (chain.step(x, theta, n), total + chain.cost(x, theta, n, data)), None

        return jax.lax.scan(body, (x0, jnp.zeros((), DTYPE)), steps)[0]

    def vjps(theta, x0, data):
        def body(carry, n):
            xbar, thetabar = carry

            def transition(x, th):
                return chain.step(x, th, n), chain.cost(x, th, n, data)

            _, vjp = jax.vjp(transition, x0, theta)
            xbar, step_thetabar = vjp((xbar, jnp.ones((), DTYPE)))
            return (xbar, jax.tree.map(jnp.add, thetabar, step_thetabar)), None

        zero = jax.tree.map(jnp.zeros_like, theta)
        return jax.lax.scan(body, (x0, zero), steps)[0]

    inputs = (setup.theta, setup.x0, setup.data)
    timings = []
    for kernel in (forward, vjps):
        compiled = compile_for(kernel, inputs)
        jax.block_until_ready(compiled.executable(*inputs))
        timings.append(min(time_once(compiled.executable, inputs) for _ in range(3 * repeats)))
    return StepCosts(n_steps, timings[0] / n_steps, timings[1] / n_steps)


@dataclass
class Row:
    size: int
    n_steps: int
    method: str
    snapshots: int | None
    forward: Timing
    gradient: Timing
    loss: float | None
    grad_over_forward: float | None = None
    revolve_bound: float | None = None
    revolve_advances: int | None = None
    work_model_s: float | None = None
    over_diffrax: float | None = None
    loss_rel_diff: float | None = None
    grad_rel_diff: float | None = None
    skipped: str | None = None
    load_avg: float | None = None


def revolve_bound(n_steps: int, snapshots: int) -> tuple[float, int]:
    """(N + extra)/N + 2 with extra the steps recomputed beyond the first sweep, and the plan's
    total advances."""
    advances = revolve_recomputations(n_steps, min(snapshots, n_steps))
    extra = advances - (n_steps - 1)
    return (n_steps + extra) / n_steps + 2.0, advances


def run_configuration(setup: Setup, costs: StepCosts | None, args: argparse.Namespace
                      ) -> list[Row]:
    """Compile and warm up every method, then time them in interleaved rounds (each round runs
    every method's forward ``FORWARD_RUNS_PER_ROUND`` times and its gradient once), so that
    load from other processes on the machine falls on all methods alike."""
    size, n_steps = setup.size, setup.n_steps
    argnums = (0, 1) if args.grad_x0 else 0

    def log(message: str) -> None:
        print(f"  [{size}² N={n_steps}] {message}", flush=True)

    methods: list[tuple[str, Callable, tuple[Any, ...]]] = [
        (name, pdefit_loss(setup, make_schedule(name, args.snapshots, args.nested_levels)),
         (setup.theta, setup.x0, setup.data))
        for name in args.schedules
    ]
    if not args.no_diffrax:
        methods.append(("diffrax", diffrax_loss(setup, args.snapshots),
                        (setup.theta, setup.x0, setup.frames)))

    compiled: dict[str, tuple[Compiled, Compiled]] = {}
    skipped: dict[str, str] = {}
    values: dict[str, float] = {}
    losses: dict[str, float] = {}
    gradients: dict[str, Any] = {}
    for name, loss, inputs in methods:
        forward = compile_for(loss, inputs)
        gradient = compile_for(jax.value_and_grad(loss, argnums=argnums), inputs)
        compiled[name] = (forward, gradient)
        temp = gradient.temp_bytes
        if name == "store_all" and temp is not None and temp > args.max_store_all_gb * GiB:
            skipped[name] = (f"temp {temp / GiB:.1f} GiB > --max-store-all-gb "
                             f"{args.max_store_all_gb}")
        values[name] = float(jax.block_until_ready(forward.executable(*inputs)))  # warm-up
        if name not in skipped:
            value, grad = jax.block_until_ready(gradient.executable(*inputs))
            losses[name], gradients[name] = float(value), grad
        log(f"{name}: compiled in {forward.compile_s + gradient.compile_s:.1f} s, gradient temp "
            f"{'?' if temp is None else f'{temp / MiB:.1f}'} MiB"
            + (f"; not run ({skipped[name]})" if name in skipped else ""))

    runs: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, *_ in methods}
    for _ in range(args.repeats):
        for name, _, inputs in methods:
            forward, gradient = compiled[name]
            runs[name][0].extend(time_once(forward.executable, inputs)
                                 for _ in range(FORWARD_RUNS_PER_ROUND))
            if name not in skipped:
                runs[name][1].append(time_once(gradient.executable, inputs))

    rows: list[Row] = []
    for name, *_ in methods:
        forward = summarise(compiled[name][0], runs[name][0], args.statistic)
        gradient = summarise(compiled[name][1], runs[name][1], args.statistic)
        row = Row(size, n_steps, name,
                  None if name in ("store_all", "nested") else args.snapshots,
                  forward, gradient, values[name], skipped=skipped.get(name))
        if gradient.best_s is not None and forward.best_s:
            row.grad_over_forward = gradient.best_s / forward.best_s
        if name.startswith("revolve"):
            row.revolve_bound, row.revolve_advances = revolve_bound(n_steps, args.snapshots)
            if costs is not None:
                # The work the plan cannot avoid: every advance, plus one VJP per step.
                row.work_model_s = (row.revolve_advances * costs.step_s
                                    + n_steps * costs.vjp_s)
        rows.append(row)
        log(f"{name}: forward {forward.best_s * 1e3:.0f} ms, gradient "
            + ("not run" if gradient.best_s is None else f"{gradient.best_s * 1e3:.0f} ms"))

    diffrax_row = next((r for r in rows if r.method == "diffrax"), None)
    if diffrax_row is not None and diffrax_row.gradient.best_s:
        for r in rows:
            if r is not diffrax_row and r.gradient.best_s is not None:
                r.over_diffrax = r.gradient.best_s / diffrax_row.gradient.best_s

    reference = next((s for s in ("store_all", "revolve", *REVOLVE_EXECUTORS, "nested")
                      if s in gradients), None)
    if reference is not None:
        for r in rows:
            if r.method in gradients:
                r.loss_rel_diff = abs(losses[r.method] - losses[reference]) / abs(
                    losses[reference])
                r.grad_rel_diff = max_relative_difference(gradients[r.method],
                                                          gradients[reference])
    load = os.getloadavg()[0]
    for r in rows:
        r.load_avg = load
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting.


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[Row]) -> str:
    header = ("size", "N", "method", "s", "fwd ms", "grad ms", "grad/fwd", "bound", "/diffrax",
              "/model", "temp MiB", "compile s", "loss rel", "grad rel")
    lines = []
    for r in rows:
        lines.append((
            f"{r.size}²", str(r.n_steps), r.method + (" *" if r.skipped else ""),
            _fmt(r.snapshots, "d"),
            _fmt(None if r.forward.best_s is None else r.forward.best_s * 1e3, ".1f"),
            _fmt(None if r.gradient.best_s is None else r.gradient.best_s * 1e3, ".1f"),
            _fmt(r.grad_over_forward, ".2f"), _fmt(r.revolve_bound, ".2f"),
            _fmt(r.over_diffrax, ".2f"),
            _fmt(None if r.work_model_s is None or r.gradient.best_s is None
                 else r.gradient.best_s / r.work_model_s, ".2f"),
            _fmt(None if r.gradient.temp_bytes is None else r.gradient.temp_bytes / MiB, ".1f"),
            _fmt(r.gradient.compile_s, ".1f"), _fmt(r.loss_rel_diff, ".1e"),
            _fmt(r.grad_rel_diff, ".1e"),
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    left = {2}
    def render(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    out = [render(header), "  ".join("-" * w for w in widths)]
    previous = None
    for r, line in zip(rows, lines, strict=True):
        if previous is not None and (r.size, r.n_steps) != previous:
            out.append("")
        previous = (r.size, r.n_steps)
        out.append(render(line))
    return "\n".join(out)


def targets(rows: Sequence[Row]) -> dict[str, Any]:
    """The issue's three targets, evaluated on the Revolve rows."""
    revolve = [r for r in rows if r.method == "revolve"]
    speed, ratio, memory = [], [], {}
    for r in revolve:
        if r.over_diffrax is not None:
            speed.append({"size": r.size, "n_steps": r.n_steps, "over_diffrax": r.over_diffrax,
                          "ok": r.over_diffrax <= 0.7})
        if r.grad_over_forward is not None and r.revolve_bound is not None:
            ratio.append({"size": r.size, "n_steps": r.n_steps,
                          "grad_over_forward": r.grad_over_forward,
                          "bound": r.revolve_bound, "ok": r.grad_over_forward <= r.revolve_bound})
        memory.setdefault(r.size, []).append(r.gradient.temp_bytes)
    flat = {}
    for size, temps in memory.items():
        temps = [t for t in temps if t is not None]
        if temps:
            spread = max(temps) / min(temps)
            flat[str(size)] = {"temp_bytes": temps, "max_over_min": spread, "ok": spread <= 1.1}
    return {"grad_time_le_0.7_diffrax": speed, "grad_over_forward_le_bound": ratio,
            "memory_flat_in_N": flat}


def print_targets(result: dict[str, Any]) -> None:
    def verdict(items: Sequence[dict[str, Any]]) -> str:
        if not items:
            return "not measured"
        bad = [i for i in items if not i["ok"]]
        return "met" if not bad else f"MISSED in {len(bad)} of {len(items)}"

    print("\nTargets (Revolve):")
    speed = result["grad_time_le_0.7_diffrax"]
    print(f"  gradient time <= 0.7 x diffrax:      {verdict(speed)}"
          + ("" if not speed else "  (ratios " + ", ".join(
              f"{i['size']}²/{i['n_steps']}: {i['over_diffrax']:.2f}" for i in speed) + ")"))
    print(f"  gradient/forward <= (N+extra)/N + 2: "
          f"{verdict(result['grad_over_forward_le_bound'])}")
    flat = result["memory_flat_in_N"]
    print(f"  memory flat in N (max/min <= 1.1):   {verdict(list(flat.values()))}"
          + "".join(f"  {size}²: {v['max_over_min']:.3f}" for size, v in flat.items()))


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }
    try:
        import diffrax
        import equinox

        info["diffrax"] = diffrax.__version__
        info["equinox"] = equinox.__version__
    except ImportError:
        pass
    return info


def source_info() -> dict[str, Any]:
    """The commit the benchmark started on and the package files that differed from it then
    (the package is imported at start, so later edits do not affect the run)."""
    root = Path(__file__).resolve().parent.parent

    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=root, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "modified": git("status", "--porcelain", "--", "pdefit", "systems").splitlines()}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": None}


def row_dict(r: Row) -> dict[str, Any]:
    return asdict(r)


def write_json(path: Path, args: argparse.Namespace, rows: Sequence[Row],
               costs: dict[int, StepCosts], source: dict[str, Any], complete: bool,
               started: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "adjoint",
        "command": [sys.executable, *sys.argv],
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
        "source": source,
        "complete": complete,
        "elapsed_s": time.perf_counter() - started,
        "notes": {
            "times": "seconds; median and min of the timed runs after one warm-up run "
                     f"(`repeats` rounds, methods interleaved; forward {FORWARD_RUNS_PER_ROUND}"
                     " runs per round); best_s and all ratios use config.statistic",
            "temp_bytes": "compiled.memory_analysis().temp_size_in_bytes of the gradient "
                          "function (arguments and outputs not included)",
            "revolve_bound": "(N + extra)/N + 2, extra = revolve_recomputations(N, s) - (N - 1)",
            "diffrax": "frames saved with SaveAt(ts=observation times); they count in its temp",
            "rel_diff": "against store_all, or revolve where store_all did not run",
            "work_model_s": "revolve: advances x step_s + N x vjp_s from step_costs, the work "
                            "the plan cannot avoid; gradient time / work_model_s is overhead",
            "load_avg": "1-minute load average after the configuration (other processes on "
                        "the machine make times noisy when it exceeds the core count)",
        },
        "step_costs": {str(size): asdict(c) for size, c in costs.items()},
        "results": [row_dict(r) for r in rows],
        "targets": targets(rows),
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="pdefit adjoint schedules vs diffrax RecursiveCheckpointAdjoint on "
                    "Aliev–Panfilov (float32).")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256],
                        help="grid sizes n (n×n)")
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 1000, 2000, 4000],
                        help="numbers of time steps N")
    parser.add_argument("--snapshots", type=int, default=32,
                        help="Revolve snapshots and diffrax checkpoints")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES + REVOLVE_EXECUTORS,
                        default=list(SCHEDULES),
                        help="revolve_segments / revolve_branch_free: Revolve with that executor "
                             "(revolve: the backend's default)")
    parser.add_argument("--nested-levels", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="which statistic of the timed runs the table and the ratios use "
                             "(both are in the JSON); min is the least disturbed by other load")
    parser.add_argument("--dt", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=20, help="observation interval in steps")
    parser.add_argument("--grad-x0", action="store_true",
                        help="differentiate with respect to the initial field too")
    parser.add_argument("--max-store-all-gb", type=float, default=4.0,
                        help="do not run StoreAll where its gradient needs more temp memory")
    parser.add_argument("--no-diffrax", action="store_true", help="pdefit schedules only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/adjoint.json"))
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: size 64, N 200 400, 1 repeat (overrides --sizes, "
                             "--steps, --repeats)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.repeats = [64], [200, 400], 1
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    source = source_info()
    info = machine_info()
    print(f"jax {info['jax']} on {info['device_kind']} ({info['cpu_count']} CPUs), "
          f"diffrax {info.get('diffrax', 'not installed')}; sizes {args.sizes}, N {args.steps}, "
          f"s = {args.snapshots}, dt = {args.dt}, observe every {args.every} steps", flush=True)
    rows: list[Row] = []
    costs: dict[int, StepCosts] = {}
    for size in args.sizes:
        for n_steps in args.steps:
            setup = make_setup(size, n_steps, args.dt, args.every)
            if size not in costs:
                c = costs[size] = step_costs(setup, args.repeats)
                print(f"  [{size}²] one step {c.step_s * 1e6:.1f} us, one step's VJP "
                      f"{c.vjp_s * 1e6:.1f} us (= {c.vjp_s / c.step_s:.2f} steps)", flush=True)
            rows.extend(run_configuration(setup, costs[size], args))
            write_json(args.out, args, rows, costs, source, complete=False, started=started)
    write_json(args.out, args, rows, costs, source, complete=True, started=started)
    print()
    print(table(rows))
    print(f"times: {args.statistic} of {args.repeats} runs; grad/fwd = gradient time / the same "
          "method's forward time; bound = (N + extra)/N + 2;\n/diffrax = gradient time / "
          "diffrax's; /model = gradient time / (advances x one step + N x one step's VJP), the "
          "work Revolve\ncannot avoid; loss rel, grad rel = largest relative difference vs "
          "store_all (revolve where store_all did not run);\n* = compiled for its memory, not run")
    print_targets(targets(rows))
    elapsed = time.perf_counter() - started
    print(f"\nwrote {args.out} in {elapsed:.0f} s ({math.ceil(elapsed / 60)} min)")


if __name__ == "__main__":
    main()
