"""The maximal Lyapunov exponent: fitted to the separations of perturbed twins from the truth
(:func:`lyapunov_exponent`, :func:`lyapunov_estimate`, used by ``pdefit-evaluate``), and
estimated for a configured simulation before fitting (:func:`estimate`, the work of
``pdefit-lyapunov``, whose command line is :mod:`pdefit.app.lyapunov`), to choose a training
window and a forecast horizon.

:func:`estimate` runs the system that makes the data (``system``, or ``simulate.system`` for a
surrogate fit) from the first experiment's seeded initial state (``simulate.seed``) together
with ``evaluate.lyapunov_directions`` twins whose ``evaluate.field`` (else the first observed
field) is offset by ``evaluate.lyapunov_perturbation`` × a seeded N(0, 1) field each — the same
twins ``pdefit-evaluate`` runs. The RMS separations over all fields are recorded every
``evaluate.frame_interval`` (else the dataset's frame interval) until their median has
saturated (reached ``SATURATION`` of the separation of two unrelated states, then run on for a
quarter of the time taken), and :func:`lyapunov_estimate` fits each one's smooth exponential
growth and reports the median, the spread, or "undetermined" and why. Its result: λ, the
Lyapunov time 1/λ, and how many frames of the configured ``simulate.steps_per_frame ×
system.dt`` spacing span ``WINDOW`` (0.35) Lyapunov times, with the separation curve.

    pdefit-lyapunov experiment=rb_temperature_from_velocity
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.analysis.reports import format_lyapunov
from pdefit.analysis.rollout import (
    perturbed_twins,
    rms_separation,
    separation_rollout,
    unrelated_separation,
)
from pdefit.fitting import assemble
from pdefit.model.system import System, stepper
from pdefit.numerics.grid import Grid
from pdefit.options import ConfigError, FitConfig, SystemConfig

# -- the exponent from separation curves ----------------------------------------------------

MIN_POINTS = 5  # frames in a fitted stretch
MIN_GROWTH = float(np.log(10.0))  # a fitted stretch spans at least a tenfold growth
MIN_R2 = 0.95  # and is that close to a straight line in log d
# and, cut into JUMP_BLOCKS equal blocks, its largest rises (those of JUMP_SHARE of the
# blocks) make at most MAX_JUMP of its growth
JUMP_BLOCKS = 20
JUMP_SHARE = 0.1
MAX_JUMP = 0.25
MAX_CANDIDATES = 5000  # stretches checked for jumps, largest growth first
MAX_FIT_POINTS = 1500  # longer curves are thinned to this many frames for the search
CEILING = 0.1  # separations above this × the saturation level are not fitted

_UNFITTED = {"exponent": None, "fit_start": None, "fit_end": None, "r2": None, "growth": None}


class _Stretches(NamedTuple):
    """The least-squares line of log d over every stretch [a, b] of at least MIN_POINTS
    frames."""

    a: np.ndarray
    b: np.ndarray
    slope: np.ndarray
    r2: np.ndarray
    growth: np.ndarray  # slope × the stretch's duration


def lyapunov_exponent(times: np.ndarray, separation: np.ndarray,
                      saturation: float | None = None) -> dict[str, Any]:
    """The maximal Lyapunov exponent from the separation d(t) of two nearby trajectories: the
    least-squares slope of log d over the stretch where d grows smoothly and exponentially.

    Candidates are the stretches before d first passes ``CEILING`` × its saturation level
    (``saturation``, e.g. the separation of unrelated states; else the median of d's last
    fifth) of at least ``MIN_POINTS`` frames where log d grows by at least ``MIN_GROWTH``
    (tenfold), fits a line with R² ≥ ``MIN_R2``, and does not grow by jumps: cut into
    ``JUMP_BLOCKS`` (20) blocks of frames (single frames in shorter stretches), the largest
    rises — those of a tenth of the blocks — make at most a quarter (``MAX_JUMP``) of its
    growth. Exponential growth rises alike in every block (blocks, not frames, so that noise
    from frame to frame does not count); a model with sharp thresholds separates by jumps (a
    cell crossing a threshold one step earlier), and a line through a staircase of a few of
    them fits its trend well. Of these stretches, the one with the largest growth is
    fitted. ``exponent`` is None, with the ``reason``, when there is none."""
    times = np.asarray(times, dtype=np.float64)
    d = np.asarray(separation, dtype=np.float64)
    ok = np.isfinite(d) & (d > 0)
    if ok.sum() < MIN_POINTS:
        return {**_UNFITTED, "reason": "fewer than five frames with a finite, nonzero separation"}
    index = _frames_before_saturation(d, ok, saturation)
    if index.size < MIN_POINTS:
        return {**_UNFITTED, "reason": "the separation saturates before it can be fitted"}
    t, y = times[index], np.log(d[index])
    lines = _stretch_lines(t, y)
    linear = np.flatnonzero((lines.slope > 0) & (lines.r2 >= MIN_R2)
                            & (lines.growth >= MIN_GROWTH))
    if linear.size == 0:
        return {**_UNFITTED,
                "reason": "no stretch of tenfold exponential growth before saturation"}
    pick = _smooth_stretch(y, lines, linear)
    if pick is None:
        return {**_UNFITTED, "reason": "the separation grows by jumps (threshold crossings), "
                                       "not smoothly"}
    return {"exponent": float(lines.slope[pick]), "fit_start": float(t[lines.a[pick]]),
            "fit_end": float(t[lines.b[pick]]), "r2": float(lines.r2[pick]),
            "growth": float(lines.growth[pick]), "reason": None}


def _frames_before_saturation(d: np.ndarray, ok: np.ndarray,
                              saturation: float | None) -> np.ndarray:
    """The frames with a finite, positive separation before it first passes ``CEILING`` × its
    saturation level, thinned to ``MAX_FIT_POINTS``."""
    if saturation is None:
        tail = d[int(0.8 * d.size):]
        tail = tail[np.isfinite(tail)]
        saturation = float(np.median(tail)) if tail.size else np.inf
    above = np.flatnonzero(ok & (d > CEILING * saturation))
    end = int(above[0]) if above.size else d.size
    index = np.arange(end)[ok[:end]]
    if index.size > MAX_FIT_POINTS:
        index = index[np.linspace(0, index.size - 1, MAX_FIT_POINTS).round().astype(int)]
    return index


def _stretch_lines(t: np.ndarray, y: np.ndarray) -> _Stretches:
    """Least squares of every stretch [a, b] at once, from prefix sums."""
    def prefix(x):
        return np.concatenate([[0.0], np.cumsum(x)])
    s1, st, sy, stt, syy, sty = (prefix(np.ones_like(t)), prefix(t), prefix(y), prefix(t * t),
                                 prefix(y * y), prefix(t * y))
    a, b = np.triu_indices(t.size, MIN_POINTS - 1)
    n = s1[b + 1] - s1[a]
    mt, my = (st[b + 1] - st[a]) / n, (sy[b + 1] - sy[a]) / n
    ctt = (stt[b + 1] - stt[a]) / n - mt * mt
    cyy = (syy[b + 1] - syy[a]) / n - my * my
    cty = (sty[b + 1] - sty[a]) / n - mt * my
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = cty / ctt
        r2 = cty * cty / (ctt * cyy)
    return _Stretches(a, b, slope, r2, slope * (t[b] - t[a]))


def _smooth_stretch(y: np.ndarray, lines: _Stretches, linear: np.ndarray) -> int | None:
    """Of the ``linear`` stretches, largest growth first, the first that does not grow by
    jumps (its largest block rises make at most ``MAX_JUMP`` of its growth); None if none."""
    for candidate in linear[np.argsort(-lines.growth[linear])][:MAX_CANDIDATES]:
        first, last = lines.a[candidate], lines.b[candidate]
        lag = max(1, (last - first) // JUMP_BLOCKS)
        rises = np.sort(np.diff(y[first:last + 1:lag]))
        top = rises[-max(1, round(JUMP_SHARE * rises.size)):]
        if top.sum() <= MAX_JUMP * lines.growth[candidate]:
            return candidate
    return None


MAX_SPREAD = 0.25  # directions whose exponents differ by more than this leave λ undetermined


def lyapunov_estimate(times: np.ndarray, separations: np.ndarray,
                      saturation: float | None = None, max_spread: float = MAX_SPREAD,
                      ) -> dict[str, Any]:
    """The maximal Lyapunov exponent from several twins: ``separations`` is (n_frames,
    n_directions), each column the separation of one perturbation direction from the truth,
    fitted by :func:`lyapunov_exponent`. ``exponent`` is the median over the directions and
    ``spread`` (max − min) / median; the exponent is None ("undetermined", with the
    ``reason``) unless most directions grow smoothly and their exponents differ by at most
    ``max_spread``. ``lyapunov_time`` is 1/λ with its range."""
    d = np.asarray(separations, dtype=np.float64)
    d = d[:, None] if d.ndim == 1 else d
    fits = [lyapunov_exponent(times, d[:, i], saturation) for i in range(d.shape[1])]
    rates = np.array([f["exponent"] for f in fits if f["exponent"] is not None])
    result: dict[str, Any] = {
        "exponent": None, "exponent_min": None, "exponent_max": None, "spread": None,
        "lyapunov_time": None, "lyapunov_time_min": None, "lyapunov_time_max": None,
        "fit_start": None, "fit_end": None, "directions": fits, "reason": None}
    if 2 * rates.size <= d.shape[1]:
        reasons = sorted({f["reason"] for f in fits if f["reason"]})
        result["reason"] = (f"only {rates.size} of {d.shape[1]} perturbation directions grow "
                            f"smoothly ({'; '.join(reasons)})")
        return result
    median = float(np.median(rates))
    spread = float((rates.max() - rates.min()) / abs(median))
    result.update(exponent_min=float(rates.min()), exponent_max=float(rates.max()),
                  spread=spread,
                  fit_start=float(np.median([f["fit_start"] for f in fits if f["exponent"]])),
                  fit_end=float(np.median([f["fit_end"] for f in fits if f["exponent"]])))
    if spread > max_spread:
        result["reason"] = (f"the perturbation directions disagree: λ from {rates.min():.4g} "
                            f"to {rates.max():.4g} (spread {spread:.0%} > {max_spread:.0%})")
        return result
    result["exponent"] = median
    if rates.min() > 0:
        result.update(lyapunov_time=1.0 / median, lyapunov_time_min=1.0 / rates.max(),
                      lyapunov_time_max=1.0 / rates.min())
    return result


# -- the exponent of a configured simulation (pdefit-lyapunov) ------------------------------

WINDOW = 0.35  # training window, in Lyapunov times
SATURATION = 0.3  # stop growing once the separation reaches this × that of unrelated states
CHUNK = 50  # frames per jitted chunk
MAX_WINDOWS = 200  # give up after this many configured simulation windows


class _Simulation(NamedTuple):
    """The data-making system of a config and the spacing of the recorded separations."""

    system: System
    grid: Grid
    params: dict[str, Any]
    sys_cfg: SystemConfig
    dt: float
    steps_per_frame: int
    data_interval: float  # the dataset's frame interval: steps_per_frame × dt
    interval: float  # the separations' frame interval
    k: int  # steps per separation frame
    field: str  # the perturbed field


class _Separation(NamedTuple):
    """The separation of each twin after every frame, whether their median saturated (the
    frame it did) and the wall time of the rollout."""

    separation: list[list[float]]
    reached: int | None
    wall: float


def estimate(cfg: FitConfig) -> dict[str, Any]:
    """λ, Lyapunov time and window sizes for the simulation ``cfg`` describes."""
    started = time.perf_counter()
    dtype = assemble.set_precision(cfg.precision)
    sim = _simulation(cfg)
    p = {n: jnp.asarray(v, dtype) for n, v in sim.params.items()}
    t_init = time.perf_counter()
    state = jax.block_until_ready({f: jnp.asarray(v, dtype) for f, v in
                                   sim.system.initial_state(sim.grid, sim.params,
                                                            int(cfg.simulate.seed)).items()})
    init_wall = time.perf_counter() - t_init
    directions = int(cfg.evaluate.lyapunov_directions)
    if directions < 1:
        raise ConfigError(f"evaluate.lyapunov_directions={directions}: need at least "
                          "one perturbation direction")
    twin = perturbed_twins(state, sim.field, float(cfg.evaluate.lyapunov_perturbation),
                           directions, dtype)
    unrelated = unrelated_separation(state)
    run = _separate(sim, state, twin, p, unrelated, int(cfg.simulate.n_frames))
    times = sim.interval * np.arange(len(run.separation))
    fit = lyapunov_estimate(times, np.asarray(run.separation), unrelated)
    result = _estimate_result(cfg, sim, directions, run, times, fit)
    result["wall_time_s"] = {"initial_state": init_wall, "rollout": run.wall,
                             "total": time.perf_counter() - started}
    return _with_window(result, sim)


def _simulation(cfg: FitConfig) -> _Simulation:
    """The data-making system of ``cfg`` (its dynamics checked) and the separations' frame
    spacing and perturbed field; a ConfigError naming a key that cannot work."""
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
        raise ConfigError(f"evaluate.frame_interval={interval} is not a multiple of "
                          f"system.dt={dt}")
    field = cfg.evaluate.field or cfg.observe.fields[0]
    if field not in system.fields:
        raise ConfigError(f"evaluate.field={field!r}: {system.name} has fields "
                          f"{list(system.fields)}")
    return _Simulation(system, grid, params, sys_cfg, dt, steps_per_frame, data_interval,
                       interval, k, field)


def _separate(sim: _Simulation, state: dict[str, Any], twin: dict[str, Any],
              p: dict[str, Any], unrelated: float, n_frames: int) -> _Separation:
    """Run ``state`` and its twins in chunks of ``CHUNK`` frames until the median separation
    has reached ``SATURATION`` × ``unrelated`` and run on for a quarter of the time taken (at
    most ``MAX_WINDOWS`` configured windows of ``n_frames``)."""
    saturated = SATURATION * unrelated
    run = separation_rollout(stepper(sim.system, sim.grid, sim.sys_cfg.integrator), sim.k, CHUNK)
    max_frames = MAX_WINDOWS * max(n_frames - 1, 1) * sim.steps_per_frame // sim.k
    separation = [np.asarray(jax.vmap(lambda b: rms_separation(state, b))(twin)).tolist()]
    reached = None
    t_roll = time.perf_counter()
    while len(separation) - 1 < max_frames:
        done = len(separation) - 1
        state, twin, d = run(state, twin, p, done * sim.interval, sim.dt)
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
    return _Separation(separation, reached, time.perf_counter() - t_roll)


def _estimate_result(cfg: FitConfig, sim: _Simulation, directions: int, run: _Separation,
                     times: np.ndarray, fit: dict[str, Any]) -> dict[str, Any]:
    """``lyapunov.json`` before the window is sized (:func:`_with_window`)."""
    return {
        "system": sim.system.name, "grid": list(sim.grid.shape), "params": {
            n: float(v) for n, v in sim.params.items() if np.ndim(v) == 0},
        "dt": sim.dt, "frame_interval": sim.interval, "data_frame_interval": sim.data_interval,
        "perturbed_field": sim.field,
        "perturbation": float(cfg.evaluate.lyapunov_perturbation), "directions": directions,
        "saturated": run.reached is not None, "lyapunov_exponent": fit["exponent"],
        "lyapunov_fit": fit, "lyapunov_time": None, "window_lyapunov_times": WINDOW,
        "window": None, "window_frames": None, "window_steps": None,
        "configured_window": (int(cfg.simulate.n_frames) - 1) * sim.data_interval,
        "configured_window_lyapunov_times": None,
        "times": times.tolist(), "separation": run.separation, "wall_time_s": None,
    }


def _with_window(result: dict[str, Any], sim: _Simulation) -> dict[str, Any]:
    """``result`` with the Lyapunov time and the training window of ``WINDOW`` Lyapunov times
    in whole frames of the dataset's spacing, where λ > 0."""
    lam = result["lyapunov_exponent"]
    if lam is not None and lam > 0:
        lyap_time = 1.0 / lam
        intervals = max(1, round(WINDOW * lyap_time / sim.data_interval))
        result.update(lyapunov_time=lyap_time, window=intervals * sim.data_interval,
                      window_frames=intervals + 1, window_steps=intervals * sim.steps_per_frame,
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
