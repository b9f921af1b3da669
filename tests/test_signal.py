"""How much of each fitted initial field the data determine (pdefit.fitting.signal): the trace
of the averaging kernel A = G_xx⁻¹ D_xx against the dense matrices, and its use in the residual
verdict's degrees of freedom."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ap_problem, dense_gauss_newton, weighted_frame_residuals
from jax.flatten_util import ravel_pytree

from pdefit.fitting import krylov, marginal, outcome, signal
from pdefit.fitting.problem import Regularization
from pdefit.fitting.shooting import Shooting

PER_VALUE = 1e-4  # the solves' relative tolerance (pdefit.fitting.marginal.RTOL)


def _problem(shape, background, fitted=("k", "a")):
    """u observed, u(0) and v(0) fitted under a background prior of weight ``background``
    centred on the truth (so the fields' optimum is near it)."""
    problem, batch, _, theta = ap_problem(shape=shape, n_steps=40, every=5, fitted=fitted,
                                          fit_fields=("u", "v"), observe=("u",), noise=0.01)
    problem = dataclasses.replace(problem, regularization=Regularization(
        field_background=background))
    return problem, batch._replace(background=dict(theta["fields"])), theta


def _dense_kernel_traces(problem, batch, theta):
    """tr A over u's and v's cells from the dense Jacobian (fields first in ravel order)."""
    unravel = ravel_pytree(theta)[1]

    def residuals(flat):
        return jnp.concatenate(weighted_frame_residuals(
            batch, krylov.predictions(problem, unravel(flat), batch)))

    matrix = dense_gauss_newton(problem, theta, batch, residuals)[0]
    jacobian = jax.jacfwd(residuals)(ravel_pytree(theta)[0])
    n = sum(int(np.prod(x.shape)) for x in theta["fields"].values())
    kernel = np.linalg.solve(matrix[:n, :n], 2 * (jacobian.T @ jacobian)[:n, :n])
    half = n // 2
    return np.trace(kernel[:half, :half]), np.trace(kernel[half:, half:])


@pytest.mark.parametrize("background", [1e-4, 1e-2])
def test_unit_probes_give_the_dense_averaging_kernel_trace(background):
    """Fields of 2 × 36 values, with k and a fitted too (held at their values: the kernel is
    the fields' block): with as many probes as values the trace is exact per field, to the
    conjugate-gradient solves' relative tolerance per value."""
    problem, batch, theta = _problem((6, 6), background)
    result = signal.field_signal(problem, theta, batch, probes=72, iterations=200)
    u, v = _dense_kernel_traces(problem, batch, theta)
    assert result["exact"] and result["probes"] == 72
    assert result["fields"]["u"]["signal_dof"] == pytest.approx(u, abs=PER_VALUE * 36)
    assert result["fields"]["v"]["signal_dof"] == pytest.approx(v, abs=PER_VALUE * 36)
    assert result["signal_dof"] == pytest.approx(u + v, abs=PER_VALUE * 72)
    assert result["fields"]["u"]["determined_fraction"] == pytest.approx(u / 36, abs=PER_VALUE)


def test_random_probes_estimate_the_trace_within_their_standard_error():
    """Eight ±1 probes on 2 × 64 values: each field's estimate within four of its standard
    errors of the dense trace, and the same seed gives the same estimate."""
    problem, batch, theta = _problem((8, 8), 1e-3, fitted=())
    result = signal.field_signal(problem, theta, batch, probes=8, seed=3)
    assert not result["exact"] and result["probes"] == 8
    for name, dense in zip(("u", "v"), _dense_kernel_traces(problem, batch, theta),
                           strict=True):
        row = result["fields"][name]
        assert 0 < row["standard_error"] < 0.2 * dense
        assert abs(row["signal_dof"] - dense) < 4 * row["standard_error"], (name, row, dense)
    again = signal.field_signal(problem, theta, batch, probes=8, seed=3)
    assert again["signal_dof"] == result["signal_dof"]
    assert result["solves_at_cap"] == 0 and len(result["solver_iterations"]) == 8
    # Solves cut short leave out the weakest directions: the trace is then too large, and
    # the lines say it is an upper bound.
    short = signal.field_signal(problem, theta, batch, probes=8, seed=3, iterations=2)
    assert short["solves_at_cap"] == 8
    assert short["signal_dof"] > result["signal_dof"]
    assert "for signal; an upper bound, 8 of 8 conjugate-gradient solves stopped at their " \
        "cap)" in signal.format_signal(short)[0]


def test_an_estimate_beyond_the_fields_size_is_reported_as_all_of_it(monkeypatch):
    """tr A over a field lies in [0, its number of values]; two probes and solves cut at 5
    iterations, preconditioned by one number per field (as the solves were before their
    cells' diagonal), put u's estimate above its 64 (a 512² BOCF fit printed 2.622e+05 of
    its 262144 values): the degrees of freedom are then the bound, the line says "all" and
    the estimate is kept."""
    problem, batch, theta = _problem((8, 8), 1e-5, fitted=())

    def one_number_per_field(problem, theta, batch, key=None):  # the fit's field scaling
        product = field_block(problem, theta, batch, key)[0]
        scale = krylov.MatrixFree(problem).diagonal(theta, batch, key, np.arange(0))
        return product, scale["fields"]

    field_block = marginal.field_block
    monkeypatch.setattr(marginal, "field_block", one_number_per_field)
    result = signal.field_signal(problem, theta, batch, probes=2, seed=1, iterations=5)
    u = result["fields"]["u"]
    assert u["estimate"] > 64 and u["signal_dof"] == 64 and u["determined_fraction"] == 1
    assert result["signal_dof"] == 64 + result["fields"]["v"]["signal_dof"]
    excess = f"{u['estimate'] - 64:.2g}"
    assert signal.format_signal(result)[0].startswith(
        "u at t = 0: the data determine all of its 64 values (degrees of freedom for signal: "
        f"the estimate is {excess} above their number ± ")


def test_the_prior_takes_over_what_the_data_do_not_see():
    """Observed u(0) is determined by its own frame (most of it, whatever the prior); the
    hidden v(0) less so, and a strong background takes over more of both. Without a prior
    every value follows the data (A = I)."""
    fractions = {}
    for background in (0.0, 1e-4, 1e-2):
        problem, batch, theta = _problem((6, 6), background, fitted=())
        rows = signal.field_signal(problem, theta, batch, probes=72)["fields"]
        fractions[background] = {f: rows[f]["determined_fraction"] for f in rows}
    assert fractions[0.0] == pytest.approx({"u": 1.0, "v": 1.0}, abs=1e-9)
    problem, batch, theta = _problem((6, 6), 0.0, fitted=())
    unpriored = signal.field_signal(problem, theta, batch, probes=4)
    assert not any(row["prior"] for row in unpriored["fields"].values())
    assert signal.format_signal(unpriored)[0].startswith(
        "u at t = 0: no prior, so all its 36 values are fitted to the data")
    assert fractions[1e-4]["u"] > 0.9
    assert fractions[1e-4]["v"] < fractions[1e-4]["u"]
    assert fractions[1e-2]["u"] < fractions[1e-4]["u"]
    assert fractions[1e-2]["v"] < fractions[1e-4]["v"]
    lines = signal.format_signal({"fields": {"v": {
        "values": 36, "signal_dof": 9.0, "standard_error": None, "determined_fraction": 0.25,
        "prior": True}}})
    assert lines == ["v at t = 0: the data determine 9 of its 36 values (25 %, degrees of "
                     "freedom for signal): mostly its prior and first guess"]


def test_the_residual_verdict_subtracts_the_fields_degrees_of_freedom():
    """The uncertainty block carries the fields' signal, and its dof is N − k − (tr A less
    the observed initial values already left out of N), for intervals and for a fit of
    fields alone."""
    for fitted in (("k", "a"), ()):
        problem, batch, theta = _problem((6, 6), 1e-4, fitted=fitted)
        block, _ = outcome.intervals(problem, theta, batch, {"kind": "additive", "sigma": 0.01},
                                     log=lambda _: None)
        fields = block["field_signal"]
        assert fields["probes"] == signal.PROBES and not fields["exact"]
        statistics = block if fitted else block["residual"]
        extra = fields["signal_dof"] - 36  # u's first frame is already out of N
        assert statistics["n_values"] == 9 * 36 - 36
        assert statistics["dof"] == pytest.approx(9 * 36 - 36 - len(fitted) - extra)
        assert "degrees of freedom for signal" in statistics.get(
            "degrees_of_freedom_note", "degrees of freedom for signal")
        verdict = outcome.residual_verdict(block)
        assert verdict["reduced_chi2"] == pytest.approx(
            statistics["rss"] / (statistics["dof"] * 0.01**2))


def test_the_verdict_compares_the_residual_with_what_the_noise_leaves():
    """With many fitted values the noise leaves an RMS residual well below σ: the message
    names that level, so that "RMS 0.0193 exceeds σ = 0.02" does not read as a
    contradiction (measured on a 512² fit of initial fields)."""
    block = {"available": True, "rss": 0.0193**2 * 786_432, "n_values": 786_432,
             "dof": 0.0193**2 * 786_432 / (2.36 * 0.02**2), "sigma": 0.02,
             "sigma_source": "dataset"}
    verdict = outcome.residual_verdict(block)
    assert verdict["verdict"] == "above_noise"
    assert verdict["reduced_chi2"] == pytest.approx(2.36)
    expected = 0.02 * (block["dof"] / block["n_values"]) ** 0.5
    assert f"exceeds the {expected:.3g} that the recorded noise σ = 0.02 leaves" in (
        verdict["message"])
    plain = outcome.residual_verdict({**block, "dof": block["n_values"],
                                      "rss": 0.02**2 * block["n_values"]})
    assert plain["verdict"] == "noise"
    assert plain["message"].startswith("RMS residual 0.02 is the recorded noise σ = 0.02 ")


def test_multiple_shooting_and_parameter_only_fits_carry_no_field_signal():
    problem, batch, theta, _ = ap_problem(shape=(6, 6), n_steps=20, every=5)
    assert not problem.fitted_fields and not signal.available(problem)
    block, _ = outcome.intervals(problem, theta, batch, {"kind": "additive", "sigma": 0.01},
                                 log=lambda _: None)
    assert block["available"] and "field_signal" not in block
    fields, _, _ = _problem((6, 6), 1e-4)
    assert signal.available(fields)
    assert not signal.available(dataclasses.replace(fields, shooting=Shooting(2)))
