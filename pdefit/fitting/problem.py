"""A fit problem: system + grid + time stepping + parameters + observations + schedule
→ ``loss(theta, batch)`` and its exact gradient.

``theta`` is the optimiser's pytree: ``{"params": {name: unconstrained value},
"fields": {name: (n_exp, ny, nx) initial field}}``; a parameter's value is a scalar, an array
of its spec's shape, or, for a per-experiment parameter, ``(n_exp, *shape)`` (see
:class:`~pdefit.model.params.ParameterLayout`). ``batch`` carries everything read from the
dataset (observed frames and the known parts of the initial state), so jitted functions take
it as an argument instead of baking it in as constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdefit.adjoint import LossChain, Schedule
from pdefit.fitting import shooting as multiple_shooting
from pdefit.fitting.observe import Observation, ObservedData, observable_names
from pdefit.model.params import ParameterLayout
from pdefit.model.system import System, stepper
from pdefit.numerics.grid import Grid
from pdefit.parallel.domain import FIELD, FRAMES, PER_EXPERIMENT, REPLICATED, Domain, TileGrid


class Batch(NamedTuple):
    """What a fit reads from its dataset, passed to ``loss(theta, batch)`` as an argument:
    the observed frames (:class:`~pdefit.fitting.observe.ObservedData`, values, masks and the step
    of each frame) and the known initial fields, ``(n_exp, ny, nx)`` each; fitted initial fields
    are in ``theta`` instead."""

    observed: ObservedData
    initial: dict[str, jnp.ndarray]  # known initial fields, (n_exp, ny, nx)
    # The first guess of fitted initial fields, (n_exp, ny, nx): the background the prior
    # ``Regularization.field_background`` pulls them towards (empty: no background).
    background: dict[str, jnp.ndarray] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)
    # Multiple shooting: a shift of the continuity's target per segment, field →
    # (n_exp, M, ny, nx), set only inside Gauss–Newton products (empty: none).
    continuity_offset: dict[str, jnp.ndarray] = {}  # noqa: RUF012 (as above)


@dataclass(frozen=True)
class Regularization:
    """Penalties. ``params``: weight of the squared distance of every fitted parameter from
    its default in unconstrained coordinates (a weak prior), averaged over the elements of an
    array or per-experiment parameter (so a scalar's term is unchanged); ``param_l2``
    overrides that weight per parameter name. ``fields``: weight of the mean square of fitted
    fields. ``smoothness``: per array parameter, weight of the mean squared difference of
    neighbouring nodes, summed over its spec's ``smooth_axes`` (wrapping on periodic ones).
    ``system``: weights of the system's own penalties (:func:`system_penalties`), functions of
    the physical parameters; averaged over experiments when they read per-experiment ones
    (:func:`system_term`).

    The prior of fitted initial fields (:meth:`FitProblem.field_prior`):
    ``field_background`` weighs the mean square of a field's distance from its first guess
    (``Batch.background``), ``field_smoothness`` the mean squared difference of neighbouring
    cells. The misfit is a mean square over the N observed values, so with noise σ a
    Gaussian background of standard deviation σ_b over C cells is
    ``field_background`` = σ² C / (N σ_b²) (for a field observed in every cell of n frames:
    σ² / (n σ_b²))."""

    params: float = 0.0
    fields: float = 0.0
    param_l2: tuple[tuple[str, float], ...] = ()
    smoothness: tuple[tuple[str, float], ...] = ()
    system: tuple[tuple[str, float], ...] = ()
    field_background: float = 0.0
    field_smoothness: float = 0.0


@dataclass(frozen=True)
class FitProblem:
    """One fit: ``system`` on ``grid`` stepped ``n_steps`` times by ``integrator`` with time
    step ``dt`` from ``t0``; ``layout`` says which parameters are fitted and how they map to
    unconstrained values, ``observation`` which fields are compared with the data and how,
    ``schedule`` how the adjoint keeps its snapshots (:class:`~pdefit.adjoint.Revolve`, ...),
    ``fitted_fields`` which initial fields are fitted, ``regularization`` the penalties,
    ``domain`` the device mesh (None: one device) and ``shooting`` the window's segments
    (None: one trajectory; see :mod:`pdefit.fitting.shooting`, whose segments' starts are
    ``theta["segments"]``).

    :meth:`loss` (``loss(theta, batch)``, jit- and grad-able) is the data misfit plus the
    penalties; its gradient is the exact discrete adjoint. :meth:`physical_params` maps
    ``theta`` back to physical parameter values. Build one from a dataset with
    :func:`pdefit.build_problem`, or from engine objects directly (tests/helpers.py)."""

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
    shooting: multiple_shooting.Shooting | None = None  # None: single shooting
    # (field, lower, upper): fitted initial fields (and segment states) that every step keeps
    # in that range (pdefit.fitting.optimisers.limit_step), from the system's field_bounds.
    field_bounds: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        multiple_shooting.check(self)
        for name, low, high in self.field_bounds:
            if name not in self.fitted_fields or not low < high:
                raise ValueError(f"field_bounds: ({name!r}, {low}, {high}) is not a range "
                                 f"(lower < upper) of a fitted field {list(self.fitted_fields)}")
        unknown = [f for f in self.fitted_fields if f not in self.system.fields]
        derived = observable_names(self.system, self.grid)
        unknown += [f for f in self.observation.fields
                    if f not in self.system.fields and f not in derived]
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} for {self.system.name}; it has "
                             f"{list(self.system.fields)} and observables {list(derived)}")
        if any(f not in self.system.fields for f in self.observation.fields) and (
                self.observation.derive is None):
            raise ValueError("observing derived quantities needs Observation(derive="
                             "system.observables)")
        reg_names = [n for n, _ in (*self.regularization.param_l2,
                                    *self.regularization.smoothness)]
        unknown = [n for n in reg_names if n not in self.layout.fitted]
        if unknown:
            raise ValueError(f"regularization of parameter(s) {unknown} that are not fitted "
                             f"(fitted: {list(self.layout.fitted)})")
        scalar = [n for n, _ in self.regularization.smoothness
                  if not self.layout.specs[n].shape]
        if scalar:
            raise ValueError(f"smoothness penalty on scalar parameter(s) {scalar}: it applies "
                             "to array parameters only")
        offered = system_penalties(self.system, self.grid)
        unknown = [n for n, _ in self.regularization.system if n not in offered]
        if unknown:
            raise ValueError(f"unknown system penalt(ies) {unknown} for {self.system.name} "
                             f"(it has {sorted(offered)})")

    # -- pieces ---------------------------------------------------------------------------------

    def chain(self, grid: Grid | TileGrid | None = None) -> LossChain:
        """The loss chain of one experiment (on one tile when ``grid`` is a tile); its θ is the
        dict of physical parameters."""
        one_step = stepper(self.system, grid or self.grid, self.integrator)
        dt, t0, observation = self.dt, self.t0, self.observation.on_grid(grid or self.grid)

        def step(state, params, n):
            return one_step(state, params, t0 + n * dt, dt)

        def cost(state, params, n, data):
            return observation.cost(state, data, n)

        def observed(n, data):
            return observation.observed(data, n)

        def observed_cost(state, params, n, data):
            return observation.misfit(state, data, jnp.maximum(data.slot_of_step[n], 0))

        return LossChain(step, cost, observed, observed_cost)

    def initial_state(self, theta: Mapping[str, Any], batch: Batch) -> dict[str, jnp.ndarray]:
        fields = theta.get("fields", {})
        return {f: fields[f] if f in self.fitted_fields else batch.initial[f]
                for f in self.system.fields}

    def physical_params(self, theta: Mapping[str, Any]) -> dict[str, jnp.ndarray]:
        """Physical values; per-experiment ones with their experiment axis."""
        return {k: jnp.asarray(v) for k, v in self.layout.physical(theta["params"]).items()}

    def scalar_values(self, theta: Mapping[str, Any]) -> dict[str, jnp.ndarray]:
        """Physical values of the fitted shared scalars (what the progress line and the final
        table show; arrays and per-experiment values are reported elsewhere)."""
        physical = self.layout.physical(theta["params"])
        return {n: physical[n] for n in self.layout.scalars}

    def experiment_params(self, theta: Mapping[str, Any], experiment: int,
                          ) -> dict[str, jnp.ndarray]:
        """The physical parameters one experiment's rollout sees."""
        shared, own = self.layout.split(self.physical_params(theta))
        return {**shared, **{k: v[experiment] for k, v in own.items()}}

    # -- the loss -------------------------------------------------------------------------------

    def data_loss(self, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
        """Mean over experiments of the observation misfit. Per-experiment parameters are
        mapped over together with each experiment's initial state and data. On a mesh, every
        device runs the whole rollout (and its adjoint) on its own tile and experiments; the
        partial misfits are summed across devices. With multiple shooting: every segment's
        misfit plus their continuity (:func:`pdefit.fitting.shooting.data_loss`)."""
        if self.shooting is not None:
            return multiple_shooting.data_loss(self, theta, batch)
        params, per_experiment = self.layout.split(self.physical_params(theta))
        x0 = self.initial_state(theta, batch)
        obs = batch.observed
        n_experiments = jax.tree.leaves(x0)[0].shape[0]

        def local_sum(x0, values, weights, scale, per_experiment, slot_of_step, params):
            grid = self.grid if self.domain is None else self.domain.tile_grid(self.grid)
            chain = self.chain(grid)

            def one(x0_e, values_e, weights_e, scale_e, own):
                data = ObservedData(values_e, weights_e, scale_e, slot_of_step)
                return self.schedule.loss(chain, x0_e, {**params, **own}, data, self.n_steps)

            return jnp.sum(jax.vmap(one)(x0, values, weights, scale, per_experiment))

        args = (x0, obs.values, obs.weights, obs.scale, per_experiment, obs.slot_of_step,
                params)
        if self.domain is None:
            total = local_sum(*args)
        else:
            specs = tuple(jax.tree.map(lambda _, s=spec: s, arg) for arg, spec in zip(
                args, (FIELD, FRAMES, FRAMES, PER_EXPERIMENT, PER_EXPERIMENT, REPLICATED,
                       REPLICATED), strict=True))
            total = self.domain.sum_over_tiles(local_sum, args, specs)
        return total / n_experiments

    def penalty(self, theta: Mapping[str, Any]) -> jnp.ndarray:
        reg = self.regularization
        total = jnp.zeros(())
        l2 = dict(reg.param_l2)
        for name, z in theta["params"].items():
            weight = l2.get(name, reg.params)
            if weight:
                spec = self.layout.specs[name]
                z_default = spec.to_unconstrained(spec.default)
                total = total + weight * jnp.mean((z - z_default) ** 2)
        for name, weight in reg.smoothness:
            spec = self.layout.specs[name]
            z = theta["params"][name]
            # A per-experiment array has a leading experiment axis before the spec's axes.
            offset = z.ndim - len(spec.shape)
            axes = spec.smooth_axes or tuple(range(len(spec.shape)))
            total = total + weight * smoothness(z, [offset + a for a in axes],
                                                [offset + a for a in spec.periodic_axes])
        if reg.fields:
            for field in theta.get("fields", {}).values():
                total = total + reg.fields * jnp.mean(field**2)
        if reg.system:
            offered = system_penalties(self.system, self.grid)
            shared, own = self.layout.split(self.physical_params(theta))
            for name, weight in reg.system:
                total = total + weight * system_term(offered[name], shared, own)
        return total

    def field_prior(self, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
        """The prior of the fitted initial fields (see :class:`Regularization`): distance
        from the first guess and roughness, each a mean over cells and experiments."""
        reg = self.regularization
        total = jnp.zeros(())
        boundaries = getattr(self.grid, "boundaries", ())
        periodic = [1 + a for a, kind in enumerate(boundaries) if kind == "periodic"]
        for name, field in theta.get("fields", {}).items():
            if reg.field_smoothness:
                total = total + reg.field_smoothness * smoothness(field, (1, 2), periodic)
            if reg.field_background and name in batch.background:
                total = total + reg.field_background * jnp.mean(
                    (field - batch.background[name]) ** 2)
        return total

    def loss(self, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
        return self.data_loss(theta, batch) + self.penalty(theta) + self.field_prior(theta,
                                                                                     batch)

    def value_and_grad(self, theta: Mapping[str, Any], batch: Batch):
        return jax.value_and_grad(self.loss)(theta, batch)


def system_penalties(system: System, grid: Grid) -> dict[str, Any]:
    """The system's own penalties, name → function of the physical parameters (none if the
    system declares no ``penalties(grid)``)."""
    declared = getattr(system, "penalties", None)
    return dict(declared(grid)) if declared is not None else {}


def system_term(term: Any, shared: Mapping[str, Any], own: Mapping[str, Any]) -> jnp.ndarray:
    """A system penalty's value: from the shared parameters alone when it reads only those
    (traced once), else its mean over experiments, each seeing its own per-experiment
    values (a term that reads one raises KeyError without them, at trace time)."""
    try:
        return term(dict(shared))
    except KeyError:
        if not own:
            raise
    return jnp.mean(jax.vmap(lambda values: term({**shared, **values}))(own))


def smoothness(z: jnp.ndarray, axes: Any, periodic: Any = ()) -> jnp.ndarray:
    """Σ over ``axes`` of the mean squared difference of neighbours along that axis (including
    the wrap-around pair on ``periodic`` axes); axes of length one contribute nothing."""
    total = jnp.zeros((), z.dtype)
    for axis in axes:
        if z.shape[axis] < 2:
            continue
        diff = jnp.roll(z, -1, axis) - z if axis in periodic else jnp.diff(z, axis=axis)
        total = total + jnp.mean(diff**2)
    return total
