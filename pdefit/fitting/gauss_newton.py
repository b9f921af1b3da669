"""Gauss–Newton curvature of a fit's loss in its scalar parameters, by forward-mode tangents.

For a loss that is a sum of costs along a trajectory, L(z) = Σ_n c_n(x_n(z)), the Gauss–Newton
matrix is G = Σ_n J_nᵀ ∇²c_n J_n with J_n = ∂x_n/∂z, the sensitivity of the state to the k
fitted parameters. The k tangents J_n are carried forward through the stepper next to the
state (one linearisation per step, applied to the k tangents at once), so the cost is about
one forward run plus k tangent runs, memory is (k + 1) states, and no trajectory is stored —
no checkpointing is needed. ∇²c_n is applied exactly by a Hessian–vector product, so any
cost works (for the MSE misfits of :mod:`pdefit.fitting.observe` it is a constant diagonal).

With G and the gradient g = Σ_n J_nᵀ ∇c_n the Levenberg–Marquardt optimiser in
:mod:`pdefit.fitting.optimisers` takes steps (G + λ diag G) δ = −g: for a handful of parameters
and data the model can fit (zero residual), it converges in tens of iterations where L-BFGS, led
astray by the small jumps the thresholds of excitable models put into the loss, can stall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.adjoint import LossChain
from pdefit.fitting.observe import ObservedData


def _pairwise(a: Any, b: Any) -> jnp.ndarray:
    """Σ over leaves of ⟨a_i, b_j⟩ for stacks of k tangents: a (k × k) matrix."""
    total = None
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        k = x.shape[0]
        term = x.reshape(k, -1) @ y.reshape(k, -1).T
        total = term if total is None else total + term
    return total


def _against(a: Any, b: Any) -> jnp.ndarray:
    """Σ over leaves of ⟨a_i, b⟩ for a stack of k tangents a and one state b: a k-vector."""
    total = None
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        term = x.reshape(x.shape[0], -1) @ y.reshape(-1)
        total = term if total is None else total + term
    return total


def trajectory_terms(chain: LossChain, x0: Any, params: Any, tangents: Any, data: Any,
                     n_steps: int, x0_tangents: Any = None,
                     ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(L, g, G) of one experiment: ``params`` the physical parameters, ``tangents`` their
    derivatives with respect to the k unconstrained ones (each leaf with a leading k axis);
    ``x0_tangents`` those of the initial state (default: zero, it does not depend on them)."""
    k = jax.tree.leaves(tangents)[0].shape[0]
    dtype = jnp.result_type(*jax.tree.leaves(x0))
    zero = (jnp.zeros((), dtype), jnp.zeros((k,), dtype), jnp.zeros((k, k), dtype))
    state_tangents = (jax.tree.map(lambda a: jnp.zeros((k, *a.shape), a.dtype), x0)
                      if x0_tangents is None else x0_tangents)

    def add_cost(x, dx, n, acc):
        def terms():
            def cost_of_state(s):
                return chain.cost(s, params, n, data)

            value = cost_of_state(x)
            # One linearisation of the gradient gives both ∇c and the Hessian–vector products.
            gx, hessian_times_one = jax.linearize(jax.grad(cost_of_state), x)
            hessian_times = jax.vmap(hessian_times_one)
            # A cost may also depend on the parameters directly.
            direct = jax.vmap(lambda d: jax.jvp(lambda q: chain.cost(x, q, n, data), (params,),
                                                (d,))[1])(tangents)
            return (acc[0] + value, acc[1] + _against(dx, gx) + direct,
                    acc[2] + _pairwise(dx, hessian_times(dx)))

        if chain.observed is None:
            return terms()
        return jax.lax.cond(chain.observed(n, data), terms, lambda: acc)

    def body(carry, n):
        x, dx, acc = carry
        acc = add_cost(x, dx, n, acc)
        x_next, linear = jax.linearize(lambda s, q: chain.step(s, q, n), x, params)
        return (x_next, jax.vmap(linear)(dx, tangents), acc), None

    (x, dx, acc), _ = jax.lax.scan(body, (x0, state_tangents, zero), jnp.arange(n_steps))
    return add_cost(x, dx, n_steps, acc)


def gauss_newton(problem: Any) -> Callable[..., tuple[Any, Any, Any]]:
    """``curvature(theta, batch) -> (loss, gradient, G)`` for ``problem`` (a
    :class:`pdefit.fitting.problem.FitProblem`): the gradient as a pytree like ``theta``, G over
    ``theta["params"]`` flattened in ``ravel_pytree`` order; the penalty's exact Hessian is
    added. Scalar parameters only, on one device.

    ``curvature(theta, batch, x0_directions)`` also carries m directions of the initial
    state (a pytree like it, each leaf with a leading m axis before the experiment axis) as
    tangents after the k parameters: G is then (k + m) × (k + m), its block [:k, k:] the
    data part 2·Jᵀ A J_x d of the loss's Gauss–Newton matrix (J_x d: the residuals' response
    to direction d of the initial state; the penalty does not see it).

    ``curvature(theta, batch, free=indices)`` (a static sequence of positions in that
    flattened order) carries tangents for those parameters only, the others held: G is then
    over ``free`` (in its order) and the gradient is zero at the held ones, whose tangents
    are never computed."""
    require_scalar_shared_fit(problem)
    return curvature_function(problem)


def curvature_function(problem: Any) -> Callable[..., tuple[Any, Any, Any]]:
    """:func:`gauss_newton`'s ``curvature`` without its checks: with fitted initial fields
    (taken from θ, their tangents zero) it is the parameters' block of the Gauss–Newton
    matrix, as :mod:`pdefit.fitting.krylov` scales its steps by."""

    def curvature(theta, batch, x0_directions=None, free=None):
        x0 = problem.initial_state(theta, batch)

        def terms(params, tangents):
            k = jax.tree.leaves(tangents)[0].shape[0]
            tangents, x0_tangents = _initial_tangents(x0, k, tangents, x0_directions)
            return _experiment_terms(problem, params, tangents, x0, x0_tangents,
                                     batch.observed)

        return parameter_block(problem, theta, terms, free)

    return curvature


def parameter_block(problem: Any, theta: Any,
                    terms: Callable[[Any, Any], tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]],
                    free: Any = None) -> tuple[Any, Any, Any]:
    """(loss, gradient, G) over the ``free`` positions of ``theta["params"]`` flattened (all:
    None), from ``terms(params, tangents)`` — the physical parameters and their k tangents
    → (L, g, G) of every experiment (stacked) — plus the penalty's exact Hessian."""
    flat, unravel = ravel_pytree(theta["params"])
    columns = np.arange(flat.shape[0]) if free is None else np.asarray(free, int)
    fitted = _Flat(flat, unravel, columns)
    params, tangents = _parameter_tangents(problem, theta, fitted)
    values, grads, matrices = terms(params, tangents)
    return _mean_with_penalty(problem, theta, fitted, values, grads, matrices)


class _Flat(NamedTuple):
    """``theta["params"]`` flattened (``ravel_pytree`` order), the way back, and the
    positions that carry tangents."""

    flat: jnp.ndarray
    unravel: Callable[[jnp.ndarray], Any]
    columns: np.ndarray


def require_scalar_shared_fit(problem: Any, fields: bool = False) -> None:
    """Refuse the fits Levenberg–Marquardt's curvature does not cover (``fields``: fitted
    initial fields are covered, by the matrix-free products of :mod:`pdefit.fitting.krylov`)."""
    if problem.fitted_fields and not fields:
        raise ValueError("levenberg_marquardt fits scalar parameters only; with fitted initial "
                         f"fields {list(problem.fitted_fields)} use optim=adam or optim=lbfgs")
    if problem.domain is not None:
        raise ValueError("levenberg_marquardt runs on one device; use mesh=single")
    if getattr(problem.layout, "per_experiment", ()):
        raise ValueError("levenberg_marquardt handles shared parameters only; per-experiment "
                         "ones need optim=adam or optim=lbfgs")
    if not problem.layout.fitted and not (fields and problem.fitted_fields):
        raise ValueError("levenberg_marquardt needs at least one fitted parameter")


def _parameter_tangents(problem: Any, theta: Any, fitted: _Flat) -> tuple[Any, Any]:
    """The physical parameters and their derivatives along each of the k free unconstrained
    ones (each leaf with a leading k axis)."""

    def physical(f):
        return problem.physical_params({**theta, "params": fitted.unravel(f)})

    flat = fitted.flat
    params = physical(flat)
    tangents = jax.vmap(lambda e: jax.jvp(physical, (flat,), (e,))[1])(
        jnp.eye(flat.shape[0], dtype=flat.dtype)[fitted.columns])
    return params, tangents


def _initial_tangents(x0: Any, k: int, tangents: Any, x0_directions: Any,
                      ) -> tuple[Any, Any]:
    """(parameter tangents, initial-state tangents), with the m ``x0_directions`` appended
    after the k parameters when given: zero in the parameters, the direction in the state."""
    x0_tangents = jax.tree.map(lambda a: jnp.zeros((k, *a.shape), a.dtype), x0)
    if x0_directions is not None:
        m = jax.tree.leaves(x0_directions)[0].shape[0]
        tangents = jax.tree.map(lambda t: jnp.concatenate(
            [t, jnp.zeros((m, *t.shape[1:]), t.dtype)]), tangents)
        x0_tangents = jax.tree.map(lambda z, d: jnp.concatenate([z, d.astype(z.dtype)]),
                                   x0_tangents, x0_directions)
    return tangents, x0_tangents


def _experiment_terms(problem: Any, params: Any, tangents: Any, x0: Any, x0_tangents: Any,
                      obs: ObservedData) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(L, g, G) of every experiment (stacked on a leading axis)."""
    # Plain stencils: the self-adjoint VJP rule has no forward mode.
    chain = problem.chain(dataclasses.replace(problem.grid, self_adjoint_vjp=False))

    def one(x0_e, dx0_e, values_e, weights_e, scale_e):
        data = ObservedData(values_e, weights_e, scale_e, obs.slot_of_step)
        return trajectory_terms(chain, x0_e, params, tangents, data, problem.n_steps, dx0_e)

    return jax.vmap(one, in_axes=(0, 1, 0, 0, 0))(
        x0, x0_tangents, obs.values, obs.weights, obs.scale)


def _mean_with_penalty(problem: Any, theta: Any, fitted: _Flat, values: jnp.ndarray,
                       grads: jnp.ndarray, matrices: jnp.ndarray) -> tuple[Any, Any, Any]:
    """(loss, gradient, G): the experiments' mean, plus the penalty, its gradient and its
    exact Hessian; the gradient as a pytree like ``theta`` (zero at held parameters)."""
    flat, unravel, columns = fitted
    k = len(columns)
    n_exp = values.shape[0]

    def penalty(f):
        return problem.penalty({**theta, "params": unravel(f)})

    loss = jnp.sum(values) / n_exp + penalty(flat)
    grad = jnp.zeros_like(flat).at[columns].set(
        jnp.sum(grads, axis=0)[:k] / n_exp + jax.grad(penalty)(flat)[columns])
    matrix = jnp.sum(matrices, axis=0) / n_exp
    matrix = matrix.at[:k, :k].add(jax.hessian(penalty)(flat)[np.ix_(columns, columns)])
    gradient = {**jax.tree.map(jnp.zeros_like, theta), "params": unravel(grad)}
    return loss, gradient, matrix
