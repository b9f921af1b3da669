"""Fixed-step integrators: they turn a right-hand side into ``step(state, params, t, dt)``.

A state is a pytree (a dict of field arrays). A right-hand side is
``rhs(state, params, t) -> d(state)/dt`` with the same structure. Gating variables (those that
relax linearly towards a state-dependent target, ``dy/dt = (y_inf - y)/tau``) can be advanced
exactly over one step by Rush–Larsen (first order) or its second-order midpoint variant; the
system then also provides
``gates(state, params, t) -> {name: (y_inf, tau)}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

State = Any
Params = Any
RHS = Callable[[State, Params, Any], State]
Gates = Callable[[State, Params, Any], dict[str, tuple[jnp.ndarray, jnp.ndarray]]]
Step = Callable[[State, Params, Any, Any], State]


def _axpy(a: Any, x: State, y: State) -> State:
    """y + a·x, leaf by leaf."""
    return jax.tree.map(lambda xi, yi: yi + a * xi, x, y)


def euler(rhs: RHS) -> Step:
    """Forward Euler: first order."""

    def step(state: State, params: Params, t: Any, dt: Any) -> State:
        return _axpy(dt, rhs(state, params, t), state)

    return step


def heun(rhs: RHS) -> Step:
    """Heun's method (explicit trapezoid): second order."""

    def step(state: State, params: Params, t: Any, dt: Any) -> State:
        k1 = rhs(state, params, t)
        k2 = rhs(_axpy(dt, k1, state), params, t + dt)
        return jax.tree.map(lambda y, a, b: y + 0.5 * dt * (a + b), state, k1, k2)

    return step


def rk4(rhs: RHS) -> Step:
    """The classical fourth-order Runge–Kutta method."""

    def step(state: State, params: Params, t: Any, dt: Any) -> State:
        k1 = rhs(state, params, t)
        k2 = rhs(_axpy(0.5 * dt, k1, state), params, t + 0.5 * dt)
        k3 = rhs(_axpy(0.5 * dt, k2, state), params, t + 0.5 * dt)
        k4 = rhs(_axpy(dt, k3, state), params, t + dt)
        return jax.tree.map(
            lambda y, a, b, c, d: y + (dt / 6.0) * (a + 2.0 * b + 2.0 * c + d),
            state, k1, k2, k3, k4,
        )

    return step


def _gated_update(state: State, derivatives: State, targets: dict, dt: Any) -> State:
    """One Rush–Larsen update over ``dt`` with frozen coefficients: each gate relaxes exactly
    towards its target ``y_inf`` with time constant ``tau``, every other field moves along its
    derivative."""
    new = {}
    for name, value in state.items():
        if name in targets:
            y_inf, tau = targets[name]
            new[name] = y_inf + (value - y_inf) * jnp.exp(-dt / tau)
        else:
            new[name] = value + dt * derivatives[name]
    return new


def rush_larsen(rhs: RHS, gates: Gates) -> Step:
    """Rush–Larsen: gating variables take the exact exponential step towards their target with
    the rest of the state frozen; all other fields take a forward-Euler step. First order overall,
    but unconditionally stable in the (often very stiff) gates."""

    def step(state: State, params: Params, t: Any, dt: Any) -> State:
        return _gated_update(state, rhs(state, params, t), gates(state, params, t), dt)

    return step


def rush_larsen2(rhs: RHS, gates: Gates) -> Step:
    """Second-order Rush–Larsen (the generalised midpoint scheme of Sundnes, Artebrant, Skavhaug
    & Tveito, 2009): a Rush–Larsen half step to the midpoint, then the full step from the start
    with the gates' targets and time constants and the other fields' derivatives taken at that
    midpoint. Two right-hand sides per step (the cost of Rush–Larsen at dt/2), second order, and
    the gates stay unconditionally stable; the other fields have explicit midpoint's stability
    (real-axis extent 2, like forward Euler)."""

    def step(state: State, params: Params, t: Any, dt: Any) -> State:
        half = 0.5 * dt
        mid = _gated_update(state, rhs(state, params, t), gates(state, params, t), half)
        return _gated_update(state, rhs(mid, params, t + half), gates(mid, params, t + half), dt)

    return step


GATED = frozenset({"rush_larsen", "rush_larsen2"})  # methods that need the system's `gates`

INTEGRATORS: dict[str, Callable[..., Step]] = {
    "euler": euler,
    "heun": heun,
    "rk4": rk4,
    "rush_larsen": rush_larsen,
    "rush_larsen2": rush_larsen2,
}

# Extent of each method's stability region along the negative real axis: dt·|λ| must stay below
# it. Stable-dt estimates of the systems are written for forward Euler (extent 2) and scaled.
REAL_AXIS_STABILITY = {"euler": 2.0, "heun": 2.0, "rk4": 2.785, "rush_larsen": 2.0,
                       "rush_larsen2": 2.0}


def make_stepper(method: str, rhs: RHS, gates: Gates | None = None) -> Step:
    """The one-step map of ``method`` for this right-hand side."""
    if method not in INTEGRATORS:
        raise ValueError(f"unknown integrator {method!r}; choose one of {sorted(INTEGRATORS)}")
    if method in GATED:
        if gates is None:
            raise ValueError(f"{method} needs a system with gating variables (a `gates` method)")
        return INTEGRATORS[method](rhs, gates)
    return INTEGRATORS[method](rhs)


def simulate(step: Step, state: State, params: Params, t0: Any, dt: Any, n_steps: int,
             steps_per_frame: int) -> State:
    """Advance ``n_steps`` steps and return the frames every ``steps_per_frame`` steps (the
    initial state first), stacked along a new leading axis. Both loops are ``lax.scan``; use
    this to make data and forecasts — fitting never materialises a trajectory."""
    if n_steps % steps_per_frame:
        raise ValueError(f"n_steps={n_steps} is not a multiple of "
                         f"steps_per_frame={steps_per_frame}")

    def one_step(carry, _):
        x, n = carry
        return (step(x, params, t0 + n * dt, dt), n + 1), None

    def one_frame(carry, _):
        carry, _ = jax.lax.scan(one_step, carry, None, length=steps_per_frame)
        return carry, carry[0]

    carry0 = (state, jnp.asarray(0, jnp.int32))
    _, frames = jax.lax.scan(one_frame, carry0, None, length=n_steps // steps_per_frame)
    return jax.tree.map(lambda x0, xs: jnp.concatenate([x0[None], xs]), state, frames)
