"""Box's second-order bias of a fit with fitted initial fields, computed densely on a small
problem, against the errors the fits make.

What it measures
----------------
The 16² Aliev–Panfilov problem of ``coverage_fields.py`` (u observed with noise σ, u(0) and
v(0) fitted with k and a under a background prior): per noise draw, the fit
(``pdefit.fit``, Levenberg–Marquardt), then at its estimate, over all 2 + 2·256 unknowns:

- the dense Gauss–Newton step −A⁻¹∇F of the whitened objective F = ½‖r/σ‖² + penalties/(2cσ²)
  (A = J̃ᵀJ̃ + the penalties' Hessian): how far the fit is from its optimum;
- Box's (1971) second-order bias b = −A⁻¹[½ J̃ᵀd + t], d_i = tr(Σ ∇²r̃_i) with Σ = A⁻¹J̃ᵀJ̃A⁻¹
  the estimate's covariance (second derivatives along Σ's axes by forward-over-forward JVPs),
  t the prior's share (−∇ tr(A⁻¹PA⁻¹J̃ᵀJ̃(β)), P the penalties' Hessian);

each in the fit's standard errors, beside the fit's error. Why it is not shipped:
docs/design-decisions.md, "When the estimate is biased".

How to run
----------
    python benchmarks/second_order_bias.py --draws 2 --first-draw 32 --background 1e-6

(about 20 s per draw for the fit and 15 s for the dense bias on 2 cores). Writes
``benchmarks/results/second_order_bias.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import pdefit
from pdefit.fitting import krylov
from pdefit.numerics.grid import Grid

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coverage_fields  # the problem and its truth (a sibling script)

CHUNK = 64  # directions per compiled batch of second-order JVPs


def whitened(problem, batch, theta, sigma: float):
    """(r̃, penalty, flat θ, unravel): the observed residuals over σ and the penalties in the
    same units, so that the fit's loss / (2cσ²) = ½‖r̃‖² + penalty (c the loss's weight per
    squared residual, uniform here)."""
    flat, unravel = ravel_pytree(theta)
    obs = batch.observed

    def residuals(f):
        predicted = krylov.predictions(problem, unravel(f), batch)
        return jnp.concatenate([jnp.ravel(jnp.where(obs.weights[k] > 0,
                                                    predicted[k] - obs.values[k], 0.0))
                                for k in sorted(obs.values)]) / sigma

    c = float(problem.data_loss(theta, batch)) / float(jnp.sum((residuals(flat) * sigma) ** 2))

    def penalty(f):
        th = unravel(f)
        return (problem.penalty(th) + problem.field_prior(th, batch)) / (2 * c * sigma**2)

    return residuals, penalty, flat, unravel


def second_order_terms(residuals, flat, a_inv, jac, prior_hessian):
    """(d, t) of Box's formula, densely."""
    cov = a_inv @ (jac.T @ jac) @ a_inv
    eigenvalues, vectors = np.linalg.eigh(0.5 * (cov + cov.T))
    axes = vectors * np.sqrt(np.clip(eigenvalues, 0.0, None))  # Σ = Σ_j l_j l_jᵀ

    def along(direction):
        tangent = lambda f: jax.jvp(residuals, (f,), (direction,))[1]  # noqa: E731
        return jax.jvp(tangent, (flat,), (direction,))[1]

    along_many = jax.jit(jax.vmap(along))
    d = np.zeros(jac.shape[0])
    for start in range(0, axes.shape[1], CHUNK):
        d += np.asarray(along_many(jnp.asarray(axes[:, start:start + CHUNK].T))).sum(0)
    t = np.zeros(flat.shape[0])
    if np.any(prior_hessian):
        rows = a_inv @ prior_hessian @ a_inv @ jac.T

        def traced(f, block, basis):
            tangents = jax.vmap(lambda e: jax.jvp(residuals, (f,), (e,))[1])(basis)
            return jnp.sum(tangents * block)

        gradient = jax.jit(jax.grad(traced))
        eye = np.eye(flat.shape[0])
        for start in range(0, flat.shape[0], CHUNK):
            t -= np.asarray(gradient(flat, jnp.asarray(rows[start:start + CHUNK]),
                                     jnp.asarray(eye[start:start + CHUNK])))
    return d, t


def dense_bias(problem, batch, theta, sigma: float) -> dict[str, dict[str, float]]:
    """Per fitted scalar (unconstrained): Box's bias, the Gauss–Newton step to the optimum and
    the standard deviation, from the dense Jacobian."""
    residuals, penalty, flat, unravel = whitened(problem, batch, theta, sigma)
    jac = np.asarray(jax.jacfwd(residuals)(flat))
    prior_hessian = np.asarray(jax.hessian(penalty)(flat))
    a_inv = np.linalg.inv(jac.T @ jac + prior_hessian)
    d, t = second_order_terms(residuals, flat, a_inv, jac, prior_hessian)
    gradient = jac.T @ np.asarray(residuals(flat)) + np.asarray(jax.grad(penalty)(flat))
    cov = np.diag(a_inv @ (jac.T @ jac) @ a_inv)
    parts = {"bias": -a_inv @ (0.5 * jac.T @ d + t), "step": -a_inv @ gradient,
             "std": np.sqrt(cov)}
    params = {k: unravel(jnp.asarray(v))["params"] for k, v in parts.items()}
    return {name: {k: float(params[k][name]) for k in parts} for name in theta["params"]}


def one_draw(frames, draw: int, sigma: float, background: float) -> dict:
    u = frames["u"] + sigma * np.random.default_rng(draw).standard_normal(frames["u"].shape)
    setup = pdefit.build_problem(
        "aliev_panfilov", {"u": u}, fit=["k", "a"], start={"k": 9.0, "a": 0.12}, dt=0.05,
        frame_interval=0.5, grid=Grid(u.shape[1:], (1.0, 1.0)),
        initial_fields={"u": "fit", "v": "fit"},
        regularization={"field_background": background}, precision="float64")
    result = pdefit.fit(setup, optimizer="levenberg_marquardt", steps=30, initial_damping=1.0,
                        krylov_iterations=40, discretization_check=False)
    dense = dense_bias(setup.problem, setup.batch, result.theta, sigma)
    record = {"draw": draw, "parameters": {}}
    for name, true in coverage_fields.TRUTH.items():
        se = result.uncertainty["parameters"][name]["std_error"]
        value = result.params[name]  # log-transformed: d(value) = value · d(log value)
        record["parameters"][name] = {
            "recovered": value, "std_error": se, "error_in_se": (value - true) / se,
            **{f"{k}_in_se": dense[name][k] * value / se for k in ("bias", "step", "std")}}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--first-draw", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=coverage_fields.SIGMA)
    parser.add_argument("--background", type=float, default=1e-6)
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/second_order_bias.json"))
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    frames = coverage_fields.truth_frames(16, 200)
    print("| draw | parameter | error / SE | Box bias / SE | GN step / SE | dense SD / SE |")
    print("|---|---|---|---|---|---|")
    records = []
    for draw in range(args.first_draw, args.first_draw + args.draws):
        records.append(one_draw(frames, draw, args.sigma, args.background))
        for name, p in records[-1]["parameters"].items():
            print(f"| {draw} | {name} | {p['error_in_se']:+.2f} | {p['bias_in_se']:+.2f} | "
                  f"{p['step_in_se']:+.3f} | {p['std_in_se']:.2f} |", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                       "records": records}, indent=1))
    if not all(math.isfinite(p["bias_in_se"]) for r in records
               for p in r["parameters"].values()):
        raise SystemExit("a bias was not finite")


if __name__ == "__main__":
    main()
