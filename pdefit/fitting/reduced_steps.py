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
   gradient r = g_p − G_px G_xx⁻¹ g_x, and the fields' response to a parameter step (S and r
   in their variational forms, :func:`pdefit.fitting.marginal.solved_columns`: second order
   in the solves' errors, S positive semi-definite, and the predicted decrease the full
   quadratic model's along the step taken; on `bocf_recovery`'s 10 ms path, seed 0: 0.146 %
   mean against 0.344 % with the first-order pair, docs/benchmarks.md);
3. the step δp = −(S + λ diag S)⁻¹ r, with λ the smallest that keeps δp within a trust
   radius (Euclidean, in the fit's unconstrained coordinates; ``optim.reduced_radius`` at a
   stage's start), moves the fields with it (δx = −G_xx⁻¹(g_x + G_xp δp), the joint
   Gauss–Newton step's field part) and the fields are refitted as in 1.;
4. the step is kept when that refit ends below where the fields alone get with as many more
   steps from 1. (the baseline: a trial's fields have had those steps too, so comparing it
   with 1.'s loss would credit the parameters with the fields' progress). Else the radius
   shrinks to 1/4 of the step's length and the step is tried again from the same solves, at
   most ``optim.reduced_tries`` times, and the fit moves to the baseline (parameters
   unchanged, fields refitted further; the next step's radius 4 × below this step's first
   try, or its length if shorter). The radius
   grows to 2 × the step after a step the radius limited whose decrease beyond the baseline
   is over 3/4 of the predicted one, and shrinks to the step's length / 4 after one under
   1/4 (:func:`next_radius`).

Why a radius rather than Nielsen's λ: once the field solves resolve S (the cells' diagonal of
:mod:`pdefit.fitting.marginal`), its scaled eigenvalues on voltage-only BOCF (64², 10 ms)
reach down to 1e-2 and below (with negative ones, where the fields were far from their
optimum, in the first-order form it had then),
and the step at λ = 1e-3 of diag S was 22 × the distance to the truth (at 0.3: 0.12 ×, lower
after the refit than the start's); three tries of Nielsen's rule from 1e-3 end at 8e-3, all
such steps (docs/benchmarks.md, "Reduced steps with the field solves resolved").

A step costs about (k + 1) × the solves' iterations + (tries + 2) × the field steps' sweeps.
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

# λ values (relative to diag S) searched for the one whose step fits the trust radius.
DAMPING_GRID = tuple(float(x) for x in np.logspace(-8, 8, 129))
# After a try that is rejected or does poorly (ratio of the actual to the predicted decrease
# below 1/4) the trust radius is the step's length over this factor (:func:`next_radius`).
SHRINK = 4.0


def make_reduced_update(loss: Callable, curvature: MatrixFree, cfg: OptimConfig,
                        describe: Callable[[Any], Mapping[str, Any]] | None = None,
                        hold: Collection[str] = (),
                        limits: opt.StepLimits | None = None) -> Callable:
    """``update(state, batch) -> (state, StepReport)`` of the module docstring, with the
    contract of :func:`pdefit.fitting.optimisers.make_matrix_free_update` (the report's loss:
    at ``state.theta``; its evaluations: the sweeps over the window), for a fit with at
    least one parameter not in ``hold`` (:func:`pdefit.fitting.updates.takes_reduced_steps`
    gives the stages holding all of them joint steps). ``state.opt_state.damping`` holds the
    trust radius of the parameters' step (``optim.reduced_radius`` at a stage's start)."""
    problem = curvature.problem
    refit = field_refit(loss, opt.make_matrix_free_update(
        loss, curvature, dataclasses.replace(cfg, parameter_step="joint"), None,
        frozenset(problem.layout.fitted), limits), cfg)

    @jax.jit
    def update(state: opt.TrainState, batch: Any):
        value = loss(state.theta, batch)
        key = jax.random.wrap_key_data(state.key)
        fitted, _, sweeps = refit(state.theta, batch, jax.random.fold_in(key, 1))
        parts = reduced_parts(problem, fitted, batch, opt.free_positions(
            state.theta["params"], hold), cfg.reduced_solve_iterations)
        # What the fields alone reach with as many more steps as a trial's refit takes: the
        # parameters' step has to beat that, not the fields it started from.
        baseline, baseline_value, taken = refit(fitted, batch, jax.random.fold_in(key, 2))

        def attempt(carry):
            tries, _, radius, best, sweeps = carry
            damping = parts.damping_within(radius)
            trial, predicted = parts.step(fitted, damping)
            trial, _, _ = opt.limit_step(fitted, trial, limits)
            trial, trial_value, taken = refit(trial, batch, jax.random.fold_in(key, 3 + tries))
            ratio = (baseline_value - trial_value) / predicted
            accept = jnp.isfinite(trial_value) & (predicted > 0) & (ratio > 1e-4)
            radius = next_radius(radius, parts.step_length(damping), damping > DAMPING_GRID[0],
                                 accept, ratio)
            best = jax.tree.map(lambda t, b: jnp.where(accept, t, b), trial, best)
            return tries + 1, accept, radius.astype(state.opt_state.damping.dtype), best, (
                sweeps + taken)

        held = state.opt_state.damping
        start = jnp.where(state.step == 0, cfg.reduced_radius, held).astype(held.dtype)
        _, kept, radius, new, sweeps = jax.lax.while_loop(
            lambda carry: (carry[0] < cfg.reduced_tries) & ~carry[1], attempt,
            (jnp.asarray(0, jnp.int32), jnp.asarray(False), start, baseline,
             sweeps + taken + parts.sweeps))
        # A step whose tries all lose to the baseline shrinks the next step's radius once, not
        # once per try: where the fields are still far from their optimum for any parameter
        # value, every try can lose, and the radius would vanish before they converge.
        first = parts.step_length(parts.damping_within(start))
        radius = jnp.where(kept, radius, jnp.minimum(start, first) / SHRINK).astype(held.dtype)
        at_bound = opt.on_bound(new["params"], limits) if limits else jnp.asarray(False)
        grad_norm = jnp.linalg.norm(parts.reduced_gradient)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        return (opt.advanced(state, new, state.opt_state._replace(damping=radius), value),
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


def next_radius(radius: jax.Array, length: jax.Array, limited: jax.Array, accepted: jax.Array,
                ratio: jax.Array) -> jax.Array:
    """The trust radius after a try whose step was ``length`` long (within ``radius``;
    ``limited``: the radius set its λ, above the grid's smallest) and whose decrease beyond
    the baseline was ``ratio`` × the predicted one: grown to twice the step after a good one
    (ratio > 3/4) that the radius limited, kept after a fair one, and shrunk to the step's
    length / :data:`SHRINK` after a poor or rejected one — the step's, not the radius's, so
    that a radius larger than the undamped step still cuts the next try."""
    grown = jnp.where(limited, jnp.maximum(radius, 2.0 * length), radius)
    return jnp.where(accepted & (ratio > 0.75), grown,
                     jnp.where(accepted & (ratio >= 0.25), radius,
                               jnp.minimum(radius, length) / SHRINK))


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

    def _eigen(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """S scaled to a unit diagonal: (its eigenvalues, floored at 0 — directions the
        cut-short solves leave negative get only the damping, as flat ones —, its
        eigenvectors, the scale sqrt(diag S))."""
        dtype = self.reduced_gradient.dtype
        scale = jnp.sqrt(jnp.maximum(jnp.diag(self.schur), jnp.finfo(dtype).tiny))
        scaled = self.schur / scale[:, None] / scale[None, :]
        values, vectors = jnp.linalg.eigh(0.5 * (scaled + scaled.T))
        return jnp.maximum(values, 0.0), vectors, scale

    def _deltas(self, dampings: jax.Array) -> jax.Array:
        """δp = −(S + λ diag S)⁻¹ r for each λ of ``dampings`` (one row each)."""
        values, vectors, scale = self._eigen()
        along = vectors.T @ (self.reduced_gradient / scale)
        return -((along / (values + dampings[:, None])) @ vectors.T) / scale

    def damping_within(self, radius: jax.Array) -> jax.Array:
        """The smallest λ of :data:`DAMPING_GRID` whose step δp is at most ``radius`` long
        (Euclidean, in the fit's unconstrained coordinates: 0.1 is a change of about 10 %
        of a log-transformed parameter), the grid's largest if none is."""
        grid = jnp.asarray(DAMPING_GRID, self.reduced_gradient.dtype)
        fits = jnp.linalg.norm(self._deltas(grid), axis=1) <= radius
        return grid[jnp.where(jnp.any(fits), jnp.argmax(fits), grid.shape[0] - 1)]

    def step_length(self, damping: jax.Array) -> jax.Array:
        """‖δp‖₂ at damping λ (the unconstrained coordinates)."""
        return jnp.linalg.norm(self._deltas(jnp.reshape(damping, (1,)).astype(
            self.reduced_gradient.dtype))[0])

    def step(self, theta: Any, damping: jax.Array) -> tuple[Any, jax.Array]:
        """(θ + the step at damping λ, the decrease the reduced model predicts)."""
        flat, unravel = ravel_pytree(theta["params"])
        delta = self._deltas(jnp.reshape(damping, (1,)).astype(flat.dtype))[0]
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
    # the gradient, k columns, k coupled products, the fields' diagonal, the solves
    sweeps = (1 + 2 * k + marginal.probe_count(theta["fields"])
              + jnp.sum(parts.steps).astype(jnp.int32))
    return ReducedParts(free, 0.5 * (schur + schur.T), parts.reduced_gradient,
                        parts.solutions, sweeps)
