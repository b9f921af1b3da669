"""Rayleigh–Bénard convection: an exactly divergence-free step, the linear onset for both wall
conditions, second-order convergence of the Nusselt number, adjoint gradients through the
projection, and recovery of the initial temperature from velocity frames alone."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.adjoint import Revolve, StoreAll
from pdefit.adjoint.taylor import taylor_test
from pdefit.fitting.observe import Observation, observed_data
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.fitting.train import run_fit
from pdefit.model.params import ParameterLayout
from pdefit.model.system import UnstableTimeStepError, check_time_step, stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.options import OptimConfig
from pdefit.systems import get_system
from pdefit.systems.rayleigh_benard import ONSET, RayleighBenard, project, solve_poisson
from tests.helpers import configured_system

BOUNDARIES = ("neumann", "periodic")
run = jax.jit(simulate, static_argnums=(0, 5, 6))


def layer(nz: int, nx: int, width: float = 1.0) -> Grid:
    """nz cells between the walls, nx across a periodic width."""
    return Grid((nz, nx), (1.0 / nz, width / nx), BOUNDARIES)


def as_params(**values: float) -> dict[str, jnp.ndarray]:
    return {k: jnp.asarray(v, jnp.float64) for k, v in values.items()}


# ---------------------------------------------------------------------------------------------
# Set-up and validation.


def test_registry_options_and_grid_checks():
    system = get_system("rayleigh_benard", walls="free_slip")
    assert isinstance(system, RayleighBenard) and system.fields == ("u", "w", "theta")
    assert {n: s.transform for n, s in system.params.items()} == {"Ra": "log", "Pr": "log"}
    with pytest.raises(ValueError, match="wall condition"):
        RayleighBenard(walls="rigid")
    params = {"Ra": 1e4, "Pr": 0.71}
    with pytest.raises(ValueError, match="1/nz"):
        system.max_stable_dt(params, Grid((8, 16), (0.1, 0.1), BOUNDARIES))
    with pytest.raises(ValueError, match="periodic"):
        system.initial_state(Grid((8, 16), (0.125, 0.125)), params, 0)
    grid = layer(16, 32, 2.0)
    # A step-based system's limit is its own (the engine does not rescale it): dx²/(4 max(Pr, 1)).
    assert check_time_step(system, params, grid, 1e-4, "euler") == pytest.approx(1 / 1024)
    with pytest.raises(UnstableTimeStepError):
        check_time_step(system, {"Ra": 1e4, "Pr": 7.0}, grid, 2e-4, "euler")


def test_initial_state_layout():
    system = RayleighBenard(init_amplitude=0.2)
    grid = layer(12, 20, 2.0)
    state = system.initial_state(grid, {"Ra": 1e4, "Pr": 1.0}, seed=3)
    assert all(state[f].shape == grid.shape for f in system.fields)
    theta = np.asarray(state["theta"])
    assert np.sqrt(np.mean(theta**2)) == pytest.approx(0.2)
    assert np.abs(theta.mean(axis=1)).max() < 1e-12  # no horizontal mean
    # It vanishes on the walls: linear extrapolation from the first two cells off each wall.
    walls = np.stack([1.5 * theta[0] - 0.5 * theta[1], 1.5 * theta[-1] - 0.5 * theta[-2]])
    assert np.abs(walls).max() < 0.1 * np.abs(theta).max()
    again = system.initial_state(grid, {"Ra": 1e4, "Pr": 1.0}, seed=3)["theta"]
    assert np.array_equal(theta, np.asarray(again))
    assert float(system.cfl_dt(state, {}, grid)) == math.inf  # at rest


def test_poisson_solve_inverts_the_discrete_laplacian():
    nz, nx = 10, 12
    dz, dx = 1.0 / nz, 0.3
    rhs = np.random.default_rng(0).standard_normal((nz, nx))
    rhs -= rhs.mean()
    phi = np.asarray(solve_poisson(jnp.asarray(rhs), dz, dx))
    ghost = np.concatenate([phi[:1], phi, phi[-1:]])  # zero flux through the walls
    lap = ((np.roll(phi, -1, 1) - 2 * phi + np.roll(phi, 1, 1)) / dx**2
           + (ghost[2:] - 2 * phi + ghost[:-2]) / dz**2)
    assert np.abs(lap - rhs).max() < 1e-10 * np.abs(rhs).max()


def test_config_builds():
    cfg, system, grid, params = configured_system("rayleigh_benard")
    check_time_step(system, params, grid, cfg["dt"], cfg["integrator"])
    # The velocity scale of developed convection, ~0.3 sqrt(Ra Pr), keeps dt inside the CFL.
    speed = 0.3 * math.sqrt(params["Ra"] * params["Pr"])
    assert cfg["dt"] < 1.0 / (speed / grid.spacing[1] + speed / grid.spacing[0])


@pytest.mark.parametrize("walls", ["no_slip", "free_slip"])
def test_advection_conserves_energy_and_theta_variance(walls):
    """With Pr = Ra = 0 the momentum tendency is pure advection, and θ's is advection plus
    diffusion plus w: for a discretely divergence-free velocity, advection neither makes nor
    destroys kinetic energy or ∫θ²."""
    system = RayleighBenard(walls=walls)
    grid = layer(12, 16, 1.6)
    rng = np.random.default_rng(0)
    u, w, theta = (jnp.asarray(rng.standard_normal(grid.shape)) for _ in range(3))
    u, w = project(u, w.at[0].set(0.0), *grid.spacing)
    still = {"u": jnp.zeros_like(u), "w": jnp.zeros_like(w), "theta": theta}
    params = as_params(Ra=0.0, Pr=0.0)
    moving = system.tendencies({"u": u, "w": w, "theta": theta}, params, grid)
    resting = system.tendencies(still, params, grid)
    w_centre = 0.5 * (w + jnp.concatenate([w[1:], jnp.zeros_like(w[:1])]))
    assert abs(float(jnp.sum(u * moving["u"] + w * moving["w"]))) < 1e-12 * float(
        jnp.sum(u**2 + w**2)) * 1e3
    advection = moving["theta"] - resting["theta"] - w_centre
    assert abs(float(jnp.sum(theta * advection))) < 1e-12 * float(jnp.sum(theta**2)) * 1e3


@pytest.mark.parametrize("walls", ["no_slip", "free_slip"])
def test_every_step_is_divergence_free(walls):
    system = RayleighBenard(walls=walls, init_amplitude=1.0)
    grid = layer(16, 24, 1.5)
    params = as_params(Ra=1e5, Pr=0.71)
    x0 = system.initial_state(grid, params, seed=1)
    frames = run(stepper(system, grid, "euler"), x0, params, 0.0,
                 0.5 * system.max_stable_dt(params, grid), 60, 1)
    div = jax.vmap(lambda s: system.divergence(s, grid))(frames)
    speed = float(jnp.max(jnp.abs(frames["w"][-1])))
    assert speed > 10.0  # a strongly driven flow, not a trivial one
    assert float(jnp.max(jnp.abs(div[1:]))) <= 1e-10
    assert float(jnp.max(jnp.abs(frames["w"][:, 0]))) == 0.0  # the bottom wall face


# ---------------------------------------------------------------------------------------------
# Linear onset: in a box one critical wavelength wide, a small perturbation decays 5 % below
# Ra_c and grows 5 % above it.

ONSET_T = 3.0
ONSET_FRAMES = 30


def growth_rate(walls: str, ra_factor: float, nz: int = 16, nx: int = 16) -> float:
    """Growth rate of the kinetic energy's square root over the second half of t ∈ [0, 3]
    (the slower modes have decayed by then), from a 1e-6 random perturbation."""
    ra_c, k_c = ONSET[walls]
    system = RayleighBenard(walls=walls, init_amplitude=1e-6)
    grid = layer(nz, nx, 2.0 * math.pi / k_c)
    params = as_params(Ra=ra_factor * ra_c, Pr=1.0)
    dt_max = system.max_stable_dt(params, grid)
    per_frame = math.ceil(ONSET_T / ONSET_FRAMES / (0.5 * dt_max))
    dt = ONSET_T / ONSET_FRAMES / per_frame
    frames = run(stepper(system, grid, "euler"), system.initial_state(grid, params, 0), params,
                 0.0, dt, per_frame * ONSET_FRAMES, per_frame)
    energy = np.asarray(jax.vmap(lambda s: system.kinetic_energy(s, grid))(frames))
    half = ONSET_FRAMES // 2
    return 0.5 * math.log(energy[-1] / energy[half]) / (ONSET_T - half * dt * per_frame)


@pytest.mark.parametrize("walls", ["no_slip", "free_slip"])
def test_linear_onset(walls):
    below, above = growth_rate(walls, 0.95), growth_rate(walls, 1.05)
    # The discrete critical Ra, by linear interpolation between the two runs.
    ra_c = ONSET[walls][0] * (0.95 + 0.1 * below / (below - above))
    print(f"{walls}: growth rates {below:.4f} (0.95 Ra_c), {above:.4f} (1.05 Ra_c); "
          f"discrete Ra_c ≈ {ra_c:.1f}")
    assert below < -0.05 and above > 0.05
    assert ra_c == pytest.approx(ONSET[walls][0], rel=0.03)


# ---------------------------------------------------------------------------------------------
# The steady roll pair at Ra = 1e4, Pr = 0.71 in a periodic box of aspect ratio 2 (k = π).


def steady_nusselt(nz: int, t_end: float = 0.6) -> tuple[float, float]:
    """(volume-averaged, bottom-wall) Nu after t_end, from a single-roll-pair perturbation."""
    system = RayleighBenard()
    grid = layer(nz, 2 * nz, 2.0)
    params = as_params(Ra=1e4, Pr=0.71)
    z, x = grid.coordinates()
    theta = 0.1 * jnp.sin(jnp.pi * z)[:, None] * jnp.cos(jnp.pi * x)[None, :]
    x0 = {"u": jnp.zeros(grid.shape), "w": jnp.zeros(grid.shape), "theta": theta}
    n = math.ceil(t_end / (0.9 * system.max_stable_dt(params, grid)))
    last = jax.tree.map(lambda f: f[-1], run(stepper(system, grid, "euler"), x0, params, 0.0,
                                             t_end / n, n, n))
    assert float(system.cfl_dt(last, params, grid)) > t_end / n  # diffusion set the step
    return float(system.nusselt(last, grid)), float(system.wall_nusselt(last, grid)[0])


def test_nusselt_converges_at_second_order():
    resolutions = (12, 24, 48)
    values = [steady_nusselt(nz) for nz in resolutions]
    nu = [v[0] for v in values]
    for volume, wall in values:  # steady: the heat flux is the same at every level
        assert wall == pytest.approx(volume, abs=1e-5)
    order = math.log2((nu[0] - nu[1]) / (nu[1] - nu[2]))
    extrapolated = nu[2] + (nu[2] - nu[1]) / (2**order - 1)
    print(f"Nu at nz = {resolutions}: {nu}; observed order {order:.3f}; "
          f"Richardson extrapolation {extrapolated:.5f}")
    assert 1.8 < order < 2.2
    # Periodic rolls (not the 2.16 of a square cavity with adiabatic side walls).
    assert 2.62 < extrapolated < 2.69


# ---------------------------------------------------------------------------------------------
# Fitting the initial temperature from velocity frames.

FIT_SYSTEM = RayleighBenard(init_amplitude=0.1, init_modes=3)
FIT_GRID = layer(16, 16, 1.0)
FIT_TRUTH = {"Ra": 5e3, "Pr": 1.0}
FIT_DT = 5e-4
FIT_EVERY = 5


@functools.cache
def fit_data(n_steps: int) -> tuple[dict[str, jnp.ndarray], dict[str, np.ndarray]]:
    x0 = FIT_SYSTEM.initial_state(FIT_GRID, FIT_TRUTH, seed=0)
    frames = run(stepper(FIT_SYSTEM, FIT_GRID, "euler"), x0, as_params(**FIT_TRUTH), 0.0,
                 FIT_DT, n_steps, FIT_EVERY)
    return x0, {f: np.asarray(v) for f, v in frames.items()}


def fit_problem(schedule, n_steps: int, fitted=()):
    """(problem, batch, theta_true, theta_start): u and w observed every FIT_EVERY steps,
    θ(t = 0) fitted from zeros, the parameters in ``fitted`` from truth × 1.2."""
    x0, frames = fit_data(n_steps)
    frame_steps = list(range(0, n_steps + 1, FIT_EVERY))
    observation = Observation(("u", "w"))
    values = {f: frames[f][None] for f in observation.fields}
    observed = observed_data(observation, values, {f: None for f in observation.fields},
                             frame_steps, n_steps, jnp.float64)
    layout = ParameterLayout.build(FIT_SYSTEM.params, FIT_TRUTH, list(fitted))
    problem = FitProblem(system=FIT_SYSTEM, grid=FIT_GRID, dt=FIT_DT, integrator="euler",
                         n_steps=n_steps, layout=layout, observation=observation,
                         schedule=schedule, fitted_fields=("theta",))
    batch = Batch(observed, {f: x0[f][None] for f in ("u", "w")})
    start = {**FIT_TRUTH, **{n: 1.2 * FIT_TRUTH[n] for n in fitted}}
    theta_true = {"params": layout.unconstrained(FIT_TRUTH), "fields": {"theta": x0["theta"][None]}}
    theta_start = {"params": layout.unconstrained(start),
                   "fields": {"theta": jnp.zeros((1, *FIT_GRID.shape))}}
    return problem, batch, theta_true, theta_start


GRAD_STEPS = 40


@functools.cache
def jitted_gradient(schedule):
    """(problem, batch, θ, jitted loss, jitted gradient) with Ra, Pr and θ(t = 0) fitted, at
    half the true θ; cached so the Taylor test reuses the revolve gradient's compilation."""
    problem, batch, truth, theta = fit_problem(schedule, GRAD_STEPS, fitted=("Ra", "Pr"))
    theta["fields"]["theta"] = 0.5 * truth["fields"]["theta"]
    return problem, batch, theta, jax.jit(problem.loss), jax.jit(jax.grad(problem.loss))


def test_revolve_gradient_equals_store_all():
    grads = []
    for schedule in (StoreAll(), Revolve(snapshots=3)):
        _, batch, theta, _, grad = jitted_gradient(schedule)
        grads.append(grad(theta, batch))
    for ref, rev in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        ref, rev = np.asarray(ref), np.asarray(rev)
        assert np.abs(ref).max() > 0
        assert np.abs(rev - ref).max() <= 1e-10 * np.abs(ref).max()


def test_taylor_remainder_is_second_order():
    _, batch, theta, loss, grad = jitted_gradient(Revolve(snapshots=3))
    rows = taylor_test(lambda t: loss(t, batch), lambda t: grad(t, batch), theta,
                       eps0=1e-3, n=5)
    orders = [r["order"] for r in rows[1:]]
    assert all(1.8 < o < 2.2 for o in orders), rows
    # The first-order difference alone shrinks only linearly, so the test can tell.
    assert rows[-1]["first_order"] > 10 * rows[-1]["remainder"]


def test_recovers_initial_temperature_from_velocity_only():
    problem, batch, truth, theta0 = fit_problem(StoreAll(), 60)
    started = time.perf_counter()
    state, _ = run_fit(problem.loss, theta0, batch,
                       OptimConfig(name="lbfgs", steps=60, clip=None, grad_tol=1e-9),
                       progress=False, log=lambda _: None)
    true_theta = np.asarray(truth["fields"]["theta"])
    fitted = np.asarray(state.theta["fields"]["theta"])
    reduction = np.linalg.norm(true_theta) / np.linalg.norm(fitted - true_theta)
    print(f"θ error reduced {reduction:.1f}× in {time.perf_counter() - started:.1f} s")
    assert reduction >= 10.0


# ---------------------------------------------------------------------------------------------
# Batch parallelism: experiments spread over devices (and tiles: tests/test_rb_sharding.py).

MESH_EXPERIMENTS = 2
MESH_STEPS = 10
MESH_GRID = layer(8, 16, 2.0)


def experiments_problem(n_exp: int, n_steps: int):
    """(problem, batch, θ): u and w of ``n_exp`` experiments (seeds 0, 1, …) on MESH_GRID
    observed every FIT_EVERY steps, each experiment's θ(t = 0) fitted, at half the truth."""
    frame_steps = list(range(0, n_steps + 1, FIT_EVERY))
    observation = Observation(("u", "w"))
    starts = [FIT_SYSTEM.initial_state(MESH_GRID, FIT_TRUTH, seed=s) for s in range(n_exp)]
    params = as_params(**FIT_TRUTH)
    runs = [run(stepper(FIT_SYSTEM, MESH_GRID, "euler"), x0, params, 0.0, FIT_DT, n_steps,
                FIT_EVERY) for x0 in starts]
    values = {f: np.stack([np.asarray(r[f]) for r in runs]) for f in observation.fields}
    observed = observed_data(observation, values, {f: None for f in observation.fields},
                             frame_steps, n_steps, jnp.float64)
    layout = ParameterLayout.build(FIT_SYSTEM.params, FIT_TRUTH, [])
    problem = FitProblem(system=FIT_SYSTEM, grid=MESH_GRID, dt=FIT_DT, integrator="euler",
                         n_steps=n_steps, layout=layout, observation=observation,
                         schedule=StoreAll(), fitted_fields=("theta",))
    batch = Batch(observed, {f: jnp.stack([x[f] for x in starts]) for f in ("u", "w")})
    theta = {"params": layout.unconstrained(FIT_TRUTH),
             "fields": {"theta": 0.5 * jnp.stack([x["theta"] for x in starts])}}
    return problem, batch, theta


@pytest.mark.skipif(jax.device_count() < MESH_EXPERIMENTS, reason="needs 2 (virtual) devices")
def test_experiments_mesh_loss_and_gradient_equal_single_device():
    from pdefit.parallel.domain import Domain

    problem, batch, theta = experiments_problem(MESH_EXPERIMENTS, MESH_STEPS)
    value, grad = jax.jit(problem.value_and_grad)(theta, batch)
    reference = np.asarray(grad["fields"]["theta"])
    assert float(value) > 0
    assert all(np.abs(g).max() > 0 for g in reference)  # every experiment contributes
    sharded = dataclasses.replace(problem, domain=Domain.build((MESH_EXPERIMENTS, 1, 1)))
    v, g = jax.jit(sharded.value_and_grad)(theta, batch)
    assert abs(float(v) - float(value)) <= 1e-12 * abs(float(value))
    field = g["fields"]["theta"]
    assert np.abs(np.asarray(field) - reference).max() <= 1e-12 * np.abs(reference).max()
    # The field gradient stays split over the experiments, like the field.
    assert not field.sharding.is_fully_replicated
    # Experiments and z split together (tests/test_rb_sharding.py: every spatial mesh).
    both = dataclasses.replace(problem, domain=Domain.build((MESH_EXPERIMENTS, 2, 1)))
    v, g = jax.jit(both.value_and_grad)(theta, batch)
    assert abs(float(v) - float(value)) <= 1e-12 * abs(float(value))
    field = np.asarray(g["fields"]["theta"])
    assert np.abs(field - reference).max() <= 1e-12 * np.abs(reference).max()


# ---------------------------------------------------------------------------------------------
# The paper's case: its window and horizon in Lyapunov times, and the tool that measures them.

CONF = Path(__file__).resolve().parents[1] / "conf"
# pdefit-lyapunov experiment=rb_temperature_from_velocity (100², Ra 1e7, Pr 7, float32).
PAPER_LYAPUNOV_EXPONENT = 1273.5


def compose_fit(*overrides: str):
    from hydra import compose, initialize_config_dir

    from pdefit.app.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="fit", overrides=list(overrides))


def test_paper_experiment_window_and_horizon_in_lyapunov_times():
    cfg = compose_fit("experiment=rb_temperature_from_velocity")
    assert cfg.system.name == "rayleigh_benard" and list(cfg.system.grid.shape) == [100, 100]
    assert list(cfg.observe.fields) == ["u", "w"] and dict(cfg.fit.initial_fields) == {
        "theta": "fit"}
    assert cfg.evaluate.field == "theta" and cfg.evaluate.activation_level is None
    window = (cfg.simulate.n_frames - 1) * cfg.simulate.steps_per_frame * cfg.system.dt
    assert 0.3 < window * PAPER_LYAPUNOV_EXPONENT < 0.4
    assert 3.0 <= cfg.evaluate.horizon * PAPER_LYAPUNOV_EXPONENT <= 7.0
    ratio = cfg.evaluate.frame_interval / cfg.system.dt
    assert ratio == pytest.approx(round(ratio))
    assert compose_fit("experiment=rb_temperature_from_velocity", "fit.params=[Ra,Pr]"
                       ).fit.params == ["Ra", "Pr"]


def test_lyapunov_tool_on_a_small_layer():
    from pdefit.analysis import lyapunov

    cfg = compose_fit(
        "system=rayleigh_benard", "system.grid.shape=[8,8]", "system.grid.spacing=[0.125,0.125]",
        "system.params.Ra=2e5", "system.params.Pr=1.0", "system.dt=2e-4",
        "system.options.init_spinup=0.2", "simulate.n_frames=3", "simulate.steps_per_frame=5",
        "observe.fields=[u,w]", "evaluate.field=theta", "precision=float64")
    result = lyapunov.estimate(cfg)
    lam = result["lyapunov_exponent"]
    assert result["saturated"] and lam is not None and lam > 0
    interval = 5 * 2e-4
    assert result["lyapunov_time"] == pytest.approx(1 / lam)
    assert result["window_frames"] - 1 == max(1, round(lyapunov.WINDOW / lam / interval))
    assert "Lyapunov time" in lyapunov.format_estimate(result)
