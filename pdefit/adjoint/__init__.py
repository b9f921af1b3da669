"""The discrete adjoint: exact gradients of a loss accumulated along a time-stepped
trajectory, with memory set by a snapshot schedule (store-all, nested ``jax.checkpoint``,
Griewank–Walther revolve), and the Taylor test that checks any gradient.

Owns: ``chain`` (the loss chain and its plain and nested scans), ``schedules`` (the schedules
and the snapshot budget), ``plan`` (the revolve plan and the tables its executors run),
``revolve`` (the revolve executors), ``taylor``. Imports nothing of pdefit: a loss chain is
three functions of the state, the parameters and the data.
"""

from pdefit.adjoint.chain import LossChain
from pdefit.adjoint.plan import (
    RevolvePlan,
    binomial_capacity,
    repetition_number,
    revolve_plan,
    revolve_recomputations,
    revolve_ticks,
)
from pdefit.adjoint.schedules import (
    REVOLVE_EXECUTORS,
    Nested,
    Revolve,
    Schedule,
    StoreAll,
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
