"""How far BOCF's first guess of the hidden gates is from their truth, and whether the voltage
trace of each cell would give a better one.

What it measures
----------------
On a voltage-only BOCF dataset (``--data``, made by ``benchmarks/realistic.py``; the dataset
stores the gates for scoring), the relative L2 error of v, w and s at t = 0 of:

* the shipped first guess (``BOCF.initial_guess``: each gate at its quasi-steady value for the
  observed u(0));
* a trace-matched guess, not shipped: a library of single-cell action potentials paced to
  their steady state at cycle lengths ``--cycle-lengths`` (Heun, ``--dt``), sampled every
  0.05 ms; each cell takes the gates of the library point (cycle length, phase) whose voltage
  over the first K observed frames is closest to the cell's (least squares), for each K of
  ``--frames``.

Both at the dataset's true parameters or at a start seed's (``--start-seed``: the parameters a
fit of the dataset's recorded ``fit.params`` draws for that ``fit.perturb.seed``), since a first
guess is made at the start. Prints a table, writes JSON.

How to run
----------
    R=runs/bench/realistic/bocf_from_voltage/sigma-0.02      # realistic.py's runs
    python benchmarks/gate_guess.py --data $R/data.zarr
    python benchmarks/gate_guess.py --data <data.zarr> --start-seed 0 --cycle-lengths 120 600 40
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pdefit
from pdefit import data as zd
from pdefit.numerics.grid import Grid
from pdefit.systems import get_system

GATES = ("v", "w", "s")
SAMPLE = 0.05  # ms between library points


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--start-seed", type=int, default=None,
                        help="parameters of this start seed (default: the truth)")
    parser.add_argument("--cycle-lengths", type=float, nargs=3, default=(120, 600, 20),
                        metavar=("FIRST", "LAST", "STEP"), help="ms")
    parser.add_argument("--dt", type=float, default=0.01, help="library time step (ms)")
    parser.add_argument("--beats", type=int, default=8, help="beats paced before the sampled one")
    parser.add_argument("--frames", type=int, nargs="+", default=[3, 6, 11, 21, 41, 101])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/gate_guess.json"))
    return parser.parse_args()


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def write_results(args: argparse.Namespace, rows: list[dict], **extra: float) -> None:
    """The command's arguments, ``extra`` and the table's rows as JSON at ``args.output``."""
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                       **extra, "rows": rows}, indent=2))


def paced_beat(system, params, cycle_length: float, dt: float, beats: int) -> dict:
    """One cell (a 1 × 1 no-flux grid) paced by 0.5/ms for 1 ms every ``cycle_length`` ms: the
    last of ``beats`` + 1 beats, sampled every SAMPLE ms."""
    grid = Grid((1, 1), (1.0, 1.0))
    n, every = round(cycle_length / dt), round(SAMPLE / dt)
    stimulus = jnp.where(jnp.arange(n) * dt < 1.0, 0.5, 0.0)

    def rate(state, current):
        out = system.rhs(state, params, 0.0, grid)
        return {**out, "u": out["u"] + current}

    def step(state, current):
        k1 = rate(state, current)
        k2 = rate({f: state[f] + dt * k1[f] for f in state}, current)
        state = {f: state[f] + 0.5 * dt * (k1[f] + k2[f]) for f in state}
        return state, state

    def beat(state, _):
        return jax.lax.scan(step, state, stimulus)[0], None

    rest = {f: jnp.full((1, 1), value) for f, value in system.rest.items()}
    state, _ = jax.lax.scan(beat, rest, None, length=beats)
    _, trace = jax.lax.scan(step, state, stimulus)
    return {f: np.asarray(v[every - 1::every]).reshape(-1) for f, v in trace.items()}


def matched(library: list[dict], u: np.ndarray, frame_dt: float, count: int) -> dict:
    """Each cell's gates at the library point whose voltage over ``count`` frames is closest."""
    observed = jnp.asarray(u[:count].reshape(count, -1))
    best = jnp.full(observed.shape[1], jnp.inf)
    gates = {g: jnp.zeros(observed.shape[1]) for g in GATES}
    stride = round(frame_dt / SAMPLE)
    for beat in library:
        length = beat["u"].shape[0]
        # The steady beat repeats: phase + k frames wraps around the cycle.
        index = (np.arange(length)[:, None] + stride * np.arange(count)[None, :]) % length
        traces = jnp.asarray(beat["u"][index])
        cost = (jnp.sum(traces**2, 1)[:, None] - 2.0 * traces @ observed
                + jnp.sum(observed**2, 0)[None, :])
        phase = jnp.argmin(cost, 0)
        closest = cost[phase, jnp.arange(observed.shape[1])]
        better = closest < best
        best = jnp.where(better, closest, best)
        for g in GATES:
            gates[g] = jnp.where(better, jnp.asarray(beat[g])[phase], gates[g])
    return {g: np.asarray(v).reshape(u.shape[1:]) for g, v in gates.items()}


def opened(path: Path):
    """(the dataset at ``path``, its recorded config, its system), in float64."""
    jax.config.update("jax_enable_x64", True)
    dataset = zd.open_dataset(path)
    config = dataset.meta.provenance["config"]
    return dataset, config, get_system(config["system"]["name"], **config["system"]["options"])


def start_parameters(dataset, system, fit: dict, seed: int) -> dict[str, float]:
    """The start a fit of ``fit["params"]`` (a dataset's recorded ``fit`` config) draws with
    its ``fit["perturb"]`` for ``fit.perturb.seed = seed`` (pdefit.build_problem draws it as
    the command line does; the recorded ``fit.start`` is not read: realistic.py's datasets
    record none, and an empty one is the truth)."""
    perturb = fit["perturb"]
    setup = pdefit.build_problem(system, dataset, fit=list(fit["params"]), observe=["u"],
                                 initial_fields=dict.fromkeys(system.fields, "fit"),
                                 perturb=(perturb["low"], perturb["high"], seed))
    return {**dataset.meta.true_params, **setup.start_values}


def as_arrays(params: dict) -> dict:
    return {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}


def main() -> None:
    args = arguments()
    dataset, config, system = opened(args.data)
    meta = dataset.meta
    params = as_arrays(dict(meta.true_params) if args.start_seed is None
                       else start_parameters(dataset, system, config["fit"], args.start_seed))
    u = np.asarray(dataset.read("u", 0), np.float64)
    truth = {g: np.asarray(dataset.read(g, 0, frames=0), np.float64) for g in GATES}
    rows = []
    guess = system.initial_guess({"u": jnp.asarray(u[0])}, params)
    rows.append({"guess": "quasi-steady (shipped)", "frames": 1,
                 **{g: relative_l2(np.asarray(guess[g]), truth[g]) for g in GATES}})
    started = time.perf_counter()
    first, last, step = args.cycle_lengths
    cycle_lengths = np.arange(first, last + step / 2, step)
    library = [paced_beat(system, params, float(c), args.dt, args.beats) for c in cycle_lengths]
    library_s = time.perf_counter() - started
    for count in args.frames:
        gates = matched(library, u, meta.dt * meta.steps_per_frame, count)
        rows.append({"guess": "trace-matched", "frames": count,
                     **{g: relative_l2(gates[g], truth[g]) for g in GATES}})
    which = "truth" if args.start_seed is None else f"start seed {args.start_seed}"
    print(f"{args.data}, parameters: {which}; library: {len(cycle_lengths)} cycle lengths "
          f"{first:g}–{last:g} ms in {library_s:.0f} s\n")
    print("| first guess | frames matched | v(0) L2 % | w(0) L2 % | s(0) L2 % |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['guess']} | {r['frames']} | {100 * r['v']:.1f} | {100 * r['w']:.1f} | "
              f"{100 * r['s']:.1f} |")
    write_results(args, rows, library_s=library_s)


if __name__ == "__main__":
    main()
