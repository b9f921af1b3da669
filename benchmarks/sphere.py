"""Cost of the sphere force fit (issue 8): one misfit and one gradient of
``experiment=sphere_force_recovery``, with the revolve schedule the experiment uses and with
store-all, and the Legendre transform inside it written two ways.

What it measures
----------------
The experiment's problem (by default its full size: 32 × 64 Gauss grid, T21, 12 experiments,
245 rk4 steps, 5280 force nodes, 12 rotations and time shifts, the initial vorticity fitted),
built through the configs from a dataset simulated into a temporary directory, at the starting
point of the fit:

- ``loss``: the jitted misfit + penalties (a forward rollout of every experiment);
- ``value_and_grad``: the jitted misfit and its exact gradient, for each schedule; the XLA
  temporary memory of the compiled gradient (``memory_analysis``) and the two gradients'
  largest difference;
- ``legendre``: one Legendre analysis of a batch of Fourier coefficients like those of a
  right-hand side, as a complex ``einsum`` against the real table (JAX promotes the table to
  complex) and as pdefit's real contraction of the stacked real and imaginary parts.

Each function runs once to compile, then ``--repeats`` interleaved rounds; the table shows the
best time (the machine may be shared; the load average is recorded).

How to run
----------
    python benchmarks/sphere.py                       # the full size
    python benchmarks/sphere.py --grid 16 32 --dt 0.05 --steps-per-frame 2   # quick

Writes ``benchmarks/results/sphere.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from hydra import compose, initialize_config_dir

from pdefit.app.config import register_configs
from pdefit.fitting import assemble
from pdefit.numerics.spherical import SphericalTransform, real_table_einsum

CONF = str(Path(__file__).resolve().parent.parent / "conf")
register_configs()


def build(tmp: Path, overrides: list[str], schedule: str,
          experiment: str | None = "sphere_force_recovery") -> assemble.FitSetup:
    """The experiment's fit setup with ``adjoint=<schedule>``, sharing one simulated dataset
    in ``tmp`` (``experiment=None``: the default fit)."""
    chosen = [] if experiment is None else [f"experiment={experiment}"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="fit", overrides=[
            f"run.dir={tmp}", *chosen, f"adjoint={schedule}", *overrides])
    dtype = assemble.set_precision(cfg.precision)
    path = tmp / "data.zarr"
    if not path.exists():
        assemble.simulate_dataset(cfg, path, dtype, log=lambda _: None)
    return assemble.build_fit(cfg, path, dtype)


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def temp_bytes(jitted, *args) -> int | None:
    analysis = jitted.lower(*args).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def legendre_case(setup: assemble.FitSetup) -> tuple[SphericalTransform, jnp.ndarray]:
    transform = setup.problem.system.transform(setup.problem.grid)
    rng = np.random.default_rng(0)
    n_experiments = jax.tree.leaves(setup.batch.observed.values)[0].shape[0]
    shape = (n_experiments, 2, transform.nlat, transform.lmax + 1)
    dtype = jnp.complex128 if jax.config.jax_enable_x64 else jnp.complex64
    coeffs = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return transform, jnp.asarray(coeffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", type=int, nargs=2, default=None, metavar=("NLAT", "NLON"))
    parser.add_argument("--dt", type=float, default=None)
    parser.add_argument("--steps-per-frame", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "sphere.json")
    args = parser.parse_args()
    overrides = ["run.progress=false", "run.plots=false"]
    if args.grid:
        overrides.append(f"system.grid.shape=[{args.grid[0]},{args.grid[1]}]")
    if args.dt:
        overrides.append(f"system.dt={args.dt}")
    if args.steps_per_frame:
        overrides.append(f"simulate.steps_per_frame={args.steps_per_frame}")

    with tempfile.TemporaryDirectory() as tmp:
        setups = {s: build(Path(tmp), overrides, s) for s in ("revolve", "store_all")}
        problem = setups["revolve"].problem
        theta, batch = setups["revolve"].theta0, setups["revolve"].batch
        loss = jax.jit(problem.loss)
        grads = {s: jax.jit(setups[s].problem.value_and_grad) for s in setups}
        memory = {s: temp_bytes(grads[s], theta, batch) for s in setups}
        transform, coeffs = legendre_case(setups["revolve"])
        table = jnp.asarray(transform.tables.legendre * transform.tables.weights,
                            coeffs.real.dtype)
        spec = "...im,mli->...ml"
        legendre = {
            "complex_einsum": jax.jit(lambda c: jnp.einsum(spec, c, table)),
            "real_split": jax.jit(lambda c: real_table_einsum(spec, c, table)),
        }
        calls = {"loss": lambda: loss(theta, batch),
                 **{f"value_and_grad_{s}": (lambda f=f: f(theta, batch))
                    for s, f in grads.items()},
                 **{f"legendre_{k}": (lambda f=f: f(coeffs)) for k, f in legendre.items()}}
        for call in calls.values():
            jax.block_until_ready(call())  # compile
        rounds = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                rounds[name].append(timed(call))
        best = {name: min(times) for name, times in rounds.items()}
        (_, g_revolve), (_, g_store) = (grads[s](theta, batch) for s in ("revolve", "store_all"))
        gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
            jax.tree.leaves(g_revolve), jax.tree.leaves(g_store), strict=True))
        scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g_store))
        legendre_gap = float(jnp.max(jnp.abs(legendre["complex_einsum"](coeffs)
                                              - legendre["real_split"](coeffs))))

    result = {
        "grid": list(problem.grid.shape), "lmax": transform.lmax, "n_steps": problem.n_steps,
        "n_experiments": int(coeffs.shape[0]), "schedule": str(problem.schedule),
        "dtype": str(coeffs.real.dtype), "best_seconds": best,
        "gradient_over_loss": best["value_and_grad_revolve"] / best["loss"],
        "revolve_over_store_all_time": (best["value_and_grad_revolve"]
                                        / best["value_and_grad_store_all"]),
        "temp_bytes": memory, "gradient_max_difference": gap, "gradient_scale": scale,
        "legendre_speedup": best["legendre_complex_einsum"] / best["legendre_real_split"],
        "legendre_max_difference": legendre_gap,
        "load_average": os.getloadavg()[0], "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "devices": [str(d) for d in jax.devices()],
    }
    print(f"sphere_force_recovery on {result['grid']} (T{result['lmax']}), "
          f"{result['n_experiments']} experiments × {result['n_steps']} steps, {result['dtype']}")
    print(f"{'what':34s} {'best time':>12s}")
    for name, seconds in best.items():
        print(f"{name:34s} {seconds * 1e3:10.2f} ms")
    print(f"gradient / loss time: {result['gradient_over_loss']:.2f}; revolve / store-all: "
          f"{result['revolve_over_store_all_time']:.2f}")
    for s, b in memory.items():
        print(f"XLA temporary memory, {s}: {'n/a' if b is None else f'{b / 2**20:.1f} MiB'}")
    print(f"revolve − store-all gradient: max |Δ| {gap:.2e} (max |g| {scale:.2e})")
    print(f"Legendre analysis: real split {result['legendre_speedup']:.2f}× the complex einsum "
          f"(max |Δ| {legendre_gap:.1e})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
