"""The revolve executors: a :class:`~pdefit.adjoint.plan.RevolvePlan` run as J(x0, θ, data)
with a ``jax.custom_vjp`` whose backward pass follows the plan.

Two executors of the same plan (see :class:`pdefit.adjoint.schedules.Revolve` for which runs
where): :func:`revolve_loss` runs its :class:`~pdefit.adjoint.plan.Segments`, with conditionals
for restore, reverse and observation; :func:`branch_free_revolve_loss` runs its
:class:`~pdefit.adjoint.plan.Ticks` without any. Both keep the snapshots in one buffer with a
spare slot and differentiate the same pieces (:func:`_transitions`); their primal is J by a
plain scan, which only runs where no gradient is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from pdefit.adjoint.chain import Data, LossChain, State, Theta, store_all_loss, zero_cost
from pdefit.adjoint.plan import RevolvePlan, Segments, revolve_ticks, segments


class _Transitions(NamedTuple):
    """The pieces both revolve executors differentiate: ``transition(x, θ, i, data)`` (one
    step and the cost of the state it starts from), ``last_transition(x, θ, data)`` (the final
    step's cost before it plus the cost of x_N) and ``primal(x0, θ, data)`` (J itself)."""

    transition: Callable[[State, Theta, Any, Data], tuple[State, Any]]
    last_transition: Callable[[State, Theta, Data], Any]
    primal: Callable[[State, Theta, Data], Any]


def _transitions(chain: LossChain, n: int) -> _Transitions:
    """The :class:`_Transitions` of ``chain`` over ``n`` steps."""

    def transition(x, theta, i, data):
        return chain.step(x, theta, i), chain.cost(x, theta, i, data)

    def last_transition(x, theta, data):
        x_next, c = transition(x, theta, n - 1, data)
        return c + chain.cost(x_next, theta, n, data)

    def primal(x0, theta, data):
        return store_all_loss(chain, x0, theta, data, n)

    return _Transitions(transition, last_transition, primal)


def _snapshot_buffers(x0: State, snapshots: int) -> State:
    """Room for ``snapshots`` states and one spare slot at the end, which takes the writes of
    segments or ticks that store nothing. Derived from x0 so that inside ``shard_map`` the
    buffers carry its sharding type."""
    return jax.tree.map(lambda a: jnp.broadcast_to(jnp.zeros_like(a), (snapshots + 1, *a.shape)),
                        x0)


def _written(snaps: State, slot: Any, x: State) -> State:
    """``snaps`` with ``x`` in ``slot``: an unconditional in-place write of one state, cheaper
    than a select (which would read the old slot) or a conditional around the whole buffer."""
    return jax.tree.map(lambda buf, a: buf.at[slot].set(a), snaps, x)


def _maybe_store(snaps, slot_steps, slot, x, i):
    """Write (x, i) into ``slot``; slot −1 means no store and writes into the spare last slot
    of the buffer instead."""
    slot = jnp.where(slot >= 0, slot, slot_steps.shape[0] - 1)
    return _written(snaps, slot, x), slot_steps.at[slot].set(i)


def _zero_cotangent(a):
    a = jnp.asarray(a)
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, dtype=jax.dtypes.float0)


def _is_none(a: Any) -> bool:
    return a is None


def _merged(free: Theta, fixed: Theta) -> Theta:
    """θ from its two parts (see :func:`_custom_loss`): each leaf from whichever holds it."""
    return jax.tree.map(lambda a, b: b if a is None else a, free, fixed, is_leaf=_is_none)


def _custom_loss(primal: Callable, forward: Callable, backward: Callable) -> Callable:
    """``primal`` as a ``jax.custom_vjp`` with ``forward`` and ``backward`` as its rules.

    θ reaches the rules in two parts of its shape, ``free`` (the leaves a derivative is taken
    of, None at the others) and ``fixed`` (the rest, None at the free ones), from JAX's
    symbolic zeros: ``forward(x0, free, fixed, data)``, and ``backward`` returns
    (x̄0, θ̄ of ``free``, data cotangent). Each reversed step then linearises the model in the
    free leaves only, so a fixed leaf need not be differentiable at all (a table the step
    reads through a host callback) and its cotangent is never formed. (In a fit's compiled
    gradient XLA already drops the unused cotangents from the loop: BOCF's 19 fixed
    parameters cost nothing there either, docs/benchmarks.md.)"""

    def forward_rule(x0, theta, data):
        def value(p):
            return p.value

        free = jax.tree.map(lambda p: p.value if p.perturbed else None, theta)
        fixed = jax.tree.map(lambda p: None if p.perturbed else p.value, theta)
        return forward(jax.tree.map(value, x0), free, fixed, jax.tree.map(value, data))

    def backward_rule(residuals, g):
        if isinstance(g, SymbolicZero):  # J itself not differentiated: nothing flows back
            g = jnp.zeros(g.shape, g.dtype)
        return backward(residuals, g)

    loss = jax.custom_vjp(primal)
    loss.defvjp(forward_rule, backward_rule, symbolic_zeros=True)
    return loss


# --------------------------------------------------------------------------------------------
# The segments executor.


def revolve_loss(chain: LossChain, plan: RevolvePlan):
    """J(x0, θ, data) with a custom VJP that follows ``plan``."""
    # NumPy, not device arrays: they become constants of whichever trace runs them (fwd and
    # bwd are traced separately, so a device array made here could leak between traces).
    forward_plan = segments(plan.kinds[: plan.first_reverse], plan.args[: plan.first_reverse])
    backward_plan = segments(plan.kinds[plan.first_reverse + 1 :],
                             plan.args[plan.first_reverse + 1 :])
    pieces = _transitions(chain, plan.n_steps)

    def forward(x0, free, fixed, data):
        return _segments_forward(chain, pieces, forward_plan, plan.snapshots, x0, free, fixed,
                                 data)

    def backward(residuals, g):
        return _segments_backward(chain, pieces.transition, backward_plan, residuals, g)

    return _custom_loss(pieces.primal, forward, backward)


def _segments_forward(chain: LossChain, pieces: _Transitions, forward_plan: Segments,
                      snapshots: int, x0: State, free: Theta, fixed: Theta, data: Data):
    """The first sweep: J, and as residuals the snapshots it stored (with their step numbers)
    and the VJP of the last step (in the state and ``free``)."""
    theta = _merged(free, fixed)
    snaps = _snapshot_buffers(x0, snapshots)
    slot_steps = jnp.zeros((snapshots + 1,), jnp.int32)

    def advance_with_cost(count, x, i, total):
        def one(_, c):
            x, i, total = c
            x_next, cost = pieces.transition(x, theta, i, data)
            return x_next, i + 1, total + cost

        return jax.lax.fori_loop(0, count, one, (x, i, total))

    def segment(k, carry):
        x, i, snaps, slot_steps, total = carry
        x, i, total = advance_with_cost(fp.advance[k], x, i, total)
        snaps, slot_steps = _maybe_store(snaps, slot_steps, fp.store[k], x, i)
        return x, i, snaps, slot_steps, total

    fp = Segments(*(jnp.asarray(a) for a in forward_plan))
    carry = (x0, jnp.asarray(0, jnp.int32), snaps, slot_steps, zero_cost(chain, x0, theta, data))
    x, _, snaps, slot_steps, total = jax.lax.fori_loop(
        0, len(forward_plan.advance), segment, carry)
    last, last_vjp = jax.vjp(
        lambda x_, f: pieces.last_transition(x_, _merged(f, fixed), data), x, free)
    return total + last, (snaps, slot_steps, last_vjp, free, fixed, data)


def _segments_backward(chain: LossChain, transition: Callable, backward_plan: Segments,
                       residuals: tuple, g: Any):
    """The reversal: (x̄0, θ̄ of the free leaves, data cotangent) from the residuals of the
    first sweep, by one loop over the segments of the plan after its first reverse."""
    snaps, slot_steps, last_vjp, free, fixed, data = residuals
    theta = _merged(free, fixed)
    xbar, thetabar = last_vjp(g)
    reverse = _segment_reverse(chain, transition, free, fixed, data, g)

    def segment(k, carry):
        x, i, snaps, slot_steps, xbar, thetabar = carry
        x, i = _restored(snaps, slot_steps, bp.restore[k], x, i)
        x, i = _advanced(chain, theta, bp.advance[k], x, i)
        snaps, slot_steps = _maybe_store(snaps, slot_steps, bp.store[k], x, i)
        xbar, thetabar = jax.lax.cond(
            bp.reverse[k] > 0, reverse, lambda x, i, xbar, thetabar: (xbar, thetabar),
            x, i, xbar, thetabar)
        return x, i, snaps, slot_steps, xbar, thetabar

    bp = Segments(*(jnp.asarray(a) for a in backward_plan))
    # The live state is set by the first segment (it always restores) before it is read.
    x_unset = jax.tree.map(lambda buf: buf[0], snaps)
    carry = (x_unset, jnp.asarray(0, jnp.int32), snaps, slot_steps, xbar, thetabar)
    if len(backward_plan.advance):  # N = 1 reverses its only step in the forward pass
        carry = jax.lax.fori_loop(0, len(backward_plan.advance), segment, carry)
    x0bar, thetabar = carry[4], carry[5]
    databar = jax.tree.map(_zero_cotangent, data)
    return x0bar, thetabar, databar


def _restored(snaps: State, slot_steps: Any, slot: Any, x: State, i: Any):
    """(x, i) from ``slot`` of the snapshots, or as they are where ``slot`` is −1."""
    return jax.lax.cond(
        slot >= 0, lambda x, i: (jax.tree.map(lambda b: b[slot], snaps), slot_steps[slot]),
        lambda x, i: (x, i), x, i)


def _advanced(chain: LossChain, theta: Theta, count: Any, x: State, i: Any):
    """(x, i) after ``count`` steps (no costs: the reversal takes them from the linearisation)."""

    def one(_, c):
        x, i = c
        return chain.step(x, theta, i), i + 1

    return jax.lax.fori_loop(0, count, one, (x, i))


def _segment_reverse(chain: LossChain, transition: Callable, free: Theta, fixed: Theta,
                     data: Data, g: Any) -> Callable:
    """``reverse(x, i, x̄, θ̄)``: the cotangents before step ``i`` from those after it (θ̄ of
    the ``free`` leaves), linearising the cost only where ``chain.observed`` says it can be
    nonzero."""

    def reverse_with_cost(x, i, xbar):
        _, vjp = jax.vjp(lambda x_, f: transition(x_, _merged(f, fixed), i, data), x, free)
        return vjp((xbar, g))

    def reverse_step_only(x, i, xbar):
        _, vjp = jax.vjp(lambda x_, f: chain.step(x_, _merged(f, fixed), i), x, free)
        return vjp(xbar)

    def reverse(x, i, xbar, thetabar):
        if chain.observed is None:
            xbar, step_thetabar = reverse_with_cost(x, i, xbar)
        else:
            xbar, step_thetabar = jax.lax.cond(chain.observed(i, data), reverse_with_cost,
                                               reverse_step_only, x, i, xbar)
        return xbar, jax.tree.map(jnp.add, thetabar, step_thetabar)

    return reverse


# --------------------------------------------------------------------------------------------
# The branch-free executor.


def _masked_cost(chain: LossChain) -> Callable:
    """The cost without a branch on the step where the chain offers one, else its cost."""
    if chain.observed is None or chain.observed_cost is None:
        return chain.cost

    def cost(x, theta, i, data):
        value = chain.observed_cost(x, theta, i, data)
        return jnp.where(chain.observed(i, data), value, jnp.zeros_like(value))

    return cost


def branch_free_revolve_loss(chain: LossChain, plan: RevolvePlan):
    """J(x0, θ, data) with a custom VJP that runs ``plan`` without conditionals (see
    :class:`~pdefit.adjoint.schedules.Revolve`): every loop but the per-unit tick loop has a
    static trip count."""
    n = plan.n_steps
    ticks = revolve_ticks(plan)
    transition, last_transition, primal = _transitions(
        chain._replace(cost=_masked_cost(chain)), n)

    def forward(x0, free, fixed, data):
        theta = _merged(free, fixed)
        snaps = _written(_snapshot_buffers(x0, plan.snapshots), 0, x0)
        slots = jnp.asarray(ticks.forward_store)

        def tick(i, carry):
            x, snaps, total = carry
            x, c = transition(x, theta, i, data)
            return x, _written(snaps, slots[i], x), total + c

        x, snaps, total = jax.lax.fori_loop(
            0, n - 1, tick, (x0, snaps, zero_cost(chain, x0, theta, data)))
        last, last_vjp = jax.vjp(lambda x_, f: last_transition(x_, _merged(f, fixed), data),
                                 x, free)
        return total + last, (snaps, last_vjp, free, fixed, data)

    def backward(residuals, g):
        snaps, last_vjp, free, fixed, data = residuals
        theta = _merged(free, fixed)
        xbar, thetabar = last_vjp(g)
        restore, first_tick = jnp.asarray(ticks.restore), jnp.asarray(ticks.first_tick)
        tick_store = jnp.asarray(ticks.tick_store)

        def tick(t, carry):
            x, i, snaps = carry
            x = chain.step(x, theta, i)
            return x, i + 1, _written(snaps, tick_store[t], x)

        def unit(u, carry):
            snaps, xbar, thetabar = carry
            # Unit u reverses step n − 2 − u after one tick per step from the restored state,
            # so the step of that state follows from the tables: no step counts are stored.
            i = n - 2 - u - (first_tick[u + 1] - first_tick[u])
            x = jax.tree.map(lambda buf: buf[restore[u]], snaps)
            x, i, snaps = jax.lax.fori_loop(first_tick[u], first_tick[u + 1], tick, (x, i, snaps))
            _, vjp = jax.vjp(lambda x_, f: transition(x_, _merged(f, fixed), i, data), x, free)
            xbar, step_thetabar = vjp((xbar, g))
            return snaps, xbar, jax.tree.map(jnp.add, thetabar, step_thetabar)

        if n > 1:
            _, xbar, thetabar = jax.lax.fori_loop(0, n - 1, unit, (snaps, xbar, thetabar))
        return xbar, thetabar, jax.tree.map(_zero_cotangent, data)

    return _custom_loss(primal, forward, backward)
