"""The discrete adjoint: exact gradients of a loss accumulated along a time-stepped
trajectory, with memory set by a snapshot schedule (store-all, nested ``jax.checkpoint``,
Griewank–Walther revolve), and the Taylor test that checks any gradient.

Owns: ``revolve`` (schedules, plans and executors), ``taylor``. Imports nothing of pdefit: a
loss chain is three functions of the state, the parameters and the data.
"""

from pdefit.adjoint.revolve import (
    REVOLVE_EXECUTORS,
    LossChain,
    Nested,
    Revolve,
    RevolvePlan,
    Schedule,
    StoreAll,
    binomial_capacity,
    repetition_number,
    revolve_plan,
    revolve_recomputations,
    revolve_ticks,
    snapshots_for_budget,
)
from pdefit.adjoint.taylor import random_direction, taylor_test

__all__ = [
    "REVOLVE_EXECUTORS",
    "LossChain",
    "Nested",
    "Revolve",
    "RevolvePlan",
    "Schedule",
    "StoreAll",
    "binomial_capacity",
    "random_direction",
    "repetition_number",
    "revolve_plan",
    "revolve_recomputations",
    "revolve_ticks",
    "snapshots_for_budget",
    "taylor_test",
]
