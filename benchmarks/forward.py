"""Forward speed of the BOCF model: pdefit (JAX, jitted) against plain NumPy and the memory bound.

What it measures
----------------
The seed paper's tissue setup on an n×n lattice: BOCF with the TNNP set, the isotropic 9-point
Laplacian with no-flux (mirror) boundaries, dx = 1, D = 0.1, Rush–Larsen with dt = 0.05 ms,
float32. The state is random (u ∈ [0, 1.5], gates ∈ [0, 1]); neither implementation branches on
values (every Heaviside is arithmetic), so the speed does not depend on it.

- ``pdefit``: ``simulate(stepper(BOCF, grid, "rush_larsen"), ...)`` jitted, ``--steps`` steps in
  one ``fori_loop``, keeping only the last state.
- ``numpy``: the same scheme written here with NumPy array operations (``np.pad`` for the halo,
  slices for the stencil, ``np.where`` for the switches), a Python loop over steps — the way one
  writes it without a compiler. Its state after 20 steps is compared with pdefit's (max |Δu|).
- ``bound``: a fused step must read and write the four fields once: 32 n² bytes. The device's
  best copy bandwidth is measured in the same run (over a 256 MiB buffer, counting read +
  write bytes: the best of a jitted XLA copy, a jitted ``a * s + b`` stream and, on the CPU
  backend only, a NumPy copy), and the bound is bandwidth ÷ 32 n² steps per second.

Each implementation runs once to warm up, then ``--repeats`` interleaved rounds; the table shows
the best time (the machine may be shared; the load average is recorded). Target (issue): pdefit
≥ 10× NumPy.

How to run
----------
    python benchmarks/forward.py                 # 256² and 512²
    python benchmarks/forward.py --sizes 128 --steps 200 --repeats 2   # quick

Writes ``benchmarks/results/forward.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.systems.bocf import BOCF, parameter_values

SYSTEM = BOCF(parameter_set="TNNP", laplacian="9pt", initial="rest")
PARAMS = {**parameter_values("TNNP"), "D": 0.1}
DT = 0.05
FIELDS = ("u", "v", "w", "s")
BYTES_PER_CELL = 2 * len(FIELDS) * 4  # read + write four float32 fields


def random_state(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"u": rng.uniform(0.0, 1.5, (n, n)).astype(np.float32),
            **{g: rng.uniform(0.0, 1.0, (n, n)).astype(np.float32) for g in FIELDS[1:]}}


# -- NumPy reference ----------------------------------------------------------------------------


def numpy_step(state: dict[str, np.ndarray], p: dict[str, np.float32], dt: np.float32,
               ) -> dict[str, np.ndarray]:
    """One Rush–Larsen step of BOCF, written directly in NumPy (float32 throughout)."""
    u, v, w, s = state["u"], state["v"], state["w"], state["s"]
    one, half = np.float32(1.0), np.float32(0.5)
    up = np.pad(u, 1, mode="symmetric")  # no-flux: mirror across the face
    lap = (4.0 * (up[:-2, 1:-1] + up[2:, 1:-1] + up[1:-1, :-2] + up[1:-1, 2:])
           + up[:-2, :-2] + up[:-2, 2:] + up[2:, :-2] + up[2:, 2:]
           - 20.0 * u) / np.float32(6.0)
    h_v = (u > p["theta_v"]).astype(np.float32)
    h_w = (u > p["theta_w"]).astype(np.float32)
    h_vm = (u > p["theta_v_minus"]).astype(np.float32)
    h_o = (u > p["theta_o"]).astype(np.float32)
    tau_o = (one - h_o) * p["tau_o1"] + h_o * p["tau_o2"]
    tau_so = p["tau_so1"] + (p["tau_so2"] - p["tau_so1"]) * half * (
        one + np.tanh(p["k_so"] * (u - p["u_so"])))
    j_fi = -v * h_v * (u - p["theta_v"]) * (p["u_u"] - u) / p["tau_fi"]
    j_so = (u - p["u_o"]) * (one - h_w) / tau_o + h_w / tau_so
    j_si = -h_w * w * s / p["tau_si"]
    v_inf = one - h_vm
    tau_v_minus = (one - h_vm) * p["tau_v1_minus"] + h_vm * p["tau_v2_minus"]
    w_inf = (one - h_o) * (one - u / p["tau_w_inf"]) + h_o * p["w_inf_star"]
    tau_w_minus = p["tau_w1_minus"] + (p["tau_w2_minus"] - p["tau_w1_minus"]) * half * (
        one + np.tanh(p["k_w_minus"] * (u - p["u_w_minus"])))
    s_inf = half * (one + np.tanh(p["k_s"] * (u - p["u_s"])))
    tau_s = (one - h_w) * p["tau_s1"] + h_w * p["tau_s2"]
    v_target = np.where(h_v > 0, np.float32(0.0), v_inf)
    v_tau = np.where(h_v > 0, p["tau_v_plus"], tau_v_minus)
    w_target = np.where(h_w > 0, np.float32(0.0), w_inf)
    w_tau = np.where(h_w > 0, p["tau_w_plus"], tau_w_minus)
    return {
        "u": u + dt * (p["D"] * lap - (j_fi + j_so + j_si)),
        "v": v_target + (v - v_target) * np.exp(-dt / v_tau),
        "w": w_target + (w - w_target) * np.exp(-dt / w_tau),
        "s": s_inf + (s - s_inf) * np.exp(-dt / tau_s),
    }


def numpy_run(state, n_steps: int):
    p = {k: np.float32(v) for k, v in PARAMS.items()}
    dt = np.float32(DT)
    for _ in range(n_steps):
        state = numpy_step(state, p, dt)
    return state


# -- pdefit -------------------------------------------------------------------------------------


def pdefit_runner(n: int, n_steps: int):
    step = stepper(SYSTEM, Grid((n, n), (1.0, 1.0)), "rush_larsen")
    p = {k: jnp.asarray(v, jnp.float32) for k, v in PARAMS.items()}

    @jax.jit
    def run(state):
        frames = simulate(step, state, p, 0.0, DT, n_steps, n_steps)
        return jax.tree.map(lambda f: f[-1], frames)

    return run


# -- bandwidth ----------------------------------------------------------------------------------


def copy_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> dict[str, float]:
    """Bytes per second moved (read + write) by a device-to-device copy of a jitted XLA
    program, by an XLA stream ``a * s + b``, and on the CPU backend by a NumPy copy (on an
    accelerator NumPy measures host memory, which bounds nothing the device does)."""
    x = jnp.ones(n_bytes // 4, jnp.float32)
    kernels = {"xla_copy": jax.jit(lambda a: a.copy()),
               "xla_stream": jax.jit(lambda a: a * 1.0001 + 0.5)}
    result = {}
    for name, kernel in kernels.items():
        jax.block_until_ready(kernel(x))
        best = min(_timed(lambda k=kernel: jax.block_until_ready(k(x))) for _ in range(repeats))
        result[name] = 2 * n_bytes / best
    if jax.default_backend() == "cpu":
        src = np.ones(n_bytes // 4, np.float32)
        dst = np.empty_like(src)
        result["numpy_copy"] = 2 * n_bytes / min(
            _timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return result


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- main ---------------------------------------------------------------------------------------


def measure(n: int, n_steps: int, numpy_steps: int, repeats: int) -> dict:
    state = random_state(n)
    run = pdefit_runner(n, n_steps)
    jstate = {k: jnp.asarray(v) for k, v in state.items()}
    jax.block_until_ready(run(jstate))  # compile + warm up
    # Agreement: 20 steps of each.
    check = pdefit_runner(n, 20)(jstate)
    reference = numpy_run(state, 20)
    agreement = float(np.max(np.abs(np.asarray(check["u"]) - reference["u"])))
    numpy_run(state, 2)  # warm up
    t_jax, t_np = [], []
    for _ in range(repeats):
        t_jax.append(_timed(lambda: jax.block_until_ready(run(jstate))))
        t_np.append(_timed(lambda: numpy_run(state, numpy_steps)))
    jax_rate = n_steps / min(t_jax)
    numpy_rate = numpy_steps / min(t_np)
    return {"n": n, "steps": n_steps, "numpy_steps": numpy_steps,
            "pdefit_steps_per_s": jax_rate, "numpy_steps_per_s": numpy_rate,
            "speedup": jax_rate / numpy_rate, "max_abs_du_after_20_steps": agreement,
            "pdefit_times_s": t_jax, "numpy_times_s": t_np,
            "bytes_per_step": BYTES_PER_CELL * n * n, "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--numpy-steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "forward.json")
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    best_bw = max(bandwidth.values())
    rows = []
    for n in args.sizes:
        row = measure(n, args.steps, args.numpy_steps, args.repeats)
        row["bound_steps_per_s"] = best_bw / row["bytes_per_step"]
        row["fraction_of_bound"] = row["pdefit_steps_per_s"] / row["bound_steps_per_s"]
        rows.append(row)

    print("copy bandwidth (read + write): " + ", ".join(
        f"{name} {value / 1e9:.2f} GB/s" for name, value in bandwidth.items())
        + f"; devices: {jax.devices()[0].device_kind} × {jax.device_count()}")
    header = (f"{'n':>5} {'pdefit steps/s':>15} {'NumPy steps/s':>14} {'speedup':>8} "
              f"{'bound steps/s':>14} {'of bound':>9} {'max|Δu| 20 steps':>17}")
    print(header)
    for r in rows:
        print(f"{r['n']:>5} {r['pdefit_steps_per_s']:>15.1f} {r['numpy_steps_per_s']:>14.1f} "
              f"{r['speedup']:>7.1f}× {r['bound_steps_per_s']:>14.1f} "
              f"{100 * r['fraction_of_bound']:>8.1f}% {r['max_abs_du_after_20_steps']:>17.2e}")
    target = all(r["speedup"] >= 10 for r in rows)
    print(f"target pdefit ≥ 10× NumPy: {'met' if target else 'MISSED'}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "forward", "commit": commit, "machine": platform.processor() or
        platform.machine(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
        "device": jax.devices()[0].device_kind, "bandwidth_bytes_per_s": bandwidth,
        "rows": rows, "target_met": target}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
