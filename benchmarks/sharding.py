"""Cost of domain decomposition: per-step time of the Aliev–Panfilov rollout and of its revolve
gradient on one device and on meshes of virtual CPU devices, plus the halo traffic per step
read from the compiled program (the sizes of its collective-permute operations).

    .venv/bin/python benchmarks/sharding.py                 # 128² and 256², meshes 1×1 1×8 2×4
    .venv/bin/python benchmarks/sharding.py --quick         # 64², seconds

The script sets ``--xla_force_host_platform_device_count`` itself (before JAX starts). On a CPU
the "devices" share the same cores, so the ratio measures the overhead of tiling and halo
exchange, not a speed-up; on a machine with several GPUs run it with ``--platform gpu`` to get
real scaling. Prints a table and writes JSON (default ``benchmarks/results/sharding.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

N_VIRTUAL = 8
if "--platform" not in sys.argv or "cpu" in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={N_VIRTUAL}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdefit.adjoint import LossChain, Revolve  # noqa: E402
from pdefit.model.system import stepper  # noqa: E402
from pdefit.numerics.grid import Grid  # noqa: E402
from pdefit.parallel.domain import AXES, Domain  # noqa: E402
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov  # noqa: E402

DTYPE_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def halo_bytes(hlo_text: str) -> int:
    """Total bytes moved by the collective-permutes of one program body."""
    total = 0
    for match in re.finditer(r"= (\w+)\[([\d,]*)\][^\n]*? collective-permute\(", hlo_text):
        dtype, dims = match.group(1), match.group(2)
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * DTYPE_BYTES.get(dtype, 4)
    return total


def state_for(grid: Grid):
    """A spiral-free but active state: excited and refractory stripes (cheap to make)."""
    y, x = np.meshgrid(*(np.arange(n) for n in grid.shape), indexing="ij")
    u = (np.sin(0.2 * x) > 0.6).astype(np.float32)
    v = 0.5 * (np.cos(0.15 * y) > 0.3).astype(np.float32)
    return {"u": jnp.asarray(u)[None], "v": jnp.asarray(v)[None]}


def build(grid: Grid, mesh_shape, n_steps: int, snapshots: int):
    """Jitted forward rollout and revolve gradient on the given mesh (None: one device)."""
    system = AlievPanfilov()
    params = {k: jnp.asarray(v, jnp.float32) for k, v in AP96.items()}
    domain = Domain.build(mesh_shape)
    tile = domain.tile_grid(grid)
    step = stepper(system, tile, "euler")
    dt = 0.05

    def chain_step(x, p, n):
        return step(x, p, n * dt, dt)

    def cost(x, p, n, data):
        return jnp.where(n % 50 == 0, jnp.sum((x["u"] - data) ** 2), 0.0).astype(jnp.float32)

    chain = LossChain(chain_step, cost)

    def forward_local(x, p):
        x = jax.tree.map(lambda a: a[0], x)
        x = jax.lax.fori_loop(0, n_steps, lambda n, s: chain_step(s, p, n), x)
        return jax.lax.psum(jnp.sum(x["u"]), AXES)

    def loss_local(x, p, data):
        x = jax.tree.map(lambda a: a[0], x)
        return jax.lax.psum(Revolve(snapshots).loss(chain, x, p, data[0], n_steps), AXES)

    field = {"u": P("e", "y", "x"), "v": P("e", "y", "x")}
    forward = jax.jit(jax.shard_map(forward_local, mesh=domain.mesh, in_specs=(field, P()),
                                    out_specs=P()))
    loss = jax.shard_map(loss_local, mesh=domain.mesh,
                         in_specs=(field, P(), P("e", "y", "x")), out_specs=P())
    gradient = jax.jit(jax.grad(loss, argnums=1))
    x0 = jax.device_put(state_for(grid), domain.sharding(P("e", "y", "x")))
    data = jax.device_put(x0["u"] * 0.9, domain.sharding(P("e", "y", "x")))
    params = jax.device_put(params, domain.sharding(P()))
    return forward, gradient, (x0, params), (x0, params, data)


def timed(fn, args, repeats: int) -> tuple[float, float]:
    """(compile + first run, best of ``repeats`` runs) in seconds."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return first, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--meshes", nargs="+", default=["1x1", "1x8", "2x4", "8x1"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--snapshots", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/sharding.json")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.repeats = [64], 100, 1
    rows = []
    for n in args.sizes:
        grid = Grid((n, n), (1.0, 1.0))
        base = None
        for mesh_name in args.meshes:
            shape = tuple(int(k) for k in mesh_name.split("x"))
            if int(np.prod(shape)) > jax.device_count():
                continue
            forward, gradient, fargs, gargs = build(grid, shape, args.steps, args.snapshots)
            hlo = forward.lower(*fargs).compile().as_text()
            f_first, f_best = timed(forward, fargs, args.repeats)
            g_first, g_best = timed(gradient, gargs, args.repeats)
            row = {
                "grid": n, "mesh": mesh_name, "devices": int(np.prod(shape)),
                "forward_step_ms": 1e3 * f_best / args.steps,
                "gradient_step_ms": 1e3 * g_best / args.steps,
                "halo_bytes_per_step": halo_bytes(hlo),
                "tile_cells": n * n // int(np.prod(shape)),
                "compile_forward_s": f_first - f_best, "compile_gradient_s": g_first - g_best,
            }
            if base is None:
                base = row
            row["forward_overhead"] = row["forward_step_ms"] / base["forward_step_ms"]
            row["gradient_overhead"] = row["gradient_step_ms"] / base["gradient_step_ms"]
            rows.append(row)
            print(f"{n:>5}² {mesh_name:>5}: forward {row['forward_step_ms']:8.3f} ms/step "
                  f"(×{row['forward_overhead']:.2f}), gradient {row['gradient_step_ms']:8.3f} "
                  f"ms/step (×{row['gradient_overhead']:.2f}), halo "
                  f"{row['halo_bytes_per_step']:>7} B/step", flush=True)
    header = (f"{'grid':>6} {'mesh':>5} {'fwd ms/step':>12} {'fwd ×':>6} {'grad ms/step':>13} "
              f"{'grad ×':>7} {'halo B/step':>12} {'tile cells':>11}")
    print("\n" + header)
    for r in rows:
        print(f"{r['grid']:>5}² {r['mesh']:>5} {r['forward_step_ms']:12.3f} "
              f"{r['forward_overhead']:6.2f} {r['gradient_step_ms']:13.3f} "
              f"{r['gradient_overhead']:7.2f} {r['halo_bytes_per_step']:12d} "
              f"{r['tile_cells']:11d}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "steps": args.steps, "snapshots": args.snapshots,
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(), "command": sys.argv}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
