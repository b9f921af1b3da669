"""What one model step costs inside the fit's sweeps: forward, tangent, adjoint, Gauss–Newton.

What it measures
----------------
A Levenberg–Marquardt step of a fit with initial fields is tens of conjugate-gradient
iterations, each one forward-mode tangent sweep and one revolve adjoint sweep of the model
(:mod:`pdefit.fitting.krylov`). On a GPU a model step of BOCF at 512² is a few tens of µs of
memory traffic, so the loop around it (a ``while`` per step, its kernel launches) can cost as
much as the step. This script times, in one process on one problem, each sweep over the
window and divides by its number of model steps:

- ``forward``: the model alone, ``lax.scan`` over the window, at each ``--unroll``;
- ``tangent``: the same with one forward-mode tangent (``jax.jvp``), at each ``--unroll``;
- ``gradient``: the loss and its gradient under each of ``--schedules`` (the experiment's
  revolve by default; ``store_all`` keeps every step's linearisation, ``every_state`` is
  revolve with a snapshot per step, ``segments`` / ``branch_free`` its two executors);
- ``adjoint, parameters: ...``: the gradient of one experiment's misfit in its initial
  state and in every physical parameter of the system, in the fitted ones, or in none;
- ``gn_product``: one Gauss–Newton product G·v (:func:`krylov.gauss_newton_product`), the
  body of a conjugate-gradient iteration.

Each is run once to compile and then ``--repeats`` times; the table shows the median. Run it
under different ``XLA_FLAGS`` or ``precision=`` overrides in separate processes to compare.

How to run
----------
    python benchmarks/sweep_cost.py --experiment bocf_from_voltage --grid 64 --frames 11
    python benchmarks/sweep_cost.py --grid 512 --frames 11 --label f32 -- precision=float32

Prints a table and writes ``benchmarks/results/sweep_cost-<label>.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from estimate_batching import setup

from pdefit.adjoint import Revolve, StoreAll
from pdefit.fitting import assemble, krylov


def timed(call: Any, repeats: int) -> dict[str, float]:
    """Seconds of the first call (compiling included) and the median of ``repeats`` more."""
    def once() -> float:
        started = time.perf_counter()
        jax.block_until_ready(jax.tree.leaves(call()))
        return time.perf_counter() - started

    first = once()
    return {"first_s": first, "median_s": statistics.median(once() for _ in range(repeats))}


def schedules(configured: Any, n_steps: int, names: list[str]) -> dict[str, Any]:
    """The adjoint schedules ``names`` name: ``configured`` (the experiment's), ``store_all``,
    ``segments`` / ``branch_free`` (its revolve plan by that executor), ``every_state``
    (revolve with a snapshot per step: no step recomputed)."""
    snapshots = getattr(configured, "snapshots", 32)
    made = {"configured": configured, "store_all": StoreAll(),
            "segments": Revolve(snapshots, executor="segments"),
            "branch_free": Revolve(snapshots, executor="branch_free"),
            "every_state": Revolve(n_steps)}
    return {f"{name}: {made[name]!r}": made[name] for name in names}


def adjoints(problem: Any, batch: Any, theta: Any) -> dict[str, Any]:
    """The adjoint sweep of one experiment by the experiment's schedule, its gradient taken
    in the initial state and in every physical parameter, in the fitted ones, or in none: the
    cost of a parameter's cotangent at every reversed step."""
    chain = problem.chain()
    physical = problem.physical_params(theta)
    fitted = set(problem.scalar_values(theta))
    x0 = jax.tree.map(lambda a: a[0], problem.initial_state(theta, batch))
    obs = batch.observed
    data = obs._replace(**{part: {k: v[0] for k, v in getattr(obs, part).items()}
                           for part in ("values", "weights", "scale")})

    def loss(x, free):
        return problem.schedule.loss(chain, x, {**physical, **free}, data, problem.n_steps)

    subsets = {f"all {len(physical)}": physical,
               f"the {len(fitted)} fitted": {k: physical[k] for k in fitted}, "none": {}}
    calls = {}
    for name, free in subsets.items():
        gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
        calls[f"adjoint, parameters: {name}"] = (
            lambda gradient=gradient, free=free: gradient(x0, free))
    return calls


def sweeps(fit: assemble.FitSetup, unrolls: list[int], schedule_names: list[str],
           ) -> dict[str, Any]:
    """The jitted sweeps of one experiment's window, by name."""
    problem, batch, theta = fit.problem, fit.batch, fit.theta0
    # forward mode needs the Laplacian without its custom VJP, as krylov.predictions does
    chain = problem.chain(dataclasses.replace(problem.grid, self_adjoint_vjp=False))
    params = problem.physical_params(theta)
    x0 = jax.tree.map(lambda a: a[0], problem.initial_state(theta, batch))
    n_steps = problem.n_steps

    def forward(x, unroll):
        def body(state, n):
            return chain.step(state, params, n), None

        return jax.lax.scan(body, x, jnp.arange(n_steps), unroll=unroll)[0]

    direction = jax.tree.map(lambda a: jnp.full_like(a, 1e-3), x0)
    theta_direction = jax.tree.map(lambda a: jnp.full_like(a, 1e-3), theta)
    calls: dict[str, Any] = {}
    for unroll in unrolls:
        run = jax.jit(lambda x, u=unroll: forward(x, u))
        tangent = jax.jit(lambda x, d, u=unroll: jax.jvp(lambda s: forward(s, u), (x,), (d,)))
        calls[f"forward (unroll {unroll})"] = lambda run=run: run(x0)
        calls[f"tangent (unroll {unroll})"] = lambda tangent=tangent: tangent(x0, direction)
    for name, schedule in schedules(problem.schedule, n_steps, schedule_names).items():
        gradient = jax.jit(dataclasses.replace(problem, schedule=schedule).value_and_grad)
        calls[f"gradient ({name})"] = lambda gradient=gradient: gradient(theta, batch)
    calls.update(adjoints(problem, batch, theta))
    product = jax.jit(lambda t, v: krylov.gauss_newton_product(problem, t, batch, v))
    calls["gn_product"] = lambda: product(theta, theta_direction)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--frames", type=int, default=11)
    parser.add_argument("--unroll", type=int, nargs="+", default=[1, 7])
    parser.add_argument("--schedules", nargs="+", default=["configured"],
                        choices=["configured", "store_all", "segments", "branch_free",
                                 "every_state"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="default")
    parser.add_argument("--output", type=Path)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = parser.parse_args()
    output = args.output or Path(f"benchmarks/results/sweep_cost-{args.label}.json")
    with tempfile.TemporaryDirectory() as workdir:
        fit = setup(args.experiment, args.grid, args.frames, Path(workdir), tuple(args.overrides))
        n_steps = fit.problem.n_steps
        records = {name: timed(call, args.repeats)
                   for name, call in sweeps(fit, args.unroll, args.schedules).items()}
    dtype = str(jax.tree.leaves(fit.theta0)[0].dtype)
    device = jax.devices()[0].device_kind
    lines = [f"{args.experiment} {args.grid}², {args.frames} frames = {n_steps} model steps, "
             f"{dtype}, {device}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} "
             f"[{args.label}]",
             "| sweep | first call s | median s | µs per model step |", "|---|---|---|---|"]
    for name, r in records.items():
        r["us_per_step"] = 1e6 * r["median_s"] / n_steps
        lines.append(f"| {name} | {r['first_s']:.2f} | {r['median_s']:.4f} | "
                     f"{r['us_per_step']:.1f} |")
    table = "\n".join(lines)
    print(table)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({
        "experiment": args.experiment, "grid": args.grid, "frames": args.frames,
        "steps": n_steps, "dtype": dtype, "device": device, "label": args.label,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "overrides": args.overrides,
        "host": platform.node(), "cpus": os.cpu_count(), "records": records,
        "table": table}, indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
