"""The revolve plan: Griewank–Walther binomial checkpointing planned once in Python.

Owns the binomial arithmetic (:func:`binomial_capacity`, :func:`repetition_number`,
:func:`revolve_recomputations`), the plan as integer action arrays (:class:`RevolvePlan`,
:func:`revolve_plan`), and the two tables the executors of :mod:`pdefit.adjoint.revolve` run
it from: :class:`Segments` and :class:`Ticks`. Plain NumPy: nothing here is traced.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

# The kinds of action a plan is made of.
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
# The plan as the executors run it.


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
