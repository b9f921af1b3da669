"""Levenberg–Marquardt on the parameters' reduced misfit (variable projection), fields refitted.

With fitted initial fields the joint steps of :func:`pdefit.fitting.optimisers.
make_matrix_free_update` solve (G + λD)δ = −g over fields and parameters together by a few
conjugate-gradient iterations. Those iterations resolve the fields' directions first: the
parameters' curvature once the fields adapt, the Schur complement S = G_pp − G_px G_xx⁻¹ G_xp,
spans four decades on BOCF (docs/design-decisions.md, "Why the joint steps leave the
parameters where they are"), and the joint steps lower the misfit through the fields while the
parameters stay where they were. Here each step works on φ(p) = min_x L(x, p) instead:

1. ``optim.reduced_field_steps`` matrix-free steps of the fields alone bring x near its optimum
   for the current parameters (the loss there is φ(p));
2. k + 1 conjugate-gradient solves with G_xx (the k free parameters' columns and the gradient's
   field part, ``optim.reduced_solve_iterations`` iterations at most) give S, the reduced
   gradient r = g_p − G_px G_xx⁻¹ g_x, and the fields' response to a parameter step;
3. the step δp = −(S + λ diag S)⁻¹ r moves the fields with it (δx = −G_xx⁻¹(g_x + G_xp δp),
   the joint Gauss–Newton step's field part), the fields are refitted as in 1., and the step
   is kept when that lowers the loss; else λ grows by Nielsen's rule and the step is tried
   again from the same solves, at most ``optim.reduced_tries`` times.

A step costs about (k + 1) × the solves' iterations + (tries + 1) × the field steps' sweeps.
One device, shared scalar parameters, no multiple shooting (as the Schur complement of the
intervals, :mod:`pdefit.fitting.marginal`, whose field solves this reuses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.fitting import marginal
from pdefit.fitting import optimisers as opt
from pdefit.fitting.krylov import MatrixFree
from pdefit.options import OptimConfig

# λ of a stage's first reduced step, relative to diag S (Marquardt's usual start).
FIRST_DAMPING = 1e-3


def make_reduced_update(loss: Callable, curvature: MatrixFree, cfg: OptimConfig,
                        describe: Callable[[Any], Mapping[str, Any]] | None = None,
                        hold: Collection[str] = (),
                        limits: opt.StepLimits | None = None) -> Callable:
    """``update(state, batch) -> (state, StepReport)`` of the module docstring, with the
    contract of :func:`pdefit.fitting.optimisers.make_matrix_free_update` (the report's loss:
    at ``state.theta``; its evaluations: the sweeps over the window), for a fit with at
    least one parameter not in ``hold`` (:func:`pdefit.fitting.updates.takes_reduced_steps`
    gives the stages holding all of them joint steps)."""
    problem = curvature.problem
    refit = field_refit(loss, opt.make_matrix_free_update(
        loss, curvature, dataclasses.replace(cfg, parameter_step="joint"), None,
        frozenset(problem.layout.fitted), limits), cfg)

    @jax.jit
    def update(state: opt.TrainState, batch: Any):
        value = loss(state.theta, batch)
        key = jax.random.wrap_key_data(state.key)
        fitted, current, sweeps = refit(state.theta, batch, jax.random.fold_in(key, 1))
        parts = reduced_parts(problem, fitted, batch, opt.free_positions(
            state.theta["params"], hold), cfg.reduced_solve_iterations)

        def attempt(carry):
            tries, _, damping_state, best, sweeps = carry
            trial, predicted = parts.step(fitted, damping_state.damping)
            trial, _, _ = opt.limit_step(fitted, trial, limits)
            trial, trial_value, taken = refit(trial, batch, jax.random.fold_in(key, 2 + tries))
            accept, damping_state = opt.nielsen_update(damping_state, current, trial_value,
                                                       predicted)
            best = jax.tree.map(lambda t, b: jnp.where(accept, t, b), trial, best)
            return tries + 1, accept, damping_state, best, sweeps + taken

        # optim.initial_damping is the fields' (1 from a poor first guess); the reduced step,
        # taken where the fields fit, starts as the scalar fits do.
        damping = state.opt_state.damping
        first = state.opt_state._replace(damping=jnp.where(
            state.step == 0, FIRST_DAMPING, damping).astype(damping.dtype))
        _, _, damping_state, new, sweeps = jax.lax.while_loop(
            lambda carry: (carry[0] < cfg.reduced_tries) & ~carry[1], attempt,
            (jnp.asarray(0, jnp.int32), jnp.asarray(False), first, fitted,
             sweeps + parts.sweeps))
        at_bound = opt.on_bound(new["params"], limits) if limits else jnp.asarray(False)
        grad_norm = jnp.linalg.norm(parts.reduced_gradient)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        return (opt.advanced(state, new, damping_state, value),
                opt.step_report(state, value, grad_norm, finite, sweeps + 1, describe, at_bound))

    return update


def field_refit(loss: Callable, fields_step: Callable, cfg: OptimConfig) -> Callable:
    """``refit(θ, batch, key) -> (θ with its fields refitted, the loss there, the sweeps)``:
    ``cfg.reduced_field_steps`` of ``fields_step`` (a matrix-free update holding every
    parameter) from a fresh Levenberg–Marquardt state, as a stage starts."""

    def refit(theta: Any, batch: Any, key: jax.Array) -> tuple[Any, jax.Array, jax.Array]:
        dtype = jax.eval_shape(loss, theta, batch).dtype
        leaf = jax.tree.leaves(theta)[0].dtype
        inner = opt.TrainState(
            step=jnp.asarray(0, jnp.int32), theta=theta,
            opt_state=opt.DampingState(jnp.asarray(cfg.initial_damping, leaf),
                                       jnp.asarray(2.0, leaf)),
            lr_scale=jnp.asarray(1.0, dtype), key=jax.random.key_data(key),
            best_loss=jnp.asarray(jnp.inf, dtype), best_theta=theta)

        def body(_, carry):
            state, sweeps = carry
            state, report = fields_step(state, batch)
            return state, sweeps + report.evaluations

        inner, sweeps = jax.lax.fori_loop(0, cfg.reduced_field_steps, body,
                                          (inner, jnp.asarray(0, jnp.int32)))
        return inner.theta, loss(inner.theta, batch), sweeps

    return refit


@dataclasses.dataclass(frozen=True)
class ReducedParts:
    """What one reduced step needs at θ (fields near their optimum): S and r over the ``free``
    positions of the flattened parameters, and G_xx⁻¹ applied to the parameters' field
    columns G_xp e_i and to g_x (``solutions``: stacked like θ's fields, the k columns first,
    g_x's last); ``sweeps``: what making them cost."""

    free: np.ndarray
    schur: jax.Array
    reduced_gradient: jax.Array
    solutions: Any
    sweeps: jax.Array

    def step(self, theta: Any, damping: jax.Array) -> tuple[Any, jax.Array]:
        """(θ + the step at damping λ, the decrease the reduced model predicts)."""
        flat, unravel = ravel_pytree(theta["params"])
        scale = jnp.sqrt(jnp.maximum(jnp.diag(self.schur), jnp.finfo(flat.dtype).tiny))
        scaled = self.schur / scale[:, None] / scale[None, :]
        values, vectors = jnp.linalg.eigh(0.5 * (scaled + scaled.T))
        # Directions the cut-short solves left negative get only the damping, as flat ones.
        inverse = 1.0 / (jnp.maximum(values, 0.0) + damping)
        delta = -(vectors @ (inverse * (vectors.T @ (self.reduced_gradient / scale)))) / scale
        predicted = -(delta @ self.reduced_gradient + 0.5 * delta @ self.schur @ delta)
        k = self.free.shape[0]
        fields_delta = jax.tree.map(
            lambda z: -(z[k] + jnp.tensordot(delta.astype(z.dtype), z[:k], 1)), self.solutions)
        params = unravel(flat.at[self.free].add(delta.astype(flat.dtype)))
        return ({**theta, "params": params,
                 "fields": jax.tree.map(jnp.add, theta["fields"], fields_delta)}, predicted)


def reduced_parts(problem: Any, theta: Any, batch: Any, free: np.ndarray,
                  iterations: int) -> ReducedParts:
    """:class:`ReducedParts` at ``theta``: k + 1 field solves, batched as the intervals' are
    (:func:`pdefit.fitting.marginal.solved_columns`)."""
    parts = marginal.solved_columns(problem, theta, batch, free, iterations)
    k = free.shape[0]
    schur = parts.block - parts.coupled
    sweeps = 1 + 2 * k + 1 + jnp.sum(parts.steps).astype(jnp.int32)
    return ReducedParts(free, 0.5 * (schur + schur.T), parts.reduced_gradient,
                        parts.solutions, sweeps)
