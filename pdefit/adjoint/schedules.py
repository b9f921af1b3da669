"""The discrete adjoint: exact gradients of an in-loop loss, with memory set by a snapshot schedule.

A fit differentiates a *loss chain* (:class:`~pdefit.adjoint.chain.LossChain`): states
x_0 … x_N with

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
  The schedule is planned once in Python (:func:`~pdefit.adjoint.plan.revolve_plan`) as integer
  action arrays and run by one loop over segments (``lax.fori_loop``), so the program does not
  grow with N and ``step`` is traced a fixed number of times.

"Snapshot" means a state kept inside one gradient evaluation; "checkpoint" is reserved for the
training state Orbax writes to disk.

Owns the schedules — small immutable values; each knows how to evaluate J so that
reverse-mode differentiation of the result follows its memory/work trade-off — and
:func:`snapshots_for_budget`. The scans live in :mod:`pdefit.adjoint.chain`, the revolve plan
in :mod:`pdefit.adjoint.plan` and its executors in :mod:`pdefit.adjoint.revolve`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from pdefit.adjoint.chain import Data, LossChain, State, Theta, nested_steps, store_all_loss
from pdefit.adjoint.plan import revolve_plan
from pdefit.adjoint.revolve import branch_free_revolve_loss, revolve_loss


@dataclass(frozen=True)
class StoreAll:
    """Keep every state (plain reverse-mode through the scan)."""

    def loss(self, chain: LossChain, x0: State, theta: Theta, data: Data, n_steps: int):
        return store_all_loss(chain, x0, theta, data, n_steps)


@dataclass(frozen=True)
class Nested:
    """``levels`` nested scans, each inner block wrapped in ``jax.checkpoint``."""

    levels: int = 2

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ValueError(f"Nested needs levels >= 1, got {self.levels}")

    def loss(self, chain: LossChain, x0: State, theta: Theta, data: Data, n_steps: int):
        x, total = nested_steps(chain, x0, theta, data, 0, n_steps, self.levels)
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
            return branch_free_revolve_loss(chain, plan)(x0, theta, data)
        return revolve_loss(chain, plan)(x0, theta, data)


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
