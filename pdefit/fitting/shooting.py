"""Multiple shooting: a long training window cut into segments, each from its own fitted state.

Over a window longer than what the model predicts from a poor start (an excitable or chaotic
system, a hidden field far from its guess), one trajectory from t = 0 meets the data only near
its start and the loss has many minima. Multiple shooting fits M segments of L = ⌈N/M⌉ steps
together: segment 0 runs from the fit's initial state (known and fitted fields as usual),
segment j ≥ 1 from a state x_j of its own (every field, observed or not, in
``θ["segments"]``, shape (n_exp, M − 1, ny, nx)). Each segment is compared with the frames
it covers, a frame on a boundary only by the segment that ends there, and consecutive
segments are joined by the continuity term

    c · Σ_{j<M−1} Σ_f mean over cells (Φ_L(x_j)_f − x_{j+1,f})²

with c = :attr:`Shooting.continuity`, in the misfit's units (a mean square per field, in the
field's own units: fields of very different magnitude weigh as their squares do). The
last segment may run past the window's end (where nothing is observed), so that every
segment has the same length and they run side by side (``vmap``), each with the fit's
adjoint schedule over L steps.

The continuity is a penalty, not a constraint: the segments never join exactly. So a fit
stage that shoots is never the last: :func:`pdefit.app.cli` follows it by single shooting on
the whole window from the fitted x_0 (and the parameters), whose trajectory is one and whose
intervals and residual verdict mean what they say.

Gauss–Newton products (:func:`pdefit.fitting.krylov.gauss_newton_product`) need the segments'
end states as residuals; :func:`predictions` gives them with the predicted frames, and
``Batch.continuity_offset`` shifts the continuity's target the way shifted data shift the
misfit's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.adjoint import LossChain
from pdefit.fitting import gauss_newton as gn
from pdefit.fitting.observe import ObservedData
from pdefit.model.system import stepper

# A pdefit.fitting.problem.FitProblem and its Batch (that module imports this one).
FitProblem = Any
Batch = Any

SEGMENTS = "segments"  # θ's key of the segments' starting states


class ShootingError(ValueError):
    """A problem that cannot shoot (:func:`check`)."""


@dataclasses.dataclass(frozen=True)
class Shooting:
    """``segments`` segments (≥ 2) joined by a continuity penalty of weight ``continuity``."""

    segments: int
    continuity: float = 0.03

    def __post_init__(self) -> None:
        if self.segments < 2:
            raise ValueError(f"multiple shooting needs at least 2 segments, got {self.segments}")
        if not self.continuity > 0:
            raise ValueError(f"the continuity weight must be > 0, got {self.continuity}")


class Segment(NamedTuple):
    """What one segment's loss chain reads besides its state: the physical parameters, the
    next segment's start (``target``), whether a next segment follows (``link``, 1 or 0), the
    segment's start time after t0 and the continuity's shift (``offset``, zero but in
    Gauss–Newton products)."""

    params: dict[str, Any]
    target: dict[str, Any]
    link: Any
    start: Any
    offset: dict[str, Any]


def segment_length(n_steps: int, segments: int) -> int:
    """L = ⌈N/M⌉ steps per segment."""
    return -(-n_steps // segments)


def check(problem: FitProblem) -> None:
    """:class:`ShootingError` where ``problem`` cannot shoot: several devices, or more
    segments than steps."""
    shooting = problem.shooting
    if shooting is None:
        return
    if problem.domain is not None:
        raise ShootingError("multiple shooting runs on one device (mesh=single)")
    if shooting.segments > problem.n_steps:
        raise ShootingError(f"{shooting.segments} segments for a window of "
                            f"{problem.n_steps} steps: at most one segment per step")


def slot_tables(slot_of_step: jnp.ndarray, n_steps: int, segments: int) -> jnp.ndarray:
    """(M, L + 1): the observed frame's slot at each local step of each segment (−1: none),
    the step-0 frame of segments j ≥ 1 left to the segment that ends on it."""
    length = segment_length(n_steps, segments)
    steps = np.arange(segments)[:, None] * length + np.arange(length + 1)[None, :]
    return _padded(slot_of_step, segments * length)[steps].at[1:, 0].set(-1)


def _padded(slot_of_step: jnp.ndarray, last: int) -> jnp.ndarray:
    """The step → slot table extended with −1 (nothing observed) up to step ``last``."""
    beyond = last + 1 - slot_of_step.shape[0]
    return jnp.concatenate([slot_of_step, jnp.full((beyond,), -1, slot_of_step.dtype)])


def segment_chain(problem: FitProblem, grid: Any) -> LossChain:
    """The loss chain of one segment on ``grid``: θ is a :class:`Segment`, the cost the
    observation misfit plus the continuity at the segment's last step."""
    one_step = stepper(problem.system, grid, problem.integrator)
    dt, t0 = problem.dt, problem.t0
    observation = problem.observation.on_grid(grid)
    length = segment_length(problem.n_steps, problem.shooting.segments)
    weight = problem.shooting.continuity

    def step(state, segment, n):
        # The start time shifts a non-autonomous system's clock; it is not fitted.
        start = jax.lax.stop_gradient(segment.start)
        return one_step(state, segment.params, t0 + start + n * dt, dt)

    def continuity(state, segment):
        gaps = [jnp.mean((state[f] - segment.target[f]
                          - jax.lax.stop_gradient(segment.offset[f])) ** 2) for f in state]
        return weight * segment.link * sum(gaps)

    def at_end(n, value):
        return jnp.where(n == length, value, jnp.zeros_like(value))

    def cost(state, segment, n, data):
        return observation.cost(state, data, n) + at_end(n, continuity(state, segment))

    def observed(n, data):
        return observation.observed(data, n) | (n == length)

    def observed_cost(state, segment, n, data):
        slot = data.slot_of_step[n]
        misfit = observation.misfit(state, data, jnp.maximum(slot, 0))
        return (jnp.where(slot >= 0, misfit, jnp.zeros_like(misfit))
                + at_end(n, continuity(state, segment)))

    return LossChain(step, cost, observed, observed_cost)


def starts_and_targets(problem: FitProblem, theta: Mapping[str, Any], batch: Batch,
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each segment's start and the state its end should meet, field → (n_exp, M, ny, nx)
    (the last segment's target is zero and unused)."""
    x0 = problem.initial_state(theta, batch)
    later = theta[SEGMENTS]
    starts = {f: jnp.concatenate([x0[f][:, None], later[f]], axis=1) for f in x0}
    targets = {f: jnp.concatenate([later[f], jnp.zeros_like(x0[f][:, None])], axis=1)
               for f in x0}
    return starts, targets


def _segment_inputs(problem: FitProblem, theta: Mapping[str, Any], batch: Batch):
    """What :func:`data_loss` and :func:`predictions` map over: per experiment the starts,
    targets and offsets; per segment the link, start time and slot table."""
    segments = problem.shooting.segments
    length = segment_length(problem.n_steps, segments)
    starts, targets = starts_and_targets(problem, theta, batch)
    offsets = batch.continuity_offset or jax.tree.map(jnp.zeros_like, targets)
    dtype = jax.tree.leaves(starts)[0].dtype
    links = jnp.asarray([1.0] * (segments - 1) + [0.0], dtype)
    times = jnp.asarray(problem.dt * length * np.arange(segments), dtype)
    tables = slot_tables(batch.observed.slot_of_step, problem.n_steps, segments)
    return starts, targets, offsets, links, times, tables, length


def data_loss(problem: FitProblem, theta: Mapping[str, Any], batch: Batch) -> jnp.ndarray:
    """The misfit of every segment to its frames plus the continuity, averaged over
    experiments like :meth:`~pdefit.fitting.problem.FitProblem.data_loss`."""
    params, per_experiment = problem.layout.split(problem.physical_params(theta))
    starts, targets, offsets, links, times, tables, length = _segment_inputs(
        problem, theta, batch)
    chain = segment_chain(problem, problem.grid)
    obs = batch.observed

    def one(starts_e, targets_e, offsets_e, values_e, weights_e, scale_e, own):
        def segment(x, target, offset, link, start, table):
            data = ObservedData(values_e, weights_e, scale_e, table)
            theta_s = Segment({**params, **own}, target, link, start, offset)
            return problem.schedule.loss(chain, x, theta_s, data, length)

        return jnp.sum(jax.vmap(segment)(starts_e, targets_e, offsets_e, links, times, tables))

    total = jax.vmap(one)(starts, targets, offsets, obs.values, obs.weights, obs.scale,
                          per_experiment)
    return jnp.sum(total) / total.shape[0]


def predictions(problem: FitProblem, theta: Mapping[str, Any], batch: Batch,
                ) -> tuple[dict[str, jnp.ndarray], dict[str, jnp.ndarray]]:
    """(the model's values at the observed frames, like ``batch.observed.values``; each
    segment's end minus the next one's start, field → (n_exp, M, ny, nx)), from one forward
    run per segment that keeps only those."""
    params, per_experiment = problem.layout.split(problem.physical_params(theta))
    starts, targets, _, links, times, tables, length = _segment_inputs(problem, theta, batch)
    grid = dataclasses.replace(problem.grid, self_adjoint_vjp=False)
    chain = segment_chain(problem, grid)
    project = problem.observation.on_grid(grid).project

    def record(buffers, x, slot):
        at = jnp.maximum(slot, 0)
        seen = project(x)
        return {f: buf.at[at].add(jnp.where(slot >= 0, seen[f].astype(buf.dtype), 0.0))
                for f, buf in buffers.items()}

    def one(starts_e, targets_e, values_e, own):
        def segment(x0, target, link, start, table):
            theta_s = Segment({**params, **own}, target, link, start,
                              jax.tree.map(jnp.zeros_like, target))

            def body(carry, n):
                x, buffers = carry
                return (chain.step(x, theta_s, n), record(buffers, x, table[n])), None

            buffers = jax.tree.map(jnp.zeros_like, values_e)
            (x, buffers), _ = jax.lax.scan(body, (x0, buffers), jnp.arange(length))
            gap = {f: link * (x[f] - target[f]) for f in x}
            return record(buffers, x, table[length]), gap

        # Every frame is recorded by one segment only (the tables say which), so the
        # segments' buffers add up to the window's.
        recorded, gaps = jax.vmap(segment)(starts_e, targets_e, links, times, tables)
        return jax.tree.map(lambda b: jnp.sum(b, axis=0), recorded), gaps

    return jax.vmap(one)(starts, targets, batch.observed.values, per_experiment)


def parameter_curvature(problem: FitProblem, theta: Mapping[str, Any], batch: Batch,
                        free: Any = None) -> tuple[Any, Any, Any]:
    """(loss, gradient, G) over the free parameters with the segments' starts held: each
    segment's forward tangents from a zero tangent at its start (the parameters' block of
    the Gauss–Newton matrix, as :func:`pdefit.fitting.gauss_newton.curvature_function` gives
    it for one trajectory)."""
    starts, targets, offsets, links, times, tables, length = _segment_inputs(
        problem, theta, batch)
    chain = segment_chain(problem, dataclasses.replace(problem.grid, self_adjoint_vjp=False))
    obs = batch.observed

    def terms(params, tangents):
        k = jax.tree.leaves(tangents)[0].shape[0]

        def stacked(a):
            return jnp.zeros((k, *jnp.shape(a)), jnp.result_type(a))

        def one(starts_e, targets_e, offsets_e, values_e, weights_e, scale_e):
            def segment(x, target, offset, link, start, table):
                data = ObservedData(values_e, weights_e, scale_e, table)
                theta_s = Segment(params, target, link, start, offset)
                tangent_s = Segment(tangents, jax.tree.map(stacked, target), stacked(link),
                                    stacked(start), jax.tree.map(stacked, offset))
                return gn.trajectory_terms(chain, x, theta_s, tangent_s, data, length)

            parts = jax.vmap(segment)(starts_e, targets_e, offsets_e, links, times, tables)
            return jax.tree.map(lambda a: jnp.sum(a, axis=0), parts)

        return jax.vmap(one)(starts, targets, offsets, obs.values, obs.weights, obs.scale)

    return gn.parameter_block(problem, theta, terms, free)


def first_guess(problem: FitProblem, theta: Mapping[str, Any], batch: Batch,
                ) -> dict[str, jnp.ndarray]:
    """Where the segments j ≥ 1 start: where a frame lies on the segment's first step, the
    observed fields are that frame (stride 1, where observed) and the others the system's
    ``initial_guess`` from it (as the fit's initial state is guessed); elsewhere, and for a
    system without that hook, the model run from θ's initial state and parameters."""
    segments = problem.shooting.segments
    length = segment_length(problem.n_steps, segments)
    one_step = stepper(problem.system, problem.grid, problem.integrator)
    dt, t0 = problem.dt, problem.t0
    x0 = problem.initial_state(theta, batch)
    obs = batch.observed
    guess = getattr(problem.system, "initial_guess", None)
    slots = _padded(obs.slot_of_step, segments * length)[np.arange(1, segments) * length]
    shared, per_experiment = problem.layout.split(problem.physical_params(theta))

    def one(x0_e, own, values_e, weights_e):
        params = {**shared, **own}

        def advance(x, first):
            def body(i, x):
                return one_step(x, params, t0 + (first + i) * dt, dt)

            x = jax.lax.fori_loop(0, length, body, x)
            return x, x

        _, states = jax.lax.scan(advance, x0_e, length * jnp.arange(segments - 1))
        at = jnp.maximum(slots, 0)
        framed = {f: values_e[f][at] for f in values_e
                  if f in states and values_e[f].shape[-2:] == states[f].shape[-2:]}
        for f, frame in framed.items():
            seen = (slots[:, None, None] >= 0) & (weights_e[f][at] > 0)
            states[f] = jnp.where(seen, frame, states[f])
        if guess is not None and framed:
            # The unobserved fields as the system guesses them from the observed frames
            # (as the fit's own initial state is guessed), where a frame lies on the step.
            guessed = jax.vmap(lambda seen: guess(seen, params))(framed)
            for f, value in guessed.items():
                if f in states and f not in framed:
                    states[f] = jnp.where(slots[:, None, None] >= 0, value, states[f])
        return states

    return jax.jit(jax.vmap(one))(x0, per_experiment, obs.values, obs.weights)


def stages(segments: int, windows: list[Any]) -> tuple[list[Any], list[int]]:
    """(the stages' training windows, how many segments each stage cuts its window into):
    ``segments`` in every stage but the last, which fits one trajectory; with multiple
    shooting and one window, a second stage on the same window for that last fit."""
    segments = int(segments)
    if segments > 1 and len(windows) == 1:
        windows = [*windows, windows[0]]
    return windows, [segments] * (len(windows) - 1) + [1]


def with_segments(problem: FitProblem, theta: Mapping[str, Any], batch: Batch,
                  ) -> dict[str, Any]:
    """``theta`` fit for ``problem``: with segments' starts (:func:`first_guess`, from
    ``theta``) when it shoots, without them when it does not."""
    plain = {k: v for k, v in theta.items() if k != SEGMENTS}
    if problem.shooting is None:
        return plain
    return {**plain, SEGMENTS: first_guess(problem, plain, batch)}
