"""A fit problem: system + grid + time stepping + parameters + observations + schedule
→ ``loss(theta, batch)`` and its exact gradient.

``theta`` is the optimiser's pytree: ``{"params": {name: unconstrained scalar},
"fields": {name: (n_exp, ny, nx) initial field}}``. ``batch`` carries everything read from the
dataset (observed frames and the known parts of the initial state), so jitted functions take
it as an argument instead of baking it in as constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .adjoint import LossChain, Schedule
from .grid import Grid
from .observe import Observation, ObservedData
from .params import ParameterLayout
from .system import System, stepper


class Batch(NamedTuple):
    observed: ObservedData
    initial: dict[str, jnp.ndarray]  # known initial fields, (n_exp, ny, nx)


@dataclass(frozen=True)
class Regularization:
    """L2 penalties: ``params`` on the distance of fitted parameters from their defaults in
    unconstrained coordinates (a weak prior), ``fields`` on the mean square of fitted fields."""

    params: float = 0.0
    fields: float = 0.0


@dataclass(frozen=True)
class FitProblem:
    system: System
    grid: Grid
    dt: float
    integrator: str
    n_steps: int
    layout: ParameterLayout
    observation: Observation
    schedule: Schedule
    fitted_fields: tuple[str, ...] = ()
    t0: float = 0.0
    regularization: Regularization = Regularization()

    def __post_init__(self) -> None:
        unknown = [f for f in (*self.fitted_fields, *self.observation.fields)
                   if f not in self.system.fields]
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} for {self.system.name}; it has "
                             f"{list(self.system.fields)}")

    # -- pieces ---------------------------------------------------------------------------------

    def chain(self) -> LossChain:
        """The loss chain of one experiment; its θ is the dict of physical parameters."""
        one_step = stepper(self.system, self.grid, self.integrator)
        dt, t0, observation = self.dt, self.t0, self.observation

        def step(state, params, n):
            return one_step(state, params, t0 + n * dt, dt)

        def cost(state, params, n, data):
            return observation.cost(state, data, n)

        return LossChain(step, cost)

    def initial_state(self, theta: Mapping[str, Any], batch: Batch) -> dict[str, jnp.ndarray]:
        fields = theta.get("fields", {})
        return {f: fields[f] if f in self.fitted_fields else batch.initial[f]
                for f in self.system.fields}

    def physical_params(self, theta: Mapping[str, Any]) -> dict[str, jnp.ndarray]:
        return {k: jnp.asarray(v) for k, v in self.layout.physical(theta["params"]).items()}

    # -- the loss -------------------------------------------------------------------------------

    def data_loss(self, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
        """Mean over experiments of the observation misfit."""
        params = self.physical_params(theta)
        x0 = self.initial_state(theta, batch)
        chain = self.chain()
        obs = batch.observed
        per_experiment = ObservedData(obs.values, obs.weights, obs.scale, None)

        def one(x0_e, obs_e):
            data = obs_e._replace(slot_of_step=obs.slot_of_step)
            return self.schedule.loss(chain, x0_e, params, data, self.n_steps)

        return jnp.mean(jax.vmap(one)(x0, per_experiment))

    def penalty(self, theta: Mapping[str, Any]) -> jnp.ndarray:
        reg = self.regularization
        total = jnp.zeros(())
        if reg.params:
            for name, z in theta["params"].items():
                spec = self.layout.specs[name]
                z_default = spec.to_unconstrained(spec.default)
                total = total + reg.params * (z - z_default) ** 2
        if reg.fields:
            for field in theta.get("fields", {}).values():
                total = total + reg.fields * jnp.mean(field**2)
        return total

    def loss(self, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
        return self.data_loss(theta, batch) + self.penalty(theta)

    def value_and_grad(self, theta: Mapping[str, Any], batch: Batch):
        return jax.value_and_grad(self.loss)(theta, batch)
