"""Whether a run nudged towards the recorded voltage sets BOCF's hidden gates: the issue's
"a short run nudged towards the data" as a first guess, measured.

What it measures
----------------
On a voltage-only BOCF dataset (``--data``, made by ``benchmarks/realistic.py``; it stores the
gates for scoring) the model runs from the first frame (u as recorded, the gates at the
shipped quasi-steady guess) for K frames with u relaxed towards the recording,

    du/dt = f(u, v, w, s) + κ (u_rec(t) − u),

u_rec linear in time between frames, stepped as the dataset's fit steps (its integrator,
``--steps-per-frame`` steps a frame). At frame K it prints the gates' relative L2 error
against the dataset's, beside the quasi-steady guess made from the recorded u at frame K,
and the misfit (in units of σ²) of a free run from the nudged state over the frames after
K, the window a fit would then fit (for scale: the same from the recorded u and the
dataset's noisy gates at frame K). At the dataset's true parameters or at a start seed's
(``--start-seed``: the parameters a fit of the dataset's recorded ``fit.params`` draws
with its ``fit.perturb``). Prints a table, writes JSON.

How to run
----------
    R=runs/bench/realistic/bocf_from_voltage/sigma-0.02      # realistic.py's runs
    python benchmarks/nudged_gates.py --data $R/data.zarr
    python benchmarks/nudged_gates.py --data $R/data.zarr --start-seed 0 --frames 10 20
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# gate_guess.py: the sibling script this one shares its dataset handling with.
from gate_guess import GATES, as_arrays, opened, relative_l2, start_parameters, write_results

from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import make_stepper


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--start-seed", type=int, default=None,
                        help="parameters of this start seed (default: the truth)")
    parser.add_argument("--frames", type=int, nargs="+", default=[10, 20, 40],
                        help="frames K nudged")
    parser.add_argument("--kappa", type=float, nargs="+", default=[0.5, 2.0, 8.0],
                        help="relaxation rates κ (1 / time unit)")
    parser.add_argument("--steps-per-frame", type=int, default=14)
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/nudged_gates.json"))
    return parser.parse_args()


def runs(system, grid: Grid, integrator: str, params: dict, recorded: jax.Array, dt: float,
         steps_per_frame: int):
    """(nudged(κ, K) → the state at frame K, free(state) → u at every frame after the
    state's), both stepped by ``integrator``; the nudged rate takes (params, u_rec, κ)."""
    free_step = make_stepper(integrator, lambda s, p, t: system.rhs(s, p, t, grid))

    def nudged_rate(state, forcing, t):
        physical, target, kappa = forcing
        out = system.rhs(state, physical, t, grid)
        return {**out, "u": out["u"] + kappa * (target - state["u"])}

    nudged_step = make_stepper(integrator, nudged_rate)

    @jax.jit
    def nudged(kappa, frames):
        state = {"u": recorded[0], **system.initial_guess({"u": recorded[0]}, params)}

        def frame(state, i):
            def sub(state, j):
                weight = (j + 0.5) / steps_per_frame  # u_rec held over a step at its middle
                target = (1 - weight) * recorded[i] + weight * recorded[i + 1]
                return nudged_step(state, (params, target, kappa), 0.0, dt), None
            return jax.lax.scan(sub, state, jnp.arange(steps_per_frame))[0], None

        index = jnp.arange(recorded.shape[0] - 1)
        return jax.lax.scan(lambda s, i: jax.lax.cond(i < frames, frame, lambda s, _: (s, None),
                                                      s, i), state, index)[0]

    @jax.jit
    def free(state):
        def frame(state, _):
            state = jax.lax.fori_loop(0, steps_per_frame,
                                      lambda _, s: free_step(s, params, 0.0, dt), state)
            return state, state["u"]
        return jax.lax.scan(frame, state, None, length=recorded.shape[0] - 1)[1]

    return nudged, free


def misfit_after(free, state: dict, recorded: jax.Array, count: int) -> float:
    """Mean squared misfit of u over the frames after ``count``, run freely from ``state``."""
    after = np.asarray(free(state))[: recorded.shape[0] - 1 - count]
    return float(np.mean((after - np.asarray(recorded[count + 1:])) ** 2))


def main() -> None:
    args = arguments()
    dataset, config, system = opened(args.data)
    meta = dataset.meta
    truth = dict(meta.true_params)
    params = as_arrays(truth if args.start_seed is None
                       else start_parameters(dataset, system, config["fit"], args.start_seed))
    grid = Grid(meta.grid_shape, meta.grid_spacing, meta.boundaries)
    integrator = config["system"]["integrator"]
    recorded = jnp.asarray(dataset.read("u", 0), jnp.float64)
    gates = {g: np.asarray(dataset.read(g, 0), np.float64) for g in GATES}
    sigma = float(meta.noise["sigma"])
    dt = meta.dt * meta.steps_per_frame / args.steps_per_frame
    nudged, free = runs(system, grid, integrator, params, recorded, dt,
                        args.steps_per_frame)
    started = time.perf_counter()
    rows = []
    for count in args.frames:
        guess = system.initial_guess({"u": recorded[count]}, params)
        rows.append({"guess": "quasi-steady (shipped)", "frames": count, "kappa": None,
                     **{g: relative_l2(np.asarray(guess[g]), gates[g][count]) for g in GATES},
                     "misfit_over_sigma2": None})
        known = {"u": recorded[count], **{g: jnp.asarray(gates[g][count]) for g in GATES}}
        rows.append({"guess": "the dataset's gates (noisy)", "frames": count, "kappa": None,
                     **dict.fromkeys(GATES, 0.0),
                     "misfit_over_sigma2": misfit_after(free, known, recorded, count) / sigma**2})
        for kappa in args.kappa:
            state = nudged(kappa, count)
            misfit = misfit_after(free, state, recorded, count)
            rows.append({"guess": "nudged", "frames": count, "kappa": kappa,
                         **{g: relative_l2(np.asarray(state[g]), gates[g][count])
                            for g in GATES},
                         "misfit_over_sigma2": misfit / sigma**2})
    seconds = time.perf_counter() - started
    which = "truth" if args.start_seed is None else f"start seed {args.start_seed}"
    print(f"{args.data}, parameters: {which}; {seconds:.0f} s\n")
    print("| gates at frame K from | K | κ | v L2 % | w L2 % | s L2 % "
          "| free run after K: misfit / σ² |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kappa = "—" if r["kappa"] is None else f"{r['kappa']:g}"
        misfit = "—" if r["misfit_over_sigma2"] is None else f"{r['misfit_over_sigma2']:.4g}"
        print(f"| {r['guess']} | {r['frames']} | {kappa} | {100 * r['v']:.1f} | "
              f"{100 * r['w']:.1f} | {100 * r['s']:.1f} | {misfit} |")
    write_results(args, rows, seconds=seconds)


if __name__ == "__main__":
    main()
