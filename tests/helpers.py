"""Small AP fit problems built directly from engine objects (no files, no Hydra)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from pdefit.adjoint import StoreAll
from pdefit.fitting.observe import Observation, observed_data
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.model.params import ParameterLayout
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov

STORE_ALL = StoreAll()


def ap_state(grid: Grid, seed: int = 0, n_exp: int = 1):
    """A cheap active AP state: smooth random bumps of excitation and recovery."""
    rng = np.random.default_rng(seed)
    y, x = np.meshgrid(*(np.arange(n) for n in grid.shape), indexing="ij")
    out = {"u": [], "v": []}
    for _ in range(n_exp):
        cy, cx = rng.uniform(0, grid.shape[0]), rng.uniform(0, grid.shape[1])
        r2 = ((y - cy) ** 2 + (x - cx) ** 2) / (0.1 * max(grid.shape)) ** 2
        out["u"].append(np.exp(-r2))
        out["v"].append(0.5 * np.exp(-r2 / 4) * rng.uniform(0.5, 1.0))
    return {k: jnp.asarray(np.stack(v)) for k, v in out.items()}


def ap_problem(shape=(12, 12), boundaries=("neumann", "neumann"), n_steps=40, every=5,
               fitted=("k", "a", "eps0", "mu1"), fit_fields=(), schedule=STORE_ALL,
               n_exp=1, integrator="euler", dtype=jnp.float64, observe=("u", "v"),
               noise=0.0, noise_seed=1):
    """An AP problem with synthetic data from the true parameters; returns
    (problem, batch, theta_true, theta_start)."""
    system = AlievPanfilov()
    grid = Grid(shape, (1.0, 1.0), boundaries)
    dt = 0.05
    x0 = jax.tree.map(lambda a: a.astype(dtype), ap_state(grid, 0, n_exp))
    params = {k: jnp.asarray(v, dtype) for k, v in AP96.items()}
    step = stepper(system, grid, integrator)
    # Frames every `every` steps and at the last step (n_steps need not be a multiple).
    frame_steps = sorted(set(range(0, n_steps + 1, every)) | {n_steps})
    frames = jax.vmap(lambda s: simulate(step, s, params, 0.0, dt, n_steps, 1))(x0)
    values = {f: np.asarray(frames[f])[:, frame_steps] for f in observe}
    if noise:
        rng = np.random.default_rng(noise_seed)
        values = {f: v + noise * rng.standard_normal(v.shape) for f, v in values.items()}
    observation = Observation(tuple(observe))
    observed = observed_data(observation, values, {f: None for f in observe}, frame_steps,
                             n_steps, dtype)
    start = dict(AP96)
    factors = np.random.default_rng(3).uniform(0.7, 1.3, len(fitted))
    for name, f in zip(fitted, factors, strict=True):
        start[name] = AP96[name] * f
    layout = ParameterLayout.build(system.params, AP96, list(fitted))
    problem = FitProblem(system=system, grid=grid, dt=dt, integrator=integrator,
                         n_steps=n_steps, layout=layout, observation=observation,
                         schedule=schedule, fitted_fields=tuple(fit_fields))
    known = {f: x0[f] for f in system.fields if f not in fit_fields}
    batch = Batch(observed, known)
    fields_true = {f: x0[f] for f in fit_fields}
    fields_start = {f: 0.8 * x0[f] + 0.05 for f in fit_fields}
    cast = lambda d: {k: jnp.asarray(v, dtype) for k, v in d.items()}  # noqa: E731
    theta_true = {"params": cast(layout.unconstrained(AP96)), "fields": fields_true}
    theta_start = {"params": cast(layout.unconstrained(start)), "fields": fields_start}
    return problem, batch, theta_true, theta_start


def weighted_frame_residuals(batch, predicted):
    """The residuals of predicted frames as the misfit weighs them (Σ r² = the data loss):
    √(w · scale / n_exp) · (prediction − datum), flattened."""
    obs = batch.observed
    n_exp = next(iter(obs.scale.values())).shape[0]
    return [jnp.ravel(jnp.sqrt(obs.weights[k] * obs.scale[k][:, None, None, None] / n_exp)
                      * (predicted[k] - obs.values[k])) for k in predicted]


def dense_gauss_newton(problem, theta, batch, residuals):
    """(G, g, r) over all of θ flattened from the dense Jacobian of ``residuals`` (flat θ →
    weighted residual vector), plus the penalties' and the field prior's exact Hessian."""
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(theta)

    def prior(f):
        return problem.penalty(unravel(f)) + problem.field_prior(unravel(f), batch)

    jacobian = jax.jacfwd(residuals)(flat)
    r = residuals(flat)
    return (2 * jacobian.T @ jacobian + jax.hessian(prior)(flat),
            2 * jacobian.T @ r + jax.grad(prior)(flat), r)


def voltage_only_truth(n_steps: int) -> dict[str, jnp.ndarray]:
    """The noise-free frames (every 10 steps) of :func:`voltage_only_setup`, u and v."""
    grid = Grid((16, 16), (1.0, 1.0))
    params = {k: jnp.asarray(v, jnp.float64) for k, v in AP96.items()}
    step = stepper(AlievPanfilov(), grid, "euler")
    spun = simulate(step, {k: v[0] for k, v in ap_state(grid).items()}, params, 0.0, 0.05,
                    100, 100)
    return simulate(step, {k: v[-1] for k, v in spun.items()}, params, 0.0, 0.05, n_steps, 10)


def voltage_only_setup(n_steps: int):
    """``pdefit.build_problem`` on noisy u frames in memory (σ = 0.01, every 10 steps of dt
    0.05 on 16², spun up for 100 steps first so that v belongs to the dynamics of u, as in a
    recording: the synthetic bumps' v is unrelated to u and the first guess from u 8× off);
    v never recorded, u(0) and v(0) fitted with k and a from (9, 0.12)."""
    import pdefit

    grid = Grid((16, 16), (1.0, 1.0))
    frames = voltage_only_truth(n_steps)
    u = np.asarray(frames["u"]) + 0.01 * np.random.default_rng(0).standard_normal(
        frames["u"].shape)
    return pdefit.build_problem(
        "aliev_panfilov", {"u": u}, fit=["k", "a"], start={"k": 9.0, "a": 0.12}, dt=0.05,
        frame_interval=0.5, grid=grid, initial_fields={"u": "fit", "v": "fit"},
        regularization={"field_background": 1e-4}, precision="float64")


def configured_system(name: str):
    """(config dict, system, grid, parameters) of ``conf/system/<name>.yaml``."""
    from pdefit.systems import get_system

    path = Path(__file__).resolve().parents[1] / "conf" / "system" / f"{name}.yaml"
    cfg = yaml.safe_load(path.read_text())
    system = get_system(cfg["name"], **cfg["options"])
    grid = Grid(tuple(cfg["grid"]["shape"]), tuple(cfg["grid"]["spacing"]),
                tuple(cfg["grid"]["boundaries"]))
    params = {**{k: spec.default for k, spec in system.params.items()}, **cfg["params"]}
    return cfg, system, grid, params
