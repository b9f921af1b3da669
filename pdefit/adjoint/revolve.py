"""The discrete adjoint: exact gradients of an in-loop loss, with memory set by a snapshot schedule.

A fit differentiates a *loss chain*: states x_0 … x_N with

    x_{n+1} = step(x_n, θ, n),      J = Σ_{n=0..N} cost(x_n, θ, n, data)

where ``cost`` is zero except at observation steps. Every schedule computes the same J and the
exact gradient of this discrete J (discretize-then-optimize); they differ in memory and work:

- :class:`StoreAll` — plain reverse-mode through ``lax.scan``: O(N) states, no recomputation.
  The reference the others are tested against.
- :class:`Nested` — ``jax.checkpoint`` around nested scans: O(levels · N^(1/levels)) states,
  about ``levels − 1`` extra forward sweeps.
- :class:`Revolve` — Griewank–Walther binomial checkpointing with ``s`` snapshots: memory is s
  states whatever N, and the number of forward recomputations is the minimum possible,
  r·N − β(s+1, r−1) with β(s, r) = C(s+r, s) and r the smallest integer with β(s, r) ≥ N.
  The schedule is planned once in Python (:func:`revolve_plan`) as integer action arrays and run
  by one loop over segments (``lax.fori_loop``), so the program does not grow with N and
  ``step`` is traced a fixed number of times.

"Snapshot" means a state kept inside one gradient evaluation; "checkpoint" is reserved for the
training state Orbax writes to disk.

``data`` travels as an argument, never as a closure: the chain's functions must not close over
traced values (they are static to ``custom_vjp``), and large observed arrays would otherwise be
baked into the program as constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

State = Any
Theta = Any
Data = Any


class LossChain(NamedTuple):
    """The functions that define a loss along a trajectory (see the module docstring).

    ``observed(n, data)``, when given, says whether ``cost`` can be nonzero at step ``n``;
    revolve then linearises the cost only at those steps (differentiating through a cost
    that branches on the step costs about one more forward step at every step).

    ``observed_cost(x, θ, n, data)``, when given with ``observed``, is ``cost`` at the steps
    ``observed`` selects, computed without branching on ``n`` (finite anywhere else): the
    branch-free revolve executor masks it instead of branching."""

    step: Callable[[State, Theta, Any], State]
    cost: Callable[[State, Theta, Any, Data], Any]
    observed: Callable[[Any, Data], Any] | None = None
    observed_cost: Callable[[State, Theta, Any, Data], Any] | None = None


# --------------------------------------------------------------------------------------------
# Schedules: small immutable values; each knows how to evaluate J so that reverse-mode
# differentiation of the result follows its memory/work trade-off.


@dataclass(frozen=True)
class StoreAll:
    """Keep every state (plain reverse-mode through the scan)."""

    def loss(self, chain: LossChain, x0: State, theta: Theta, data: Data, n_steps: int):
        x, total = _scan(chain, x0, theta, data, 0, n_steps)
        return total + chain.cost(x, theta, n_steps, data)


@dataclass(frozen=True)
class Nested:
    """``levels`` nested scans, each inner block wrapped in ``jax.checkpoint``."""

    levels: int = 2

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ValueError(f"Nested needs levels >= 1, got {self.levels}")

    def loss(self, chain: LossChain, x0: State, theta: Theta, data: Data, n_steps: int):
        x, total = _nested(chain, x0, theta, data, 0, n_steps, self.levels)
        return total + chain.cost(x, theta, n_steps, data)


REVOLVE_EXECUTORS = ("auto", "segments", "branch_free")


@dataclass(frozen=True)
class Revolve:
    """Binomial checkpointing with ``snapshots`` stored states (x_0 included).

    ``executor`` runs the same plan two ways: ``segments`` (one loop over segments, with
    conditionals for restore, reverse and observation and a loop of dynamic length per
    advance: cheapest where a conditional costs nothing, as on a CPU) or ``branch_free`` (no
    conditionals: restores by dynamic index, a store after every step, the cost masked; on an
    accelerator every conditional and every dynamic loop test waits for the host). ``auto``:
    ``segments`` on the CPU backend, ``branch_free`` elsewhere."""

    snapshots: int = 16
    executor: str = "auto"

    def __post_init__(self) -> None:
        if self.snapshots < 1:
            raise ValueError(f"Revolve needs at least one snapshot, got {self.snapshots}")
        if self.executor not in REVOLVE_EXECUTORS:
            raise ValueError(f"Revolve executor {self.executor!r}: use one of "
                             f"{REVOLVE_EXECUTORS}")

    def __repr__(self) -> str:  # what logs and summary.json show; "auto" goes unsaid
        executor = "" if self.executor == "auto" else f", executor={self.executor!r}"
        return f"Revolve(snapshots={self.snapshots}{executor})"

    def loss(self, chain: LossChain, x0: State, theta: Theta, data: Data, n_steps: int):
        if n_steps == 0:
            return chain.cost(x0, theta, 0, data)
        plan = revolve_plan(n_steps, min(self.snapshots, n_steps))
        executor = self.executor
        if executor == "auto":
            executor = "segments" if jax.default_backend() == "cpu" else "branch_free"
        if executor == "branch_free":
            return _branch_free_revolve_loss(chain, plan)(x0, theta, data)
        return _revolve_loss(chain, plan)(x0, theta, data)


Schedule = StoreAll | Nested | Revolve


def snapshots_for_budget(budget_bytes: float, state_bytes: float, reserve: int = 6) -> int:
    """How many snapshots fit in ``budget_bytes`` for states of ``state_bytes``, leaving room for
    ``reserve`` working states (live state, cotangent, one step's linearisation)."""
    s = int(budget_bytes // state_bytes) - reserve
    if s < 1:
        raise ValueError(
            f"a memory budget of {budget_bytes / 2**20:.1f} MiB holds no snapshot of a "
            f"{state_bytes / 2**20:.2f} MiB state beside {reserve} working states"
        )
    return s


# --------------------------------------------------------------------------------------------
# Plain and nested scans.


def _scan(chain: LossChain, x0: State, theta: Theta, data: Data, start: Any, length: int):
    """Advance ``length`` steps from step index ``start``; return (x, Σ cost before each step)."""

    def body(carry, n):
        x, total = carry
        total = total + chain.cost(x, theta, n, data)
        return (chain.step(x, theta, n), total), None

    (x, total), _ = jax.lax.scan(body, (x0, _zero_cost(chain, x0, theta, data)),
                                 start + jnp.arange(length))
    return x, total


def _nested(chain, x0, theta, data, start, length, levels):
    if levels == 1 or length <= 1:
        return _scan(chain, x0, theta, data, start, length)
    block = math.ceil(length ** ((levels - 1) / levels))
    n_blocks, remainder = divmod(length, block)

    @jax.checkpoint
    def one_block(x, first):
        return _nested(chain, x, theta, data, first, block, levels - 1)

    def body(carry, first):
        x, total = carry
        x, part = one_block(x, first)
        return (x, total + part), None

    firsts = start + block * jnp.arange(n_blocks)
    (x, total), _ = jax.lax.scan(body, (x0, _zero_cost(chain, x0, theta, data)), firsts)
    if remainder:
        x, part = _nested(chain, x, theta, data, start + n_blocks * block, remainder, levels - 1)
        total = total + part
    return x, total


def _zero_cost(chain, x0, theta, data):
    """A zero to start summing costs from, of the cost's dtype and typed like a reduction of
    the state (inside ``shard_map`` a loop carry must keep one "varying" type throughout)."""
    dtype = jax.eval_shape(lambda: chain.cost(x0, theta, jnp.asarray(0), data)).dtype
    return jnp.sum(jax.tree.leaves(x0)[0][..., :0]).astype(dtype)


# --------------------------------------------------------------------------------------------
# Revolve: the plan.

ADVANCE, STORE, RESTORE, REVERSE = 0, 1, 2, 3


def binomial_capacity(snapshots: int, repetitions: int) -> int:
    """β(s, r) = C(s + r, s): the most steps s snapshots can reverse when no step is advanced
    more than r times."""
    return math.comb(snapshots + repetitions, snapshots) if repetitions >= 0 else 0


def repetition_number(n_steps: int, snapshots: int) -> int:
    """The smallest r with β(s, r) ≥ N."""
    r = 0
    while binomial_capacity(snapshots, r) < n_steps:
        r += 1
    return r


def revolve_recomputations(n_steps: int, snapshots: int) -> int:
    """The minimal number of forward advances (the first sweep included) needed to reverse
    ``n_steps`` steps with ``snapshots`` snapshots: r·N − β(s+1, r−1)."""
    if n_steps <= 1:
        return 0
    r = repetition_number(n_steps, snapshots)
    return r * n_steps - binomial_capacity(snapshots + 1, r - 1)


def _optimal_split(m: int, s: int) -> int:
    """How far to advance before storing the next snapshot when reversing m steps with s
    snapshots (one of which holds the start). Any split in
    [max(β(s, r−2), m − β(s−1, r)), min(β(s, r−1), m − β(s−1, r−1))] attains the minimum
    r·m − β(s+1, r−1); the test suite checks this against brute-force dynamic programming."""
    if s == 1:
        return m - 1
    r = repetition_number(m, s)
    low = max(binomial_capacity(s, r - 2), m - binomial_capacity(s - 1, r))
    return min(max(low, 1), m - 1)


class RevolvePlan(NamedTuple):
    """Actions as integer arrays: ``kinds[k]`` in {ADVANCE, STORE, RESTORE, REVERSE} and
    ``args[k]`` (number of steps for ADVANCE, slot for STORE/RESTORE). ``first_reverse`` splits
    the plan: everything before it is the forward sweep (run in the primal pass)."""

    n_steps: int
    snapshots: int
    kinds: np.ndarray
    args: np.ndarray
    first_reverse: int

    def __hash__(self) -> int:  # so a plan can be a static argument
        return hash((self.n_steps, self.snapshots))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RevolvePlan) and (self.n_steps, self.snapshots) == (
            other.n_steps, other.snapshots)

    def count(self, kind: int) -> int:
        """Total of ``kind`` actions (for ADVANCE: total steps advanced)."""
        if kind == ADVANCE:
            return int(self.args[self.kinds == ADVANCE].sum())
        return int((self.kinds == kind).sum())


@lru_cache(maxsize=64)
def revolve_plan(n_steps: int, snapshots: int) -> RevolvePlan:
    """The binomial schedule reversing ``n_steps`` steps with ``snapshots`` slots. Slots are used
    as a stack: slot ``d`` holds the start of the sub-range being reversed at depth ``d``."""
    if n_steps < 1 or snapshots < 1:
        raise ValueError(f"need n_steps >= 1 and snapshots >= 1, got {n_steps}, {snapshots}")
    actions: list[tuple[int, int]] = [(STORE, 0)]
    # An explicit stack instead of recursion, since N may be large. Frames are either
    # ("reverse", start, stop, slot): reverse steps [start, stop) with x_start live and held in
    # `slot`; or ("restore", slot, 0, 0).
    stack: list[tuple[str, int, int, int]] = [("reverse", 0, n_steps, 0)]
    while stack:
        what, a, b, slot = stack.pop()
        if what == "restore":
            actions.append((RESTORE, a))
            continue
        m = b - a
        if m == 1:
            actions.append((REVERSE, 0))
            continue
        split = _optimal_split(m, snapshots - slot)
        actions.append((ADVANCE, split))
        right_slot = slot
        if m - split > 1:  # a single step is reversed from the live state, no snapshot needed
            right_slot = slot + 1
            actions.append((STORE, right_slot))
        # Executed in the opposite order of pushing: right part, back to x_start, left part.
        stack.append(("reverse", a, a + split, slot))
        stack.append(("restore", slot, 0, 0))
        stack.append(("reverse", a + split, b, right_slot))
    kinds = np.array([a for a, _ in actions], dtype=np.int32)
    args = np.array([b for _, b in actions], dtype=np.int32)
    first_reverse = int(np.argmax(kinds == REVERSE))
    return RevolvePlan(n_steps, snapshots, kinds, args, first_reverse)


# --------------------------------------------------------------------------------------------
# Revolve: the executor.


class Segments(NamedTuple):
    """A run of actions in the fixed order restore → advance → store → reverse, as arrays with
    one entry per segment (−1 / 0 where a segment lacks that action). Executing segments
    instead of single actions lets one loop body do all four without a ``switch``: a switch
    would pass the whole snapshot buffer through a conditional at every action, which costs a
    copy of all snapshots per reversed step on some backends."""

    restore: np.ndarray  # slot, or -1
    advance: np.ndarray  # number of steps, may be 0
    store: np.ndarray    # slot, or -1
    reverse: np.ndarray  # 1 to reverse one step, else 0


_STAGE = {RESTORE: 0, ADVANCE: 1, STORE: 2, REVERSE: 3}


def segments(kinds: np.ndarray, args: np.ndarray) -> Segments:
    """Group an action list into :class:`Segments`."""
    rows: list[list[int]] = []
    last_stage = 4
    for kind, arg in zip(kinds.tolist(), args.tolist(), strict=True):
        stage = _STAGE[kind]
        if stage <= last_stage:
            rows.append([-1, 0, -1, 0])
        rows[-1][stage] = 1 if kind == REVERSE else arg
        last_stage = stage
    table = np.asarray(rows, np.int32).reshape(-1, 4)
    return Segments(*(np.ascontiguousarray(table[:, k]) for k in range(4)))


def _transitions(chain: LossChain, n: int):
    """The pieces both revolve executors differentiate: ``transition(x, θ, i, data)`` (one
    step and the cost of the state it starts from), ``last_transition(x, θ, data)`` (the final
    step's cost before it plus the cost of x_N) and ``primal(x0, θ, data)`` (J itself)."""

    def transition(x, theta, i, data):
        return chain.step(x, theta, i), chain.cost(x, theta, i, data)

    def last_transition(x, theta, data):
        x_next, c = transition(x, theta, n - 1, data)
        return c + chain.cost(x_next, theta, n, data)

    def primal(x0, theta, data):
        return StoreAll().loss(chain, x0, theta, data, n)

    return transition, last_transition, primal


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


def _revolve_loss(chain: LossChain, plan: RevolvePlan):
    """J(x0, θ, data) with a custom VJP that follows ``plan``."""
    # NumPy, not device arrays: they become constants of whichever trace runs them (fwd and
    # bwd are traced separately, so a device array made here could leak between traces).
    forward_plan = segments(plan.kinds[: plan.first_reverse], plan.args[: plan.first_reverse])
    backward_plan = segments(plan.kinds[plan.first_reverse + 1 :],
                             plan.args[plan.first_reverse + 1 :])
    transition, last_transition, primal = _transitions(chain, plan.n_steps)

    def forward(x0, theta, data):
        snaps = _snapshot_buffers(x0, plan.snapshots)
        slot_steps = jnp.zeros((plan.snapshots + 1,), jnp.int32)

        def advance_with_cost(count, x, i, total):
            def one(_, c):
                x, i, total = c
                x_next, cost = transition(x, theta, i, data)
                return x_next, i + 1, total + cost

            return jax.lax.fori_loop(0, count, one, (x, i, total))

        def segment(k, carry):
            x, i, snaps, slot_steps, total = carry
            x, i, total = advance_with_cost(fp.advance[k], x, i, total)
            snaps, slot_steps = _maybe_store(snaps, slot_steps, fp.store[k], x, i)
            return x, i, snaps, slot_steps, total

        fp = Segments(*(jnp.asarray(a) for a in forward_plan))
        carry = (x0, jnp.asarray(0, jnp.int32), snaps, slot_steps,
                 _zero_cost(chain, x0, theta, data))
        x, _, snaps, slot_steps, total = jax.lax.fori_loop(
            0, len(forward_plan.advance), segment, carry)
        last, last_vjp = jax.vjp(lambda x_, th: last_transition(x_, th, data), x, theta)
        return total + last, (snaps, slot_steps, last_vjp, theta, data)

    def backward(residuals, g):
        snaps, slot_steps, last_vjp, theta, data = residuals
        xbar, thetabar = last_vjp(g)

        def advance(count, x, i):
            def one(_, c):
                x, i = c
                return chain.step(x, theta, i), i + 1

            return jax.lax.fori_loop(0, count, one, (x, i))

        def reverse_with_cost(x, i, xbar):
            _, vjp = jax.vjp(lambda x_, th: transition(x_, th, i, data), x, theta)
            return vjp((xbar, g))

        def reverse_step_only(x, i, xbar):
            _, vjp = jax.vjp(lambda x_, th: chain.step(x_, th, i), x, theta)
            return vjp(xbar)

        def reverse(x, i, xbar, thetabar):
            if chain.observed is None:
                xbar, step_thetabar = reverse_with_cost(x, i, xbar)
            else:
                xbar, step_thetabar = jax.lax.cond(chain.observed(i, data), reverse_with_cost,
                                                   reverse_step_only, x, i, xbar)
            return xbar, jax.tree.map(jnp.add, thetabar, step_thetabar)

        def segment(k, carry):
            x, i, snaps, slot_steps, xbar, thetabar = carry
            slot = bp.restore[k]
            x, i = jax.lax.cond(
                slot >= 0, lambda x, i: (jax.tree.map(lambda b: b[slot], snaps), slot_steps[slot]),
                lambda x, i: (x, i), x, i)
            x, i = advance(bp.advance[k], x, i)
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

    loss = jax.custom_vjp(primal)
    loss.defvjp(forward, backward)
    return loss


class Ticks(NamedTuple):
    """A plan as the branch-free executor runs it. Forward: one tick per step of the first
    sweep, ``forward_store[t]`` the slot the state after it goes to (the spare slot when none).
    Backward: one unit per reversed step, which restores ``restore[u]``, runs ticks
    ``first_tick[u]`` to ``first_tick[u + 1]`` (one step each, then a store into
    ``tick_store[t]``) and reverses one step. Both store tables end with one unused entry."""

    forward_store: np.ndarray
    restore: np.ndarray
    first_tick: np.ndarray
    tick_store: np.ndarray


def revolve_ticks(plan: RevolvePlan) -> Ticks:
    """The plan as :class:`Ticks`. Relies on the plan's shape (checked): the first sweep
    stores slot 0 first; every store follows an advance; in the reversal every reverse but
    the last is followed by a restore."""
    spare = plan.snapshots
    kinds, args = plan.kinds.tolist(), plan.args.tolist()
    if kinds[0] != STORE or args[0] != 0:
        raise ValueError("a revolve plan starts by storing x_0 in slot 0")

    def ticked(actions: list[tuple[int, int]]) -> list[int]:
        stores: list[int] = []
        for kind, arg in actions:
            if kind == ADVANCE:
                stores += [spare] * arg
            elif kind == STORE:
                if not stores:
                    raise ValueError("a revolve plan stores only right after an advance")
                stores[-1] = arg
        return stores

    forward = ticked(list(zip(kinds[1:plan.first_reverse], args[1:plan.first_reverse],
                              strict=True)))
    if len(forward) != plan.n_steps - 1:
        raise ValueError("a revolve plan's first sweep advances to the last step")
    restore, first_tick, tick_store = [], [], []
    unit: list[tuple[int, int]] = []
    for kind, arg in zip(kinds[plan.first_reverse + 1:], args[plan.first_reverse + 1:],
                         strict=True):
        if kind == RESTORE and not unit:
            restore.append(arg)
            first_tick.append(len(tick_store))
        elif kind == REVERSE:
            tick_store += ticked(unit)
            unit = []
        elif kind in (ADVANCE, STORE) and restore:
            unit.append((kind, arg))
        else:
            raise ValueError("every unit of a revolve reversal starts with a restore")
    if unit or len(restore) != plan.n_steps - 1:
        raise ValueError("a revolve reversal ends with a reverse, one per earlier step")
    first_tick.append(len(tick_store))
    # One spare entry more in each store table: a loop body is traced even where it never
    # runs, and indexing an empty table fails at trace time.
    return Ticks(*(np.asarray(a, np.int32) for a in ([*forward, spare], restore, first_tick,
                                                       [*tick_store, spare])))


def _masked_cost(chain: LossChain) -> Callable:
    """The cost without a branch on the step where the chain offers one, else its cost."""
    if chain.observed is None or chain.observed_cost is None:
        return chain.cost

    def cost(x, theta, i, data):
        value = chain.observed_cost(x, theta, i, data)
        return jnp.where(chain.observed(i, data), value, jnp.zeros_like(value))

    return cost


def _branch_free_revolve_loss(chain: LossChain, plan: RevolvePlan):
    """J(x0, θ, data) with a custom VJP that runs ``plan`` without conditionals (see
    :class:`Revolve`): every loop but the per-unit tick loop has a static trip count."""
    n = plan.n_steps
    ticks = revolve_ticks(plan)
    transition, last_transition, primal = _transitions(
        chain._replace(cost=_masked_cost(chain)), n)

    def forward(x0, theta, data):
        snaps = _written(_snapshot_buffers(x0, plan.snapshots), 0, x0)
        slots = jnp.asarray(ticks.forward_store)

        def tick(i, carry):
            x, snaps, total = carry
            x, c = transition(x, theta, i, data)
            return x, _written(snaps, slots[i], x), total + c

        x, snaps, total = jax.lax.fori_loop(
            0, n - 1, tick, (x0, snaps, _zero_cost(chain, x0, theta, data)))
        last, last_vjp = jax.vjp(lambda x_, th: last_transition(x_, th, data), x, theta)
        return total + last, (snaps, last_vjp, theta, data)

    def backward(residuals, g):
        snaps, last_vjp, theta, data = residuals
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
            _, vjp = jax.vjp(lambda x_, th: transition(x_, th, i, data), x, theta)
            xbar, step_thetabar = vjp((xbar, g))
            return snaps, xbar, jax.tree.map(jnp.add, thetabar, step_thetabar)

        if n > 1:
            _, xbar, thetabar = jax.lax.fori_loop(0, n - 1, unit, (snaps, xbar, thetabar))
        return xbar, thetabar, jax.tree.map(_zero_cotangent, data)

    loss = jax.custom_vjp(primal)
    loss.defvjp(forward, backward)
    return loss


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
