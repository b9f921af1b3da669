"""The parameters' curvature with fitted initial fields as nuisance unknowns (a Schur complement).

Where initial fields are fitted with the parameters, the parameters' uncertainty must let
the fields move too: with B the half Gauss–Newton matrix of the loss over θ = (p, x₀) (data
and priors), the marginal curvature of p is the Schur complement

    S = B_pp − B_px B_xx⁻¹ B_xp,

and the Laplace (Gaussian posterior) covariance of p is a σ² S⁻¹ for misfit weights a that
are one number (the loss a Σ r² + priors, with noise σ). B_xx has 10⁴–10⁶ rows, so it is
never formed: the k columns B_xp e_i come from k matrix-free products
(:func:`pdefit.fitting.krylov.gauss_newton_product`) and each B_xx⁻¹ B_xp e_i from
conjugate gradients on the field block, preconditioned like the fit's steps. The same
solve reduces the gradient (g_p − B_px B_xx⁻¹ g_x), whose Gauss–Newton step tells how far a
fit stopped from its optimum.

What the result is, is :class:`pdefit.fitting.uncertainty.CurvatureParts` with bread S and
meat a·S, so the intervals, flags and residual verdict of
:func:`pdefit.fitting.uncertainty.estimate` apply unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.fitting import krylov
from pdefit.fitting.problem import Batch, FitProblem

# Conjugate-gradient iterations per field-block solve, and their relative tolerance.
ITERATIONS = 60
RTOL = 1e-4


def fields_reason(problem: FitProblem, weights: dict[str, Any]) -> str | None:
    """Why no marginal curvature can be formed for ``problem`` with misfit ``weights`` (per
    observed field, one per experiment; None: it can)."""
    if problem.domain is not None:
        return "the Gauss–Newton curvature runs on one device (mesh=single)"
    others = [n for n in problem.layout.fitted if n not in problem.layout.scalars]
    if others or not problem.layout.fitted:
        return ("intervals with fitted initial fields cover shared scalar parameters only"
                if others else "no fitted parameter")
    if common_weight(weights) is None:
        return ("intervals with fitted initial fields need one misfit weight for every "
                "observed value (one field, or fields of equal noise and count)")
    return None


def common_weight(weights: dict[str, Any]) -> float | None:
    """The one misfit weight of every observed value (``weights``: per observed field, one
    per experiment), or None where they differ."""
    levels = np.concatenate([np.ravel(w) for w in weights.values()])
    return float(levels[0]) if np.allclose(levels, levels[0], rtol=1e-12, atol=0.0) else None


def marginal_parts(problem: FitProblem, theta: Any, batch: Batch,
                   iterations: int = ITERATIONS) -> tuple[np.ndarray, np.ndarray]:
    """(S, the reduced gradient of the loss) at ``theta``, over ``theta["params"]`` flattened in
    ``ravel_pytree`` order (see the module docstring)."""
    columns, reduced_gradient, block = _solved_columns(problem, theta, batch, iterations)
    schur = 0.5 * (block - columns)
    return 0.5 * (schur + schur.T), np.asarray(reduced_gradient, np.float64)


def _solved_columns(problem: FitProblem, theta: Any, batch: Batch, iterations: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(G_px G_xx⁻¹ G_xp, g_p − G_px G_xx⁻¹ g_x, G_pp) for G = 2B, the full Gauss–Newton
    matrix of the loss."""
    flat, unravel = ravel_pytree(theta["params"])
    k = flat.shape[0]
    zero = jax.tree.map(jnp.zeros_like, theta)
    gradient = jax.jit(jax.grad(problem.loss))(theta, batch)
    product = jax.jit(lambda v: krylov.gauss_newton_product(problem, theta, batch, v))
    fields_only, scale = field_block(problem, theta, batch)
    solve = jax.jit(lambda rhs: field_solve(fields_only, rhs, scale, iterations))
    block = np.zeros((k, k))
    coupled = np.zeros((k, k))
    for i in range(k):
        column = product({**zero, "params": unravel(jnp.eye(k, dtype=flat.dtype)[i])})
        block[:, i] = np.asarray(ravel_pytree(column["params"])[0])
        solved = solve(column["fields"])
        coupled[:, i] = np.asarray(ravel_pytree(product({**zero, "fields": solved})[
            "params"])[0])
    g_fields = solve(gradient["fields"])
    reduced = (np.asarray(ravel_pytree(gradient["params"])[0])
               - np.asarray(ravel_pytree(product({**zero, "fields": g_fields})["params"])[0]))
    return coupled, reduced, block


def field_block(problem: FitProblem, theta: Any, batch: Batch, key: jax.Array | None = None,
                ) -> tuple[Any, Any]:
    """(v ↦ G_xx v, the Gauss–Newton matrix's block over the fitted fields applied to
    fields v; the fit's scaling of the fields, which preconditions its solves), at
    ``theta``; ``key`` draws the scaling's Hutchinson probe."""
    zero = jax.tree.map(jnp.zeros_like, theta)

    def fields_only(fields):
        return krylov.gauss_newton_product(problem, theta, batch, {**zero, "fields": fields})[
            "fields"]

    key = jax.random.key(0) if key is None else key
    return fields_only, krylov.MatrixFree(problem).diagonal(theta, batch, key)["fields"]


def field_solve(fields_only: Any, rhs: Any, scale: Any, iterations: int) -> Any:
    """G_xx⁻¹ rhs by preconditioned conjugate gradients (the fit's field scaling)."""
    return field_solution(fields_only, rhs, scale, iterations).value


def field_solution(fields_only: Any, rhs: Any, scale: Any, iterations: int) -> lx.Solution:
    """lineax's solution of :func:`field_solve` (``stats["num_steps"]``: the iterations)."""
    structure = jax.eval_shape(lambda: rhs)
    tags = lx.positive_semidefinite_tag
    operator = lx.FunctionLinearOperator(fields_only, structure, tags=tags)
    preconditioner = lx.FunctionLinearOperator(
        lambda v: jax.tree.map(jnp.divide, v, scale), structure, tags=tags)
    return lx.linear_solve(operator, rhs, lx.CG(rtol=RTOL, atol=0.0, max_steps=iterations),
                           options={"preconditioner": preconditioner}, throw=False)
