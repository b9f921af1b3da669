"""Cost of domain decomposition: per-step time of the Aliev–Panfilov rollout and of its revolve
gradient on one device and on meshes of virtual CPU devices, plus the halo traffic per step
read from the compiled program (the sizes of its collective-permute operations).

    .venv/bin/python benchmarks/sharding.py                 # 128² and 256², meshes 1×1 1×8 2×4
    .venv/bin/python benchmarks/sharding.py --quick         # 64², seconds
    .venv/bin/python benchmarks/sharding.py --system rayleigh_benard   # RB, its pencil solve
    .venv/bin/python benchmarks/sharding.py --system sphere_ns   # the sphere over latitude

Rayleigh–Bénard (``--system rayleigh_benard``, grids nz × 4nz, default 64 × 256, on 1/2/4/8
devices) adds the bytes of its all-to-all transposes per program body and the memory per
device of a 256 × 1024 revolve gradient on 4 devices, read from ``compiled.memory_analysis()``
of the compiled program (arguments + outputs + temporaries − aliased: XLA's static buffer plan
of one device's program, not a measurement of a running process). JSON:
``benchmarks/results/sharding_rb.json``.

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
from pdefit.systems.rayleigh_benard import RayleighBenard  # noqa: E402

DTYPE_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1,
               "c64": 8, "c128": 16}



def with_overheads(row: dict, first: dict) -> dict:
    """``row`` with its forward and gradient times as multiples of ``first``'s (one device)."""
    row["forward_overhead"] = row["forward_step_ms"] / first["forward_step_ms"]
    row["gradient_overhead"] = row["gradient_step_ms"] / first["gradient_step_ms"]
    return row

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
    """Jitted forward rollout and revolve gradient of Aliev–Panfilov on the given mesh."""
    params = {k: jnp.asarray(v, jnp.float32) for k, v in AP96.items()}
    return build_case(AlievPanfilov(), params, state_for(grid), grid, mesh_shape, n_steps,
                      snapshots, dt=0.05, every=50)


def build_case(system, params, state, grid: Grid, mesh_shape, n_steps: int, snapshots: int,
               dt: float, every: int):
    """Jitted forward rollout and revolve gradient (with respect to the parameters) of
    ``system`` from ``state`` (fields with a leading experiment axis of one) on the given mesh,
    the first field observed every ``every`` steps."""
    domain = Domain.build(mesh_shape)
    step = stepper(system, domain.tile_grid(grid), "euler")
    observed = system.fields[0]
    dtype = jax.tree.leaves(state)[0].dtype

    def chain_step(x, p, n):
        return step(x, p, n * dt, dt)

    def cost(x, p, n, data):
        return jnp.where(n % every == 0, jnp.sum((x[observed] - data) ** 2), 0.0).astype(dtype)

    chain = LossChain(chain_step, cost)

    def forward_local(x, p):
        x = jax.tree.map(lambda a: a[0], x)
        x = jax.lax.fori_loop(0, n_steps, lambda n, s: chain_step(s, p, n), x)
        return jax.lax.psum(jnp.sum(x[observed]), AXES)

    def loss_local(x, p, data):
        x = jax.tree.map(lambda a: a[0], x)
        return jax.lax.psum(Revolve(snapshots).loss(chain, x, p, data[0], n_steps), AXES)

    field = {f: P("e", "y", "x") for f in system.fields}
    forward = jax.jit(jax.shard_map(forward_local, mesh=domain.mesh, in_specs=(field, P()),
                                    out_specs=P()))
    loss = jax.shard_map(loss_local, mesh=domain.mesh,
                         in_specs=(field, P(), P("e", "y", "x")), out_specs=P())
    gradient = jax.jit(jax.grad(loss, argnums=1))
    x0 = jax.device_put(state, domain.sharding(P("e", "y", "x")))
    data = jax.device_put(x0[observed] * 0.9, domain.sharding(P("e", "y", "x")))
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


# -- Rayleigh–Bénard: the pencil-decomposed pressure solve ----------------------------------------

RB_PARAMS = {"Ra": 1.0e5, "Pr": 1.0}
RB_MESHES = ["1x1", "1x2", "2x1", "1x4", "2x2", "4x1", "1x8", "2x4"]
RB_MEMORY_GRID = (256, 1024)  # nz × nx, aspect 4: the published 1024 × 256
RB_MEMORY_MESHES = ["1x1", "1x4", "2x2", "4x1"]


def collective_bytes(hlo_text: str, op: str) -> int:
    """Total bytes of the results of the ``op`` operations in a program's text (each loop body
    once: one SSP-RK3 stage of Rayleigh–Bénard)."""
    total = 0
    for match in re.finditer(rf"= ([^\n]*?) {op}\(", hlo_text):  # one result or a tuple
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += size * DTYPE_BYTES.get(dtype, 4)
    return total


def rb_build(nz: int, mesh_shape, n_steps: int, snapshots: int, dtype):
    """:func:`build_case` for Rayleigh–Bénard on nz × 4nz square cells, from a seeded θ."""
    nx = 4 * nz
    grid = Grid((nz, nx), (1.0 / nz, 4.0 / nx), ("neumann", "periodic"))
    system = RayleighBenard()
    params = {k: jnp.asarray(v, dtype) for k, v in RB_PARAMS.items()}
    state = {k: v[None] for k, v in system.perturbation(grid, 0, dtype).items()}
    dt = 0.5 * system.max_stable_dt(RB_PARAMS, grid)
    return build_case(system, params, state, grid, mesh_shape, n_steps, snapshots, dt, 10)


def rb_timing_row(nz: int, mesh_name: str, args, dtype) -> dict:
    shape = tuple(int(k) for k in mesh_name.split("x"))
    forward, gradient, fargs, gargs = rb_build(nz, shape, args.steps, args.snapshots, dtype)
    hlo = forward.lower(*fargs).compile().as_text()
    f_first, f_best = timed(forward, fargs, args.repeats)
    g_first, g_best = timed(gradient, gargs, args.repeats)
    return {"grid": [nz, 4 * nz], "mesh": mesh_name, "devices": int(np.prod(shape)),
            "forward_steps_per_s": args.steps / f_best,
            "forward_step_ms": 1e3 * f_best / args.steps,
            "gradient_s": g_best, "gradient_step_ms": 1e3 * g_best / args.steps,
            "all_to_all_bytes_per_stage": collective_bytes(hlo, "all-to-all"),
            "halo_bytes_per_stage": collective_bytes(hlo, "collective-permute"),
            "compile_forward_s": f_first - f_best, "compile_gradient_s": g_first - g_best}


def rb_memory_row(mesh_name: str, args, dtype) -> dict:
    """Per-device memory of the compiled revolve gradient on the memory grid."""
    nz, nx = args.memory_grid
    shape = tuple(int(k) for k in mesh_name.split("x"))
    _, gradient, _, gargs = rb_build(nz, shape, args.steps, args.snapshots, dtype)
    assert nx == 4 * nz, "the memory grid is nz × 4nz"
    memory = gradient.lower(*gargs).compile().memory_analysis()
    sizes = {k: int(getattr(memory, f"{k}_size_in_bytes")) for k in
             ("argument", "output", "temp", "alias", "generated_code")}
    total = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
    return {"grid": [nz, nx], "mesh": mesh_name, "devices": int(np.prod(shape)),
            "per_device_mib": total / 2**20, **{f"{k}_mib": v / 2**20 for k, v in sizes.items()}}


def run_rayleigh_benard(args) -> None:
    """Forward and gradient timings on 1/2/4/8 devices, then memory per device; a table and
    JSON."""
    dtype = jnp.dtype(args.dtype)
    sizes = args.sizes or ([32] if args.quick else [64])
    meshes = args.meshes or RB_MESHES
    args.steps = args.steps or (20 if args.quick else 50)
    rows, base = [], {}
    for nz in sizes:
        for mesh_name in meshes:
            if int(np.prod([int(k) for k in mesh_name.split("x")])) > jax.device_count():
                continue
            row = rb_timing_row(nz, mesh_name, args, dtype)
            rows.append(with_overheads(row, base.setdefault(nz, row)))
            print(f"{nz}×{4 * nz} {mesh_name:>4}: {row['forward_steps_per_s']:8.1f} steps/s "
                  f"(×{row['forward_overhead']:.2f}), gradient {row['gradient_s']:.3f} s "
                  f"(×{row['gradient_overhead']:.2f}), all-to-all "
                  f"{row['all_to_all_bytes_per_stage']} B/stage", flush=True)
    memory = [rb_memory_row(m, args, dtype) for m in args.memory_meshes
              if int(np.prod([int(k) for k in m.split("x")])) <= jax.device_count()]
    print_rb_tables(rows, memory, args)
    out = Path(args.out or "benchmarks/results/sharding_rb.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "memory": memory, "steps": args.steps, "snapshots": args.snapshots,
        "dtype": args.dtype, "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(), "command": sys.argv}, indent=2))
    print(f"\nwrote {out}")


def print_rb_tables(rows: list, memory: list, args) -> None:
    print(f"\nRayleigh–Bénard, {args.dtype}, {args.steps} steps, revolve with "
          f"{args.snapshots} snapshots")
    print(f"{'grid':>9} {'mesh':>5} {'steps/s':>9} {'fwd ×':>6} {'grad s':>8} {'grad ×':>7} "
          f"{'a2a B/stage':>12} {'halo B/stage':>13}")
    for r in rows:
        print(f"{r['grid'][0]:>4}×{r['grid'][1]:<4} {r['mesh']:>5} "
              f"{r['forward_steps_per_s']:9.1f} {r['forward_overhead']:6.2f} "
              f"{r['gradient_s']:8.3f} {r['gradient_overhead']:7.2f} "
              f"{r['all_to_all_bytes_per_stage']:12d} {r['halo_bytes_per_stage']:13d}")
    print(f"\nmemory per device, revolve gradient ({args.steps} steps, {args.snapshots} "
          "snapshots), compiled.memory_analysis()")
    print(f"{'grid':>9} {'mesh':>5} {'total MiB':>10} {'args':>8} {'temp':>8} {'out':>7}")
    for m in memory:
        print(f"{m['grid'][0]:>4}×{m['grid'][1]:<4} {m['mesh']:>5} {m['per_device_mib']:10.1f} "
              f"{m['argument_mib']:8.1f} {m['temp_mib']:8.1f} {m['output_mib']:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", default="aliev_panfilov",
                        choices=["aliev_panfilov", "rayleigh_benard", "sphere_ns"])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--meshes", nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--snapshots", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--memory-grid", type=int, nargs=2, default=list(RB_MEMORY_GRID))
    parser.add_argument("--memory-meshes", nargs="+", default=list(RB_MEMORY_MESHES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.system == "sphere_ns":  # the sphere over latitude: benchmarks/sharding_sphere.py
        from benchmarks.sharding_sphere import run_sphere

        run_sphere(args, (build_case, timed, collective_bytes, with_overheads))
        return
    if args.system == "rayleigh_benard":
        run_rayleigh_benard(args)
        return
    args.sizes = args.sizes or [128, 256]
    args.meshes = args.meshes or ["1x1", "1x8", "2x4", "8x1"]
    args.steps = args.steps or 400
    args.out = args.out or "benchmarks/results/sharding.json"
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
            base = base or row
            rows.append(with_overheads(row, base))
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
