"""The discrete adjoint: revolve and nested gradients equal store-all, Taylor order 2, the
number of step evaluations equals the revolve formula, and memory does not grow with N."""

from __future__ import annotations

import dataclasses
import math
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.adjoint import (
    LossChain,
    Nested,
    Revolve,
    StoreAll,
    binomial_capacity,
    repetition_number,
    revolve_plan,
    revolve_recomputations,
    revolve_ticks,
    snapshots_for_budget,
    taylor_test,
)
from pdefit.adjoint.plan import ADVANCE, RESTORE, REVERSE, STORE, _optimal_split
from tests.helpers import ap_problem

# ---------------------------------------------------------------------------------------------
# The plan.


@cache
def brute_force_cost(m: int, s: int) -> int:
    """Minimal advances to reverse m steps with s snapshots, by exhaustive search."""
    if m <= 1:
        return 0
    if s == 0:
        return 10**9
    best = 10**9
    for split in range(1, m):
        if m - split > 1 and s < 2:
            continue
        best = min(best, split + brute_force_cost(m - split, s - 1) + brute_force_cost(split, s))
    return best


def test_formula_and_split_rule_match_brute_force():
    for s in range(1, 6):
        for m in range(2, 60):
            assert revolve_recomputations(m, s) == brute_force_cost(m, s), (m, s)
            split = _optimal_split(m, s)
            right = brute_force_cost(m - split, s - 1) if m - split > 1 else 0
            assert split + right + brute_force_cost(split, s) == brute_force_cost(m, s), (m, s)


def execute_plan(plan):
    """Interpret a plan on integer 'states' (a state is its step index) and return the order
    of reversed steps and the number of advances, checking every invariant on the way."""
    slots: dict[int, int] = {}
    live, reversed_steps, advances = 0, [], 0
    for kind, arg in zip(plan.kinds.tolist(), plan.args.tolist(), strict=True):
        if kind == ADVANCE:
            assert arg >= 1
            live += arg
            advances += arg
        elif kind == STORE:
            assert arg < plan.snapshots
            slots[arg] = live
        elif kind == RESTORE:
            live = slots[arg]
        elif kind == REVERSE:
            expected = plan.n_steps - 1 - len(reversed_steps)
            assert live == expected, "each reverse acts on the next step back"
            reversed_steps.append(live)
    return reversed_steps, advances


@pytest.mark.parametrize("n,s", [(1, 1), (2, 1), (9, 1), (10, 2), (37, 3), (100, 5),
                                 (1001, 7), (4000, 16), (12, 40)])
def test_plan_reverses_every_step_once_with_minimal_advances(n, s):
    s = min(s, n)
    plan = revolve_plan(n, s)
    reversed_steps, advances = execute_plan(plan)
    assert reversed_steps == list(range(n - 1, -1, -1))
    assert advances == revolve_recomputations(n, s)
    assert plan.kinds[plan.first_reverse] == REVERSE
    assert set(plan.kinds[: plan.first_reverse].tolist()) <= {ADVANCE, STORE}


@pytest.mark.parametrize("n,s", [(1, 1), (2, 1), (9, 1), (37, 3), (1001, 7), (4000, 16),
                                 (12, 40)])
def test_branch_free_ticks_follow_the_plan(n, s):
    """The branch-free executor's ticks reverse the same steps with the same advances."""
    s = min(s, n)
    plan, ticks = revolve_plan(n, s), revolve_ticks(revolve_plan(n, s))
    slots = {0: 0}
    assert len(ticks.forward_store) == n and ticks.forward_store[-1] == s
    for step, slot in enumerate(ticks.forward_store[:-1].tolist()):
        slots[slot] = step + 1
    reversed_steps, advances = [n - 1], n - 1
    for u, slot in enumerate(ticks.restore.tolist()):
        live = slots[slot]
        for t in range(ticks.first_tick[u], ticks.first_tick[u + 1]):
            live, advances = live + 1, advances + 1
            slots[int(ticks.tick_store[t])] = live
        reversed_steps.append(live)
    assert reversed_steps == list(range(n - 1, -1, -1))
    assert advances == revolve_recomputations(n, s) == plan.count(ADVANCE)
    assert set(ticks.restore.tolist()) <= set(range(s))


def test_revolve_executor_is_checked_and_named_when_not_auto():
    assert repr(Revolve(32)) == "Revolve(snapshots=32)"
    assert repr(Revolve(4, "branch_free")) == "Revolve(snapshots=4, executor='branch_free')"
    with pytest.raises(ValueError, match="executor 'gpu'"):
        Revolve(4, "gpu")


def test_binomial_helpers():
    assert binomial_capacity(3, 2) == math.comb(5, 3)
    assert repetition_number(10, 3) == 2  # β(3,1)=4 < 10 <= β(3,2)=10
    assert revolve_recomputations(5, 1) == 10  # N(N-1)/2 with one snapshot
    assert snapshots_for_budget(100 * 2**20, 2**20) == 94
    with pytest.raises(ValueError, match="holds no snapshot"):
        snapshots_for_budget(2**20, 2**20)


# ---------------------------------------------------------------------------------------------
# Gradients.


def relative_error(a, b) -> float:
    num = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b), strict=True))
    den = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
    return num / den


ALL_SCHEDULES = (Revolve(1), Revolve(4), Revolve(64), Nested(2), Nested(3))
# The executor for accelerators, run here on the CPU (where "auto" picks "segments").
BRANCH_FREE = (Revolve(1, "branch_free"), Revolve(4, "branch_free"), Revolve(64, "branch_free"))


@pytest.mark.parametrize(("boundaries", "integrator", "schedules"), [
    (("neumann", "neumann"), "euler", ALL_SCHEDULES + BRANCH_FREE),
    (("periodic", "neumann"), "euler", ALL_SCHEDULES),
    (("neumann", "neumann"), "rk4", (Revolve(4), Nested(2))),  # RK4 compiles slowly on CPU
])
def test_schedules_agree_with_store_all(boundaries, integrator, schedules):
    """Scalar parameters and a fitted initial field, two experiments (vmapped), odd N."""
    problem, batch, _, theta = ap_problem(boundaries=boundaries, integrator=integrator,
                                          n_steps=37, every=4, fit_fields=("v",), n_exp=2)
    reference = jax.jit(problem.value_and_grad)(theta, batch)
    for schedule in schedules:
        other = dataclasses.replace(problem, schedule=schedule)
        value, grad = jax.jit(other.value_and_grad)(theta, batch)
        assert abs(float(value) - float(reference[0])) <= 1e-12 * abs(float(reference[0]))
        assert relative_error(grad, reference[1]) <= 1e-10, schedule
    assert float(jnp.max(jnp.abs(reference[1]["fields"]["v"]))) > 0


def test_taylor_remainder_is_second_order():
    problem, batch, _, theta = ap_problem(fit_fields=("v",), schedule=Revolve(3), n_steps=40)
    loss = jax.jit(problem.loss)
    grad = jax.jit(jax.grad(problem.loss))
    rows = taylor_test(lambda t: loss(t, batch), lambda t: grad(t, batch), theta,
                       eps0=1e-2, n=5)
    orders = [r["order"] for r in rows[1:]]
    assert all(1.8 < o < 2.2 for o in orders), rows
    # The first-order difference alone shrinks only linearly, so the test can tell.
    assert rows[-1]["first_order"] > 10 * rows[-1]["remainder"]


# ---------------------------------------------------------------------------------------------
# Work and memory.


def counting_chain(chain: LossChain, counter: list[int]) -> LossChain:
    def bump():
        counter[0] += 1

    def step(x, theta, n):
        jax.debug.callback(bump)
        return chain.step(x, theta, n)

    return chain._replace(step=step)  # keeps observed/observed_cost: the masked path runs


@pytest.mark.parametrize("n,s,executor", [
    (1, 1, "auto"), (7, 1, "auto"), (20, 1, "auto"), (25, 3, "auto"), (33, 4, "auto"),
    (64, 6, "auto"), (101, 8, "auto"),
    (1, 1, "branch_free"), (20, 1, "branch_free"), (101, 8, "branch_free")])
def test_step_evaluations_match_revolve_formula(n, s, executor):
    problem, batch, _, theta = ap_problem(shape=(6, 6), n_steps=n, every=1)
    counter = [0]
    chain = counting_chain(problem.chain(), counter)
    params = problem.physical_params(theta)
    x0 = jax.tree.map(lambda a: a[0], problem.initial_state(theta, batch))
    obs = batch.observed
    data = obs._replace(values={k: v[0] for k, v in obs.values.items()},
                        weights={k: v[0] for k, v in obs.weights.items()},
                        scale={k: v[0] for k, v in obs.scale.items()})
    grad = jax.jit(jax.grad(lambda p: Revolve(s, executor).loss(chain, x0, p, data, n)))
    jax.block_until_ready(grad(params))
    r = repetition_number(n, s)
    expected = n + r * n - binomial_capacity(s + 1, r - 1) if n > 1 else 1
    assert counter[0] == expected


def temp_bytes(problem, batch, theta) -> int:
    compiled = jax.jit(jax.grad(problem.loss)).lower(theta, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_revolve_memory_is_flat_in_trajectory_length():
    sizes = {}
    for schedule in [Revolve(8), StoreAll()]:
        for n in (1000, 4000):
            problem, batch, _, theta = ap_problem(shape=(32, 32), n_steps=n, every=100,
                                                  schedule=schedule)
            sizes[type(schedule).__name__, n] = temp_bytes(problem, batch, theta)
    revolve_growth = sizes["Revolve", 4000] / sizes["Revolve", 1000]
    store_growth = sizes["StoreAll", 4000] / sizes["StoreAll", 1000]
    assert revolve_growth <= 1.10, sizes
    assert 3.5 <= store_growth <= 4.5, sizes
    assert sizes["Revolve", 4000] < sizes["StoreAll", 4000] / 20


def test_chain_with_time_dependent_forcing_parameter():
    """A field-valued, time-dependent forcing θ_f(n) enters every step: revolve must collect
    its cotangent step by step exactly as store-all does."""
    n_steps, shape = 21, (5, 7)  # odd, with an observation at the last step
    key = jax.random.key(0)
    forcing = jax.random.normal(key, (n_steps, *shape))

    def step(x, theta, n):
        return x + 0.05 * (jnp.tanh(x) * theta["rate"] + theta["forcing"][n])

    def cost(x, theta, n, data):
        return jnp.where(n % 3 == 0, jnp.sum((x - data[n // 3]) ** 2), 0.0)

    chain = LossChain(step, cost)
    x0 = jnp.zeros(shape)
    data = jnp.ones((n_steps // 3 + 1, *shape))
    theta = {"rate": jnp.asarray(0.3), "forcing": forcing}
    ref = jax.grad(lambda t: StoreAll().loss(chain, x0, t, data, n_steps))(theta)
    got = jax.grad(lambda t: Revolve(3).loss(chain, x0, t, data, n_steps))(theta)
    assert relative_error(got, ref) <= 1e-12
    assert np.all(np.abs(np.asarray(ref["forcing"])) > 0)


@pytest.mark.parametrize("executor", ["segments", "branch_free"])
def test_revolve_linearises_only_the_leaves_a_derivative_is_taken_of(executor):
    """A leaf of θ held fixed (here a table the step reads through a host callback, which has
    no derivative rule at all) is never linearised by the reversal: the gradient in the other
    leaves equals store-all's, and so does the gradient in the initial state alone."""
    n_steps, shape = 23, (4, 6)
    table = np.linspace(0.0, 1.0, shape[0] * shape[1]).reshape(shape)

    def lookup(t):  # no JVP or VJP: linearising it would raise
        return jax.pure_callback(lambda a: np.asarray(a) ** 2,
                                 jax.ShapeDtypeStruct(shape, t.dtype), t)

    def step(x, theta, n):
        return x + 0.05 * (jnp.tanh(x) * theta["rate"] + lookup(theta["table"]) * theta["gain"])

    def cost(x, theta, n, data):
        return jnp.where(n % 4 == 0, jnp.sum((x - data[n // 4]) ** 2), 0.0)

    chain = LossChain(step, cost)
    x0 = jnp.full(shape, 0.1)
    data = jnp.ones((n_steps // 4 + 1, *shape))
    theta = {"rate": jnp.asarray(0.3), "gain": jnp.asarray(0.7), "table": jnp.asarray(table)}
    revolve = Revolve(3, executor)

    def by(schedule, x, free):
        return schedule.loss(chain, x, {**theta, **free}, data, n_steps)

    free = {"rate": theta["rate"], "gain": theta["gain"]}
    ref = jax.grad(lambda f: by(StoreAll(), x0, f))(free)
    got = jax.jit(jax.grad(lambda f: by(revolve, x0, f)))(free)
    assert relative_error(got, ref) <= 1e-12
    ref_x0 = jax.grad(lambda x: by(StoreAll(), x, {}))(x0)
    got_x0 = jax.jit(jax.grad(lambda x: by(revolve, x, {})))(x0)
    assert relative_error(got_x0, ref_x0) <= 1e-12
    # the table itself: JAX refuses to differentiate the callback (the wording may change)
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=r"(?i)callback"):
        jax.grad(lambda t: by(revolve, x0, {"table": t}))(theta["table"])
