"""Five pieces pdefit writes by hand, each measured against a maintained library that offers it.

What it measures
----------------
1. ``revolve`` — pdefit's binomial checkpoint plan (:func:`pdefit.adjoint.revolve_plan`) against
   ``checkpoint_schedules`` (``MultistageCheckpointSchedule``, the binomial schedule, and
   ``Revolve``, its H-Revolve port) for (N steps, s snapshots) pairs: forward step
   evaluations (pdefit's advances plus the one step each reversal recomputes inside its VJP,
   which the library counts as a forward), snapshot writes, snapshots held at once, planning
   time. Then the library's action stream is translated into pdefit's integer plan and run
   by pdefit's jitted segment executor on a small chain with a time-dependent forcing: the
   gradient is compared with store-all and the time with pdefit's own plan.
2. ``lm`` — pdefit's Levenberg–Marquardt (``pdefit.fitting.train.run_fit`` with
   ``optim.name=levenberg_marquardt`` and :func:`pdefit.fitting.gauss_newton.gauss_newton`)
   against ``optimistix.LevenbergMarquardt`` on the same Aliev–Panfilov fit (a 12 × 12 grid, 40
   Euler steps, u and v observed every 5 steps, k, a, eps0, mu1 fitted from 0.7–1.3× the
   truth, the same unconstrained coordinates; Σ r² of the library's residual vector equals
   pdefit's loss, checked): steps, loss evaluations, wall time (first call, compile included,
   and warm), parameter error, and the XLA temporary memory of one compiled step/solve at
   that size and at a larger one (``--lm-large``, compiled only).
3. ``sphere`` — :class:`pdefit.numerics.spherical.SphericalTransform` against ``s2fft`` on the
   Gauss–Legendre grids pdefit uses (12 × 24, 16 × 32: tests; 32 × 64: conf/system/sphere_ns):
   synthesis + analysis of a batch of 12 fields (the experiment count of
   sphere_force_recovery), float64: compile time, best warm time, round-trip error, whether
   ``jax.grad`` runs. ``s2fft`` fixes its grid to L × (2L − 1) for band limit L, so it is run at
   L = lmax + 1 (pdefit's truncation, a smaller grid that aliases products) and at L = nlat
   (pdefit's latitudes, full band), each on the fly and with precomputed kernels.
4. ``fft`` — ``jaxdecomp`` (run in a child process with 2 virtual CPU devices): whether its
   pencil FFT runs on the CPU backend, its agreement with ``jnp.fft.fftn``, forward-mode and
   reverse-mode differentiation, and its time against one unsharded FFT on the mirrored
   Rayleigh–Bénard pressure grid (200 × 100) and on a 64³ cube. On 2 shared cores the
   virtual devices share the same cores: the times say nothing about scaling.
5. ``linear`` — ``lineax`` where pdefit solves linear systems: the Levenberg–Marquardt normal
   equations (k × k, ``jnp.linalg.solve``) against ``lx.LU`` and ``lx.Cholesky``; the
   Rayleigh–Bénard pressure Poisson solve (``systems.rayleigh_benard.solve_poisson``, exact by
   FFT/DCT) against matrix-free ``lx.CG`` on the same 5-point operator, 100 × 100.

A library that is not installed is skipped with a note. Each timed function runs once (the
"first" time: trace + compile + run), then ``--repeats`` times; the table shows the best (the
machine may be shared; the load average is recorded).

How to run
----------
Install the libraries beside pdefit's own dependencies, pinning jax so they do not upgrade it
(optimistix and lineax already come with the ``bench`` extra, through diffrax):

    pip install "jax==$(python -c 'import jax;print(jax.__version__)')" \\
        checkpoint-schedules optimistix lineax s2fft jaxdecomp
    python benchmarks/libraries.py                    # all five
    python benchmarks/libraries.py --only revolve lm  # some

Writes ``benchmarks/results/libraries.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.adjoint import LossChain, RevolvePlan, StoreAll, revolve_plan
from pdefit.adjoint.plan import ADVANCE, RESTORE, REVERSE, STORE, segments
from pdefit.adjoint.revolve import revolve_loss
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.observe import Observation, observed_data
from pdefit.fitting.optimisers import init_state, make_damped_update, make_optimizer
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.fitting.train import run_fit
from pdefit.model.params import ParameterLayout
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.numerics.spherical import SphericalTransform, tables
from pdefit.options import OptimConfig
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov
from pdefit.systems.rayleigh_benard import solve_poisson

jax.config.update("jax_enable_x64", True)

LIBRARIES = {"revolve": "checkpoint_schedules", "lm": "optimistix", "sphere": "s2fft",
             "fft": "jaxdecomp", "linear": "lineax"}
DISTRIBUTIONS = {"checkpoint_schedules": "checkpoint-schedules"}


def installed(module: str) -> str | None:
    """The installed version of ``module``'s distribution, or None."""
    if importlib.util.find_spec(module) is None:
        return None
    return importlib.metadata.version(DISTRIBUTIONS.get(module, module))


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(first call, best of ``repeats`` more) in seconds, waiting for the results."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return first, best


# -- 1. revolve plans ----------------------------------------------------------------------------


def library_counts(make_schedule: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Build and walk a checkpoint_schedules action stream: forward step evaluations, RAM
    snapshot writes, the most RAM snapshots held at once, and the best time of both."""
    walks = [_walk(make_schedule) for _ in range(repeats)]
    return {**walks[0], "plan_s": min(w["plan_s"] for w in walks)}


def _walk(make_schedule: Callable[[], Any]) -> dict[str, Any]:
    import checkpoint_schedules as cs

    start = time.perf_counter()
    forward = writes = most = 0
    held: set[int] = set()
    for action in make_schedule():
        if isinstance(action, cs.Forward):
            forward += action.n1 - action.n0
            if action.write_ics and action.storage == cs.StorageType.RAM:
                writes += 1
                held.add(action.n0)
                most = max(most, len(held))
        elif isinstance(action, cs.Move):
            held.discard(action.n)
        elif isinstance(action, cs.EndReverse):
            break
    return {"forward_steps": forward, "snapshot_writes": writes, "snapshots_held": most,
            "plan_s": time.perf_counter() - start}


def pdefit_counts(n_steps: int, snapshots: int, repeats: int) -> dict[str, Any]:
    elapsed = np.inf
    for _ in range(repeats):
        revolve_plan.cache_clear()
        start = time.perf_counter()
        plan = revolve_plan(n_steps, snapshots)
        elapsed = min(elapsed, time.perf_counter() - start)
    slots = plan.args[plan.kinds == STORE]
    return {"forward_steps": plan.count(ADVANCE) + n_steps,
            "snapshot_writes": plan.count(STORE), "snapshots_held": len(set(slots.tolist())),
            "plan_s": elapsed}


def plan_from_schedule(schedule: Any, n_steps: int, snapshots: int) -> RevolvePlan:
    """A checkpoint_schedules action stream as pdefit's integer plan: a RAM write of step n0
    becomes a store into the lowest free slot, a forward that keeps the adjoint's inputs
    advances one step less (pdefit's reversal recomputes that step inside its VJP), a copy or
    move becomes a restore (a move frees the slot)."""
    import checkpoint_schedules as cs

    actions: list[tuple[int, int]] = []
    slot_of: dict[int, int] = {}
    for action in schedule:
        if isinstance(action, cs.Forward):
            if action.write_ics and action.storage == cs.StorageType.RAM:
                slot_of[action.n0] = min(set(range(snapshots)) - set(slot_of.values()))
                actions.append((STORE, slot_of[action.n0]))
            if action.write_adj_deps and action.n1 - action.n0 != 1:
                raise ValueError(f"{action}: stores the adjoint's inputs of several steps")
            count = action.n1 - action.n0 - int(action.write_adj_deps)
            if count:
                actions.append((ADVANCE, count))
        elif isinstance(action, cs.Reverse):
            actions.append((REVERSE, 0))
        elif isinstance(action, (cs.Copy, cs.Move)):
            slot = slot_of.pop(action.n) if isinstance(action, cs.Move) else slot_of[action.n]
            actions.append((RESTORE, slot))
        elif isinstance(action, cs.EndReverse):
            break
    kinds = np.array([k for k, _ in actions], np.int32)
    args = np.array([a for _, a in actions], np.int32)
    return RevolvePlan(n_steps, snapshots, kinds, args, int(np.argmax(kinds == REVERSE)))


def forcing_chain(n_steps: int) -> tuple[LossChain, Any, Any, Any]:
    """A small chain whose θ includes a forcing per step (so every reversal must be right)."""
    shape = (5, 7)

    def step(x, theta, n):
        return x + 0.05 * (jnp.tanh(x) * theta["rate"] + theta["forcing"][n])

    def cost(x, theta, n, data):
        return jnp.where(n % 3 == 0, jnp.sum((x - data[n // 3]) ** 2), 0.0)

    theta = {"rate": jnp.asarray(0.3),
             "forcing": jax.random.normal(jax.random.key(0), (n_steps, *shape))}
    return LossChain(step, cost), jnp.zeros(shape), theta, jnp.ones((n_steps // 3 + 1, *shape))


def executor_check(n_steps: int, snapshots: int, repeats: int) -> dict[str, Any]:
    """pdefit's segment executor run with pdefit's plan and with the library's, translated."""
    import checkpoint_schedules as cs

    chain, x0, theta, data = forcing_chain(n_steps)
    reference = jax.jit(jax.grad(lambda t: StoreAll().loss(chain, x0, t, data, n_steps)))(theta)
    out: dict[str, Any] = {"n_steps": n_steps, "snapshots": snapshots}
    plans = {"pdefit": revolve_plan(n_steps, snapshots),
             "checkpoint_schedules": plan_from_schedule(
                 cs.MultistageCheckpointSchedule(n_steps, snapshots, 0), n_steps, snapshots)}
    for name, plan in plans.items():
        grad = jax.jit(jax.grad(lambda t, p=plan: revolve_loss(chain, p)(x0, t, data)))
        first, best = timed(lambda g=grad: g(theta), 4 * repeats)  # milliseconds: more
        error = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(
            jax.tree.leaves(grad(theta)), jax.tree.leaves(reference), strict=True))
        out[name] = {"grad_rel_error_vs_store_all": error, "first_s": first, "best_s": best,
                     "actions": len(plan.kinds),
                     "segments": len(segments(plan.kinds, plan.args).advance)}
    return out


def bench_revolve(repeats: int) -> dict[str, Any]:
    import checkpoint_schedules as cs

    rows = []
    for n_steps, snapshots in ((400, 32), (1000, 8), (10000, 32)):
        row = {"n_steps": n_steps, "snapshots": snapshots,
               "pdefit": pdefit_counts(n_steps, snapshots, repeats),
               "multistage": library_counts(
                   lambda n=n_steps, s=snapshots: cs.MultistageCheckpointSchedule(n, s, 0),
                   repeats)}
        # H-Revolve's dynamic programme: seconds here, over 300 s at (10000, 32) (measured
        # once), so it runs once and not at that size.
        row["hrevolve"] = (library_counts(lambda n=n_steps, s=snapshots: cs.Revolve(n, s), 1)
                           if n_steps <= 1000 else "skipped: over 300 s at this size")
        rows.append(row)
    return {"rows": rows, "executor": executor_check(400, 8, repeats)}


def print_revolve(result: dict[str, Any]) -> None:
    print("revolve: forward step evaluations / snapshot writes / held / plan time")
    for row in result["rows"]:
        cells = [f"N={row['n_steps']:>5} s={row['snapshots']:>2}"]
        for name in ("pdefit", "multistage", "hrevolve"):
            c = row[name]
            cells.append(f"{name} " + (f"{c['forward_steps']}/{c['snapshot_writes']}/"
                                       f"{c['snapshots_held']}/{1e3 * c['plan_s']:.1f} ms"
                                       if isinstance(c, dict) else "skipped"))
        print("  " + " | ".join(cells))
    ex = result["executor"]
    for name in ("pdefit", "checkpoint_schedules"):
        e = ex[name]
        print(f"  executor N={ex['n_steps']} s={ex['snapshots']}, {name} plan "
              f"({e['segments']} segments): grad error "
              f"{e['grad_rel_error_vs_store_all']:.1e}, first {e['first_s']:.2f} s, "
              f"best {1e3 * e['best_s']:.2f} ms")


# -- 2. Levenberg–Marquardt ------------------------------------------------------------------


FITTED = ("k", "a", "eps0", "mu1")
DT = 0.05


def ap_fit(shape: tuple[int, int], n_steps: int, every: int) -> dict[str, Any]:
    """An AP fit from synthetic noise-free data (as tests/helpers.py builds one)."""
    system, grid = AlievPanfilov(), Grid(shape, (1.0, 1.0), ("neumann", "neumann"))
    rng = np.random.default_rng(0)
    y, x = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    cy, cx = rng.uniform(0, shape[0]), rng.uniform(0, shape[1])
    r2 = ((y - cy) ** 2 + (x - cx) ** 2) / (0.1 * max(shape)) ** 2
    x0 = {"u": jnp.asarray(np.exp(-r2))[None],
          "v": jnp.asarray(0.5 * np.exp(-r2 / 4) * rng.uniform(0.5, 1.0))[None]}
    truth = {k: jnp.asarray(v, jnp.float64) for k, v in AP96.items()}
    step = stepper(system, grid, "euler")
    frames = jax.vmap(lambda s: simulate(step, s, truth, 0.0, DT, n_steps, every))(x0)
    observation = Observation(("u", "v"))
    observed = observed_data(observation, {f: np.asarray(frames[f]) for f in ("u", "v")},
                             {"u": None, "v": None}, list(range(0, n_steps + 1, every)),
                             n_steps, jnp.float64)
    layout = ParameterLayout.build(system.params, AP96, list(FITTED))
    factors = np.random.default_rng(3).uniform(0.7, 1.3, len(FITTED))
    start = {**AP96, **{n: AP96[n] * f for n, f in zip(FITTED, factors, strict=True)}}
    problem = FitProblem(system=system, grid=grid, dt=DT, integrator="euler", n_steps=n_steps,
                         layout=layout, observation=observation, schedule=StoreAll())
    cast = lambda d: {k: jnp.asarray(v, jnp.float64) for k, v in d.items()}  # noqa: E731
    return {"problem": problem, "batch": Batch(observed, x0), "every": every,
            "theta_start": {"params": cast(layout.unconstrained(start)), "fields": {}}}


def residual_function(fit: dict[str, Any]) -> tuple[Callable, Any, Callable]:
    """(r(y, args), y0, unravel): Σ r² is pdefit's loss at the parameters y (unconstrained,
    flattened like ``ravel_pytree``)."""
    problem, batch, every = fit["problem"], fit["batch"], fit["every"]
    y0, unravel = ravel_pytree(fit["theta_start"]["params"])
    # Plain stencils, as pdefit's Gauss–Newton uses: the self-adjoint VJP rule (a custom_vjp)
    # has no forward mode, and optimistix builds the Jacobian by forward mode.
    grid = dataclasses.replace(problem.grid, self_adjoint_vjp=False)
    step = stepper(problem.system, grid, problem.integrator)
    obs = batch.observed

    def residuals(y, args):
        params = problem.physical_params({"params": unravel(y)})
        frames = jax.vmap(lambda s: simulate(step, s, params, 0.0, problem.dt,
                                             problem.n_steps, every))(batch.initial)
        n_exp = frames["u"].shape[0]
        parts = [jnp.sqrt(obs.scale[f][:, None, None, None] * obs.weights[f])
                 * (frames[f] - obs.values[f]) for f in problem.observation.fields]
        return jnp.concatenate([p.ravel() for p in parts]) / jnp.sqrt(n_exp)

    return residuals, y0, unravel


def parameter_error(problem: FitProblem, params: Any) -> float:
    fitted = problem.layout.physical(params)
    return max(abs(float(fitted[n]) / AP96[n] - 1.0) for n in FITTED)


def temp_bytes(fn: Callable, *args: Any) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def ours_lm(fit: dict[str, Any], repeats: int) -> dict[str, Any]:
    problem, batch, theta = fit["problem"], fit["batch"], fit["theta_start"]
    curvature = gauss_newton(problem)
    cfg = OptimConfig(name="levenberg_marquardt", steps=60, clip=None, grad_tol=1e-9)
    start = time.perf_counter()
    _, history = run_fit(problem.loss, theta, batch, cfg, progress=False,
                         log=lambda _: None, curvature=curvature)
    wall = time.perf_counter() - start
    update = make_damped_update(problem.loss, curvature)
    state = init_state(theta, make_optimizer(cfg), jnp.float64)
    _, step_s = timed(lambda: update(state, batch), repeats)
    steps = len(history.records)
    return {"steps": steps, "loss_evaluations": sum(r["evaluations"] for r in history.records),
            "final_loss": history.best_loss, "stop": history.stop_reason,
            "param_rel_error": parameter_error(problem, history.best_theta["params"]),
            "first_s": wall, "warm_s_estimate": steps * step_s, "step_s": step_s,
            "temp_bytes": temp_bytes(lambda s, b: update(s, b)[0].theta, state, batch)}


def optimistix_lm(fit: dict[str, Any], repeats: int, ours_steps: int) -> dict[str, Any]:
    import optimistix as optx

    residuals, y0, unravel = residual_function(fit)
    problem = fit["problem"]
    solver = optx.LevenbergMarquardt(rtol=1e-10, atol=1e-10)

    def solve(y):
        sol = optx.least_squares(residuals, solver, y, max_steps=200, throw=False)
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    jitted = jax.jit(solve)
    first, best = timed(lambda: jitted(y0), repeats)
    value, steps, successful = jitted(y0)
    calls = []  # residual evaluations, counted by a callback in a second compiled solve

    def counted(y, args):
        jax.debug.callback(lambda: calls.append(1))
        return residuals(y, args)

    jax.block_until_ready(jax.jit(lambda y: optx.least_squares(
        counted, solver, y, max_steps=200, throw=False).value)(y0))
    loss_check = float(jnp.sum(residuals(y0, None) ** 2)
                       / problem.loss(fit["theta_start"], fit["batch"]) - 1.0)
    cut = jax.jit(lambda y: optx.least_squares(residuals, solver, y, max_steps=ours_steps,
                                               throw=False).value)(y0)
    return {"steps": int(steps), "successful": bool(successful),
            "loss_evaluations": len(calls),
            "param_rel_error_after_pdefit_steps": parameter_error(problem, unravel(cut)),
            "final_loss": float(jnp.sum(residuals(value, None) ** 2)),
            "loss_check_rel": loss_check,
            "param_rel_error": parameter_error(problem, unravel(value)),
            "first_s": first, "warm_s": best, "temp_bytes": temp_bytes(solve, y0)}


def lm_memory(large: tuple[int, int, int]) -> dict[str, Any]:
    """Temporary bytes of one compiled pdefit LM step and one optimistix solve at a larger
    size (compiled, not run)."""
    import optimistix as optx

    n, n_steps, every = large
    fit = ap_fit((n, n), n_steps, every)
    problem, batch, theta = fit["problem"], fit["batch"], fit["theta_start"]
    update = make_damped_update(problem.loss, gauss_newton(problem))
    cfg = OptimConfig(name="levenberg_marquardt")
    state = init_state(theta, make_optimizer(cfg), jnp.float64)
    residuals, y0, _ = residual_function(fit)
    solver = optx.LevenbergMarquardt(rtol=1e-10, atol=1e-10)
    return {"grid": n, "n_steps": n_steps, "every": every,
            "pdefit_step_temp_bytes": temp_bytes(lambda s, b: update(s, b)[0].theta, state,
                                                 batch),
            "optimistix_solve_temp_bytes": temp_bytes(lambda y: optx.least_squares(
                residuals, solver, y, max_steps=200, throw=False).value, y0)}


def bench_lm(repeats: int, large: tuple[int, int, int]) -> dict[str, Any]:
    fit = ap_fit((12, 12), 40, 5)
    ours = ours_lm(fit, repeats)
    return {"problem": "AP 12x12, 40 Euler steps, frames every 5, k a eps0 mu1",
            "pdefit": ours, "optimistix": optimistix_lm(fit, repeats, ours["steps"]),
            "memory_large": lm_memory(large)}


def print_lm(result: dict[str, Any]) -> None:
    print(f"levenberg-marquardt: {result['problem']}")
    for name in ("pdefit", "optimistix"):
        r = result[name]
        warm = r.get("warm_s", r.get("warm_s_estimate"))
        evaluations = r.get("loss_evaluations", "-")
        print(f"  {name:<10} steps {r['steps']:>3}  loss evals {evaluations!s:>3}  "
              f"loss {r['final_loss']:.2e}  param err {r['param_rel_error']:.1e}  "
              f"first {r['first_s']:.2f} s  warm {warm:.3f} s  "
              f"temp {r['temp_bytes'] / 2**20:.2f} MiB")
    print(f"  optimistix after {result['pdefit']['steps']} steps: param err "
          f"{result['optimistix']['param_rel_error_after_pdefit_steps']:.1e}")
    m = result["memory_large"]
    print(f"  {m['grid']}² grid, {m['n_steps']} steps: temp pdefit step "
          f"{m['pdefit_step_temp_bytes'] / 2**20:.1f} MiB, optimistix solve "
          f"{m['optimistix_solve_temp_bytes'] / 2**20:.1f} MiB")


# -- 3. spherical-harmonic transforms ------------------------------------------------------------


SPHERE_GRIDS = ((12, 24), (16, 32), (32, 64))
BATCH = 12


def roundtrip_row(roundtrip: Callable, coefficients: Any, repeats: int) -> dict[str, Any]:
    """Compile time, best time, relative round-trip error and a gradient of a jitted
    synthesis + analysis (``roundtrip``) on band-limited ``coefficients``."""
    jitted = jax.jit(roundtrip)
    start = time.perf_counter()
    compiled = jitted.lower(coefficients).compile()
    compile_s = time.perf_counter() - start
    _, best = timed(lambda: compiled(coefficients), repeats)
    back = compiled(coefficients)
    error = float(jnp.max(jnp.abs(back - coefficients)) / jnp.max(jnp.abs(coefficients)))
    try:
        grad = jax.jit(jax.grad(lambda a: jnp.sum(jnp.abs(roundtrip(a)) ** 2)))(coefficients)
        differentiable = bool(jnp.all(jnp.isfinite(grad)))
    except Exception as exc:  # the table reports what failed
        differentiable = f"{type(exc).__name__}: {exc}"[:200]
    return {"compile_s": compile_s, "best_s": best, "roundtrip_rel_error": error,
            "grad": differentiable}


def ours_sphere(nlat: int, nlon: int, repeats: int) -> dict[str, Any]:
    transform = SphericalTransform(nlat, nlon)
    size = transform.lmax + 1
    rng = np.random.default_rng(0)
    a = rng.standard_normal((BATCH, size, size)) + 1j * rng.standard_normal((BATCH, size, size))
    a[:, 0] = a[:, 0].real  # m = 0 coefficients of a real field are real
    coefficients = jnp.asarray(a * transform.mask)
    row = roundtrip_row(lambda c: transform.analysis(transform.synthesis(c)), coefficients,
                        repeats)
    start = time.perf_counter()
    tables.__wrapped__(nlat, nlon, transform.lmax)  # the Legendre tables, uncached
    return {"grid": [nlat, nlon], "lmax": transform.lmax,
            "tables_s": time.perf_counter() - start, **row}


def s2fft_sphere(band: int, repeats: int) -> dict[str, Any]:
    """s2fft on its Gauss–Legendre grid for band limit ``band``, on the fly and with
    precomputed kernels (their construction timed)."""
    import s2fft
    import s2fft.precompute_transforms as pt
    from s2fft.utils import signal_generator

    rng = np.random.default_rng(0)
    flm = jnp.stack([jnp.asarray(signal_generator.generate_flm(rng, band, reality=True))
                     for _ in range(BATCH)])
    options = {"sampling": "gl", "reality": True}
    out: dict[str, Any] = {"L": band, "grid": [band, 2 * band - 1]}
    out["on_the_fly"] = roundtrip_row(jax.vmap(lambda a: s2fft.forward(
        s2fft.inverse(a, band, method="jax", **options), band, method="jax", **options)), flm,
        repeats)
    start = time.perf_counter()
    kernels = [jax.block_until_ready(pt.construct.spin_spherical_kernel_jax(
        band, forward=forward, **options)) for forward in (True, False)]
    kernels_s = time.perf_counter() - start
    out["precomputed"] = {"kernels_s": kernels_s, **roundtrip_row(jax.vmap(
        lambda a: pt.spherical.forward(pt.spherical.inverse(a, band, kernel=kernels[1],
                                                            **options), band,
                                       kernel=kernels[0], **options)), flm, repeats)}
    return out


def bench_sphere(repeats: int) -> dict[str, Any]:
    rows = []
    for nlat, nlon in SPHERE_GRIDS:
        ours = ours_sphere(nlat, nlon, repeats)
        rows.append({"pdefit": ours,
                     "s2fft_same_L": s2fft_sphere(ours["lmax"] + 1, repeats),
                     "s2fft_same_nlat": s2fft_sphere(nlat, repeats)})
    return {"batch": BATCH, "dtype": "float64", "rows": rows}


def print_sphere(result: dict[str, Any]) -> None:
    print(f"sphere: synthesis + analysis of {result['batch']} fields, float64 "
          "(compile / best / round-trip error / grad)")

    def cells(r: dict[str, Any]) -> str:
        return (f"{r['compile_s']:.2f} s / {1e3 * r['best_s']:.3f} ms / "
                f"{r['roundtrip_rel_error']:.0e} / {r['grad'] is True}")

    for row in result["rows"]:
        ours = row["pdefit"]
        print(f"  pdefit {ours['grid'][0]}x{ours['grid'][1]} L={ours['lmax']} (tables "
              f"{1e3 * ours['tables_s']:.1f} ms): {cells(ours)}")
        for key in ("s2fft_same_L", "s2fft_same_nlat"):
            s = row[key]
            print(f"    s2fft L={s['L']} ({s['grid'][0]}x{s['grid'][1]}): on the fly "
                  f"{cells(s['on_the_fly'])}; precomputed (kernels "
                  f"{s['precomputed']['kernels_s']:.1f} s) {cells(s['precomputed'])}")


# -- 4. distributed FFT --------------------------------------------------------------------------


def pencil_fft(shape: tuple[int, int, int], repeats: int) -> dict[str, Any]:
    """jaxdecomp's pfft3d of a random array of ``shape`` split over 2 devices (first axis)."""
    import jaxdecomp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), axis_names=("z", "y"))
    host = np.random.default_rng(0).standard_normal(shape).astype(np.complex128)
    x = jax.device_put(host, NamedSharding(mesh, P("z", "y")))
    pfft = jax.jit(jaxdecomp.pfft3d)
    first, best = timed(lambda: pfft(x), repeats)
    # pfft3d returns the axes (X, Y, Z) transposed to (Y, Z, X).
    error = float(np.max(np.abs(np.asarray(pfft(x)) - np.transpose(np.fft.fftn(host),
                                                                     (1, 2, 0)))))
    fftn, local = jax.jit(jnp.fft.fftn), jnp.asarray(host)  # one device
    _, best_local = timed(lambda: fftn(local), repeats)
    tangent = jax.jit(lambda a: jax.jvp(jaxdecomp.pfft3d, (a,), (a,))[1])(x)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(jnp.abs(jaxdecomp.pfft3d(
        a.astype(jnp.complex128))) ** 2)))(x.real)
    return {"first_s": first, "best_s": best, "max_abs_error_vs_fftn": error,
            "one_device_fftn_best_s": best_local, "jvp": bool(jnp.all(jnp.isfinite(tangent))),
            "grad": bool(jnp.all(jnp.isfinite(grad)))}


def fft_child(repeats: int) -> dict[str, Any]:
    """Runs in a child process with 2 virtual CPU devices (see :func:`bench_fft`). The
    Rayleigh–Bénard grid is 2-D: pfft3d needs a third axis, tried with 1 and 2 planes."""
    rows = []
    for shape in ((200, 100, 1), (200, 100, 2), (64, 64, 64)):
        try:
            rows.append({"shape": list(shape), "devices": 2, **pencil_fft(shape, repeats)})
        except Exception as exc:  # the table reports what failed (the innermost error line)
            lines = [line.strip() for line in str(exc).splitlines()] or [""]
            reason = next((line for line in reversed(lines)
                           if re.match(r"\w+(Error|Exception): ", line)), lines[0])
            rows.append({"shape": list(shape), "devices": 2,
                         "error": f"{type(exc).__name__}: {reason}"[:300]})
    return {"rows": rows}


def bench_fft(repeats: int) -> dict[str, Any]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, __file__, "--fft-child", "--repeats", str(repeats)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_fft(result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"jaxdecomp: FAILED\n{result['error']}")
        return
    print("jaxdecomp pfft3d on 2 virtual CPU devices (same 2 cores as 1 device)")
    for r in result["rows"]:
        if "error" in r:
            print(f"  {r['shape']}: FAILED {r['error']}")
            continue
        print(f"  {r['shape']}: first {r['first_s']:.2f} s, best {1e3 * r['best_s']:.2f} ms "
              f"(one-device fftn {1e3 * r['one_device_fftn_best_s']:.2f} ms), error vs fftn "
              f"{r['max_abs_error_vs_fftn']:.1e}, jvp {r['jvp']}, grad {r['grad']}")


# -- 5. linear solves ----------------------------------------------------------------------------


def normal_equations(k: int, repeats: int) -> dict[str, Any]:
    """(G + λ diag G) δ = −g as pdefit's LM step forms it, with a random G = JᵀJ."""
    import lineax as lx

    rng = np.random.default_rng(k)
    jac = rng.standard_normal((10 * k, k)) * np.logspace(0, 3, k)  # badly scaled columns
    matrix = jac.T @ jac
    system = jnp.asarray(matrix + 1e-3 * np.diag(np.diag(matrix)))
    g = jnp.asarray(rng.standard_normal(k))
    solvers = {
        "jnp.linalg.solve": lambda a, b: jnp.linalg.solve(a, b),
        "lineax LU": lambda a, b: lx.linear_solve(lx.MatrixLinearOperator(a), b, lx.LU()).value,
        "lineax Cholesky": lambda a, b: lx.linear_solve(lx.MatrixLinearOperator(
            a, lx.positive_semidefinite_tag), b, lx.Cholesky()).value}
    out: dict[str, Any] = {"k": k}
    for name, solve in solvers.items():
        jitted = jax.jit(solve)
        _, best = timed(lambda j=jitted: j(system, g), 20 * repeats)  # microseconds: more
        delta = jitted(system, g)
        residual = float(jnp.linalg.norm(system @ delta - g) / jnp.linalg.norm(g))
        out[name] = {"best_s": best, "rel_residual": residual}
    return out


def poisson(repeats: int, n: int = 100) -> dict[str, Any]:
    """The Rayleigh–Bénard pressure solve (n × n, walls in z, periodic in x) by pdefit's
    FFT/DCT and by matrix-free CG on the same operator."""
    import lineax as lx

    dz = dx = 1.0 / n

    def laplacian(phi):
        ghosts = jnp.concatenate([phi[:1], phi, phi[-1:]], axis=0)  # zero flux at the walls
        return ((jnp.roll(phi, -1, 1) - 2 * phi + jnp.roll(phi, 1, 1)) / dx**2
                + (ghosts[2:] - 2 * phi + ghosts[:-2]) / dz**2)

    rhs = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)))
    rhs = rhs - jnp.mean(rhs)  # in the range of the operator
    structure = jax.ShapeDtypeStruct((n, n), rhs.dtype)
    operator = lx.FunctionLinearOperator(lambda p: -laplacian(p), structure,
                                         lx.positive_semidefinite_tag)
    methods = {
        "pdefit fft/dct": lambda b: solve_poisson(b, dz, dx),
        "lineax CG": lambda b: lx.linear_solve(operator, -b, lx.CG(
            rtol=1e-10, atol=1e-10, max_steps=20000), throw=False).value}
    out: dict[str, Any] = {"grid": [n, n]}
    for name, method in methods.items():
        jitted = jax.jit(method)
        first, best = timed(lambda j=jitted: j(rhs), repeats)
        phi = jitted(rhs)
        residual = float(jnp.linalg.norm(laplacian(phi) - rhs) / jnp.linalg.norm(rhs))
        out[name] = {"first_s": first, "best_s": best, "rel_residual": residual}
    steps = jax.jit(lambda b: lx.linear_solve(operator, -b, lx.CG(
        rtol=1e-10, atol=1e-10, max_steps=20000), throw=False).stats["num_steps"])(rhs)
    out["lineax CG"]["iterations"] = int(steps)
    return out


def bench_linear(repeats: int) -> dict[str, Any]:
    return {"normal_equations": [normal_equations(k, repeats) for k in (4, 32)],
            "poisson": poisson(repeats)}


def print_linear(result: dict[str, Any]) -> None:
    print("linear solves (best time / relative residual)")
    for row in result["normal_equations"]:
        print(f"  LM normal equations k={row['k']}: " + "; ".join(
            f"{name} {1e6 * row[name]['best_s']:.0f} µs / {row[name]['rel_residual']:.0e}"
            for name in ("jnp.linalg.solve", "lineax LU", "lineax Cholesky")))
    p = result["poisson"]
    cg = p["lineax CG"]
    print(f"  RB Poisson {p['grid'][0]}x{p['grid'][1]}: pdefit fft/dct "
          f"{1e3 * p['pdefit fft/dct']['best_s']:.3f} ms / "
          f"{p['pdefit fft/dct']['rel_residual']:.0e}; lineax CG {1e3 * cg['best_s']:.1f} ms "
          f"/ {cg['rel_residual']:.0e} ({cg['iterations']} iterations)")


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(LIBRARIES), default=list(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lm-large", type=int, nargs=3, default=[64, 400, 20],
                        metavar=("N", "STEPS", "EVERY"))
    parser.add_argument("--fft-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "libraries.json")
    args = parser.parse_args()
    if args.fft_child:
        print(json.dumps(fft_child(args.repeats)))
        return
    runs = {"revolve": (lambda: bench_revolve(args.repeats), print_revolve),
            "lm": (lambda: bench_lm(args.repeats, tuple(args.lm_large)), print_lm),
            "sphere": (lambda: bench_sphere(args.repeats), print_sphere),
            "fft": (lambda: bench_fft(args.repeats), print_fft),
            "linear": (lambda: bench_linear(args.repeats), print_linear)}
    results: dict[str, Any] = {}
    versions = {module: installed(module) for module in LIBRARIES.values()}
    for name in args.only:
        module = LIBRARIES[name]
        if versions[module] is None:
            print(f"{name}: skipped, {module} is not installed")
            results[name] = {"skipped": f"{module} not installed"}
            continue
        measure, show = runs[name]
        results[name] = measure()
        show(results[name])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "libraries", "commit": commit, "machine": platform.processor() or
        platform.machine(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
        "libraries": versions, "load_average": os.getloadavg()[0], "results": results},
        indent=2, default=str))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
