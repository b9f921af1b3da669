"""Honest forecasts (issue 13): the evaluator says when the truth comes to rest, and the
Lyapunov estimate of a model with sharp thresholds either agrees across time steps or says that
it cannot be determined."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.analysis.activity import activity_measure, quiescent_from
from pdefit.analysis.lyapunov import lyapunov_estimate, lyapunov_exponent


def test_active_fraction_declared_or_generic_and_the_onset_of_rest():
    times = np.arange(6.0)
    assert quiescent_from(times, np.array([0.5, 0.3, 0.04, 0.0, 0.0, 0.0]), 0.05) == 2.0
    # A dip that recovers is not rest; activity at the last frame is not rest either.
    assert quiescent_from(times, np.array([0.5, 0.01, 0.3, 0.2, 0.1, 0.06]), 0.05) is None
    assert quiescent_from(times, np.array([0.5, 0.01, 0.3, 0.0, 0.1, 0.0]), 0.05) == 5.0
    assert quiescent_from(times, np.zeros(6), 0.05) == 0.0
    # Declared: BOCF's excited tissue, u > 0.5.
    from pdefit.systems.bocf import BOCF

    u = jnp.array([[0.0, 0.6], [0.9, 0.4]])
    fraction, means = activity_measure(BOCF(), "v", {"u": u})
    assert means == "u > 0.5" and float(fraction({"u": u}, {"u": u})) == 0.5
    # Generic: a point is active while the evaluated field changes by more than 1 % of its
    # first-frame range (here 2) over a frame.
    plain = SimpleNamespace(name="plain", fields=("a",))
    first = {"a": jnp.array([[0.0, 2.0], [1.0, 1.0]])}
    fraction, means = activity_measure(plain, "a", first)
    after = {"a": first["a"] + jnp.array([[0.03, 0.0], [0.01, -0.5]])}
    assert "|Δa|" in means and float(fraction(first, after)) == 0.5
    bad = SimpleNamespace(name="bad", fields=("a",), activity=("b", 0.5))
    with pytest.raises(ValueError, match="activity names field 'b'"):
        activity_measure(bad, "a", first)


def test_lyapunov_estimate_reports_spread_or_why_it_is_undetermined():
    times = np.linspace(0.0, 100.0, 501)

    def grow(rate):
        return np.minimum(1e-8 * np.exp(rate * times), 1.0)

    agree = lyapunov_estimate(times, np.stack([grow(0.2), grow(0.22), grow(0.21)], 1), 1.0)
    assert agree["exponent"] == pytest.approx(0.21) and agree["spread"] == pytest.approx(
        0.02 / 0.21)
    assert agree["lyapunov_time_min"] == pytest.approx(1 / 0.22) and agree["reason"] is None
    disagree = lyapunov_estimate(times, np.stack([grow(0.1), grow(0.2), grow(0.15)], 1), 1.0)
    assert disagree["exponent"] is None and "disagree" in disagree["reason"]
    # Growth by jumps — a staircase of tenfold steps, as threshold crossings make — is not
    # exponential growth, although a line through it fits its trend.
    stairs = 1e-8 * 10.0 ** np.floor(times / 20.0)
    fit = lyapunov_exponent(times, stairs, 1.0)
    assert fit["exponent"] is None and "jumps" in fit["reason"]
    undetermined = lyapunov_estimate(times, np.stack([stairs, stairs, grow(0.2)], 1), 1.0)
    assert undetermined["exponent"] is None
    assert undetermined["reason"].startswith("only 1 of 3 perturbation directions")


def test_lyapunov_of_a_sharp_threshold_model_agrees_across_time_steps_or_is_undetermined():
    """Sharp BOCF (published Heaviside thresholds) with re-entrant activity from 30 stimuli,
    its separations from four twins over 300 ms at dt = 0.05 and 0.025 ms: the estimates
    agree within 25 %, or an estimate is undetermined and says why. (A single-twin fit of
    the same curves gave λ = 0.085–0.23 /ms at dt = 0.05 and 0.068 /ms at 0.025.)"""
    from pdefit.analysis.lyapunov import separation_rollout
    from pdefit.analysis.rollout import perturbed_twins, unrelated_separation
    from pdefit.model.system import stepper
    from pdefit.numerics.grid import Grid
    from pdefit.systems.bocf import BOCF, parameter_values

    system = BOCF(parameter_set="TNNP", laplacian="9pt", init_stimuli=30, init_duration=3000.0)
    grid = Grid((48, 48), (1.0, 1.0))
    params = {**parameter_values("TNNP"), "D": 0.05}
    p = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    state = system.initial_state(grid, params, seed=1)
    assert float(jnp.mean(state["u"] > 0.5)) > 0.05  # active tissue, not rest
    interval, n_frames = 2.0, 150
    times = interval * np.arange(1, n_frames + 1)
    estimates = {}
    for dt in (0.05, 0.025):
        run = separation_rollout(stepper(system, grid, "rush_larsen"), round(interval / dt),
                                 n_frames)
        twins = perturbed_twins(state, "u", 1e-6, 4, jnp.float64)
        separation = np.asarray(run(state, twins, p, 0.0, dt)[2])
        assert separation.shape == (n_frames, 4) and separation.max() > 1e-4  # they separate
        estimates[dt] = lyapunov_estimate(times, separation, unrelated_separation(state))
    determined = [e["exponent"] for e in estimates.values() if e["exponent"] is not None]
    for e in estimates.values():
        if e["exponent"] is None:
            assert e["reason"] and len(e["directions"]) == 4
        else:
            assert e["spread"] <= 0.25 and e["lyapunov_time"] == pytest.approx(1 / e["exponent"])
    if len(determined) == 2:
        assert abs(determined[0] - determined[1]) <= 0.25 * max(determined)


# -- pdefit-evaluate end to end -----------------------------------------------------------------

from tests.test_fit import config  # noqa: E402  (shared compose helper)

FIT = ["simulate.n_frames=4", "simulate.steps_per_frame=10", "simulate.noise.kind=none",
       "run.progress=false", "run.plots=false", "precision=float64", "fit.perturb=null",
       "optim=adam", "optim.steps=1"]


def test_evaluate_does_not_flag_a_truth_that_keeps_reentry(tmp_path):
    """Aliev–Panfilov, the model at the truth: an S1–S2 spiral on 48² keeps re-entry over the
    horizon and is not flagged as at rest (the exact-model test in tests/test_evaluate.py has
    a truth that dies out and is)."""
    from pdefit.app.cli import fit
    from pdefit.app.evaluate import evaluate_run, format_evaluation

    run = tmp_path / "spiral"
    fit(config(run, *FIT, "system.grid.shape=[48,48]"))
    logged = []
    spiral = evaluate_run(run, ["evaluate.horizon=60", "evaluate.activation_level=null"],
                          log=logged.append)
    assert spiral["active_measure"] == "u > 0.5"
    assert spiral["truth_quiescent_from"] is None and not spiral["forecast_runs_into_rest"]
    assert min(spiral["curves"]["truth_active_fraction"]) >= 0.05
    assert spiral["valid_while_active"] == spiral["valid_for"] == pytest.approx(60.0)
    assert not any("at rest" in line for line in logged)
    assert "at rest" not in format_evaluation(spiral)
    assert len(spiral["curves"]["separation"][0]) == 4  # one curve per direction
    stored = json.loads((run / "evaluation.json").read_text())
    assert stored["truth_quiescent_from"] is None and (run / "activity.png").stat().st_size > 0
    from pdefit.analysis.forecast import EvaluationError

    for key, value in (("lyapunov_directions", 0), ("min_active_fraction", 1.5)):
        with pytest.raises(EvaluationError, match=f"evaluate.{key}={value}"):
            evaluate_run(run, [f"evaluate.{key}={value}"], log=lambda _: None)
