"""Which unknowns a long window's Levenberg–Marquardt steps can move: parameters, fields, both.

What it measures
----------------
From a fitted state — a run directory's ``fitted.npz``, or one stage's Orbax checkpoint
(``<run>/stage-<i>/checkpoints/<step>``: that stage's best θ) — on the first ``--frames``
frames of the experiment's dataset (``--data``, made by ``benchmarks/realistic.py``):

* ``--mode alternate``: ``--rounds`` times, ``--param-steps`` steps of the dense
  Levenberg–Marquardt on the parameters alone with the fitted initial fields held
  (``pdefit.fitting.gauss_newton.curvature_function``: the parameters' block; 0: none), then
  ``--field-steps`` steps of the matrix-free one on the fields with the parameters held
  (``--parameters-at-truth``: held at the truth, how low the fields alone take the loss
  there);
* ``--mode joint``: ``--rounds`` × ``--field-steps`` steps of the matrix-free
  Levenberg–Marquardt over both, as the experiment's stages take them (its
  ``optim.krylov_iterations`` conjugate-gradient iterations per step, override after ``--``);
* ``--mode reduced``: the parameters by a quasi-Newton method (SciPy's L-BFGS-B, at most
  ``--rounds`` evaluations) on the reduced misfit φ(p) = min over the fields of the loss
  (variable projection): each evaluation first fits the fields alone, ``--field-steps``
  matrix-free steps from the best evaluation's fields so far, and takes the gradient in the
  parameters there (at the fields' optimum it is φ's gradient); the parameters' coordinates
  are the unconstrained ones divided by ``--reduced-scale``, so that a unit step of
  L-BFGS-B changes them by that much (a first measurement: docs/benchmarks.md, "A first
  outer optimiser over the parameters on φ");
* ``--mode staged``: the parameters alone (the dense Levenberg–Marquardt, ``--param-steps``
  steps per window, u_so and k_so held in the first as the experiment holds them) on the
  first ``--stages`` frames in turn, the initial fields held where ``--start`` has them;
* ``--mode schur``: ``--rounds`` times, ``--field-steps`` steps on the fields alone, then one
  Gauss–Newton step of the parameters on φ: the Schur complement S of the fields and the
  reduced gradient g (:func:`pdefit.fitting.marginal.marginal_parts`, its field solves at
  most ``--schur-iterations`` conjugate-gradient iterations), δ = −(2S + λ diag 2S)⁻¹ g with
  λ = ``--schur-damping`` (S's negative eigenvalues, which cut-short solves leave, set to 0);
  it prints S's eigenvalues, the solves that stopped at their cap, and the cosines of −g and
  δ with the way to the truth (unconstrained coordinates), then takes the step, halved until
  the loss is finite (the fields refitted by the next round's steps).

Without ``--start`` the fit starts where the experiment starts (its perturbed parameters,
the system's first guess of the fields); ``--simulate`` makes ``--data`` first (the
experiment's recipe), and ``--fields-first 2 3 6 11 21`` fits the fields alone,
``--prep-steps`` steps on each of those windows in turn, before the mode's own steps, as the
experiment's held stages do (``benchmarks/gpu_reduced.sh`` runs the reduced search so in one
GPU call). ``--budget-s`` ends the reduced search at its best point once that many seconds
have passed since the script started, and the Schur rounds before a round that the time left
would not hold (as long as the last). ``--probe-spacing`` and ``--no-prior-floor`` set the
field solves' preconditioner (``marginal.field_block``) for a side-by-side comparison.

After each part: the loss on the window and every parameter's error against the dataset's
truth. A diagnostic of the voltage-only BOCF fits (docs/benchmarks.md, "Why the long windows
do not move the parameters"): it separates "the step cannot be resolved" from "the data do not
pull the parameters to the truth while the hidden fields are wrong".

How to run
----------
    R=runs/bench/realistic/bocf_from_voltage/sigma-0.02      # realistic.py's runs
    python benchmarks/block_steps.py --start $R/seed-0 --data $R/data.zarr --rounds 2
    python benchmarks/block_steps.py --start <run>/stage-3/checkpoints/29 --data <data.zarr> \\
        --frames 21 --mode joint --rounds 3 --field-steps 4 -- optim.krylov_iterations=100

Extra Hydra overrides after ``--`` go to the fit (e.g. ``system.options.heaviside_width=0.01``:
the smoothed model on the same data). Appends one JSON record per run to
``benchmarks/results/block_steps.jsonl`` (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The sibling benchmark's config and noise overrides (this directory is on the path).
from bocf_robustness import config, noise_overrides, simulate
from jax.flatten_util import ravel_pytree
from scipy.optimize import minimize

from pdefit import data as zd
from pdefit.app.config import to_options
from pdefit.fitting import assemble, krylov, marginal
from pdefit.fitting import gauss_newton as gn
from pdefit.fitting.train import run_fit
from pdefit.options import FitConfig
from pdefit.runtime.compile_cache import use_compilation_cache


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="bocf_from_voltage")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=0.02)
    parser.add_argument("--start", type=Path, default=None,
                        help="a run directory (fitted.npz) or a stage's checkpoint step")
    parser.add_argument("--data", type=Path, required=True,
                        help="the dataset (Zarr); with --simulate, <folder>/data.zarr to make")
    parser.add_argument("--simulate", action="store_true",
                        help="make --data first (the experiment's recipe, the overrides)")
    parser.add_argument("--fields-first", type=int, nargs="+", default=[],
                        help="windows (frames) on which the fields alone are fitted first")
    parser.add_argument("--prep-steps", type=int, default=30,
                        help="--fields-first: steps per window")
    parser.add_argument("--frames", type=int, default=None, help="window (default: all)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 6, 11, 21, 41, 101],
                        help="--mode staged: the windows, in frames")
    parser.add_argument("--mode", choices=("alternate", "joint", "reduced", "schur", "staged"),
                        default="alternate")
    parser.add_argument("--schur-iterations", type=int, default=200)
    parser.add_argument("--schur-damping", type=float, default=1e-3)
    parser.add_argument("--probe-spacing", type=int, default=marginal.PROBE_SPACING,
                        help="the field solves' probed diagonal: its lattice's spacing")
    parser.add_argument("--no-prior-floor", action="store_true",
                        help="the probed diagonal not floored at the fields' prior curvature "
                             "(with --probe-spacing 4: the preconditioner shipped until "
                             "2026-12-04)")
    parser.add_argument("--reduced-scale", type=float, default=0.1)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--mode reduced: start no evaluation this many seconds after "
                             "the script started")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--param-steps", type=int, default=8)
    parser.add_argument("--field-steps", type=int, default=3)
    parser.add_argument("--parameters-at-truth", action="store_true",
                        help="replace the start's parameters by the dataset's true ones "
                             "(the fields stay the start's)")
    parser.add_argument("--save", type=Path, default=None,
                        help="a folder for the states --start reads back: <save>/prep after "
                             "--fields-first, <save>/round-<r> after each schur round, "
                             "<save>/final at the end")
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/block_steps.jsonl"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    # bocf_robustness.simulate writes <folder>/data.zarr, replacing what is there: never a
    # dataset this script did not just make.
    if args.simulate and (args.data.name != "data.zarr" or args.data.exists()):
        parser.error(f"--data {args.data}: with --simulate, a data.zarr that does not exist yet")
    return args


def is_checkpoint(start: Path | None) -> bool:
    return start is not None and (start / "state").is_dir()


def save_state(folder: Path, theta: Any) -> None:
    """``theta`` as a checkpoint step ``--start`` reads back (never over an existing one)."""
    import orbax.checkpoint as ocp

    if (folder / "state").exists():
        raise FileExistsError(f"--save {folder}: a state is there already")
    folder.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((folder / "state").absolute(), {"best_theta": theta})
    checkpointer.wait_until_finished()


def save(args: argparse.Namespace, name: str, theta: Any) -> None:
    if args.save is not None:
        save_state(args.save / name, theta)


def setup_for(args: argparse.Namespace) -> Any:
    """The fit of one window from ``args.start`` (its parameters and fields)."""
    n = zd.open_dataset(args.data).meta.n_frames if args.frames is None else args.frames
    # One window, no stages (assemble.build_fit applies no stage holds; null drops them).
    overrides = [f"experiment={args.experiment}", f"system.grid.shape=[{args.grid},{args.grid}]",
                 *noise_overrides(args.sigma), f"data.path={args.data}", "fit.stages=null",
                 "fit.hold=null", f"data.frames=[{','.join(map(str, range(n)))}]",
                 *([] if args.start is None or is_checkpoint(args.start)
                   else [f"fit.start_from={args.start}"]),
                 *args.overrides]
    cfg = to_options(config(overrides), FitConfig)
    setup = assemble.build_fit(cfg, args.data, assemble.set_precision(cfg.precision))
    theta = setup.theta0
    if is_checkpoint(args.start):
        import orbax.checkpoint as ocp

        saved = ocp.StandardCheckpointer().restore(args.start.absolute() / "state")
        theta = jax.tree.map(lambda a, b: jnp.asarray(b, a.dtype).reshape(a.shape), theta,
                             saved["best_theta"])
    return cfg, setup, theta


def at_truth(problem: Any, theta: Any, truth: dict[str, float]) -> Any:
    """``theta`` with its fitted parameters at ``truth`` (unconstrained)."""
    specs = problem.layout.specs
    return {**theta, "params": {name: jnp.asarray(specs[name].to_unconstrained(truth[name]),
                                                  value.dtype).reshape(value.shape)
                                for name, value in theta["params"].items()}}


def errors(problem: Any, theta: Any, truth: dict[str, float]) -> dict[str, float]:
    values = problem.physical_params(theta)
    return {name: float(values[name]) / truth[name] - 1.0 for name in problem.layout.fitted}


def reduced(problem: Any, batch: Any, theta: Any, args: argparse.Namespace,
            fields_alone: Any, record: Any) -> Any:
    """``--mode reduced`` (see the module docstring): the best θ found."""
    flat, unravel = ravel_pytree(theta["params"])
    gradient = jax.jit(jax.grad(problem.loss))
    state = {"best": (np.inf, theta), "count": 0}

    def phi(z: np.ndarray) -> tuple[float, np.ndarray]:
        if args.deadline is not None and time.perf_counter() > args.deadline:
            raise OutOfTimeError
        params = unravel(jnp.asarray(z * args.reduced_scale, flat.dtype))
        # From the best fields so far: a trial point's fields, fitted in a few steps to
        # parameters a line search then rejects, are a worse start than those.
        fitted = fields_alone({**state["best"][1], "params": params}, args.field_steps)
        state["count"] += 1
        loss = float(problem.loss(fitted, batch))
        if loss < state["best"][0]:
            state["best"] = (loss, fitted)
        record(f"{state['count']}: reduced", fitted)
        g = np.asarray(ravel_pytree(gradient(fitted, batch)["params"])[0], np.float64)
        return loss, g * args.reduced_scale

    try:
        minimize(phi, np.asarray(flat, np.float64) / args.reduced_scale, jac=True,
                 method="L-BFGS-B", options={"maxfun": args.rounds, "maxiter": args.rounds,
                                             # only the count or the budget ends the search:
                                             # φ's gradient is small in these units
                                             "gtol": 0.0, "ftol": 0.0})
    except OutOfTimeError:
        print(f"{'reduced':>16}: stopped after {state['count']} evaluations (--budget-s)",
              flush=True)
    return state["best"][1]


class OutOfTimeError(Exception):
    """``--budget-s`` spent: the reduced search ends with its best point."""


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def schur_step(problem: Any, batch: Any, theta: Any, args: argparse.Namespace,
               truth: dict[str, float]) -> tuple[Any, dict[str, Any]]:
    """``--mode schur``'s parameter step at ``theta`` (see the module docstring) and what it
    measured."""
    flat, unravel = ravel_pytree(theta["params"])
    started = time.perf_counter()
    parts = marginal.marginal_parts(problem, theta, batch, iterations=args.schur_iterations)
    matrix, reduced_gradient, lost = 2.0 * parts.schur, parts.reduced_gradient, parts.unresolved
    root = np.sqrt(np.maximum(np.abs(np.diag(matrix)), 1e-30))
    # In coordinates scaled by S's diagonal; a direction rounding leaves negative (the
    # variational S is positive semidefinite) gets only the damping, as a flat one would.
    eigenvalues, vectors = np.linalg.eigh(matrix / np.outer(root, root))
    inverse = 1.0 / (np.maximum(eigenvalues, 0.0) + args.schur_damping)
    delta = -(vectors @ (inverse * (vectors.T @ (reduced_gradient / root)))) / root
    toward = np.asarray(ravel_pytree(at_truth(problem, theta, truth)["params"])[0] - flat)
    report = {"seconds": time.perf_counter() - started, "lost": list(lost),
              "scaled_eigenvalues": [float(e) for e in eigenvalues],
              "cos_gradient_truth": cosine(-reduced_gradient, toward),
              "cos_step_truth": cosine(delta, toward),
              "step_over_distance": float(np.linalg.norm(delta) / np.linalg.norm(toward))}
    print(f"{'schur':>16}: {report['seconds']:.0f} s, solves lost at {list(lost)}, scaled "
          f"eigenvalues {eigenvalues.min():.3g} … {eigenvalues.max():.3g}, cos(−g, truth) "
          f"{report['cos_gradient_truth']:+.3f}, cos(step, truth) {report['cos_step_truth']:+.3f}"
          f", |step| / distance {report['step_over_distance']:.3g}", flush=True)
    # A step the model cannot run (a non-finite loss) is halved until it can, at most 20
    # times, so that the next round's field steps have a finite start.
    for halvings in range(21):
        stepped = {**theta, "params": unravel(jnp.asarray(np.asarray(flat) + delta / 2**halvings,
                                                          flat.dtype))}
        if np.isfinite(float(problem.loss(stepped, batch))):
            break
    report["halvings"] = halvings
    return stepped, report


def staged(args: argparse.Namespace, theta: Any, truth: dict[str, float], rows: list) -> None:
    """``--mode staged`` (see the module docstring): each window's loss and errors in ``rows``."""
    started = time.perf_counter()
    for index, frames in enumerate(args.stages):
        cfg, setup, _ = setup_for(argparse.Namespace(**{**vars(args), "frames": frames}))
        problem = setup.problem
        _, history = run_fit(problem.loss, theta, setup.batch,
                             dataclasses.replace(cfg.optim, steps=args.param_steps),
                             curvature=gn.curvature_function(problem),
                             hold=["u_so", "k_so"] if index == 0 else [], progress=False,
                             log=lambda _: None, layout=problem.layout,
                             field_bounds=problem.field_bounds)
        theta = history.best_theta
        err = errors(problem, theta, truth)
        size = np.abs(list(err.values()))
        rows.append({"part": f"{frames} frames", "loss": float(history.best_loss),
                     "steps": len(history.losses), "stop": history.stop_reason,
                     "mean_error": float(size.mean()), "median_error": float(np.median(size)),
                     "errors": err, "wall_s": time.perf_counter() - started})
        print(f"{frames:>9} frames: best {history.best_loss:.4e} ({len(history.losses)} steps, "
              f"{history.stop_reason}), mean {100 * size.mean():.2f} %, median "
              f"{100 * np.median(size):.2f} %, {rows[-1]['wall_s']:.0f} s | "
              + " ".join(f"{k} {100 * v:+.1f}" for k, v in err.items()), flush=True)


def fields_first(args: argparse.Namespace, theta: Any, names: list[str], record: Any) -> Any:
    """``--fields-first``: the fields alone, ``--prep-steps`` steps on each window in turn."""
    for frames in args.fields_first:
        cfg, setup, _ = setup_for(argparse.Namespace(**{**vars(args), "frames": frames}))
        _, history = run_fit(setup.problem.loss, theta, setup.batch,
                             dataclasses.replace(cfg.optim, steps=args.prep_steps),
                             curvature=krylov.MatrixFree(setup.problem), hold=names,
                             progress=False, log=lambda _: None,
                             layout=setup.problem.layout,
                             field_bounds=setup.problem.field_bounds)
        theta = history.best_theta
        record(f"fields, {frames} fr", theta, f"its window {history.best_loss:.4e}, "
               f"{len(history.losses)} steps ({history.stop_reason})")
    return theta


def main() -> None:
    args = arguments()
    args.deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    # marginal_parts looks field_block up in its module: the solves' preconditioner as asked
    marginal.field_block = functools.partial(marginal.field_block, spacing=args.probe_spacing,
                                             floored=not args.no_prior_floor)
    print(f"field solves' diagonal: every {args.probe_spacing}th cell probed, "
          f"{'not ' if args.no_prior_floor else ''}floored at the prior's curvature", flush=True)
    use_compilation_cache()  # every run_fit call compiles its step again
    if args.simulate:
        simulate([f"experiment={args.experiment}",
                  f"system.grid.shape=[{args.grid},{args.grid}]", *args.overrides],
                 args.sigma, args.data.parent)
    cfg, setup, theta = setup_for(args)
    problem, batch = setup.problem, setup.batch
    truth = {k: float(v) for k, v in zd.open_dataset(args.data).meta.true_params.items()}
    dense, matrix_free = gn.curvature_function(problem), krylov.MatrixFree(problem)
    names = list(theta["params"])
    if args.parameters_at_truth:
        theta = at_truth(problem, theta, truth)
    started, rows = time.perf_counter(), []

    def record(part: str, theta: Any, note: str = "") -> None:
        err = errors(problem, theta, truth)
        size = np.abs(list(err.values()))
        row = {"part": part, "loss": float(problem.loss(theta, batch)),
               "mean_error": float(size.mean()), "median_error": float(np.median(size)),
               "errors": err, "wall_s": time.perf_counter() - started, "note": note}
        rows.append(row)
        print(f"{part:>16}: loss {row['loss']:.4e}, mean {100 * row['mean_error']:.2f} %, "
              f"median {100 * row['median_error']:.2f} %, {row['wall_s']:.0f} s | "
              + " ".join(f"{k} {100 * v:+.1f}" for k, v in err.items())
              + (f" | {note}" if note else ""), flush=True)

    def steps(theta: Any, count: int, curvature: Any, hold: list[str]) -> Any:
        state, _ = run_fit(problem.loss, theta, batch,
                           dataclasses.replace(cfg.optim, steps=count), curvature=curvature,
                           hold=hold, progress=False, log=lambda _: None,
                           layout=problem.layout, field_bounds=problem.field_bounds)
        return state.theta

    record("start", theta)
    theta = fields_first(args, theta, names, record)
    if args.fields_first:
        save(args, "prep", theta)
    if args.mode == "staged":
        staged(args, theta, truth, rows)
    if args.mode == "reduced":
        theta = reduced(problem, batch, theta, args, lambda t, k: steps(t, k, matrix_free,
                                                                         names), record)
    round_s = 0.0
    for r in range(args.rounds if args.mode not in ("reduced", "staged") else 0):
        if args.deadline is not None and time.perf_counter() + round_s > args.deadline:
            print(f"{'budget':>16}: stopped before round {r} (--budget-s)", flush=True)
            break
        round_started = time.perf_counter()
        if args.mode == "schur":
            theta = steps(theta, args.field_steps, matrix_free, names)
            record(f"{r}: fields", theta)
            theta, measured = schur_step(problem, batch, theta, args, truth)
            rows.append({"part": f"{r}: schur", **measured})
            record(f"{r}: parameters", theta)
            save(args, f"round-{r}", theta)
            round_s = time.perf_counter() - round_started
            continue
        if args.mode == "joint":
            theta = steps(theta, args.field_steps, matrix_free, [])
            record(f"{r}: joint", theta)
            continue
        if args.param_steps:
            theta = steps(theta, args.param_steps, dense, [])
            record(f"{r}: parameters", theta)
        theta = steps(theta, args.field_steps, matrix_free, names)
        record(f"{r}: fields", theta)
    save(args, "final", theta)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("a") as out:
        out.write(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                              "krylov_iterations": cfg.optim.krylov_iterations,
                              "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
