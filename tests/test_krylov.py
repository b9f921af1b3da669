"""Matrix-free Levenberg–Marquardt over parameters and initial fields (pdefit.fitting.krylov)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ap_problem, dense_gauss_newton, voltage_only_setup, weighted_frame_residuals
from jax.flatten_util import ravel_pytree

from pdefit.adjoint import Revolve
from pdefit.fitting import krylov, marginal, signal, uncertainty
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.problem import Regularization
from pdefit.fitting.train import run_fit
from pdefit.options import OptimConfig


def _dense_gauss_newton(problem, theta, batch):
    """(G, g) over all of θ from the dense Jacobian of the weighted residuals."""
    unravel = ravel_pytree(theta)[1]

    def residuals(f):
        return jnp.concatenate(weighted_frame_residuals(
            batch, krylov.predictions(problem, unravel(f), batch)))

    return dense_gauss_newton(problem, theta, batch, residuals)[:2]


def _fields_problem():
    problem, batch, _, theta = ap_problem(shape=(6, 6), n_steps=20, every=5,
                                          fit_fields=("u", "v"), observe=("u",))
    problem = dataclasses.replace(problem, regularization=Regularization(
        params=1e-3, field_background=0.02, field_smoothness=0.01))
    batch = batch._replace(background={"u": 0.9 * theta["fields"]["u"],
                                       "v": theta["fields"]["v"]})
    return problem, batch, theta


def test_matrix_free_product_equals_the_dense_gauss_newton_matrix():
    """G·v from one tangent sweep and one adjoint equals JᵀWJ·v of the dense Jacobian (with
    the penalties' and the field prior's Hessian), and the loss gradient equals Jᵀr."""
    problem, batch, theta = _fields_problem()
    flat, unravel = ravel_pytree(theta)
    matrix, gradient = _dense_gauss_newton(problem, theta, batch)
    g = ravel_pytree(jax.grad(problem.loss)(theta, batch))[0]
    np.testing.assert_allclose(g, gradient, rtol=1e-10, atol=1e-14)
    for seed in range(3):
        v = jax.random.normal(jax.random.key(seed), flat.shape, flat.dtype)
        product = krylov.gauss_newton_product(problem, theta, batch, unravel(v))
        np.testing.assert_allclose(ravel_pytree(product)[0], matrix @ v, rtol=1e-10,
                                   atol=1e-12 * np.abs(matrix @ v).max())
    # The scaling: the parameters' diagonal exact, each field's a Hutchinson estimate.
    diagonal = krylov.MatrixFree(problem).diagonal(theta, batch, jax.random.key(1))
    k = len(problem.layout.fitted)
    np.testing.assert_allclose(ravel_pytree(diagonal["params"])[0], np.diag(matrix)[-k:],
                               rtol=1e-10)
    for i, name in enumerate(("u", "v")):
        exact = np.mean(np.diag(matrix)[36 * i:36 * (i + 1)])
        assert float(diagonal["fields"][name][0, 0, 0]) == pytest.approx(exact, rel=0.5)
    # The parameters' block of the preconditioner is G's, and the solve it preconditions
    # still reaches the dense Levenberg–Marquardt step (G + λD)δ = −g.
    diagonal, block = krylov.MatrixFree(problem).scaling_and_block(theta, batch,
                                                                    jax.random.key(1))
    np.testing.assert_allclose(block.matrix, matrix[-k:, -k:], rtol=1e-10)
    d = ravel_pytree(diagonal)[0]
    dense = np.linalg.solve(matrix + 0.01 * np.diag(d), -g)
    delta, _ = krylov.damped_solve(
        lambda v: krylov.gauss_newton_product(problem, theta, batch, v),
        jax.tree.map(jnp.asarray, unravel(g)), diagonal, jnp.asarray(0.01), 300, 1e-13, block)
    np.testing.assert_allclose(ravel_pytree(delta)[0], dense, rtol=1e-6,
                               atol=1e-8 * np.abs(dense).max())


def test_the_parameter_block_resolves_correlated_parameters_in_few_iterations():
    """G = JᵀJ of 50 field values (J's columns independent) and six parameters of very
    different scales whose columns are nearly parallel (their block badly conditioned):
    preconditioned by the parameters' whole block, 8 conjugate-gradient iterations reach the
    damped step's parameters to 0.1 %; by the diagonal alone they stay more than 1 % off.
    Both reach it given enough iterations."""
    rng = np.random.default_rng(3)
    fields_columns = rng.normal(size=(200, 50)) / np.sqrt(200)
    shared = rng.normal(size=(200, 1))
    params_columns = (shared + 1e-2 * rng.normal(size=(200, 6))) * 10.0 ** rng.uniform(-2, 2, 6)
    jacobian = np.hstack([fields_columns, params_columns])
    matrix = jacobian.T @ jacobian
    params_block = matrix[50:, 50:]
    assert np.linalg.cond(params_block / np.sqrt(np.outer(np.diag(params_block),
                                                          np.diag(params_block)))) > 1e3
    gradient = rng.normal(size=56)
    diagonal = {"fields": {"x": jnp.ones(50)}, "params": {"p": jnp.asarray(
        np.diag(params_block))}}
    damping = 1e-3
    d = ravel_pytree(diagonal)[0]
    dense = np.linalg.solve(matrix + damping * np.diag(d), -gradient)
    unravel = ravel_pytree(diagonal)[1]
    block = krylov.ParameterBlock(np.arange(6), jnp.asarray(params_block))

    def solve(iterations, with_block):
        delta, _ = krylov.damped_solve(
            lambda v: unravel(jnp.asarray(matrix) @ ravel_pytree(v)[0]),
            unravel(jnp.asarray(gradient)), diagonal, jnp.asarray(damping), iterations, 1e-14,
            block if with_block else None)
        return np.asarray(ravel_pytree(delta)[0])

    def params_error(x):
        return np.linalg.norm(x[50:] - dense[50:]) / np.linalg.norm(dense[50:])

    # Measured: 4e-5 against 6.6e-2 after 8 iterations, 1e-7 against 2.6e-3 after 16.
    assert params_error(solve(8, True)) < 1e-3
    assert params_error(solve(8, False)) > 1e-2
    assert params_error(solve(200, False)) < 1e-6


def test_matrix_free_solve_equals_dense_levenberg_marquardt_on_scalars():
    """On a scalar problem the conjugate-gradient solve of (G + λD)δ = −g reaches the dense
    Levenberg–Marquardt step, D the diagonal of the dense curvature."""
    problem, batch, _, theta = ap_problem(shape=(8, 8), n_steps=12)
    _, grad, matrix = gauss_newton(problem)(theta, batch)
    mf = krylov.MatrixFree(problem)
    diagonal = mf.diagonal(theta, batch, jax.random.key(0))
    np.testing.assert_allclose(ravel_pytree(diagonal["params"])[0], np.diag(matrix),
                               rtol=1e-10)
    damping = 0.01
    delta, iterations = krylov.damped_solve(lambda v: mf.product(theta, batch, v), grad,
                                            diagonal, jnp.asarray(damping), 50, 1e-12)
    assert 1 <= int(iterations) <= 50
    g = ravel_pytree(grad["params"])[0]
    dense = np.linalg.solve(matrix + damping * np.diag(np.diag(matrix)), -g)
    np.testing.assert_allclose(ravel_pytree(delta["params"])[0], dense, rtol=1e-7)


def test_fitted_fields_take_the_matrix_free_path():
    problem, *_ = ap_problem(fit_fields=("v",))
    assert isinstance(krylov.curvature_for(problem), krylov.MatrixFree)
    with pytest.raises(ValueError, match="scalar parameters only"):
        gauss_newton(problem)


def _voltage_only_fit(sigma, n_steps, shape, fitted, steps, noise_seed=1, **optim):
    """A u-only AP fit of u(0), v(0) and ``fitted`` with matrix-free Levenberg–Marquardt,
    v(0) from the system's first guess, a weak background prior: (problem, batch, truth,
    history)."""
    problem, batch, truth, start = ap_problem(
        shape=shape, n_steps=n_steps, every=10, fit_fields=("u", "v"), observe=("u",),
        noise=sigma, schedule=Revolve(8), fitted=fitted, noise_seed=noise_seed)
    u0 = batch.observed.values["u"][:, 0]
    params = problem.physical_params(start)
    start = {**start, "fields": {"u": u0, **problem.system.initial_guess({"u": u0}, params)}}
    n_frames = n_steps // 10 + 1
    problem = dataclasses.replace(problem, regularization=Regularization(
        field_background=sigma**2 / (n_frames * 0.3**2)))
    batch = batch._replace(background=dict(start["fields"]))
    _, history = run_fit(problem.loss, start, batch, OptimConfig(
        name="levenberg_marquardt", steps=steps, clip=None, grad_tol=1e-10,
        krylov_iterations=40, initial_damping=1.0, **optim), progress=False, log=lambda _: None,
        curvature=krylov.curvature_for(problem), layout=problem.layout)
    return problem, batch, truth, history


def test_voltage_only_noisy_aliev_panfilov_recovers_parameters_and_hidden_recovery():
    """u observed alone with noise σ = 0.01; u(0) and the unobserved v(0) fitted with k, a,
    μ1 from a start 30 % off, v(0) from the system's first guess: the parameters within a
    few per cent, v(0) within 15 % where the tissue is excited, and the misfit at the noise
    level (reduced χ² ≈ 1)."""
    sigma = 0.01
    problem, _, truth, history = _voltage_only_fit(sigma, 400, (16, 16), ("k", "a", "mu1"), 40)
    fitted = problem.layout.physical(history.best_theta["params"])
    true = problem.layout.physical(truth["params"])
    for name, tolerance in (("k", 0.03), ("a", 0.03), ("mu1", 0.08)):
        assert float(fitted[name]) == pytest.approx(float(true[name]), rel=tolerance), name
    excited = truth["fields"]["u"] > 0.05
    error = (history.best_theta["fields"]["v"] - truth["fields"]["v"]) * excited
    assert float(jnp.linalg.norm(error) / jnp.linalg.norm(truth["fields"]["v"] * excited)) < 0.15
    assert 0.8 < history.best_loss / sigma**2 < 1.3


def test_intervals_with_fitted_fields_are_the_dense_schur_complement():
    """With fitted u(0) and v(0) the parameters' standard errors are a σ² S⁻¹ of the Schur
    complement S = B_pp − B_px B_xx⁻¹ B_xp, the field block solved by conjugate gradients:
    equal to the dense computation, and wider than the intervals that hold the fields."""
    problem, batch, theta = _fields_problem()
    problem = dataclasses.replace(problem, regularization=Regularization(field_background=0.02))
    sigma = 0.01
    estimate = uncertainty.estimate(problem, theta, batch, sigma)
    assert estimate["available"], estimate
    matrix, _ = _dense_gauss_newton(problem, theta, batch)
    k = len(problem.layout.fitted)
    bread = 0.5 * matrix  # params last in ravel order ("fields" < "params")
    pp, px, xx = bread[-k:, -k:], bread[-k:, :-k], bread[:-k, :-k]
    schur = pp - px @ np.linalg.solve(xx, px.T)
    a = float(np.ravel(uncertainty.misfit_weights(problem, batch)["u"])[0])
    dense_z = np.sqrt(np.diag(a * sigma**2 * np.linalg.inv(schur)))
    held_z = np.sqrt(np.diag(a * sigma**2 * np.linalg.inv(pp)))
    flat, unravel = ravel_pytree(theta["params"])
    index = unravel(jnp.arange(flat.shape[0]))
    for name, row in estimate["parameters"].items():
        spec = problem.layout.specs[name]
        slope = float(jax.jvp(spec.to_physical, (theta["params"][name],), (1.0,))[1])
        i = int(index[name])
        assert row["std_error"] == pytest.approx(abs(slope) * dense_z[i], rel=1e-3), name
        assert dense_z[i] > held_z[i]
        # Converged solves close the bracket around the dense std error.
        low, high = row["std_error_bounds"]
        assert low == pytest.approx(row["std_error"], rel=1e-12)
        assert abs(slope) * dense_z[i] * (1 - 1e-3) <= high <= row["std_error"] * 1.01, name


def test_residual_with_fitted_fields_pairs_each_field_with_its_own_data():
    """Several observed fields named out of sorted order (v before u): the residual sum behind
    the reduced χ² compares each field's predictions with that field's data (it used to pair
    them by position, and a BOCF fit of all four fields reported χ² 3650 for 5.9)."""
    problem, batch, _, theta = ap_problem(shape=(6, 6), n_steps=20, every=5,
                                          fit_fields=("u", "v"), observe=("v", "u"))
    problem = dataclasses.replace(problem, regularization=Regularization(field_background=0.02))
    assert list(batch.observed.values) == ["v", "u"]
    estimate = uncertainty.estimate(problem, theta, batch, 0.01)
    assert estimate["available"], estimate
    predicted = krylov.predictions(problem, theta, batch)
    observed = batch.observed
    rss = sum(float(jnp.sum(observed.weights[f] * (predicted[f] - observed.values[f]) ** 2))
              for f in ("u", "v"))
    assert estimate["rss"] == pytest.approx(rss, rel=1e-12)


def test_field_solves_batched_under_vmap_equal_solves_one_at_a_time():
    """The estimate's field solves (the Schur columns with the reduced gradient, and the
    signal probes) give the same numbers run all at once, in pairs, or one after another."""
    problem, batch, theta = _fields_problem()
    problem = dataclasses.replace(problem, regularization=Regularization(field_background=0.02))
    apart = marginal.marginal_parts(problem, theta, batch, batch_size=1)
    # The reduced gradient g_p − G_px G_xx⁻¹ g_x is a difference of terms 100 × larger than
    # itself here: its rounding is that of g_p.
    gradient = ravel_pytree(jax.grad(problem.loss)(theta, batch)["params"])[0]
    for size in (None, 2):
        together = marginal.marginal_parts(problem, theta, batch, batch_size=size)
        np.testing.assert_allclose(together.schur, apart.schur, rtol=1e-9,
                                   atol=1e-12 * np.abs(apart.schur).max())
        np.testing.assert_allclose(together.reduced_gradient, apart.reduced_gradient,
                                   rtol=1e-9, atol=1e-10 * np.abs(gradient).max())
    one_by_one = signal.field_signal(problem, theta, batch, probes=4, batch_size=1)
    at_once = signal.field_signal(problem, theta, batch, probes=4)
    assert at_once["solver_iterations"] == one_by_one["solver_iterations"]
    for name, row in at_once["fields"].items():
        assert row["signal_dof"] == pytest.approx(one_by_one["fields"][name]["signal_dof"],
                                                  rel=1e-9)


def test_a_marginal_curvature_is_lost_only_where_its_solve_stopped_at_its_cap(monkeypatch):
    """With the threshold raised to the whole held-fields curvature (every S_ii is below it),
    a parameter is reported lost where its field solve stopped at its cap (1 iteration) and
    not where the solves converged: a small S_ii from a converged solve is measured; and not
    where the bracket of its std error is closed, however capped its solve."""
    problem, batch, theta = _fields_problem()
    problem = dataclasses.replace(problem, regularization=Regularization(field_background=0.02))
    monkeypatch.setattr(marginal, "RESOLVED", 1.0)
    assert marginal.marginal_parts(problem, theta, batch, iterations=500).unresolved == ()
    k = ravel_pytree(theta["params"])[0].shape[0]
    assert marginal.marginal_parts(problem, theta, batch, iterations=1).unresolved == tuple(
        range(k))
    # 4 iterations: each solve at its cap, every bracket within 0.4 % (measured), so the
    # std errors are measured to SPREAD = 10 %, not to 0.01 %.
    assert marginal.marginal_parts(problem, theta, batch, iterations=4).unresolved == ()
    monkeypatch.setattr(marginal, "SPREAD", 1e-4)
    assert marginal.marginal_parts(problem, theta, batch, iterations=4).unresolved == tuple(
        range(k))


def test_truncated_field_solves_bracket_the_dense_schur_complement():
    """However far the field solves got (1, 2, 4, 8 iterations or converged), the variational
    estimate S⁺ is positive semi-definite and above the dense Schur complement S, the bound
    S⁻ from the solves' residuals and the prior's curvature floor below it (in the
    positive semi-definite order), so the std errors they give bracket the dense ones; the
    bracket closes as the solves converge, and the reduced gradient's error is second order
    in the solves' (at 8 iterations below the first-order estimate's)."""
    problem, batch, theta = _fields_problem()
    problem = dataclasses.replace(problem, regularization=Regularization(field_background=0.02))
    matrix, gradient = map(np.asarray, _dense_gauss_newton(problem, theta, batch))
    k = len(problem.layout.fitted)
    half = 0.5 * matrix  # params last in ravel order ("fields" < "params")
    pp, px, xx = half[-k:, -k:], half[-k:, :-k], half[:-k, :-k]
    schur = pp - px @ np.linalg.solve(xx, px.T)
    reduced = 0.5 * (gradient[-k:] - px @ np.linalg.solve(xx, gradient[:-k]))
    floor = marginal.curvature_floor(problem, theta, batch)
    assert 0 < floor <= np.linalg.eigvalsh(matrix[:-k, :-k]).min()
    dense_std = np.sqrt(np.diag(np.linalg.inv(schur)))
    scale = np.abs(schur).max()
    widths = []
    for cap in (1, 2, 4, 8, 500):
        parts = marginal.marginal_parts(problem, theta, batch, iterations=cap)
        assert np.linalg.eigvalsh(parts.schur).min() >= -1e-12 * scale, cap
        assert np.linalg.eigvalsh(parts.schur - schur).min() >= -1e-10 * scale, cap
        assert np.linalg.eigvalsh(schur - parts.schur_lower).min() >= -1e-10 * scale, cap
        narrow = np.sqrt(np.diag(np.linalg.inv(parts.schur)))
        assert np.all(narrow <= dense_std * (1 + 1e-8)), cap
        low = np.linalg.eigvalsh(parts.schur_lower)
        if low.min() > 0:
            wide = np.sqrt(np.diag(np.linalg.inv(parts.schur_lower)))
            assert np.all(wide >= dense_std * (1 - 1e-8)), cap
            widths.append(float(np.max(wide / narrow)))
        else:
            widths.append(np.inf)
        if cap == 8:
            error = np.abs(0.5 * parts.reduced_gradient - reduced).max()
    assert widths[0] == np.inf or widths[0] > 1.1
    assert widths[-1] < 1 + 1e-3 and widths == sorted(widths, reverse=True), widths
    # The first-order estimate g_p − G_px x_g from the same 8-iteration solve of x_g.
    solved = marginal.solved_columns(problem, theta, batch, np.arange(k), 8)
    x_g = ravel_pytree(jax.tree.map(lambda z: z[k], solved.solutions))[0]
    first_order = 0.5 * gradient[-k:] - px @ np.asarray(x_g)
    assert error < np.abs(first_order - reduced).max()
    # What the estimate says of 2-iteration solves: intervals from S⁺, named as lower bounds.
    capped = uncertainty.estimate(problem, theta, batch, 0.01, parts=uncertainty.curvature_parts(
        problem, theta, batch, 2))
    assert set(capped["open_brackets"]) == set(capped["parameters"]), capped["open_brackets"]
    assert "are lower bounds" in capped["note"]
    assert uncertainty.estimate(problem, theta, batch, 0.01)["open_brackets"] == []


def test_a_truncated_field_solve_leaves_the_marginal_curvature_above_the_converged_one():
    """Conjugate gradients from zero approach bᵀ G_xx⁻¹ b from below, so the Schur
    complement's diagonal from capped solves is never below the converged one, and the std
    error σ √(a / S̃_ii) it gives is a lower bound however far the solves got;
    ``curvature_parts`` passes its cap on."""
    problem, batch, theta = _fields_problem()
    problem = dataclasses.replace(problem, regularization=Regularization(field_background=0.02))
    converged = np.diag(uncertainty.curvature_parts(problem, theta, batch, 500).bread)
    for cap in (1, 2, 4):
        capped = np.diag(uncertainty.curvature_parts(problem, theta, batch, cap).bread)
        assert np.all(capped >= converged * (1 - 1e-9)), (cap, capped, converged)
    assert np.any(np.diag(uncertainty.curvature_parts(problem, theta, batch, 1).bread)
                  > converged * 1.01)


def test_python_api_fits_hidden_fields_with_levenberg_marquardt():
    """``pdefit.build_problem`` on u frames in memory (noisy, v never recorded) with u(0) and
    v(0) fitted, and ``pdefit.fit(optimizer="levenberg_marquardt")``: the matrix-free path,
    k and a near the truth, intervals marginalised over the fields, a residual verdict, and
    the check that flags the background prior as narrower than v's first guess is wrong."""
    import pdefit

    setup = voltage_only_setup(200)
    assert setup.problem.fitted_fields == ("u", "v")
    result = pdefit.fit(setup, optimizer="levenberg_marquardt", steps=15, initial_damping=1.0,
                        krylov_iterations=30, discretization_check=False)
    assert result.params["k"] == pytest.approx(8.0, rel=0.01)
    assert result.params["a"] == pytest.approx(0.15, rel=0.01)
    assert result.uncertainty["available"], result.uncertainty
    assert set(result.uncertainty["parameters"]) == {"k", "a"}
    assert result.residual["verdict"] in ("estimated", "noise")
    assert set(result.fields) == {"u", "v"}
    # v's first guess (its nullcline where u is excited) is 1.27 (rms) off the truth, about
    # 6 × the σ_b = 0.22 of the background weight 1e-4: flagged, with the weight that fits it.
    check = result.uncertainty["field_background"]
    assert check["narrow"] == ["v"]
    assert check["fields"]["v"]["ratio"] > 4 and check["fields"]["u"]["ratio"] < 0.1
    assert 1e-6 < check["matching_weight"] < 1e-5


def test_fields_alone_are_fitted_by_matrix_free_steps():
    """No parameter fitted, only the unobserved v(0) (noise-free): the misfit falls by orders
    of magnitude and v(0) approaches the truth where u is excited."""
    problem, batch, truth, start = ap_problem(shape=(8, 8), n_steps=40, every=5, fitted=(),
                                              fit_fields=("v",), observe=("u",))
    _, history = run_fit(problem.loss, start, batch, OptimConfig(
        name="levenberg_marquardt", steps=20, clip=None, grad_tol=0.0, krylov_iterations=20,
        initial_damping=1.0), progress=False, log=lambda _: None,
        curvature=krylov.curvature_for(problem), layout=problem.layout)
    assert history.best_loss < 1e-3 * history.records[0]["loss"]
    excited = batch.initial["u"] > 0.2
    error = (history.best_theta["fields"]["v"] - truth["fields"]["v"]) * excited
    before = (start["fields"]["v"] - truth["fields"]["v"]) * excited
    assert float(jnp.linalg.norm(error)) < 0.1 * float(jnp.linalg.norm(before))


def test_a_fit_of_initial_fields_alone_has_a_residual_verdict():
    """No parameter fitted, so no intervals, but the residual is still set against the
    recorded noise: u(0) and v(0) fitted to noisy u (σ = 0.01) end at the noise (reduced χ²
    ≈ 1, verdict ``noise``); against a recorded σ ten times smaller the verdict is
    ``above_noise``."""
    from pdefit.fitting import outcome

    sigma = 0.01
    problem, batch, truth, start = ap_problem(shape=(8, 8), n_steps=40, every=5, fitted=(),
                                              fit_fields=("u", "v"), observe=("u",),
                                              noise=sigma)
    start = {**start, "fields": {"u": batch.observed.values["u"][:, 0],
                                 "v": truth["fields"]["v"] * 1.2}}
    _, history = run_fit(problem.loss, start, batch, OptimConfig(
        name="levenberg_marquardt", steps=20, clip=None, grad_tol=0.0, krylov_iterations=40,
        initial_damping=1.0), progress=False, log=lambda _: None,
        curvature=krylov.curvature_for(problem), layout=problem.layout)
    block, _ = outcome.intervals(problem, history.best_theta, batch,
                                 {"kind": "additive", "sigma": sigma}, log=lambda _: None)
    assert not block["available"] and block["reason"] == "no fitted parameter"
    assert block["residual"]["n_values"] == 9 * 64 - 64  # the fitted u(0) fits its own frame
    verdict = outcome.residual_verdict(block)
    assert verdict["verdict"] == "noise", verdict
    assert 0.7 < verdict["reduced_chi2"] < 1.3
    small, _ = outcome.intervals(problem, history.best_theta, batch,
                                 {"kind": "additive", "sigma": sigma / 10}, log=lambda _: None)
    assert outcome.residual_verdict(small)["verdict"] == "above_noise"


def test_a_known_initial_field_copied_from_the_noisy_frame_is_left_out_of_n():
    """v(0) fitted alone, u(0) known and read from the noisy first frame: those values fit
    their own data exactly, so the residual statistics leave them out of N."""
    from pdefit.fitting import outcome

    problem, batch, truth, _ = ap_problem(shape=(8, 8), n_steps=40, every=5, fitted=(),
                                              fit_fields=("v",), observe=("u",), noise=0.01)
    batch = batch._replace(initial={"u": batch.observed.values["u"][:, 0]})
    block, _ = outcome.intervals(problem, truth, batch, {"kind": "additive", "sigma": 0.01},
                                 log=lambda _: None)
    assert block["residual"]["copied_initial_values"] == 64
    assert block["residual"]["n_values"] == 9 * 64 - 64


def test_a_held_entry_does_not_end_the_solve():
    """A held parameter has a zero gradient entry and a zero row and column of the masked
    product (so its residual stays exactly zero); the solve must still run to the
    Levenberg–Marquardt step over the free entries, not stop after one iteration
    (lineax's entrywise test with atol = 0 was 0/0 there)."""
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(6, 6))
    free = np.array([0, 1, 1, 0, 1, 1], float)
    matrix = free[:, None] * (basis @ basis.T + 0.1 * np.eye(6)) * free[None, :]
    gradient = rng.normal(size=6) * free
    diagonal = np.where(free > 0, np.diag(matrix), 1.0)
    damping = 0.01
    delta, iterations = krylov.damped_solve(
        lambda v: {"x": jnp.asarray(matrix) @ v["x"]}, {"x": jnp.asarray(gradient)},
        {"x": jnp.asarray(diagonal)}, jnp.asarray(damping), 50, 1e-10)
    assert int(iterations) > 1
    kept = free > 0
    dense = np.zeros(6)
    dense[kept] = np.linalg.solve(matrix[np.ix_(kept, kept)]
                                  + damping * np.diag(diagonal[kept]), -gradient[kept])
    np.testing.assert_allclose(np.asarray(delta["x"]), dense, rtol=1e-8, atol=1e-14)


def test_the_reduced_step_fits_its_trust_radius_and_the_radius_follows_the_step():
    """The reduced step's λ is the smallest of the grid whose step fits the trust radius, and
    the radius after a try is set from the step's length: a radius larger than the undamped
    step shrinks to a quarter of that step after a rejection, not of itself, and grows only
    when it limited a good step."""
    from pdefit.fitting import reduced_steps

    rng = np.random.default_rng(3)
    basis = np.linalg.qr(rng.normal(size=(4, 4)))[0]
    schur = basis @ np.diag([4.0, 1.0, 1e-2, 1e-4]) @ basis.T  # small eigenvalues: long steps
    parts = reduced_steps.ReducedParts(np.arange(4), jnp.asarray(schur),
                                       jnp.asarray(rng.normal(size=4)), None, jnp.asarray(0))
    grid = np.asarray(reduced_steps.DAMPING_GRID)
    for radius in (1e-3, 0.1, 3.0):
        damping = float(parts.damping_within(jnp.asarray(radius)))
        assert float(parts.step_length(damping)) <= radius
        smaller = grid[np.searchsorted(grid, damping) - 1]
        assert float(parts.step_length(smaller)) > radius
        # δp = −(S + λ diag S)⁻¹ r, the step the length measures
        dense = -np.linalg.solve(schur + damping * np.diag(np.diag(schur)),
                                 np.asarray(parts.reduced_gradient))
        np.testing.assert_allclose(float(parts.step_length(damping)), np.linalg.norm(dense),
                                   rtol=1e-6)

    def after(radius, length, limited, accepted, ratio):
        return float(reduced_steps.next_radius(*map(jnp.asarray, (radius, length, limited,
                                                                  accepted, ratio))))

    assert after(10.0, 0.2, False, False, 0.0) == pytest.approx(0.05)  # the step's quarter
    assert after(0.1, 0.08, True, False, 0.0) == pytest.approx(0.02)
    assert after(0.1, 0.08, True, True, 0.1) == pytest.approx(0.02)    # poor: shrinks too
    assert after(0.1, 0.08, True, True, 0.5) == pytest.approx(0.1)     # fair: kept
    assert after(0.1, 0.08, True, True, 0.9) == pytest.approx(0.16)    # good, limited: grows
    assert after(10.0, 0.2, False, True, 0.9) == pytest.approx(10.0)   # not limited: kept


def test_the_reduced_step_is_the_gauss_newton_step_with_the_fields_eliminated():
    """optim.parameter_step=reduced: its step (δp, δx) solves the Gauss–Newton system with the
    parameters' block damped by λ diag S (S the Schur complement of the fields) — checked
    against the dense Jacobian's G — and the update it makes lowers the loss each step and
    moves the parameters towards the truth on a small voltage-only problem."""
    from pdefit.fitting import reduced_steps

    problem, batch, theta = _fields_problem()
    matrix, gradient = map(np.asarray, _dense_gauss_newton(problem, theta, batch))
    k = len(problem.layout.fitted)
    n = matrix.shape[0] - k
    parts = reduced_steps.reduced_parts(problem, theta, batch, np.arange(k), 300)
    g_xx, g_xp = matrix[:n, :n], matrix[:n, n:]
    schur = matrix[n:, n:] - g_xp.T @ np.linalg.solve(g_xx, g_xp)
    # The field solves stop at marginal.RTOL = 1e-4 of their right-hand sides.
    np.testing.assert_allclose(parts.schur, schur, rtol=1e-4, atol=1e-6 * np.abs(schur).max())
    damping = 0.1
    stepped, predicted = parts.step(theta, jnp.asarray(damping))
    damped = np.array(matrix)
    damped[n:, n:] += damping * np.diag(np.diag(schur))
    dense = np.linalg.solve(damped, -gradient)
    delta = ravel_pytree(stepped)[0] - ravel_pytree(theta)[0]
    np.testing.assert_allclose(delta, dense, rtol=1e-4, atol=1e-6 * np.abs(dense).max())
    assert float(predicted) > 0

    # The update itself (u and v observed with noise, both initial fields fitted from the
    # noisy first frame, k and a from a start 25 % and 16 % off): the loss never rises and
    # four reduced steps end nearer the truth than four joint ones (measured: 1.5 % against
    # 4.0 % for the larger error of the two, at a lower loss).
    ends = {step: _all_fields_fit(step) for step in ("reduced", "joint")}
    (errors, losses), (joint_errors, joint_losses) = ends["reduced"], ends["joint"]
    assert all(b <= a for a, b in itertools.pairwise(losses))
    assert len(losses) == len(joint_losses)  # optim.reduced_steps, not optim.steps=40
    assert max(errors) < 0.5 * max(joint_errors)
    assert min(losses) <= min(joint_losses)


def _all_fields_fit(parameter_step):
    """Four Levenberg–Marquardt steps of k, a, u(0), v(0) on 8² Aliev–Panfilov data of u and
    v (σ = 0.01, 11 frames), the fields from the noisy first frame: (|error| of k and a,
    the losses)."""
    sigma = 0.01
    problem, batch, truth, start = ap_problem(
        shape=(8, 8), n_steps=100, every=10, fit_fields=("u", "v"), observe=("u", "v"),
        noise=sigma, schedule=Revolve(8), fitted=("k", "a"), noise_seed=1)
    start = {**start, "fields": {f: batch.observed.values[f][:, 0] for f in ("u", "v")}}
    problem = dataclasses.replace(problem, regularization=Regularization(
        field_background=sigma**2 / (11 * 0.3**2)))
    batch = batch._replace(background=dict(start["fields"]))
    _, history = run_fit(problem.loss, start, batch, OptimConfig(
        # optim.reduced_steps caps the reduced fit at the joint fit's 4 steps.
        name="levenberg_marquardt", steps=4 if parameter_step == "joint" else 40,
        reduced_steps=4, clip=None, grad_tol=1e-10, krylov_iterations=20,
        initial_damping=1.0, parameter_step=parameter_step, reduced_field_steps=3,
        reduced_solve_iterations=60, reduced_tries=2), progress=False, log=lambda _: None,
        curvature=krylov.curvature_for(problem), layout=problem.layout)
    fitted = problem.layout.physical(history.best_theta["params"])
    true = problem.layout.physical(truth["params"])
    return ([abs(float(fitted[n]) / float(true[n]) - 1) for n in ("k", "a")],
            history.losses)


def test_the_probed_cell_diagonal_is_exact_for_a_local_operator():
    """An operator that couples each cell with its neighbours (a 5-point stencil of cell-wise
    coefficients) and two fields at the same cell: the lattice probes of
    marginal.cell_diagonal see no other cell of their lattice, so the diagonal is exact, for
    any number of probes run together, on a grid the lattice does not divide."""
    rng = np.random.default_rng(3)
    shape = (2, 11, 9)
    weight = {f: jnp.asarray(rng.uniform(1e-2, 1.0, shape) ** 2) for f in ("u", "v")}

    def product(x):
        def stencil(z, c):
            padded = jnp.pad(z, ((0, 0), (1, 1), (1, 1)))
            neighbours = (padded[:, :-2, 1:-1] + padded[:, 2:, 1:-1] + padded[:, 1:-1, :-2]
                          + padded[:, 1:-1, 2:])
            return c * z + 0.1 * neighbours
        return {"u": stencil(x["u"], weight["u"]) + 0.3 * x["v"],
                "v": stencil(x["v"], weight["v"]) + 0.3 * x["u"]}

    fields = {f: jnp.zeros(shape) for f in ("u", "v")}
    for size in (1, 5, 64):
        diagonal = marginal.cell_diagonal(product, fields, jax.random.key(0), size)
        for f in fields:
            np.testing.assert_allclose(diagonal[f], weight[f], rtol=1e-12)
    # A lower bound per field (the prior's curvature, marginal.field_floors) raises only the
    # entries below it.
    floored = marginal.cell_diagonal(product, fields, jax.random.key(0), 5,
                                     floors={"u": 0.25})
    np.testing.assert_allclose(floored["u"], np.maximum(weight["u"], 0.25), rtol=1e-12)
    np.testing.assert_allclose(floored["v"], weight["v"], rtol=1e-12)
    assert float(jnp.min(weight["u"])) < 0.25


def test_the_probed_diagonal_is_never_below_the_fields_prior_curvature():
    """Voltage-only BOCF (32², 5 ms): a true diagonal entry of the field block is at least its
    field's prior curvature (marginal.field_floors). A lattice of every 2nd cell, whose
    probes' crosstalk leaves some cells far below it, is floored there; the lattice
    field_block probes on leaves no cell below it either."""
    setup = _bocf_voltage_setup()
    problem, batch, theta = setup.problem, setup.batch, setup.theta0
    floors = marginal.field_floors(problem, theta, batch)
    assert min(floors.values()) == marginal.curvature_floor(problem, theta, batch) > 0
    fields_only, cells = marginal.field_block(problem, theta, batch)
    size = marginal.probe_count(theta["fields"], 2)
    raw = marginal.cell_diagonal(fields_only, theta["fields"], jax.random.key(0), size,
                                 spacing=2)
    floored = marginal.cell_diagonal(fields_only, theta["fields"], jax.random.key(0), size,
                                     spacing=2, floors=floors)
    assert any(bool(jnp.any(raw[f] < floors[f])) for f in raw), "no crosstalk to floor here"
    for f in raw:
        np.testing.assert_allclose(floored[f], jnp.maximum(raw[f], floors[f]), rtol=1e-6)
        assert float(jnp.min(cells[f])) >= floors[f] * (1 - 1e-6), f


def test_field_solves_preconditioned_cell_by_cell_converge_where_one_number_per_field_does_not():
    """Voltage-only BOCF (u observed, the gates hidden and fitted): the data see a gate's
    cells by decades more or less, so the Schur complement's field solves preconditioned by
    the probed diagonal (marginal.field_block) reach their tolerance (measured: in 93
    iterations) where one number per field (the fit's step scaling) stops short at 150."""
    setup = _bocf_voltage_setup()
    problem, batch, theta = setup.problem, setup.batch, setup.theta0
    fields_only, cells = marginal.field_block(problem, theta, batch)
    per_field = krylov.MatrixFree(problem).diagonal(theta, batch, jax.random.key(0),
                                                   np.arange(0))["fields"]
    spread = {f: float(jnp.max(d) / jnp.min(d)) for f, d in cells.items()}
    assert max(spread.values()) > 1e3, spread
    zero = jax.tree.map(jnp.zeros_like, theta)
    flat, unravel = ravel_pytree(theta["params"])
    column = krylov.gauss_newton_product(problem, theta, batch, {**zero, "params": unravel(
        jnp.zeros_like(flat).at[0].set(1.0))})["fields"]
    steps = {name: int(marginal.field_solution(fields_only, column, scale, 150).stats[
        "num_steps"]) for name, scale in (("cells", cells), ("per field", per_field))}
    assert steps["cells"] <= 115 and steps["per field"] >= 150, steps


def _bocf_voltage_setup():
    """BOCF TNNP on 32², waves from random stimuli, u recorded every 0.5 ms for 5 ms with σ = 0.02
    (Heun at 0.5/14 ms); the ten parameters of bocf_from_voltage at the truth, u(0) and the
    gates fitted from BOCF's first guess under the experiment's background prior."""
    import tempfile

    import pdefit
    from pdefit.numerics.grid import Grid

    system = pdefit.get_system("bocf", initial="stimuli", laplacian="9pt")
    dt, truth = 0.5 / 14, {"D": 0.1}
    with tempfile.TemporaryDirectory() as where:
        data = pdefit.simulate_dataset(system, Path(where) / "u.zarr",
                                       grid=Grid((32, 32), (1.0, 1.0)), dt=dt, n_frames=11,
                                       steps_per_frame=14, params=truth, noise_sigma=0.02,
                                       integrator="heun", fields=["u"], precision="float64")
        names = ["u_s", "u_so", "k_so", "tau_so1", "tau_si", "k_s", "u_u", "theta_v", "D",
                 "tau_fi"]
        return pdefit.build_problem(
            system, data, fit=names, start=data.meta.true_params, params=truth,
            initial_fields=dict.fromkeys(("u", "v", "w", "s"), "fit"),
            regularization={"field_background": 0.02**2 / (11 * 0.09)}, precision="float64")
