"""Standard errors and 95 % intervals of fitted parameters (pdefit.fitting.uncertainty): the
covariance against a direct Jacobian of the residuals, coverage over noise seeds through a real
Levenberg–Marquardt fit, the 1/√frames shrinkage, and flags on parameters the data do not
determine."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from pdefit.adjoint import StoreAll
from pdefit.fitting.directions import NOT_DETERMINED, UNRESOLVED
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.observe import Observation, observed_data
from pdefit.fitting.problem import Batch, FitProblem, Regularization
from pdefit.fitting.train import run_fit
from pdefit.fitting.uncertainty import (
    NOT_CONVERGED,
    ROUNDOFF_NOTE,
    CurvatureParts,
    at_roundoff,
    data_rms,
    estimate,
)
from pdefit.model.params import ParameterLayout
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.options import OptimConfig
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov
from tests.helpers import ap_state

DT = 0.05
SIGMA = 0.01
GRID = Grid((12, 12), (1.0, 1.0), ("neumann", "neumann"))
# Plain stencils: forward mode (jax.jacfwd) cannot go through the self-adjoint VJP rule.
PLAIN_GRID = Grid(GRID.shape, GRID.spacing, GRID.boundaries, self_adjoint_vjp=False)
NO_PENALTY = Regularization()


def trajectory(x0, n_steps, params=None):
    """AP states at every step, (n_steps + 1, ny, nx) per field (the true parameters unless
    ``params`` are given)."""
    params = {k: jnp.asarray(v) for k, v in AP96.items()} if params is None else params
    return simulate(stepper(AlievPanfilov(), PLAIN_GRID, "euler"), x0, params, 0.0, DT,
                    n_steps, 1)


def initial_state():
    return {k: v[0] for k, v in ap_state(GRID).items()}


def noisy_problem(fitted, frame_steps, noise_seed=0, sigma=SIGMA, x0=None,
                  field_weights=(), regularization=NO_PENALTY, truth=None):
    """AP on 12², u and v observed at ``frame_steps`` with additive noise, known initial
    state: (problem, batch, theta at the truth, raw observed values)."""
    x0 = initial_state() if x0 is None else x0
    n_steps = frame_steps[-1]
    states = trajectory(x0, n_steps) if truth is None else truth
    rng = np.random.default_rng(noise_seed)
    values = {f: np.asarray(states[f])[None, frame_steps] for f in ("u", "v")}
    values = {f: v + sigma * rng.standard_normal(v.shape) for f, v in values.items()}
    observation = Observation(("u", "v"), field_weights=tuple(field_weights))
    observed = observed_data(observation, values, {"u": None, "v": None}, frame_steps,
                             n_steps, jnp.float64)
    layout = ParameterLayout.build(AlievPanfilov().params, AP96, list(fitted))
    problem = FitProblem(AlievPanfilov(), GRID, DT, "euler", n_steps, layout, observation,
                         StoreAll(), regularization=regularization)
    batch = Batch(observed, {f: x0[f][None] for f in ("u", "v")})
    theta = {"params": {k: jnp.asarray(v) for k, v in layout.unconstrained(AP96).items()},
             "fields": {}}
    return problem, batch, theta, values


@pytest.mark.parametrize("copied", [False, True], ids=["known-initial-state", "noisy-copy"])
def test_covariance_equals_the_direct_jacobian_of_the_residuals(copied):
    """Unequal field weights and an L2 prior (the sandwich's general case): the covariance
    from forward-tangent sweeps equals σ̂² B⁻¹ M B⁻¹ with J from jax.jacfwd of the residual
    vector, σ̂² = RSS/(N − p) and M = JᵀA²J; with the initial state a copy of the noisy first
    frame, its values leave N and M gains (JᵀAJ_x)(JᵀAJ_x)ᵀ (J_x by jax.jacfwd, too)."""
    frame_steps = list(range(0, 21, 5))
    weights, prior = {"u": 1.0, "v": 3.0}, 0.02
    problem, batch, theta, values = noisy_problem(
        ("k", "a", "mu1"), frame_steps, field_weights=weights.items(),
        regularization=Regularization(params=prior))
    if copied:
        batch = batch._replace(initial={f: jnp.asarray(values[f][:, 0]) for f in values})
    flat, unravel = ravel_pytree(theta["params"])
    x0 = {f: batch.initial[f][0] for f in ("u", "v")}

    def residuals(f, x0):
        states = trajectory(x0, frame_steps[-1], problem.layout.physical(unravel(f)))
        return jnp.concatenate([(states[g][jnp.asarray(frame_steps)] - values[g][0]).ravel()
                                for g in ("u", "v")])

    r, jac = np.asarray(residuals(flat, x0)), np.asarray(jax.jacfwd(residuals)(flat, x0))
    n = r.shape[0] // 2
    a = np.concatenate([np.full(n, weights["u"] / n), np.full(n, weights["v"] / n)])
    bread = jac.T @ (a[:, None] * jac) + prior * np.eye(3)
    meat = jac.T @ (a[:, None] ** 2 * jac)
    n_values = r.shape[0]
    if copied:
        jac_x0 = jax.jacfwd(residuals, argnums=1)(flat, x0)
        cross = jac.T @ (a[:, None] * np.concatenate(
            [jac_x0[f].reshape(r.shape[0], -1) for f in ("u", "v")], axis=1))
        meat = meat + cross @ cross.T
        n_values -= 2 * 144
    sigma2 = float(r @ r) / (n_values - 3)
    inverse = np.linalg.inv(bread)
    expected = sigma2 * inverse @ meat @ inverse

    # At the truth, the Gauss–Newton step −B⁻¹JᵀAr (the prior's gradient is zero there) to the
    # noisy data's optimum.
    step = -inverse @ (jac.T @ (a * r))

    result = estimate(problem, theta, batch)
    assert result["sigma_source"] == "residual" and result["dof"] == n_values - 3
    assert result["copied_initial_values"] == (2 * 144 if copied else 0)
    assert result["initial_state_noise"] == ("exact" if copied else None)
    assert result["sigma"] ** 2 == pytest.approx(sigma2, rel=1e-10)
    index = unravel(jnp.arange(3))
    for name, row in result["parameters"].items():
        sigma_z = np.sqrt(expected[int(index[name]), int(index[name])])
        # log parameters: physical std error = value · σ_θ, interval mapped from θ-space; it
        # spans the fitted value (the truth) and the optimum, q σ_θ beyond each.
        assert row["std_error"] == pytest.approx(AP96[name] * sigma_z, rel=1e-7)
        q, shift = result["quantile"], step[int(index[name])]
        assert row["optimum"] == pytest.approx(AP96[name] * np.exp(shift), rel=1e-6)
        assert row["ci95_low"] == pytest.approx(
            AP96[name] * np.exp(min(shift, 0.0) - q * sigma_z), rel=1e-6)
        assert row["ci95_high"] == pytest.approx(
            AP96[name] * np.exp(max(shift, 0.0) + q * sigma_z), rel=1e-6)
        assert row["ci95_low"] < min(AP96[name], row["optimum"])
        assert row["ci95_high"] > max(AP96[name], row["optimum"])
    for name, row in result["parameters"].items():
        i = int(index[name])
        assert row["to_optimum"] == pytest.approx(abs(step[i]) / np.sqrt(expected[i, i]),
                                                  rel=1e-6)
        assert row["flag"] == ("" if row["to_optimum"] <= 0.5 else
                               f"{NOT_CONVERGED} ({row['to_optimum']:.2g} std errors)")
    assert result["near_singular_directions"] == []


@pytest.mark.slow
def test_intervals_cover_the_truth_over_noise_seeds():
    """Levenberg–Marquardt fits of k and a to 20 noise draws (σ = 0.01 on u and v, noise level
    estimated from the residual): the 95 % intervals contain the truth in 85–100 % of cases."""
    frame_steps = list(range(0, 21, 4))
    fitted = ("k", "a")
    truth = trajectory(initial_state(), frame_steps[-1])
    cfg = OptimConfig(name="levenberg_marquardt", steps=15, clip=None, grad_tol=1e-10)
    covered, total, start = 0, 0, time.perf_counter()
    for seed in range(20):
        problem, batch, theta_true, _ = noisy_problem(fitted, frame_steps, noise_seed=seed,
                                                      truth=truth)
        theta0 = {**theta_true, "params": {k: v + 0.1 for k, v in theta_true["params"].items()}}
        _, history = run_fit(problem.loss, theta0, batch, cfg, progress=False,
                             log=lambda _: None, curvature=gauss_newton(problem))
        result = estimate(problem, history.best_theta, batch)
        for name in fitted:
            row = result["parameters"][name]
            covered += row["ci95_low"] <= AP96[name] <= row["ci95_high"]
            total += 1
            assert row["to_optimum"] < 0.01 and row["flag"] == ""  # converged
    fraction = covered / total
    print(f"coverage {covered}/{total} = {fraction:.3f} in {time.perf_counter() - start:.1f} s")
    assert 0.85 <= fraction <= 1.0


def test_a_fit_stopped_short_gets_an_interval_that_spans_the_optimum():
    """From a point 3 std errors off the converged Levenberg–Marquardt optimum in k, the
    estimate points back to that optimum (its Gauss–Newton step) and the interval spans both
    the point and the optimum's own 95 % interval, so a fit stopped short still covers where
    the data put the parameter."""
    frame_steps = list(range(0, 21, 4))
    problem, batch, theta_true, _ = noisy_problem(("k", "a"), frame_steps, noise_seed=3)
    cfg = OptimConfig(name="levenberg_marquardt", steps=15, clip=None, grad_tol=1e-10)
    _, history = run_fit(problem.loss, theta_true, batch, cfg, progress=False,
                         log=lambda _: None, curvature=gauss_newton(problem))
    converged = estimate(problem, history.best_theta, batch, sigma=SIGMA)
    k = converged["parameters"]["k"]
    assert k["to_optimum"] < 0.01 and k["flag"] == ""
    params = dict(history.best_theta["params"])
    params["k"] = params["k"] + 3.0 * k["std_error"] / k["value"]  # log k: σ_θ = σ_k / k
    short = estimate(problem, {**history.best_theta, "params": params}, batch, sigma=SIGMA)
    row = short["parameters"]["k"]
    assert row["flag"].startswith(NOT_CONVERGED) and 2.5 < row["to_optimum"] < 3.5
    assert row["optimum"] == pytest.approx(k["value"], abs=0.05 * k["std_error"])
    assert row["std_error"] == pytest.approx(k["std_error"], rel=0.05)
    assert row["ci95_low"] <= k["ci95_low"] + 0.05 * k["std_error"]
    assert row["ci95_high"] >= row["value"] + 1.9 * row["std_error"]
    assert not row["value"] - 1.96 * row["std_error"] <= k["ci95_low"]  # centred: it would not


def test_standard_errors_shrink_like_one_over_sqrt_frames():
    """Twice and four times as many frames over the same window (known σ): the standard errors
    shrink by √2 and 2 within 20 %."""
    errors = []
    for every in (8, 4, 2):
        frame_steps = list(range(0, 33, every))
        problem, batch, theta, _ = noisy_problem(("k", "a", "eps0"), frame_steps)
        result = estimate(problem, theta, batch, sigma=SIGMA)
        assert result["sigma_source"] == "dataset"
        errors.append({n: r["std_error"] for n, r in result["parameters"].items()})
    for name in errors[0]:
        for finer, expected in ((1, np.sqrt(2)), (2, 2.0)):
            ratio = errors[0][name] / errors[finer][name]
            assert ratio == pytest.approx(expected, rel=0.2), (name, finer, ratio)


def test_an_indefinite_curvature_is_reported_as_computed_wrong_not_as_flat():
    """A Gauss–Newton curvature cannot be indefinite: one that comes out so (as the Schur
    complement did on a BOCF 64² fit of all four fields, relative eigenvalue −7.7, its
    field solves at their cap) flags the parameters in that direction as unknown, with a
    note, where a merely flat direction says "not determined by the data"."""
    problem, batch, theta, _ = noisy_problem(("k", "a", "eps0"), list(range(0, 21, 5)))
    parts = dict(rss=1.0, n_values=100, gradient=np.zeros(3), initial_noise=None)
    # Flattened order a, eps0, k; eps0 and k move together: flat, or with eigenvalue −2 of 4.
    flat = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0 - 1e-12], [0.0, 1.0 - 1e-12, 1.0]])
    indefinite = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 3.0], [0.0, 3.0, 1.0]])
    for bread, flag in ((flat, NOT_DETERMINED), (indefinite, UNRESOLVED)):
        result = estimate(problem, theta, batch, sigma=SIGMA,
                          parts=CurvatureParts(bread=bread, meat=bread, **parts))
        assert [result["parameters"][n]["flag"] for n in ("eps0", "k")] == [flag, flag]
        assert result["parameters"]["a"]["flag"] == "" and result["parameters"]["a"]["std_error"]
        if flag == NOT_DETERMINED:
            assert result["note"] is None
        else:
            assert result["note"].startswith("no interval for ['eps0', 'k']"), result["note"]
            assert "indefinite: relative eigenvalue -0.5" in result["note"]
    # A std error the field solves leave bracketed too widely (marginal.SPREAD): unknown too.
    lost = estimate(problem, theta, batch, sigma=SIGMA, parts=CurvatureParts(
        bread=np.eye(3), meat=np.eye(3), unresolved=(0,), **parts))
    assert lost["parameters"]["a"]["flag"] == UNRESOLVED and lost["parameters"]["a"][
        "std_error"] is None
    assert lost["parameters"]["k"]["flag"] == "" and "fields' block solves" in lost["note"]


def test_a_parameter_the_data_do_not_see_is_flagged():
    """A spatially uniform state never diffuses, so D has no effect on the observed window: D
    is flagged and named in a near-singular direction, k still gets an interval."""
    x0 = {"u": jnp.full((12, 12), 0.6), "v": jnp.full((12, 12), 0.05)}
    problem, batch, theta, _ = noisy_problem(("D", "k"), list(range(0, 21, 5)), x0=x0)
    result = estimate(problem, theta, batch)
    assert result["parameters"]["D"]["flag"] == NOT_DETERMINED
    assert result["parameters"]["D"]["ci95_low"] is None
    assert [list(d["parameters"]) for d in result["near_singular_directions"]] == [["D"]]
    assert result["condition_number"] is None
    k = result["parameters"]["k"]
    # Evaluated at the truth, not at the noisy data's optimum: k may be flagged for that only.
    assert k["flag"] == "" or k["flag"].startswith(NOT_CONVERGED)
    assert result["flagged"] == (["D"] if k["flag"] == "" else ["D", "k"])
    assert 0 < k["ci95_low"] < AP96["k"] * 1.5 and k["ci95_high"] > k["ci95_low"]


def test_fit_command_prints_and_writes_intervals(tmp_path, capsys):
    """pdefit-fit on a small noisy AP dataset: the final table has the std error and 95 %
    interval columns, summary.json the uncertainty block with the dataset's noise level;
    fit.uncertainty=false leaves them out."""
    from hydra import compose, initialize_config_dir

    from pdefit.app import cli

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    overrides = ["system.grid.shape=[16,16]", "+system.options.initial=blobs",
                 "simulate.n_frames=4", "simulate.steps_per_frame=10",
                 "simulate.noise.kind=additive", f"simulate.noise.sigma={SIGMA}",
                 "run.progress=false", "run.plots=false", "optim=levenberg_marquardt",
                 "optim.steps=6", "fit.params=[k,a]", "precision=float64"]
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        on = compose(config_name="fit", overrides=[f"run.dir={tmp_path / 'on'}", *overrides])
        off = compose(config_name="fit", overrides=[f"run.dir={tmp_path / 'off'}",
                                                    *overrides, "fit.uncertainty=false"])
    summary = cli.fit(on)
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("parameter"))
    assert "± std err" in header and "95 % interval" in header
    saved = json.loads((tmp_path / "on" / "summary.json").read_text())["uncertainty"]
    assert saved == json.loads(json.dumps(summary["uncertainty"]))
    assert saved["available"] and saved["sigma_source"] == "dataset"
    assert saved["sigma"] == pytest.approx(SIGMA)
    # Frame 0 is the initial state read from the data: its copied values are not counted.
    assert saved["dof"] == 3 * 2 * 16 * 16 - 2
    assert saved["copied_initial_values"] == 2 * 16 * 16
    assert saved["initial_state_noise"] == "exact"
    for row in summary["parameters"]:
        bounds = saved["parameters"][row["name"]]
        assert bounds["ci95_low"] < row["recovered"] < bounds["ci95_high"]
        assert row["ci95_low"] == bounds["ci95_low"]
        line = next(x for x in table if x.startswith(row["name"] + " "))
        printed = re.search(r"\[(\S+), (\S+)\]", line).groups()
        assert [float(x) for x in printed] == pytest.approx(
            [bounds["ci95_low"], bounds["ci95_high"]], rel=1e-4)
    assert cli.fit(off)["uncertainty"] == {"available": False,
                                           "reason": "fit.uncertainty=false"}
    assert "95 % interval" not in capsys.readouterr().out


def test_noise_free_fit_is_reported_at_rounding_level(tmp_path, capsys):
    """Noise-free data fitted to their float32 precision: σ from the residual is rounding, so
    the output says so instead of flagging every parameter as short of its optimum; a noise
    level of the data's 1 % is not rounding."""
    from hydra import compose, initialize_config_dir

    from pdefit.app import cli
    from pdefit.fitting import assemble

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="fit", overrides=[
            f"run.dir={tmp_path}", "system.grid.shape=[16,16]", "+system.options.initial=blobs",
            "simulate.n_frames=4", "simulate.steps_per_frame=10", "run.progress=false",
            "run.plots=false", "optim=levenberg_marquardt", "optim.steps=12",
            "fit.params=[k,a]", "precision=float32"])
    summary = cli.fit(cfg)
    block = summary["uncertainty"]
    assert block["sigma_source"] == "residual" and block["residual_at_roundoff"]
    assert block["note"] == ROUNDOFF_NOTE and ROUNDOFF_NOTE in capsys.readouterr().out
    assert not any(NOT_CONVERGED in r["flag"] for r in block["parameters"].values())
    setup = assemble.build_fit(cfg, tmp_path / "data.zarr", assemble.set_precision("float32"))
    scale = data_rms(setup.batch)
    assert 0.1 < scale < 10
    assert at_roundoff(block["sigma"], setup.batch) and not at_roundoff(0.01 * scale, setup.batch)
