"""``pdefit-lyapunov``: the maximal Lyapunov exponent of the configured simulation, to choose a
training window and a forecast horizon before fitting.

The system that makes the data (``system``, or ``simulate.system`` for a surrogate fit) is run
from the first experiment's seeded initial state (``simulate.seed``) together with
``evaluate.lyapunov_directions`` twins whose ``evaluate.field`` (else the first observed field)
is offset by ``evaluate.lyapunov_perturbation`` × a seeded N(0, 1) field each — the same twins
``pdefit-evaluate`` runs. The RMS separations over all fields are recorded every
``evaluate.frame_interval`` (else the dataset's frame interval) until their median has
saturated (reached ``SATURATION`` of the separation of two unrelated states, then run on for a
quarter of the time taken), and :func:`pdefit.analysis.reports.lyapunov_estimate` fits each one's
smooth exponential growth and reports the median, the spread, or "undetermined" and why.
Printed: λ, the Lyapunov time 1/λ, and how many frames of the configured
``simulate.steps_per_frame × system.dt`` spacing span ``WINDOW`` (0.35) Lyapunov times; the
numbers and the separation curve go to ``lyapunov.json`` in the run directory.

    pdefit-lyapunov experiment=rb_temperature_from_velocity
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import hydra
import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import DictConfig

from pdefit.analysis.forecast import advance, perturbed_twins, rms_separation, unrelated_separation
from pdefit.analysis.reports import format_lyapunov, lyapunov_estimate
from pdefit.app.config import CONF_DIR, register_configs
from pdefit.app.rundir import open_run_record, output_dir, register_resolvers
from pdefit.fitting import assemble
from pdefit.model.system import stepper

register_configs()
register_resolvers()

WINDOW = 0.35  # training window, in Lyapunov times
SATURATION = 0.3  # stop growing once the separation reaches this × that of unrelated states
CHUNK = 50  # frames per jitted chunk
MAX_WINDOWS = 200  # give up after this many configured simulation windows


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


def estimate(cfg: DictConfig) -> dict[str, Any]:
    """λ, Lyapunov time and window sizes for the simulation ``cfg`` describes."""
    started = time.perf_counter()
    dtype = assemble.set_precision(cfg.precision)
    sys_cfg = assemble.data_system_config(cfg)
    system, grid = assemble.make_system(sys_cfg), assemble.make_grid(sys_cfg)
    params = assemble.system_params(system, sys_cfg.params)
    assemble.check_dynamics(system, params, grid, sys_cfg)
    dt = float(sys_cfg.dt)
    steps_per_frame = int(cfg.simulate.steps_per_frame)
    data_interval = steps_per_frame * dt
    interval = float(cfg.evaluate.frame_interval or data_interval)
    k = round(interval / dt)
    if k < 1 or abs(interval / dt - k) > 1e-6 * interval / dt:
        raise assemble.ConfigError(f"evaluate.frame_interval={interval} is not a multiple of "
                                   f"system.dt={dt}")
    field = cfg.evaluate.field or cfg.observe.fields[0]
    if field not in system.fields:
        raise assemble.ConfigError(f"evaluate.field={field!r}: {system.name} has fields "
                                   f"{list(system.fields)}")

    p = {n: jnp.asarray(v, dtype) for n, v in params.items()}
    t_init = time.perf_counter()
    state = jax.block_until_ready({f: jnp.asarray(v, dtype) for f, v in
                                   system.initial_state(grid, params,
                                                        int(cfg.simulate.seed)).items()})
    init_wall = time.perf_counter() - t_init
    directions = int(cfg.evaluate.lyapunov_directions)
    if directions < 1:
        raise assemble.ConfigError(f"evaluate.lyapunov_directions={directions}: need at least "
                                   "one perturbation direction")
    twin = perturbed_twins(state, field, float(cfg.evaluate.lyapunov_perturbation), directions,
                           dtype)
    unrelated = unrelated_separation(state)
    saturated = SATURATION * unrelated
    run = separation_rollout(stepper(system, grid, sys_cfg.integrator), k, CHUNK)
    max_frames = MAX_WINDOWS * max(int(cfg.simulate.n_frames) - 1, 1) * steps_per_frame // k
    separation = [np.asarray(jax.vmap(lambda b: rms_separation(state, b))(twin)).tolist()]
    reached = None
    t_roll = time.perf_counter()
    while len(separation) - 1 < max_frames:
        done = len(separation) - 1
        state, twin, d = run(state, twin, p, done * interval, dt)
        d = np.asarray(d, np.float64)
        separation += d.tolist()
        if not np.all(np.isfinite(d)):
            raise FloatingPointError(f"the simulation blew up after {len(separation) - 1} "
                                     f"frames; check system.dt")
        typical = np.median(d, axis=1)
        if reached is None and np.any(typical >= saturated):
            reached = done + 1 + int(np.argmax(typical >= saturated))
        if reached is not None and len(separation) - 1 >= math.ceil(1.25 * reached):
            break
    roll_wall = time.perf_counter() - t_roll
    times = interval * np.arange(len(separation))
    fit = lyapunov_estimate(times, np.asarray(separation), unrelated)
    lam = fit["exponent"]
    result: dict[str, Any] = {
        "system": system.name, "grid": list(grid.shape), "params": {
            n: float(v) for n, v in params.items() if np.ndim(v) == 0},
        "dt": dt, "frame_interval": interval, "data_frame_interval": data_interval,
        "perturbed_field": field, "perturbation": float(cfg.evaluate.lyapunov_perturbation),
        "directions": directions,
        "saturated": reached is not None, "lyapunov_exponent": lam, "lyapunov_fit": fit,
        "lyapunov_time": None, "window_lyapunov_times": WINDOW, "window": None,
        "window_frames": None, "window_steps": None,
        "configured_window": (int(cfg.simulate.n_frames) - 1) * data_interval,
        "configured_window_lyapunov_times": None,
        "times": times.tolist(), "separation": separation,
        "wall_time_s": {"initial_state": init_wall, "rollout": roll_wall,
                        "total": time.perf_counter() - started},
    }
    if lam is not None and lam > 0:
        lyap_time = 1.0 / lam
        intervals = max(1, round(WINDOW * lyap_time / data_interval))
        result.update(lyapunov_time=lyap_time, window=intervals * data_interval,
                      window_frames=intervals + 1, window_steps=intervals * steps_per_frame,
                      configured_window_lyapunov_times=result["configured_window"] * lam)
    return result


def format_estimate(r: dict[str, Any]) -> str:
    lines = [f"{r['system']} on {r['grid']}, dt = {r['dt']:g}: separation of "
             f"{r['directions']} twins ({r['perturbed_field']} + {r['perturbation']:g}·N(0,1)) "
             "over "
             f"{r['times'][-1]:.4g} time units ({len(r['times']) - 1} frames of "
             f"{r['frame_interval']:g})"]
    if not r["saturated"]:
        lines.append("warning: the separation did not saturate; the estimate may be poor")
    lam = r["lyapunov_exponent"]
    fit = r["lyapunov_fit"]
    lines.append(format_lyapunov(fit))
    if lam is None or lam <= 0:
        return "\n".join(lines)
    lines += [
        f"fitted over t = {fit['fit_start']:.4g} … {fit['fit_end']:.4g} (median over the "
        "directions)",
        f"Lyapunov time 1/λ = {r['lyapunov_time']:.5g} = "
        f"{r['lyapunov_time'] / r['dt']:.1f} steps of dt",
        f"{r['window_lyapunov_times']} Lyapunov times = {r['window_frames']} frames "
        f"(simulate.n_frames={r['window_frames']}, {r['window_steps']} steps, window "
        f"{r['window']:.5g}) at steps_per_frame × dt = {r['data_frame_interval']:g}",
        f"the configured window ({r['configured_window']:.5g}) is "
        f"{r['configured_window_lyapunov_times']:.3g} Lyapunov times",
    ]
    return "\n".join(lines)


@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
def lyapunov_main(cfg: DictConfig) -> None:
    """pdefit-lyapunov: the maximal Lyapunov exponent of the configured simulation (the data's
    system from simulate.seed's initial state and a twin perturbed by
    evaluate.lyapunov_perturbation), to choose a training window (simulate.n_frames) and a
    forecast horizon before fitting. Prints λ, the Lyapunov time and a suggested window;
    writes lyapunov.json to the run directory. Takes every pdefit-fit key (same config).

    Example:
      pdefit-lyapunov experiment=rb_temperature_from_velocity"""
    result = estimate(cfg)
    out = output_dir(cfg)
    open_run_record(out, cfg)
    (out / "lyapunov.json").write_text(json.dumps(result, indent=2))
    print(format_estimate(result))
    print(f"wrote {out / 'lyapunov.json'} ({result['wall_time_s']['total']:.1f} s)")
