"""Matrix-free Gauss–Newton for fits of initial fields with the parameters (incremental 4D-Var).

With fitted initial fields the unknowns number 10⁴–10⁶, too many for the dense curvature of
:mod:`pdefit.fitting.gauss_newton`. Here the Gauss–Newton matrix G is only ever applied to a
vector, and the Levenberg–Marquardt step (G + λD) δ = −g is solved by preconditioned
conjugate gradients (lineax's ``CG``), the inner loop of incremental 4D-Var:

- **G·v without a matrix.** The misfit is Σ w (h(x_n) − y_n)², so its gradient at data
  y'_n = h(x_n) − J_n v (the model's own predictions less their response to v, held fixed)
  is Σ J_nᵀ W J_n v = G·v exactly, also for a nonlinear observation h. One forward-mode
  sweep (``jax.jvp``, no trajectory stored) gives the predictions and their tangent; one
  gradient of the unchanged loss with those data — the revolve adjoint, bounded memory —
  gives the product. Penalties and the field prior add their exact Hessian–vector product.
- **Scaling D and the preconditioner.** The parameters' diagonal of G is exact (the k
  forward tangents of :func:`pdefit.fitting.gauss_newton.gauss_newton`); each field's is
  one number, the mean of z ⊙ Gz over its cells for a random ±1 probe z (Hutchinson's
  estimator), since a field's cells differ less from each other than from the parameters.
  The preconditioner is ((1 + λ)D)⁻¹, or with ``optim.krylov_preconditioner=parameter_block``
  on the parameters the inverse of their whole damped block G_pp + λD_pp (its k × k matrix
  comes with the diagonal, at no extra sweep): a PDE's parameters are strongly correlated,
  and a diagonal leaves their block's condition number to the conjugate gradients. What
  holds the parameters back once the fields adapt is S, the Schur complement of the
  fields, not G_pp (:mod:`pdefit.fitting.reduced_steps`).

With multiple shooting (:mod:`pdefit.fitting.shooting`) the segments' starts are unknowns
like the fitted fields, and the gaps between segments residuals like the frames.

One device, shared parameters (like the dense Levenberg–Marquardt).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.fitting import gauss_newton as gn
from pdefit.fitting import shooting
from pdefit.fitting.observe import ObservedData
from pdefit.fitting.problem import Batch, FitProblem


@dataclasses.dataclass(frozen=True)
class MatrixFree:
    """The Gauss–Newton products of ``problem``'s loss over all of θ (parameters and fitted
    fields), for :func:`pdefit.fitting.optimisers.make_matrix_free_update`."""

    problem: FitProblem

    def product(self, theta: Any, batch: Batch, v: Any) -> Any:
        """G·v (a pytree like ``theta``): the data misfit's Gauss–Newton matrix plus the
        penalties' and the field prior's exact Hessian, applied to ``v``."""
        return gauss_newton_product(self.problem, theta, batch, v)

    def diagonal(self, theta: Any, batch: Any, key: jax.Array,
                 free: np.ndarray | None = None) -> Any:
        """A positive scaling like ``theta``: the exact Gauss–Newton diagonal of the
        parameters (at the ``free`` positions of their flattened order; 1 at held ones) and
        one Hutchinson estimate per fitted field."""
        return scaling(self, theta, batch, key, free)[0]

    def scaling_and_block(self, theta: Any, batch: Any, key: jax.Array,
                free: np.ndarray | None = None) -> tuple[Any, ParameterBlock | None]:
        """(:meth:`diagonal`, the parameters' Gauss–Newton block over the ``free``
        positions, None without free parameters), from the same sweeps."""
        return scaling(self, theta, batch, key, free)


class ParameterBlock(NamedTuple):
    """The Gauss–Newton matrix of the parameters at ``columns`` of their flattened order
    (``matrix``: k × k, the penalties' Hessian included), for the block preconditioner."""

    columns: np.ndarray
    matrix: jnp.ndarray


def curvature_for(problem: FitProblem) -> Callable[..., Any] | MatrixFree:
    """What Levenberg–Marquardt needs of ``problem``: the dense parameter curvature, or the
    matrix-free products when initial fields are fitted too (ValueError for fits neither
    covers: several devices, per-experiment parameters)."""
    if problem.fitted_fields or problem.shooting is not None:
        gn.require_scalar_shared_fit(problem, fields=True)
        return MatrixFree(problem)
    return gn.gauss_newton(problem)


def predictions(problem: FitProblem, theta: Any, batch: Batch) -> dict[str, jnp.ndarray]:
    """The model's values at the observed frames, like ``batch.observed.values`` (field →
    (n_exp, n_slots, ...)), from one forward run per experiment that keeps those only."""
    chain = problem.chain(dataclasses.replace(problem.grid, self_adjoint_vjp=False))
    project = problem.observation.on_grid(problem.grid).project
    params = problem.physical_params(theta)
    x0 = problem.initial_state(theta, batch)
    obs = batch.observed
    slot_of_step = obs.slot_of_step

    def record(buffers, x, n):
        slot = slot_of_step[n]
        at = jnp.maximum(slot, 0)
        seen = project(x)
        return {f: buf.at[at].set(jnp.where(slot >= 0, seen[f].astype(buf.dtype), buf[at]))
                for f, buf in buffers.items()}

    def one(x0_e, values_e):
        def body(carry, n):
            x, buffers = carry
            return (chain.step(x, params, n), record(buffers, x, n)), None

        buffers = jax.tree.map(jnp.zeros_like, values_e)
        (x, buffers), _ = jax.lax.scan(body, (x0_e, buffers), jnp.arange(problem.n_steps))
        return record(buffers, x, problem.n_steps)

    return jax.vmap(one)(x0, obs.values)


def gauss_newton_product(problem: FitProblem, theta: Any, batch: Batch, v: Any) -> Any:
    """G·v of the loss (see the module docstring). With multiple shooting the segments' gaps
    (end − next start) are residuals too, shifted by ``Batch.continuity_offset`` as the
    frames are by their data."""
    if problem.shooting is None:
        predicted, response = jax.jvp(lambda t: predictions(problem, t, batch), (theta,),
                                      (v,))
        offset = {}
    else:
        (predicted, gaps), (response, gap_response) = jax.jvp(
            lambda t: shooting.predictions(problem, t, batch), (theta,), (v,))
        offset = jax.tree.map(lambda p, dp: jax.lax.stop_gradient(p - dp), gaps,
                              gap_response)
    shifted = jax.tree.map(lambda p, dp: jax.lax.stop_gradient(p - dp), predicted, response)
    linearised = batch._replace(observed=ObservedData(
        shifted, batch.observed.weights, batch.observed.scale, batch.observed.slot_of_step),
        continuity_offset=offset)
    data_part = jax.grad(problem.data_loss)(theta, linearised)

    def prior(t):
        return problem.penalty(t) + problem.field_prior(t, batch)

    prior_part = jax.jvp(jax.grad(prior), (theta,), (v,))[1]
    return jax.tree.map(jnp.add, data_part, prior_part)


def scaling(curvature: MatrixFree, theta: Any, batch: Batch, key: jax.Array,
            free: np.ndarray | None) -> Any:
    """See :meth:`MatrixFree.diagonal`."""
    problem = curvature.problem
    flat = ravel_pytree(theta["params"])[0]
    columns = np.arange(flat.shape[0]) if free is None else np.asarray(free, int)
    params_diag, block = jnp.ones_like(flat), None
    if len(columns):  # held or no parameters: only the fields are scaled
        curvature_of = (gn.curvature_function(problem) if problem.shooting is None
                        else functools.partial(shooting.parameter_curvature, problem))
        _, _, matrix = curvature_of(theta, batch, free=columns)
        floor = 1e-12 * jnp.maximum(jnp.max(jnp.diag(matrix)), jnp.finfo(flat.dtype).tiny)
        params_diag = params_diag.at[columns].set(jnp.maximum(jnp.diag(matrix), floor))
        block = ParameterBlock(columns, matrix)
    # Each fitted field, and each field of the segments' starts, gets one Hutchinson number.
    groups = [g for g in ("fields", shooting.SEGMENTS) if theta.get(g)]
    named = [(g, name, x) for g in groups for name, x in sorted(theta[g].items())]
    keys = jax.random.split(key, max(len(named), 1))
    probe = jax.tree.map(jnp.zeros_like, theta)
    for (group, name, x), k in zip(named, keys, strict=False):
        probe[group] = {**probe[group], name: jax.random.rademacher(k, x.shape, x.dtype)}
    response = curvature.product(theta, batch, probe)
    top = jnp.max(params_diag[columns]) if len(columns) else jnp.ones((), flat.dtype)
    scaled = {group: {} for group in groups}
    for group, name, _ in named:
        z = probe[group][name]
        scaled[group][name] = jnp.full_like(z, jnp.maximum(
            jnp.mean(z * response[group][name]), 1e-12 * top))
    unravel = ravel_pytree(theta["params"])[1]
    return {**theta, "params": unravel(params_diag), **scaled}, block


def damped_solve(product: Callable[[Any], Any], gradient: Any, diagonal: Any,
                 damping: jax.Array, iterations: int, rtol: float,
                 block: ParameterBlock | None = None) -> tuple[Any, jax.Array]:
    """(δ ≈ −(G + λD)⁻¹ g, the iterations taken) by at most ``iterations`` steps of conjugate
    gradients preconditioned by ((1 + λ)D)⁻¹ (``product``: v ↦ G·v; D: ``diagonal``), on
    ``theta["params"]`` by (G_pp + λD_pp)⁻¹ instead where the parameters' ``block`` is given."""

    def damped(v):
        return jax.tree.map(lambda gv, d, x: gv + damping * d * x, product(v), diagonal, v)

    on_block = None if block is None else _block_inverse(block, diagonal["params"], damping)

    def preconditioned(v):
        out = jax.tree.map(lambda d, x: x / ((1.0 + damping) * d), diagonal, v)
        if on_block is None:
            return out
        flat, unravel = ravel_pytree(v["params"])
        scaled = ravel_pytree(out["params"])[0]
        return {**out, "params": unravel(scaled.at[block.columns].set(
            on_block(flat[block.columns])))}

    solution = conjugate_gradients(damped, preconditioned, jax.tree.map(jnp.negative, gradient),
                                   iterations, rtol)
    # An iterate that stopped at the step cap is still a descent direction (truncated CG).
    return (jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x, 0.0), solution.value),
            jnp.asarray(solution.stats["num_steps"], jnp.int32))


def _block_inverse(block: ParameterBlock, params_diagonal: Any,
                   damping: jax.Array) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """x ↦ (G_pp + λD_pp)⁻¹x on the block's columns, by one eigendecomposition of the block
    scaled to a unit diagonal. Its eigenvalues are floored at √ε of the largest: a
    preconditioner only has to be positive definite, and parameters the data do not
    determine (or a rounded, slightly indefinite G_pp at λ → 0) must not blow up its
    inverse."""
    d = ravel_pytree(params_diagonal)[0][block.columns]
    root = jnp.sqrt(d)
    scaled = block.matrix / root[:, None] / root[None, :]
    scaled = 0.5 * (scaled + scaled.T) + damping * jnp.eye(d.shape[0], dtype=d.dtype)
    values, vectors = jnp.linalg.eigh(scaled)
    floor = jnp.sqrt(jnp.finfo(d.dtype).eps) * jnp.maximum(jnp.max(values), 1.0)
    inverse = (vectors / jnp.maximum(values, floor)) @ vectors.T

    def apply(x):
        return (inverse @ (x / root)) / root

    return apply


def conjugate_gradients(operator: Callable[[Any], Any], preconditioner: Callable[[Any], Any],
                        rhs: Any, iterations: int, rtol: float) -> lx.Solution:
    """A⁻¹ rhs by at most ``iterations`` steps of lineax's preconditioned ``CG`` (``operator``:
    v ↦ Av, positive semidefinite; ``preconditioner``: v ↦ M⁻¹v); lineax's solution
    (``.value``; ``stats["num_steps"]``: the iterations), also when it stops at the cap."""
    structure = jax.eval_shape(lambda: rhs)
    tags = lx.positive_semidefinite_tag
    # lineax stops when every entry of the residual is within atol + rtol·|rhs| of zero. An
    # entry of rhs that stays exactly zero (a held parameter, whose row and column the
    # masked product zeroes) made that test 0/0 with atol = 0, and NaN passes it: every solve
    # ended after one iteration (measured on every stage with a held parameter). The
    # smallest normal number keeps such entries out of the test and changes nothing else.
    atol = float(jnp.finfo(jnp.result_type(*jax.tree.leaves(rhs))).tiny)
    return lx.linear_solve(
        lx.FunctionLinearOperator(operator, structure, tags=tags), rhs,
        lx.CG(rtol=rtol, atol=atol, max_steps=iterations),
        options={"preconditioner": lx.FunctionLinearOperator(preconditioner, structure,
                                                            tags=tags)},
        throw=False)
