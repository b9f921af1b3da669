"""Gauss–Newton curvature by forward tangents, and Levenberg–Marquardt fits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from pdefit.adjoint import Revolve
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.train import run_fit
from pdefit.options import OptimConfig
from tests.helpers import ap_problem


def test_curvature_is_the_hessian_at_a_zero_residual_and_the_gradient_is_exact():
    """At the truth (noise-free data) the residual vanishes, so the Gauss–Newton matrix equals
    the loss's Hessian exactly; anywhere, the gradient equals reverse-mode's."""
    problem, batch, theta_true, theta_start = ap_problem(n_exp=2)
    curvature = jax.jit(gauss_newton(problem))
    value, grad, matrix = curvature(theta_true, batch)
    flat, unravel = ravel_pytree(theta_true["params"])

    def loss_of(f):
        return problem.loss({**theta_true, "params": unravel(f)}, batch)

    hessian = np.asarray(jax.jit(jax.hessian(loss_of))(flat))
    assert float(value) == pytest.approx(float(loss_of(flat)), abs=1e-20)
    np.testing.assert_allclose(np.asarray(matrix), hessian, rtol=1e-7,
                               atol=1e-9 * np.abs(hessian).max())
    value, grad, matrix = curvature(theta_start, batch)
    reference = jax.grad(problem.loss)(theta_start, batch)
    assert float(value) == pytest.approx(float(problem.loss(theta_start, batch)), rel=1e-12)
    for name, g in reference["params"].items():
        assert float(grad["params"][name]) == pytest.approx(float(g), rel=1e-9)
    eigenvalues = np.linalg.eigvalsh(np.asarray(matrix))
    assert eigenvalues.min() > -1e-12 * eigenvalues.max()  # positive semidefinite


def test_levenberg_marquardt_recovers_parameters_in_few_steps():
    problem, batch, theta_true, theta_start = ap_problem(schedule=Revolve(4))
    _, history = run_fit(problem.loss, theta_start, batch,
                             OptimConfig(name="levenberg_marquardt", steps=30, clip=None,
                                         grad_tol=1e-9),
                             progress=False, log=lambda _: None,
                             curvature=gauss_newton(problem))
    fitted = problem.layout.physical(history.best_theta["params"])
    truth = problem.layout.physical(theta_true["params"])
    for name in problem.layout.fitted:
        assert float(fitted[name]) == pytest.approx(float(truth[name]), rel=1e-6), name
    assert len(history.records) <= 30


def test_levenberg_marquardt_step_follows_the_learning_rate_scale():
    """After a non-finite point the loop retries from its last good state with lr_scale
    reduced: Levenberg–Marquardt's step must shrink with it (else the retry repeats the
    failed step), and recover after an accepted one."""
    from pdefit.fitting.optimisers import _damping_state, init_state, make_damped_update

    problem, batch, _, theta_start = ap_problem(shape=(8, 8), n_steps=10)
    update = make_damped_update(problem.loss, gauss_newton(problem))
    steps = {}
    for scale in (1.0, 0.25):
        start = init_state(theta_start, _damping_state(), jax.numpy.float64)
        moved, _ = update(start._replace(lr_scale=jax.numpy.asarray(scale)), batch)
        steps[scale] = (ravel_pytree(moved.theta["params"])[0]
                        - ravel_pytree(theta_start["params"])[0])
        # The accepted step doubles a reduced scale back towards 1.
        assert float(moved.lr_scale) == min(1.0, 2 * scale)
    assert float(np.abs(steps[1.0]).max()) > 0
    np.testing.assert_allclose(np.asarray(steps[0.25]), 0.25 * np.asarray(steps[1.0]),
                               rtol=1e-9)


def test_levenberg_marquardt_refuses_fields():
    problem, *_ = ap_problem(fit_fields=("v",))
    with pytest.raises(ValueError, match="scalar parameters only"):
        gauss_newton(problem)


@pytest.mark.parametrize("name", ["adam", "lbfgs", "levenberg_marquardt"])
def test_held_parameters_keep_their_start_in_every_optimiser(name):
    """``hold``: the held parameters stay bit for bit at their start while the others move;
    Levenberg–Marquardt's curvature then has the free columns only, and they are the free
    block of the full one."""
    problem, batch, _, theta_start = ap_problem(shape=(8, 8), n_steps=10)
    hold = {"a", "mu1"}
    curvature = gauss_newton(problem)
    _, history = run_fit(problem.loss, theta_start, batch,
                         OptimConfig(name=name, steps=2, clip=None, lr=0.01),
                         progress=False, log=lambda _: None, curvature=curvature, hold=hold)
    for key, start in theta_start["params"].items():
        moved = float(history.best_theta["params"][key]) != float(start)
        assert moved == (key not in hold), key
    if name == "levenberg_marquardt":
        free = [i for i, key in enumerate(sorted(theta_start["params"])) if key not in hold]
        _, full_grad, full = jax.jit(curvature)(theta_start, batch)
        _, grad, matrix = jax.jit(lambda t, b: curvature(t, b, free=free))(theta_start, batch)
        assert matrix.shape == (len(free), len(free))
        np.testing.assert_allclose(np.asarray(matrix), np.asarray(full)[np.ix_(free, free)],
                                   rtol=1e-12)
        for key in theta_start["params"]:
            expected = 0.0 if key in hold else float(full_grad["params"][key])
            assert float(grad["params"][key]) == pytest.approx(expected, rel=1e-12), key
    with pytest.raises(ValueError, match=r"cannot hold \['D'\]"):
        run_fit(problem.loss, theta_start, batch, OptimConfig(name=name, steps=1),
                progress=False, log=lambda _: None, curvature=curvature, hold={"D"})
