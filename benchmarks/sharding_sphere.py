"""The sphere (``sphere_ns``) split over latitude, for ``benchmarks/sharding.py --system
sphere_ns``: per-step time of the forward rollout and of its revolve gradient (with respect to
ν and Ω) on meshes [k, 1] of k = 1, 2, 4, 8 devices, the bytes of the collective sums
(all-reduce) of one step read from the compiled program, and the memory per device of the
compiled gradient (``compiled.memory_analysis()``: arguments + outputs + temporaries −
aliased; XLA's static plan, not a measured process).

Grids nlat × 2·nlat (default 64 × 128, T42, and 128 × 256, T85). On virtual CPU devices that
share the same cores the ratio against one device is the overhead of the banded transforms and
their collective sums, not a speed-up. JSON: ``benchmarks/results/sharding_sphere.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.numerics.grid import Grid
from pdefit.systems.sphere_ns import SphereNS

SPHERE_MESHES = ["1x1", "2x1", "4x1", "8x1"]
SPHERE_PARAMS = {"nu": 1.0e-3, "Omega": 0.0}


def sphere_build(nlat: int, mesh_shape, n_steps: int, snapshots: int, dtype, build_case):
    """``build_case`` (benchmarks/sharding.py) for the sphere on nlat × 2·nlat."""
    grid = Grid((nlat, 2 * nlat), (math.pi / nlat, math.pi / nlat), ("neumann", "periodic"))
    system = SphereNS(init_lmax=8)
    params = {k: jnp.asarray(v, dtype) for k, v in SPHERE_PARAMS.items()}
    state = {k: jnp.asarray(v, dtype)[None]
             for k, v in system.initial_state(grid, params, 0).items()}
    dt = 0.2 * min(system.max_stable_dt(SPHERE_PARAMS, grid),
                   system.cfl_dt({"zeta": state["zeta"][0]}, SPHERE_PARAMS, grid))
    return build_case(system, params, state, grid, mesh_shape, n_steps, snapshots, dt, 10)


def sphere_row(nlat: int, mesh_name: str, args, dtype, helpers) -> dict:
    build_case, timed, collective_bytes = helpers[:3]
    shape = tuple(int(k) for k in mesh_name.split("x"))
    forward, gradient, fargs, gargs = sphere_build(nlat, shape, args.steps, args.snapshots,
                                                   dtype, build_case)
    forward_c = forward.lower(*fargs).compile()
    gradient_c = gradient.lower(*gargs).compile()
    memory = gradient_c.memory_analysis()
    per_device = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                  + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
    _, f_best = timed(forward_c, fargs, args.repeats)
    _, g_best = timed(gradient_c, gargs, args.repeats)
    return {"grid": [nlat, 2 * nlat], "mesh": mesh_name, "devices": int(np.prod(shape)),
            "rows_per_tile": nlat // shape[0],
            "forward_step_ms": 1e3 * f_best / args.steps,
            "gradient_step_ms": 1e3 * g_best / args.steps,
            "all_reduce_bytes_per_step": collective_bytes(forward_c.as_text(), "all-reduce"),
            "gradient_per_device_mib": per_device / 2**20}


def run_sphere(args, helpers) -> None:
    """Forward and gradient timings of the sphere on latitude meshes; a table and JSON."""
    dtype = jnp.dtype(args.dtype)
    with_overheads = helpers[3]
    sizes = args.sizes or ([32] if args.quick else [64, 128])
    meshes = args.meshes or SPHERE_MESHES
    args.steps = args.steps or (10 if args.quick else 40)
    rows, base = [], {}
    for nlat in sizes:
        for mesh_name in meshes:
            shape = [int(k) for k in mesh_name.split("x")]
            if math.prod(shape) > jax.device_count() or nlat % shape[0]:
                continue
            row = sphere_row(nlat, mesh_name, args, dtype, helpers)
            rows.append(with_overheads(row, base.setdefault(nlat, row)))
            print(f"{nlat}×{2 * nlat} {mesh_name:>4}: forward {row['forward_step_ms']:.3f} ms/step"
                  f" (×{row['forward_overhead']:.2f}), gradient {row['gradient_step_ms']:.3f} "
                  f"ms/step (×{row['gradient_overhead']:.2f})", flush=True)
    print(f"\nsphere_ns over latitude, {args.dtype}, {args.steps} Euler steps, revolve with "
          f"{args.snapshots} snapshots")
    print(f"{'grid':>9} {'mesh':>5} {'rows':>5} {'fwd ms/step':>12} {'fwd ×':>6} "
          f"{'grad ms/step':>13} {'grad ×':>7} {'all-reduce B/step':>18} {'grad MiB/dev':>13}")
    for r in rows:
        print(f"{r['grid'][0]:>4}×{r['grid'][1]:<4} {r['mesh']:>5} {r['rows_per_tile']:5d} "
              f"{r['forward_step_ms']:12.3f} {r['forward_overhead']:6.2f} "
              f"{r['gradient_step_ms']:13.3f} {r['gradient_overhead']:7.2f} "
              f"{r['all_reduce_bytes_per_step']:18d} {r['gradient_per_device_mib']:13.1f}")
    out = Path(args.out or "benchmarks/results/sharding_sphere.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "steps": args.steps, "snapshots": args.snapshots, "dtype": args.dtype,
        "integrator": "euler", "jax": jax.__version__,
        "note": ("all_reduce_bytes_per_step: the collective sums in the program (the loop body "
                 "once) plus the 4-byte sum of the loss; gradient_per_device_mib leaves out "
                 "constants: on one device the Legendre tables are constants, on a tile the "
                 "band cut from them is a temporary, so it counts there"),
        "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
        "command": sys.argv}, indent=2))
    print(f"\nwrote {out}")
