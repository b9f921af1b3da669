"""The optimisers and the jitted update that takes one step of them.

Owns the training state (:class:`TrainState`: everything a step depends on, as arrays — what a
checkpoint saves), the optax chains (gradient clipping, learning-rate schedules, adam, adamw,
sgd, L-BFGS with its zoom line search) and Levenberg–Marquardt with Nielsen's damping update,
and the updates the loop of :mod:`pdefit.fitting.train` runs: :func:`make_update` (optax),
:func:`make_damped_update` (Levenberg–Marquardt, dense curvature of scalar parameters),
:func:`make_matrix_free_update` (with fitted initial fields; their reduced variant:
:mod:`pdefit.fitting.reduced_steps`), each one jitted program returning the candidate state
and a :class:`StepReport`.

Step control (:class:`StepLimits`, from the parameters' specs): every update, of every
optimiser, is clipped so that no log-transformed parameter changes by more than a factor
exp(``optim.max_log_step``), then projected onto the parameters' bounds in unconstrained
coordinates. A fit can then never leave [lower, upper], nor jump decades in one
step; the report says when a parameter sits on a bound (the loop's run-off rule). Fitted
initial fields (and multiple shooting's segment states) that the system bounds
(``field_bounds``, e.g. gates in [0, 1]) are projected onto their range the same way; a
field on its bound is no run-off (resting tissue sits there).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from pdefit.fitting.krylov import MatrixFree, damped_solve
from pdefit.model.params import ParameterLayout
from pdefit.options import OptimConfig


class TrainState(NamedTuple):
    """Everything a step depends on, as arrays: what a checkpoint saves."""

    step: jax.Array  # int32: optimiser steps applied
    theta: Any  # unconstrained parameters and fitted fields
    opt_state: Any
    lr_scale: jax.Array  # multiplies every update; reduced after a non-finite step
    key: jax.Array  # raw uint32 key data for stochastic parts of a fit; advanced every step
    best_loss: jax.Array  # the lowest loss evaluated so far …
    best_theta: Any  # … and where


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    final = cfg.lr * cfg.final_lr_fraction
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.final_lr_fraction)
    elif cfg.schedule == "exponential":
        main = optax.exponential_decay(cfg.lr, decay_steps, final / cfg.lr)
    else:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; use constant, cosine or exponential")
    if cfg.warmup_steps:
        warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
        return optax.join_schedules([warmup, main], [cfg.warmup_steps])
    return main


class DampingState(NamedTuple):
    """Levenberg–Marquardt's state: the damping λ and the factor ν it grows by on the next
    rejected step (Nielsen's update)."""

    damping: jax.Array
    factor: jax.Array


LEVENBERG_MARQUARDT = "levenberg_marquardt"


def _damping_state(initial: float = 1e-3) -> optax.GradientTransformation:
    """An optax-shaped holder of :class:`DampingState`: the steps themselves are taken by
    :func:`make_damped_update`, which needs the curvature, not only the gradient."""

    def init(params: Any) -> DampingState:
        leaf = jax.tree.leaves(params)[0]
        return DampingState(jnp.asarray(initial, leaf.dtype), jnp.asarray(2.0, leaf.dtype))

    def update(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("levenberg_marquardt steps are taken by make_damped_update")

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Gradient clipping (optional) followed by the optimiser. ``lbfgs`` ignores the
    learning-rate schedule: its zoom line search chooses each step length, as does
    ``levenberg_marquardt`` its damping."""
    if cfg.name == LEVENBERG_MARQUARDT:
        return _damping_state(cfg.initial_damping)
    schedule = learning_rate_schedule(cfg)
    optimizers: dict[str, Callable[[], optax.GradientTransformation]] = {
        "adam": lambda: optax.adam(schedule),
        "adamw": lambda: optax.adamw(schedule),
        "sgd": lambda: optax.sgd(schedule, momentum=0.9),
        "lbfgs": lambda: optax.lbfgs(),
    }
    if cfg.name not in optimizers:
        raise ValueError(f"unknown optimizer {cfg.name!r}; choose one of "
                         f"{sorted([*optimizers, LEVENBERG_MARQUARDT])}")
    parts = [optax.clip_by_global_norm(cfg.clip)] if cfg.clip else []
    return optax.chain(*parts, optimizers[cfg.name]())


def _strong(tree: Any) -> Any:
    """The same arrays without weak types, so that a state built here, one returned by the
    update and one restored from disk all have one jit signature (no retrace, no change of
    type promotion after a resume)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=jnp.result_type(x)), tree)


def _replicated(theta: Any) -> Sharding:
    """Where the loop keeps leaves that have no sharding of their own (counters, scalars):
    replicated over the mesh of the first mesh-sharded leaf of ``theta``, else on one local
    device."""
    for leaf in jax.tree.leaves(theta):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return SingleDeviceSharding(jax.local_devices()[0])


def _placed(tree: Any, replicated: Sharding) -> Any:
    """Every leaf committed: mesh-sharded leaves where they are, the rest on ``replicated``.
    The update's outputs are committed arrays; an uncommitted first state would compile the
    update a second time, and the restore (which copies these placements) would put arrays
    on devices that do not match the rest of the state."""
    def place(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        return jax.device_put(x, sharding if isinstance(sharding, NamedSharding) else replicated)

    return jax.tree.map(place, tree)


def init_state(theta0: Any, optimizer: optax.GradientTransformation, loss_dtype: Any,
               seed: int = 0) -> TrainState:
    state = _strong(TrainState(
        step=jnp.asarray(0, jnp.int32), theta=theta0, opt_state=optimizer.init(theta0),
        lr_scale=jnp.asarray(1.0, loss_dtype),
        key=jax.random.key_data(jax.random.key(seed)),
        best_loss=jnp.asarray(jnp.inf, loss_dtype), best_theta=theta0))
    return _placed(state, _replicated(theta0))


def advanced(state: TrainState, theta: Any, opt_state: Any, value: jax.Array) -> TrainState:
    """The state after one step to ``theta``, ``value`` being the loss at ``state.theta``
    (which becomes the best point if it beats the best so far)."""
    better = value < state.best_loss
    return _strong(TrainState(
        step=state.step + 1, theta=theta, opt_state=opt_state, lr_scale=state.lr_scale,
        key=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.key))[0]),
        best_loss=jnp.where(better, value, state.best_loss).astype(state.best_loss.dtype),
        best_theta=jax.tree.map(lambda t, b: jnp.where(better, t, b), state.theta,
                                state.best_theta)))


class StepLimits(NamedTuple):
    """Where a step may take the fitted parameters (``theta["params"]``): ``lower`` and
    ``upper`` their bounds in unconstrained coordinates (±inf: open), ``log_names`` those
    under a log transform, whose change per step is at most ``max_log_step`` (None: no
    limit); ``fields``: (field, lower, upper) for fitted initial fields (and segment states)
    kept in a range, in the field's own units."""

    lower: dict[str, float]
    upper: dict[str, float]
    log_names: tuple[str, ...]
    max_log_step: float | None
    fields: tuple[tuple[str, float, float], ...] = ()

    @property
    def active(self) -> bool:
        finite = [b for b in (*self.lower.values(), *self.upper.values()) if np.isfinite(b)]
        return (bool(finite) or bool(self.fields)
                or (self.max_log_step is not None and bool(self.log_names)))


def step_limits(layout: ParameterLayout | None, cfg: OptimConfig,
                field_bounds: tuple[tuple[str, float, float], ...] = ()) -> StepLimits | None:
    """The step control of a fit of ``layout``'s parameters under ``cfg``, with the fitted
    fields' ``field_bounds`` (:attr:`pdefit.fitting.problem.FitProblem.field_bounds`); None
    when there is nothing to limit."""
    if layout is None:
        return None
    bounds = {name: layout.specs[name].unconstrained_bounds() for name in layout.fitted}
    limits = StepLimits({n: b[0] for n, b in bounds.items()},
                        {n: b[1] for n, b in bounds.items()},
                        tuple(n for n in layout.fitted if layout.specs[n].transform == "log"),
                        cfg.max_log_step, tuple(field_bounds))
    return limits if limits.active else None


def project_fields(theta: Any, bounds: tuple[tuple[str, float, float], ...]) -> Any:
    """``theta`` with its fitted fields (``theta["fields"]``) and segment states
    (``theta["segments"]``) clipped to ``bounds`` ((field, lower, upper) triples)."""
    ranges = {name: (low, high) for name, low, high in bounds}
    out = dict(theta)
    for key in ("fields", "segments"):
        if key in theta:
            out[key] = {f: jnp.clip(x, *ranges[f]).astype(x.dtype) if f in ranges else x
                        for f, x in theta[key].items()}
    return out


def limit_step(old: Any, new: Any, limits: StepLimits | None) -> tuple[Any, jax.Array,
                                                                      jax.Array]:
    """(θ, changed, at_bound): ``new`` with each log parameter's change from ``old`` (θ trees)
    clipped to ±``limits.max_log_step`` and every ``θ["params"]`` entry clipped to its
    bounds; whether that changed ``new``, and whether a parameter now sits on one of its
    finite bounds. (Clipped elementwise rather than the whole step shortened: a direction the
    data hardly see, where a Gauss–Newton step is long, would otherwise hold every other
    parameter back too.)"""
    no = jnp.asarray(False)
    if limits is None:
        return new, no, no
    step = limits.max_log_step
    params = {}
    for name, value in new["params"].items():
        if step is not None and name in limits.log_names:
            value = jnp.clip(value, old["params"][name] - step, old["params"][name] + step)
        params[name] = jnp.clip(value, limits.lower.get(name, -np.inf),
                                limits.upper.get(name, np.inf)).astype(value.dtype)
    limited = project_fields({**new, "params": params}, limits.fields)
    changed = jnp.any(jnp.stack([jnp.any(a != b) for a, b in zip(
        jax.tree.leaves(limited), jax.tree.leaves(new), strict=True)] or [no]))
    return limited, changed, on_bound(params, limits)


def on_bound(params: Mapping[str, Any], limits: StepLimits | None) -> jax.Array:
    """Whether an element of ``params`` (unconstrained) sits on one of its finite bounds."""
    hits = [jnp.asarray(False)]
    for name, value in params.items():
        low, high = limits.lower.get(name, -np.inf), limits.upper.get(name, np.inf)
        if np.isfinite(low):
            hits.append(jnp.any(value <= low))
        if np.isfinite(high):
            hits.append(jnp.any(value >= high))
    return jnp.any(jnp.stack(hits))


def _invalidate_line_search(opt_state: Any, changed: jax.Array) -> Any:
    """``opt_state`` with a zoom line search's stored loss set to +inf where ``changed``: its
    loss and gradient belong to the point it accepted, which the step control moved, so the
    next step must evaluate them anew (see :func:`_value_and_grad`)."""
    def fix(node: Any) -> Any:
        if isinstance(node, optax.ScaleByZoomLinesearchState):
            return node._replace(value=jnp.where(changed, jnp.inf, node.value).astype(
                node.value.dtype))
        return node

    return jax.tree.map(fix, opt_state,
                        is_leaf=lambda x: isinstance(x, optax.ScaleByZoomLinesearchState))


class StepReport(NamedTuple):
    """What the host reads after a step, in one transfer: about the point the step started
    from (``state.theta``), and how many evaluations the step took."""

    step: jax.Array  # the step number of that point
    loss: jax.Array
    grad_norm: jax.Array
    finite: jax.Array  # loss and gradient finite
    lr_scale: jax.Array
    evaluations: jax.Array  # int32: loss (or loss-and-gradient) evaluations, line search included
    params: Any  # ``describe(theta)``, or None
    at_bound: jax.Array  # the step ended with a parameter on one of its bounds (StepLimits)


def step_report(state: TrainState, value: jax.Array, grad_norm: jax.Array, finite: jax.Array,
                evaluations: jax.Array, describe: Callable[[Any], Mapping[str, Any]] | None,
                at_bound: jax.Array) -> StepReport:
    return StepReport(step=state.step, loss=value, grad_norm=grad_norm, finite=finite,
                      lr_scale=state.lr_scale, evaluations=jnp.asarray(evaluations, jnp.int32),
                      params=dict(describe(state.theta)) if describe else None,
                      at_bound=jnp.asarray(at_bound))


def _line_search_steps(opt_state: Any) -> jax.Array:
    """Loss-and-gradient evaluations the optimiser's line search made in its last update (each
    zoom or backtracking iteration evaluates once); 0 for optimisers without one."""
    counts = [info.num_linesearch_steps for info in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ZoomLinesearchInfo))
        if isinstance(info, optax.ZoomLinesearchInfo)]
    return sum(counts, jnp.asarray(0, jnp.int32)).astype(jnp.int32)


def _line_search_state(opt_state: Any) -> Any:
    """The zoom line search's state inside ``opt_state`` (L-BFGS), or None."""
    found = [s for s in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByZoomLinesearchState))
        if isinstance(s, optax.ScaleByZoomLinesearchState)]
    return found[0] if len(found) == 1 else None


def _value_and_grad(loss: Callable, state: TrainState, batch: Any,
                    ) -> tuple[jax.Array, Any, jax.Array]:
    """(loss, gradient) at ``state.theta`` and whether they were evaluated (1) or taken from
    the line search (0). A zoom line search leaves the loss and gradient of the point it
    accepted in its state, and that point is ``state.theta`` when the update was applied
    unscaled — under this update ``lr_scale`` is 1 until the first non-finite step and never
    returns to 1 (only Levenberg–Marquardt's update, which has no line search, restores it) — so
    L-BFGS evaluates once per line-search iteration rather than once more per step.
    (``optax.value_and_grad_from_state`` would reuse it after a step scaled by ``lr_scale``
    and does not say whether it evaluated.)"""
    searched = _line_search_state(state.opt_state)
    if searched is None:
        value, grad = jax.value_and_grad(loss)(state.theta, batch)
        return value, grad, jnp.asarray(1, jnp.int32)
    dtype = jax.eval_shape(loss, state.theta, batch).dtype
    stored = jnp.isfinite(searched.value) & (state.lr_scale == 1)
    value, grad = jax.lax.cond(
        stored,
        lambda: (searched.value.astype(dtype), jax.tree.map(
            lambda g, t: g.astype(t.dtype), searched.grad, state.theta)),
        lambda: jax.value_and_grad(loss)(state.theta, batch))
    return value, grad, 1 - stored.astype(jnp.int32)


def _zero_held(tree: Any, hold: Collection[str]) -> Any:
    """``tree`` (shaped like θ) with its ``["params"]`` entries named in ``hold`` zeroed."""
    if not hold:
        return tree
    return {**tree, "params": {name: jnp.zeros_like(value) if name in hold else value
                               for name, value in tree["params"].items()}}


def free_positions(params: Mapping[str, Any], hold: Collection[str]) -> np.ndarray:
    """Positions of the parameters not in ``hold`` in ``ravel_pytree(params)``'s order (a
    dict's leaves in key order), from shapes only: static under ``jit``."""
    flags = jax.tree.leaves({name: np.full(np.shape(value), name in hold)
                             for name, value in params.items()})
    return np.flatnonzero(~np.concatenate([np.ravel(f) for f in flags] or [np.zeros(0, bool)]))


def make_update(loss: Callable, optimizer: optax.GradientTransformation,
                describe: Callable[[Any], Mapping[str, Any]] | None = None,
                hold: Collection[str] = (), limits: StepLimits | None = None) -> Callable:
    """``update(state, batch) -> (candidate state, StepReport)``, jitted. Extra arguments
    (value, gradient, loss function) are offered to optimisers that take them, such as
    L-BFGS's line search. The parameters named in ``hold`` keep their values: their gradient
    is zeroed before the optimiser sees it (so its moments and curvature pairs never hold
    them) and their update after (weight decay would move them). ``limits``: the step
    control (:func:`limit_step`)."""

    @jax.jit
    def update(state: TrainState, batch: Any):
        value, grad, evaluated = _value_and_grad(loss, state, batch)
        grad = _zero_held(grad, hold)
        grad_norm = optax.tree.norm(grad)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(
            grad, state.opt_state, state.theta, value=value, grad=grad,
            value_fn=lambda theta: loss(theta, batch))
        updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype),
                               _zero_held(updates, hold))
        theta, changed, at_bound = limit_step(
            state.theta, optax.apply_updates(state.theta, updates), limits)
        opt_state = _invalidate_line_search(opt_state, changed)
        evaluations = evaluated + _line_search_steps(opt_state)
        return (advanced(state, theta, opt_state, value),
                step_report(state, value, grad_norm, finite, evaluations, describe, at_bound))

    return update


def make_damped_update(loss: Callable, curvature: Callable,
                       describe: Callable[[Any], Mapping[str, Any]] | None = None,
                       hold: Collection[str] = (), limits: StepLimits | None = None,
                       ) -> Callable:
    """Levenberg–Marquardt on ``theta["params"]`` with the same contract as
    :func:`make_update`. ``curvature(theta, batch) -> (loss, gradient, G)`` (see
    :mod:`pdefit.fitting.gauss_newton`). A step solves (G + λ diag G) δ = −g and is kept when the
    loss falls by at least 1e-4 of what the quadratic model predicts; a rejected step (also one
    whose trial loss is not finite) leaves θ as it is and raises λ, so the step shrinks towards
    a short gradient step. Two evaluations per step: the curvature (with loss and gradient)
    and the trial loss. The step is scaled by ``lr_scale`` (below 1 after a non-finite
    point; each accepted step doubles it back towards 1). The parameters named in ``hold``
    keep their values: the curvature is asked for the others' columns only (``free``), and
    the step is solved over those. ``limits``: the step control (:func:`limit_step`), applied
    to the trial point before its loss is evaluated; the decrease the model predicts is that
    of the step actually tried."""

    @jax.jit
    def update(state: TrainState, batch: Any):
        flat, unravel = ravel_pytree(state.theta["params"])
        if hold:
            free = free_positions(state.theta["params"], hold)
            value, grad, matrix = curvature(state.theta, batch, free=free)
        else:
            free = np.arange(flat.shape[0])
            value, grad, matrix = curvature(state.theta, batch)
        g = ravel_pytree(grad["params"])[0][free]
        delta = _damped_step(matrix, g, state.opt_state.damping, state.lr_scale, flat.dtype)
        trial_theta, _, _ = limit_step(state.theta, {
            **state.theta, "params": unravel(flat + jnp.zeros_like(flat).at[free].set(delta))},
            limits)
        delta = (ravel_pytree(trial_theta["params"])[0] - flat)[free]
        predicted = -(g @ delta + 0.5 * delta @ matrix @ delta)
        trial = loss(trial_theta, batch)
        accept, opt_state = nielsen_update(state.opt_state, value, trial, predicted)
        theta = jax.tree.map(lambda t, s: jnp.where(accept, t, s), trial_theta, state.theta)
        at_bound = on_bound(theta["params"], limits) if limits else jnp.asarray(False)
        grad_norm = optax.tree.norm(grad)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm) & jnp.all(jnp.isfinite(matrix))
        # An accepted step doubles a reduced lr_scale back towards 1: a retry shortens the
        # steps near the bad point only, not for the rest of the stage (Gauss–Newton steps
        # converge quadratically only unscaled).
        lr_scale = jnp.where(accept, jnp.minimum(1.0, 2.0 * state.lr_scale), state.lr_scale)
        return (advanced(state, theta, opt_state, value)._replace(
                    lr_scale=lr_scale.astype(state.lr_scale.dtype)),
                step_report(state, value, grad_norm, finite, 2, describe, at_bound))

    return update


def make_matrix_free_update(loss: Callable, curvature: MatrixFree, cfg: OptimConfig,
                            describe: Callable[[Any], Mapping[str, Any]] | None = None,
                            hold: Collection[str] = (), limits: StepLimits | None = None,
                            ) -> Callable:
    """Levenberg–Marquardt over all of θ — parameters and fitted initial fields — with the
    contract of :func:`make_damped_update`: the step solves (G + λD) δ = −g by at most
    ``cfg.krylov_iterations`` preconditioned conjugate-gradient iterations on the
    matrix-free products of :mod:`pdefit.fitting.krylov`, and is kept or rejected by the same
    rule (the predicted decrease from one more product, G·δ, at the step tried). Its report
    counts the sweeps over the window: :data:`MATRIX_FREE_SWEEPS` and one per iteration."""

    @jax.jit
    def update(state: TrainState, batch: Any):
        theta = state.theta
        free = free_positions(theta["params"], hold)

        def masked(tree):
            return _zero_held(tree, hold)

        value, grad = jax.value_and_grad(loss)(theta, batch)
        grad = masked(grad)
        diagonal, block = curvature.scaling_and_block(
            theta, batch, jax.random.fold_in(jax.random.wrap_key_data(state.key), 1), free)

        def product(v):
            return masked(curvature.product(theta, batch, masked(v)))

        damping = state.opt_state.damping
        delta, iterations = damped_solve(
            product, grad, diagonal, damping, cfg.krylov_iterations, cfg.krylov_rtol,
            block if cfg.krylov_preconditioner == "parameter_block" else None)
        trial_theta, _, _ = limit_step(theta, jax.tree.map(
            lambda t, d: t + state.lr_scale.astype(t.dtype) * d, theta, delta), limits)
        delta = jax.tree.map(jnp.subtract, trial_theta, theta)
        predicted = -(_dot(grad, delta) + 0.5 * _dot(delta, product(delta)))
        trial = loss(trial_theta, batch)
        accept, opt_state = nielsen_update(state.opt_state, value, trial, predicted)
        new = jax.tree.map(lambda t, s: jnp.where(accept, t, s), trial_theta, theta)
        at_bound = on_bound(new["params"], limits) if limits else jnp.asarray(False)
        grad_norm = optax.tree.norm(grad)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        lr_scale = jnp.where(accept, jnp.minimum(1.0, 2.0 * state.lr_scale), state.lr_scale)
        return (advanced(state, new, opt_state, value)._replace(
                    lr_scale=lr_scale.astype(state.lr_scale.dtype)), step_report(
                state, value, grad_norm, finite, MATRIX_FREE_SWEEPS + iterations, describe,
                at_bound))

    return update


# Sweeps of a matrix-free step besides its conjugate-gradient iterations (each one product):
# loss and gradient, the parameters' tangents for D, the fields' probe, G·δ, the trial loss.
MATRIX_FREE_SWEEPS = 5


def _dot(a: Any, b: Any) -> jax.Array:
    """Σ over leaves of ⟨a, b⟩."""
    return sum(jnp.vdot(x, y) for x, y in zip(*map(jax.tree.leaves, (a, b)), strict=True))


def _damped_step(matrix: jax.Array, g: jax.Array, damping: jax.Array, lr_scale: jax.Array,
                 dtype: Any) -> jax.Array:
    """The step δ solving (G + λ diag G) δ = −g, scaled by ``lr_scale``."""
    diagonal = jnp.diag(matrix)
    # Parameters the data do not see would make the system singular: floor the scaling.
    floor = 1e-12 * jnp.maximum(jnp.max(diagonal), jnp.finfo(dtype).tiny)
    system = matrix + damping * jnp.diag(jnp.maximum(diagonal, floor))
    # Scaled by lr_scale like every optimiser's update: after a non-finite point the
    # loop retries from its last good state with a shorter step, not the same one.
    return -lr_scale.astype(dtype) * jnp.linalg.solve(system, g)


def nielsen_update(damping_state: DampingState, value: jax.Array, trial: jax.Array,
                   predicted: jax.Array) -> tuple[jax.Array, DampingState]:
    """Whether the trial step is kept (its loss finite and falling by at least 1e-4 of the
    predicted decrease), and the damping after it: shrunk by Nielsen's factor when kept, else
    raised by ν, which doubles on every rejection in a row."""
    damping, factor = damping_state.damping, damping_state.factor
    ratio = (value - trial) / predicted
    accept = jnp.isfinite(trial) & (predicted > 0) & (ratio > 1e-4)
    shrink = jnp.maximum(1.0 / 3.0, 1.0 - (2.0 * ratio - 1.0) ** 3)
    return accept, DampingState(
        jnp.where(accept, damping * shrink, damping * factor).astype(damping.dtype),
        jnp.where(accept, 2.0, 2.0 * factor).astype(factor.dtype))
