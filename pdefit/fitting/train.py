"""The optimisation loop: optax over the unconstrained parameters and fitted fields, with
checkpoints, preemption and resume.

One jitted update computes loss, gradient and the optimiser step, and a small report of it
(loss, gradient norm, the physical values, how many loss evaluations the step took, line
search included); the Python loop runs over optimiser iterations and reads that report in one
transfer per step — its only wait on the device, which also keeps the dispatch queue short.
The step counter lives on the host.

Non-finite steps. The loss and gradient are evaluated at the current parameters; if either is
not finite those parameters are bad, so the loop goes back to the *anchor* — the last state
whose loss and gradient were finite — scales the learning rate down by ``optim.nan_lr_factor``
and takes that step again, shorter. After ``optim.max_nan_failures`` such failures the run
stops with :class:`TrainingDivergedError`.

Checkpoints hold the anchor and the metric history before its step, never a state that was
not yet evaluated. A resumed run therefore re-evaluates the anchor first — the same numbers,
because the update is deterministic and the state comes back bit for bit — and follows
exactly the path the uninterrupted run took, including what happens after a non-finite step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from pdefit.options import OptimConfig
from pdefit.runtime.checkpoint import (
    CheckpointOptions,
    CheckpointStore,
    remove_checkpoints,
    write_json_atomic,
)
from pdefit.runtime.progress import ProgressOptions, progress_bar
from pdefit.runtime.resume import CONTINUATION_KEYS, DRIVING_KEYS, config_differences
from pdefit.runtime.signals import Preempted, PreemptionFlag, exit_code, signal_name, stop_reason


class TrainingDivergedError(RuntimeError):
    """Too many non-finite losses or gradients."""


class ResumeMismatchError(ValueError):
    """The run directory holds checkpoints of a different configuration or dataset."""


class TrainState(NamedTuple):
    """Everything a step depends on, as arrays: what a checkpoint saves."""

    step: jax.Array  # int32: optimiser steps applied
    theta: Any  # unconstrained parameters and fitted fields
    opt_state: Any
    lr_scale: jax.Array  # multiplies every update; reduced after a non-finite step
    key: jax.Array  # raw uint32 key data for stochastic parts of a fit; advanced every step
    best_loss: jax.Array  # the lowest loss evaluated so far …
    best_theta: Any  # … and where


@dataclass
class FitHistory:
    losses: list[float] = field(default_factory=list)  # per applied step, then the final loss
    records: list[dict[str, Any]] = field(default_factory=list)  # the metrics.jsonl lines
    best_loss: float = math.inf
    best_theta: Any = None
    nan_failures: int = 0
    wall_time: float = 0.0  # over all restarts
    restarts: int = 0  # how many times this run was resumed from a checkpoint
    resumed_from: int | None = None  # the step this process resumed from
    # Why the loop ended: steps_done | converged | stalled (patience, or steps that no longer
    # change anything) | preempted | interrupted (Ctrl-C) | diverged.
    stop_reason: str = ""


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


def _damping_state() -> optax.GradientTransformation:
    """An optax-shaped holder of :class:`DampingState`: the steps themselves are taken by
    :func:`make_damped_update`, which needs the curvature, not only the gradient."""

    def init(params: Any) -> DampingState:
        leaf = jax.tree.leaves(params)[0]
        return DampingState(jnp.asarray(1e-3, leaf.dtype), jnp.asarray(2.0, leaf.dtype))

    def update(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("levenberg_marquardt steps are taken by make_damped_update")

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Gradient clipping (optional) followed by the optimiser. ``lbfgs`` ignores the
    learning-rate schedule: its zoom line search chooses each step length, as does
    ``levenberg_marquardt`` its damping."""
    if cfg.name == LEVENBERG_MARQUARDT:
        return _damping_state()
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


def _advanced(state: TrainState, theta: Any, opt_state: Any, value: jax.Array) -> TrainState:
    """The state after one step to ``theta``, ``value`` being the loss at ``state.theta``
    (which becomes the best point if it beats the best so far)."""
    better = value < state.best_loss
    return _strong(TrainState(
        step=state.step + 1, theta=theta, opt_state=opt_state, lr_scale=state.lr_scale,
        key=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.key))[0]),
        best_loss=jnp.where(better, value, state.best_loss).astype(state.best_loss.dtype),
        best_theta=jax.tree.map(lambda t, b: jnp.where(better, t, b), state.theta,
                                state.best_theta)))


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


def _report(state: TrainState, value: jax.Array, grad_norm: jax.Array, finite: jax.Array,
            evaluations: jax.Array, describe: Callable[[Any], Mapping[str, Any]] | None,
            ) -> StepReport:
    return StepReport(step=state.step, loss=value, grad_norm=grad_norm, finite=finite,
                      lr_scale=state.lr_scale, evaluations=jnp.asarray(evaluations, jnp.int32),
                      params=dict(describe(state.theta)) if describe else None)


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
    (``optax.value_and_grad_from_state`` reuses the stored pair too, but only tests it for
    ∞: it would reuse it after a step scaled down by ``lr_scale``, and it does not say
    whether it evaluated, which the evaluation count needs.)"""
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


def _free_positions(params: Mapping[str, Any], hold: Collection[str]) -> np.ndarray:
    """Positions of the parameters not in ``hold`` in ``ravel_pytree(params)``'s order (a
    dict's leaves in key order), from shapes only: static under ``jit``."""
    flags = jax.tree.leaves({name: np.full(np.shape(value), name in hold)
                             for name, value in params.items()})
    return np.flatnonzero(~np.concatenate([np.ravel(f) for f in flags]))


def make_update(loss: Callable, optimizer: optax.GradientTransformation,
                describe: Callable[[Any], Mapping[str, Any]] | None = None,
                hold: Collection[str] = ()) -> Callable:
    """``update(state, batch) -> (candidate state, StepReport)``, jitted. Extra arguments
    (value, gradient, loss function) are offered to optimisers that take them, such as
    L-BFGS's line search. The parameters named in ``hold`` keep their values: their gradient
    is zeroed before the optimiser sees it (so its moments and curvature pairs never hold
    them) and their update after (weight decay would move them)."""

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
        theta = optax.apply_updates(state.theta, updates)
        evaluations = evaluated + _line_search_steps(opt_state)
        return (_advanced(state, theta, opt_state, value),
                _report(state, value, grad_norm, finite, evaluations, describe))

    return update


def make_damped_update(loss: Callable, curvature: Callable,
                       describe: Callable[[Any], Mapping[str, Any]] | None = None,
                       hold: Collection[str] = ()) -> Callable:
    """Levenberg–Marquardt on ``theta["params"]`` with the same contract as
    :func:`make_update`. ``curvature(theta, batch) -> (loss, gradient, G)`` (see
    :mod:`pdefit.fitting.gauss_newton`). A step solves (G + λ diag G) δ = −g and is kept when the
    loss falls by at least 1e-4 of what the quadratic model predicts; a rejected step (also one
    whose trial loss is not finite) leaves θ as it is and raises λ, so the step shrinks towards
    a short gradient step. Two evaluations per step: the curvature (with loss and gradient)
    and the trial loss. The step is scaled by ``lr_scale`` (below 1 after a non-finite
    point; each accepted step doubles it back towards 1). The parameters named in ``hold``
    keep their values: the curvature is asked for the others' columns only (``free``), and
    the step is solved over those."""

    @jax.jit
    def update(state: TrainState, batch: Any):
        flat, unravel = ravel_pytree(state.theta["params"])
        if hold:
            free = _free_positions(state.theta["params"], hold)
            value, grad, matrix = curvature(state.theta, batch, free=free)
        else:
            free = np.arange(flat.shape[0])
            value, grad, matrix = curvature(state.theta, batch)
        g = ravel_pytree(grad["params"])[0][free]
        damping, factor = state.opt_state.damping, state.opt_state.factor
        diagonal = jnp.diag(matrix)
        # Parameters the data do not see would make the system singular: floor the scaling.
        floor = 1e-12 * jnp.maximum(jnp.max(diagonal), jnp.finfo(flat.dtype).tiny)
        system = matrix + damping * jnp.diag(jnp.maximum(diagonal, floor))
        # Scaled by lr_scale like every optimiser's update: after a non-finite point the
        # loop retries from its last good state with a shorter step, not the same one.
        delta = -state.lr_scale.astype(flat.dtype) * jnp.linalg.solve(system, g)
        predicted = -(g @ delta + 0.5 * delta @ matrix @ delta)
        trial_theta = {**state.theta,
                       "params": unravel(flat + jnp.zeros_like(flat).at[free].set(delta))}
        trial = loss(trial_theta, batch)
        ratio = (value - trial) / predicted
        accept = jnp.isfinite(trial) & (predicted > 0) & (ratio > 1e-4)
        shrink = jnp.maximum(1.0 / 3.0, 1.0 - (2.0 * ratio - 1.0) ** 3)
        opt_state = DampingState(
            jnp.where(accept, damping * shrink, damping * factor).astype(damping.dtype),
            jnp.where(accept, 2.0, 2.0 * factor).astype(factor.dtype))
        theta = jax.tree.map(lambda t, s: jnp.where(accept, t, s), trial_theta, state.theta)
        grad_norm = optax.tree.norm(grad)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm) & jnp.all(jnp.isfinite(matrix))
        # An accepted step doubles a reduced lr_scale back towards 1: a retry shortens the
        # steps near the bad point only, not for the rest of the stage (Gauss–Newton steps
        # converge quadratically only unscaled).
        lr_scale = jnp.where(accept, jnp.minimum(1.0, 2.0 * state.lr_scale), state.lr_scale)
        return (_advanced(state, theta, opt_state, value)._replace(
                    lr_scale=lr_scale.astype(state.lr_scale.dtype)),
                _report(state, value, grad_norm, finite, 2, describe))

    return update


def data_fingerprint(batch: Any) -> str:
    """A digest of the data a fit sees (values of every array this process holds whole,
    shapes and dtypes of the others), saved with each checkpoint so that resuming against
    changed data is an error rather than a silent change of problem."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        digest.update(f"{jax.tree_util.keystr(path)}:{np.shape(leaf)}:{jnp.result_type(leaf)}"
                      .encode())
        if getattr(leaf, "is_fully_addressable", True):
            digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Anchor:
    """The last state with a finite loss and gradient, how many records precede it, and its
    step (on the host)."""

    state: TrainState
    n_records: int
    step: int


# Steps in a row with bit-identical loss and gradient norm after which a fit counts as stalled:
# the optimiser no longer moves θ (L-BFGS whose line search finds no descent below float
# resolution), so further steps would repeat the same numbers.
IDENTICAL_STEPS = 3


def _repeating(records: list[dict[str, Any]]) -> bool:
    recent = records[-IDENTICAL_STEPS:]
    return len(recent) == IDENTICAL_STEPS and all(
        (r["loss"], r["grad_norm"]) == (recent[0]["loss"], recent[0]["grad_norm"])
        for r in recent)


def _stalled(records: list[dict[str, Any]], patience: int) -> bool:
    """True when the best loss of the last ``patience`` records is no better (by a relative
    1e-6) than the best before them: the optimiser is going nowhere (e.g. an L-BFGS line
    search that can no longer find descent in float32 noise)."""
    if len(records) <= patience:
        return False
    before = min(r["loss"] for r in records[:-patience])
    recent = min(r["loss"] for r in records[-patience:])
    return recent > before * (1.0 - 1e-6)


def run_fit(loss: Callable, theta0: Any, batch: Any, cfg: OptimConfig, *,
            describe: Callable[[Any], Mapping[str, float]] | None = None,
            metrics_path: Path | None = None, progress: bool | ProgressOptions = True,
            log: Callable[[str], None] = print,
            checkpoint: CheckpointOptions | None = None, resume: bool = True,
            config: Mapping[str, Any] | None = None, status_path: Path | None = None,
            seed: int = 0, preemption: PreemptionFlag | None = None,
            on_step: Callable[[int, Mapping[str, Any]], None] | None = None,
            curvature: Callable | None = None, hold: Collection[str] = (),
            ) -> tuple[TrainState, FitHistory]:
    """Minimise ``loss(theta, batch)`` from ``theta0``.

    ``describe(theta)`` gives the physical values written with each metrics record.
    ``checkpoint`` enables Orbax checkpoints (every ``checkpoint.every`` steps and at the end)
    and preemption handling; a directory that already holds checkpoints is resumed from
    unless ``resume`` is False (then they are deleted). ``config`` (the resolved run config) is
    saved with each checkpoint and must match on resume, except ``run.*``. ``on_step(step,
    record)`` is called after every applied step (tests use it to send signals).
    ``curvature`` (from :func:`pdefit.fitting.gauss_newton.gauss_newton`) is needed by
    ``levenberg_marquardt``. ``hold`` names entries of ``theta0["params"]`` that every
    optimiser keeps at their values (a stage of a staged fit that frees them later).

    Raises :class:`Preempted` (a ``SystemExit`` with status 75) after a preemption signal, once
    the checkpoint is on disk, and :class:`TrainingDivergedError` after too many non-finite
    steps.
    """
    optimizer = make_optimizer(cfg)
    hold = frozenset(hold)
    if hold:
        names = set(theta0["params"]) if isinstance(theta0, Mapping) else set()
        if not hold <= names:
            raise ValueError(f"cannot hold {sorted(hold - names)}: not among the fitted "
                             f"parameters {sorted(names)}")
        if hold == names and not jax.tree.leaves(
                {k: v for k, v in theta0.items() if k != "params"}):
            raise ValueError(f"holding every fitted parameter {sorted(names)} leaves nothing "
                             "to fit")
    if cfg.name == LEVENBERG_MARQUARDT:
        if curvature is None:
            raise ValueError("optim.name=levenberg_marquardt needs the problem's Gauss–Newton "
                             "curvature (pdefit.fitting.gauss_newton)")
        update = make_damped_update(loss, curvature, describe, hold)
    else:
        update = make_update(loss, optimizer, describe, hold)
    loss_dtype = jax.eval_shape(loss, theta0, batch).dtype
    state = init_state(theta0, optimizer, loss_dtype, seed)
    history = FitHistory()
    fingerprint = data_fingerprint(batch) if checkpoint else None
    config = dict(config or {})
    primary = jax.process_index() == 0

    store = None
    if checkpoint:
        store, state, history = _open_checkpoints(checkpoint, resume, state, config,
                                                  fingerprint, log)
    anchor = _Anchor(state, len(history.records), int(jax.device_get(state.step)))
    wall_before = history.wall_time
    start = time.perf_counter()

    def elapsed() -> float:
        return wall_before + time.perf_counter() - start

    def meta(status: str) -> dict[str, Any]:
        return {"records": history.records[:anchor.n_records],
                "nan_failures": history.nan_failures, "restarts": history.restarts,
                "wall_time": elapsed(), "data_fingerprint": fingerprint, "status": status,
                "stop_reason": history.stop_reason}

    def save(status: str, wait: bool = False) -> None:
        if store is not None:
            store.save(anchor.step, anchor.state, meta(status), config, wait=wait)
        write_status(status)

    def write_status(status: str) -> None:
        if status_path is not None and primary:
            write_json_atomic(status_path, {
                "status": status, "stop_reason": history.stop_reason or None,
                "step": anchor.step,
                "loss": history.records[-1]["loss"] if history.records else None,
                "best_loss": _finite_or_none(history.best_loss),
                "nan_failures": history.nan_failures, "restarts": history.restarts,
                "wall_time_s": elapsed()})

    metrics = _open_metrics(metrics_path, history.records) if primary else None
    bar = progress_bar(cfg.steps, anchor.step, progress, primary)
    # Signals are taken over only where they can be honoured: with checkpoints, or when the
    # caller passes its own flag.
    watch = store is not None or preemption is not None
    flag = preemption if preemption is not None else PreemptionFlag()
    write_status("running")
    try:
        with flag if watch else contextlib.nullcontext():
            step = anchor.step  # of ``state``, kept on the host
            evaluations = applied = 0  # in this process, for the progress line
            while step < cfg.steps:
                candidate, report = update(state, batch)
                # The step's one host transfer; waiting for it keeps one update in flight.
                report = jax.device_get(report)
                converged = False
                if report.finite:
                    record = _record(report, elapsed())
                    value = record["loss"]
                    anchor = _Anchor(state, len(history.records), step)
                    history.records.append(record)
                    history.best_loss = min(history.best_loss, value)
                    if metrics:
                        metrics.write(json.dumps(record) + "\n")
                        metrics.flush()
                    state = candidate
                    step += 1
                    grad_norm_0 = history.records[0]["grad_norm"]
                    converged = record["grad_norm"] <= cfg.grad_tol * grad_norm_0
                    if converged:
                        history.stop_reason = "converged"
                        log(f"converged at step {step}: gradient norm "
                            f"{record['grad_norm']:.3e} <= {cfg.grad_tol:g} x initial")
                    elif cfg.patience and _stalled(history.records, cfg.patience):
                        converged = True
                        history.stop_reason = "stalled"
                        log(f"stopped at step {step}: the loss has not improved "
                            f"by a relative 1e-6 in {cfg.patience} steps (optim.patience)")
                    elif cfg.name != LEVENBERG_MARQUARDT and _repeating(history.records):
                        # (a rejected Levenberg–Marquardt step legitimately repeats θ)
                        converged = True
                        history.stop_reason = "stalled"
                        log(f"stopped at step {step}: {IDENTICAL_STEPS} steps in "
                            f"a row with the same loss {value:.6e} and gradient norm; the "
                            "optimiser no longer changes the parameters")
                    evaluations += record["evaluations"]
                    applied += 1
                    bar.set_postfix(loss=f"{value:.3e}", evals=f"{evaluations / applied:.3g}/step",
                                    refresh=False)
                    bar.update(1)
                    if on_step:
                        on_step(record["step"], record)
                else:
                    history.nan_failures += 1
                    if history.nan_failures > cfg.max_nan_failures:
                        history.stop_reason = "diverged"
                        write_status("diverged")
                        raise TrainingDivergedError(
                            f"loss or gradient not finite at step {step} "
                            f"({history.nan_failures} failures, optim.max_nan_failures="
                            f"{cfg.max_nan_failures}); last learning-rate scale "
                            f"{float(anchor.state.lr_scale):.3g}. Lower optim.lr or check "
                            "dt and the data.")
                    state = anchor.state._replace(
                        lr_scale=anchor.state.lr_scale * cfg.nan_lr_factor)
                    del history.records[anchor.n_records:]
                    if metrics:
                        metrics = _open_metrics(metrics_path, history.records, metrics)
                    failed, step = step, anchor.step
                    anchor = _Anchor(state, anchor.n_records, step)
                    bar.n = step
                    log(f"step {failed}: non-finite loss/gradient; back to "
                        f"step {step}, learning rate scaled by "
                        f"{float(state.lr_scale):.3g} (failure {history.nan_failures} of "
                        f"at most {cfg.max_nan_failures})")

                # Step boundary: every process takes the same decision here.
                signum = flag.agreed() if watch else 0
                if signum:
                    history.stop_reason = stop_reason(signum)
                    save(history.stop_reason, wait=True)
                    where = f"written to {store.directory}" if store else "not written"
                    then = ("so that the job is requeued" if history.stop_reason == "preempted"
                            else "(interrupted); the same command resumes")
                    log(f"{signal_name(signum)}: checkpoint at step {anchor.step} "
                        f"{where}; exiting with status {exit_code(signum)} {then}")
                    flag.forward()
                    raise Preempted(anchor.step, signum)
                if converged:
                    break
                if store is not None and anchor.step % checkpoint.every == 0:
                    save("running")
        history.stop_reason = history.stop_reason or "steps_done"
        final_loss = float(jax.device_get(jax.jit(loss)(state.theta, batch)))
        save("done", wait=True)
    finally:
        bar.close()
        if metrics:
            metrics.close()
        if store is not None:
            store.close()  # waits for a write still in flight
    history.best_theta = state.best_theta
    if math.isfinite(final_loss):
        if final_loss < float(jax.device_get(state.best_loss)):
            history.best_theta = state.theta
        history.best_loss = min(history.best_loss, final_loss)
    history.losses = [r["loss"] for r in history.records] + [final_loss]
    history.wall_time = elapsed()
    return state, history


# ---------------------------------------------------------------------------------------------


def _open_checkpoints(options: CheckpointOptions, resume: bool, fresh: TrainState,
                      config: Mapping[str, Any], fingerprint: str | None,
                      log: Callable[[str], None],
                      ) -> tuple[CheckpointStore, TrainState, FitHistory]:
    """The run's checkpoint store, and the state and history to start from: the newest
    checkpoint's (shaped like ``fresh``), or ``fresh`` and an empty history."""
    _require_one_directory(options.directory)
    if not resume:
        removed = remove_checkpoints(options.directory)
        if removed:
            log(f"run.resume=false: removed {removed} checkpoint(s) in {options.directory}; "
                "starting over")
    store = CheckpointStore(options)
    try:
        # The stored config first: a changed optimiser or parameter set also changes the
        # state's structure, and the restore would only say that the trees do not match.
        stored = store.read_config()
        if stored is not None:
            _check_config(stored[1], config, store)
        restored = store.restore(fresh)
        if restored is not None:
            _check_compatible(restored, config, fingerprint, store)
    except Exception:
        store.close()
        raise
    if restored is None:
        return store, fresh, FitHistory()
    history = _history_from(restored.meta)
    history.restarts += 1
    history.resumed_from = restored.step
    log(f"resuming from checkpoint step {restored.step} in {store.directory} (restart "
        f"{history.restarts}; {len(history.records)} steps done, best loss "
        f"{_fmt(history.best_loss)}, lr scale {float(restored.state.lr_scale):.3g})")
    return store, restored.state, history


def _record(report: StepReport, t: float) -> dict[str, Any]:
    record: dict[str, Any] = {"step": int(report.step), "loss": float(report.loss),
                              "grad_norm": float(report.grad_norm),
                              "lr_scale": float(report.lr_scale),
                              "evaluations": int(report.evaluations), "time": t}
    if report.params is not None:
        record["params"] = {k: float(v) for k, v in report.params.items()}
    return record


def _history_from(meta: Mapping[str, Any]) -> FitHistory:
    records = [dict(r) for r in meta.get("records", [])]
    return FitHistory(records=records,
                      best_loss=min((r["loss"] for r in records), default=math.inf),
                      nan_failures=int(meta.get("nan_failures", 0)),
                      wall_time=float(meta.get("wall_time", 0.0)),
                      restarts=int(meta.get("restarts", 0)))


RESUME_HINT = ("Use another run.name or run.dir for this run, or run.resume=false to discard "
               "the checkpoints.")


def resume_mismatch(saved: Mapping[str, Any] | None, config: Mapping[str, Any],
                    where: Path | str) -> ResumeMismatchError | None:
    """The error for resuming ``where`` (checkpoints made with ``saved``) with ``config``, or
    None if they may go on together: keys that only drive the run and the stopping keys
    (``optim.steps``: a finished run can be continued) may change."""
    if not saved or not config:
        return None
    differences = config_differences(saved, config, ignore=DRIVING_KEYS + CONTINUATION_KEYS)
    if not differences:
        return None
    return ResumeMismatchError(
        f"{where} holds checkpoints of a different configuration: "
        + "; ".join(differences[:8]) + (" …" if len(differences) > 8 else "")
        + f". {RESUME_HINT}")


def _check_config(saved: Mapping[str, Any] | None, config: Mapping[str, Any],
                  store: CheckpointStore) -> None:
    error = resume_mismatch(saved, config, store.directory)
    if error is not None:
        raise error


def _check_compatible(restored: Any, config: Mapping[str, Any], fingerprint: str | None,
                      store: CheckpointStore) -> None:
    _check_config(restored.config, config, store)
    saved = restored.meta.get("data_fingerprint")
    if saved and fingerprint and saved != fingerprint:
        raise ResumeMismatchError(
            f"the data differ from those the checkpoints in {store.directory} were made "
            f"with. {RESUME_HINT}")


def _require_one_directory(directory: Path) -> None:
    """The processes of one run save one checkpoint together (each writes its own shards), so
    they must name the same directory; otherwise each waits for the others' files forever."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = hashlib.sha256(str(Path(directory).absolute()).encode()).digest()[:8]
    digests = multihost_utils.process_allgather(np.frombuffer(digest, np.uint32))
    if not np.all(digests == digests[0:1]):
        raise ValueError(f"the {jax.process_count()} processes of this run use different "
                         f"checkpoint directories ({directory} in process "
                         f"{jax.process_index()}); give them one shared run.dir")


def _open_metrics(path: Path | None, records: list[dict[str, Any]], current: Any = None):
    """metrics.jsonl holding exactly ``records``, open for appending (rewritten on resume and
    after a rollback, so the file always matches the run's history)."""
    if current is not None:
        current.close()
    if path is None:
        return None
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
    return path.open("a")


def _fmt(x: float) -> str:
    return f"{x:.4e}" if math.isfinite(x) else "—"


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
