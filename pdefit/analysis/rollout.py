"""The jitted rollouts of a forecast: the truth, the fitted model and copies of the truth offset
by tiny perturbations in seeded random directions ("twins") advanced side by side, keeping per
frame only what the scores need (error statistics, separations, the truth's activity and one
field's images), so that thousands of frames fit in memory. Shared by ``pdefit-evaluate``
(:mod:`pdefit.analysis.forecast`) and ``pdefit-lyapunov`` (:mod:`pdefit.analysis.lyapunov`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def rms_separation(a: Mapping[str, Any], b: Mapping[str, Any]) -> jnp.ndarray:
    """The RMS difference of two states over all their fields (each field weighted alike)."""
    return jnp.sqrt(jnp.mean(jnp.stack([jnp.mean((b[f] - a[f]) ** 2) for f in a])))


def advance(step: Callable, state, params, t0, dt, n_steps: int):
    """``n_steps`` steps of ``step`` from time ``t0`` (a ``fori_loop``, for use inside jit)."""
    def body(i, s):
        return step(s, params, t0 + i * dt, dt)
    return jax.lax.fori_loop(0, n_steps, body, state)


def perturbed_twins(state: Mapping[str, Any], field: str, size: float, n: int, dtype: Any,
                    seed: int = 12345) -> dict[str, jnp.ndarray]:
    """``n`` copies of ``state`` (stacked on a leading axis) whose ``field`` is offset by
    ``size`` × a seeded N(0, 1) field each: the perturbation directions of a Lyapunov
    estimate."""
    rng = np.random.default_rng(seed)
    shape = np.shape(state[field])
    twins = {f: jnp.broadcast_to(v, (n, *np.shape(v))) for f, v in state.items()}
    return {**twins, field: twins[field] + jnp.asarray(
        size * rng.standard_normal((n, *shape)), dtype)}


def unrelated_separation(state: Mapping[str, Any]) -> float:
    """The RMS separation of two unrelated states with this one's statistics: √2 × the RMS of
    each field's deviation from its mean, averaged over the fields like the separation."""
    return float(np.sqrt(2.0 * np.mean([np.var(np.asarray(v, np.float64))
                                        for v in state.values()])))


def forecast_rollout(truth_step: Callable, model_step: Callable, k_truth: int, k_model: int,
                     n_frames: int, compare: Sequence[str], image: str,
                     activity: Callable) -> Callable:
    """A jitted ``run(truth, model, twins, p_truth, p_model, t_truth, t_model, dt_truth,
    dt_model)`` giving, at ``n_frames`` frames ``k_truth`` truth steps (``k_model`` model steps)
    apart: the MAE of each compared field, the truth's min/max of them, the RMS separation of
    each twin (``twins`` stacked on a leading axis, advanced together by vmap) from the truth
    over all its fields, the truth's ``activity(state, next_state)`` and the ``image`` field
    of truth and model."""
    compare = tuple(compare)

    @jax.jit
    def run(truth, model, twins, p_truth, p_model, t_truth, t_model, dt_truth, dt_model):
        def frame(carry, j):
            truth, model, twins = carry
            t_t = t_truth + j * k_truth * dt_truth
            t_m = t_model + j * k_model * dt_model
            next_truth = advance(truth_step, truth, p_truth, t_t, dt_truth, k_truth)
            out = {
                "mae": jnp.stack([jnp.mean(jnp.abs(model[f] - truth[f])) for f in compare]),
                "low": jnp.stack([jnp.min(truth[f]) for f in compare]),
                "high": jnp.stack([jnp.max(truth[f]) for f in compare]),
                "separation": jax.vmap(lambda twin: rms_separation(truth, twin))(twins),
                "active": activity(truth, next_truth),
                "truth_image": truth[image],
                "model_image": model[image],
            }
            carry = (next_truth,
                     advance(model_step, model, p_model, t_m, dt_model, k_model),
                     jax.vmap(lambda twin: advance(truth_step, twin, p_truth, t_t, dt_truth,
                                                   k_truth))(twins))
            return carry, out

        return jax.lax.scan(frame, (truth, model, twins), jnp.arange(n_frames))[1]

    return run


def separation_rollout(step, k: int, n_frames: int):
    """A jitted ``run(a, b, params, t, dt)`` advancing the state ``a`` and the twins ``b``
    (stacked on a leading axis) ``n_frames`` × ``k`` steps; returns the end states and the RMS
    separation over all fields of each twin from ``a`` after each frame (n_frames, twins)."""

    @jax.jit
    def run(a, b, params, t, dt):
        def frame(carry, j):
            a, b = carry
            t_start = t + j * k * dt
            a, b = (advance(step, a, params, t_start, dt, k),
                    jax.vmap(lambda twin: advance(step, twin, params, t_start, dt, k))(b))
            d = jax.vmap(lambda twin: rms_separation(a, twin))(b)
            return (a, b), d

        (a, b), d = jax.lax.scan(frame, (a, b), jnp.arange(n_frames))
        return a, b, d

    return run
