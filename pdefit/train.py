"""The optimisation loop: optax over the unconstrained parameters and fitted fields.

One jitted update computes loss, gradient and the optimiser step; the Python loop runs over
optimiser iterations (each blocks on its loss, which also keeps the dispatch queue short).
A step whose loss or gradient is not finite is not applied: the last good state is kept, the
learning rate is scaled down, and after too many failures the run stops with a clear message.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from .config import OptimConfig


class TrainingDivergedError(RuntimeError):
    """Too many consecutive non-finite losses or gradients."""


class TrainState(NamedTuple):
    step: jnp.ndarray
    theta: Any
    opt_state: Any
    lr_scale: jnp.ndarray


@dataclass
class FitHistory:
    losses: list[float] = field(default_factory=list)
    best_loss: float = math.inf
    best_theta: Any = None
    nan_failures: int = 0
    wall_time: float = 0.0


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


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Gradient clipping (optional) followed by the optimiser. ``lbfgs`` ignores the
    learning-rate schedule: its zoom line search chooses each step length."""
    schedule = learning_rate_schedule(cfg)
    optimizers: dict[str, Callable[[], optax.GradientTransformation]] = {
        "adam": lambda: optax.adam(schedule),
        "adamw": lambda: optax.adamw(schedule),
        "sgd": lambda: optax.sgd(schedule, momentum=0.9),
        "lbfgs": lambda: optax.lbfgs(),
    }
    if cfg.name not in optimizers:
        raise ValueError(f"unknown optimizer {cfg.name!r}; choose one of {sorted(optimizers)}")
    parts = [optax.clip_by_global_norm(cfg.clip)] if cfg.clip else []
    return optax.chain(*parts, optimizers[cfg.name]())


def make_update(loss: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """``update(state, batch) -> (candidate state, loss, grad norm, finite)``, jitted. Extra
    arguments (value, gradient, loss function) are offered to optimisers that take them, such
    as L-BFGS's line search."""

    @jax.jit
    def update(state: TrainState, batch: Any):
        value, grad = jax.value_and_grad(loss)(state.theta, batch)
        grad_norm = optax.global_norm(grad)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(
            grad, state.opt_state, state.theta, value=value, grad=grad,
            value_fn=lambda theta: loss(theta, batch))
        updates = jax.tree.map(lambda u: state.lr_scale * u, updates)
        theta = optax.apply_updates(state.theta, updates)
        candidate = TrainState(state.step + 1, theta, opt_state, state.lr_scale)
        return candidate, value, grad_norm, finite

    return update


def run_fit(loss: Callable, theta0: Any, batch: Any, cfg: OptimConfig, *,
            describe: Callable[[Any], Mapping[str, float]] | None = None,
            metrics_path: Path | None = None, progress: bool = True,
            log: Callable[[str], None] = print) -> tuple[TrainState, FitHistory]:
    """Minimise ``loss(theta, batch)`` from ``theta0``. ``describe(theta)`` gives the physical
    values written to the metrics file at each step."""
    optimizer = make_optimizer(cfg)
    update = make_update(loss, optimizer)
    state = TrainState(jnp.asarray(0), theta0, optimizer.init(theta0), jnp.asarray(1.0))
    history = FitHistory()
    grad_norm_0 = None
    metrics = metrics_path.open("w") if metrics_path else None
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, disable=not progress, desc="fit", dynamic_ncols=True)
    try:
        while int(state.step) < cfg.steps:
            candidate, value, grad_norm, finite = update(state, batch)
            value = float(value)  # blocks: one update in flight at a time
            if not bool(finite):
                history.nan_failures += 1
                if history.nan_failures > cfg.max_nan_failures:
                    raise TrainingDivergedError(
                        f"loss or gradient not finite at step {int(state.step)} "
                        f"{history.nan_failures} times; last learning-rate scale "
                        f"{float(state.lr_scale):.3g}. Lower optim.lr or check dt and the data.")
                scale = state.lr_scale * cfg.nan_lr_factor
                log(f"step {int(state.step)}: non-finite loss/gradient; step skipped, "
                    f"learning rate scaled by {float(scale):.3g}")
                # Keep the last good parameters and optimiser state, but move on a step so the
                # schedule advances.
                state = state._replace(step=state.step + 1, lr_scale=scale)
                continue
            if value < history.best_loss:
                history.best_loss, history.best_theta = value, state.theta
            history.losses.append(value)
            if metrics:
                record = {"step": int(state.step), "loss": value, "grad_norm": float(grad_norm),
                          "lr_scale": float(state.lr_scale),
                          "time": time.perf_counter() - start}
                if describe:
                    record["params"] = {k: float(v) for k, v in describe(state.theta).items()}
                metrics.write(json.dumps(record) + "\n")
            state = candidate
            if grad_norm_0 is None:
                grad_norm_0 = float(grad_norm)
            if float(grad_norm) <= cfg.grad_tol * grad_norm_0:
                log(f"converged at step {int(state.step)}: gradient norm {float(grad_norm):.3e} "
                    f"<= {cfg.grad_tol:g} x initial")
                bar.update(1)
                break
            bar.set_postfix(loss=f"{value:.3e}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
        if metrics:
            metrics.close()
    final_loss = float(jax.jit(loss)(state.theta, batch))
    if math.isfinite(final_loss) and final_loss < history.best_loss:
        history.best_loss, history.best_theta = final_loss, state.theta
    history.losses.append(final_loss)
    history.wall_time = time.perf_counter() - start
    return state, history
