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
from .domain import FIELD, FRAMES, PER_EXPERIMENT, REPLICATED, Domain, TileGrid
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
    domain: Domain | None = None  # None: one device; else tiles and experiments over a mesh

    def __post_init__(self) -> None:
        unknown = [f for f in (*self.fitted_fields, *self.observation.fields)
                   if f not in self.system.fields]
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} for {self.system.name}; it has "
                             f"{list(self.system.fields)}")

    # -- pieces ---------------------------------------------------------------------------------

    def chain(self, grid: Grid | TileGrid | None = None) -> LossChain:
        """The loss chain of one experiment (on one tile when ``grid`` is a tile); its θ is the
        dict of physical parameters."""
        one_step = stepper(self.system, grid or self.grid, self.integrator)
        dt, t0, observation = self.dt, self.t0, self.observation

        def step(state, params, n):
            return one_step(state, params, t0 + n * dt, dt)

        def cost(state, params, n, data):
            return observation.cost(state, data, n)

        def observed(n, data):
            return observation.observed(data, n)

        return LossChain(step, cost, observed)

    def initial_state(self, theta: Mapping[str, Any], batch: Batch) -> dict[str, jnp.ndarray]:
        fields = theta.get("fields", {})
        return {f: fields[f] if f in self.fitted_fields else batch.initial[f]
                for f in self.system.fields}

    def physical_params(self, theta: Mapping[str, Any]) -> dict[str, jnp.ndarray]:
        return {k: jnp.asarray(v) for k, v in self.layout.physical(theta["params"]).items()}

    # -- the loss -------------------------------------------------------------------------------

    def data_loss(self, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
        """Mean over experiments of the observation misfit. On a mesh, every device runs the
        whole rollout (and its adjoint) on its own tile and experiments; the partial misfits
        are summed across devices."""
        params = self.physical_params(theta)
        x0 = self.initial_state(theta, batch)
        obs = batch.observed
        n_experiments = jax.tree.leaves(x0)[0].shape[0]

        def local_sum(x0, values, weights, scale, slot_of_step, params):
            grid = self.grid if self.domain is None else self.domain.tile_grid(self.grid)
            chain = self.chain(grid)

            def one(x0_e, values_e, weights_e, scale_e):
                data = ObservedData(values_e, weights_e, scale_e, slot_of_step)
                return self.schedule.loss(chain, x0_e, params, data, self.n_steps)

            return jnp.sum(jax.vmap(one)(x0, values, weights, scale))

        args = (x0, obs.values, obs.weights, obs.scale, obs.slot_of_step, params)
        if self.domain is None:
            total = local_sum(*args)
        else:
            specs = tuple(jax.tree.map(lambda _, s=spec: s, arg) for arg, spec in zip(
                args, (FIELD, FRAMES, FRAMES, PER_EXPERIMENT, REPLICATED, REPLICATED),
                strict=True))
            total = self.domain.sum_over_tiles(local_sum, args, specs)
        return total / n_experiments

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
