"""Parameter ranking, forecast metrics on synthetic cases with known answers, and the
``pdefit-evaluate`` / ``pdefit-rank`` commands end to end on small problems."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.analysis.lyapunov import lyapunov_exponent
from pdefit.analysis.reports import (
    activation_time_error,
    activation_times,
    describe_loss,
    error_summary,
    fields_figure,
    format_error_summary,
    format_percent,
    format_table,
    parameter_table,
    validity_horizon,
)
from pdefit.app.validate import validate_fit
from pdefit.fitting.ranking import rank_parameters
from pdefit.numerics.grid import Grid
from pdefit.options import ConfigError
from pdefit.systems.bocf import BOCF, parameter_values

# -- metrics with known answers -----------------------------------------------------------------


def test_validity_horizon():
    times = np.arange(11.0)
    error = np.array([0, 0.01, 0.02, 0.03, 0.04, 0.06, 0.2, 0.01, 0, 0, 0])
    assert validity_horizon(times, error, 0.05) == 4.0  # last frame before the first above
    assert validity_horizon(times, error, 0.5) == 10.0  # never above: the whole span
    assert validity_horizon(times + 3.0, np.full(11, 1.0), 0.5) == 0.0


def test_final_table_in_significant_figures_with_units():
    """A relative error of 1.3e-6 prints as 1.3e-04 %, not 0.000 %; units have a column."""
    truth = {"k": 8.0, "D": 0.1171, "u_o": 0.0}
    rows = parameter_table(["k", "D", "u_o"], {"k": 10.0, "D": 0.2, "u_o": 0.1},
                           {"k": 8.0 * (1 + 1.3e-6), "D": 0.1171 * 1.25, "u_o": 1e-3},
                           truth, {"k": "1", "D": "mm²/ms"})
    table = format_table(rows).splitlines()
    assert table[0].split()[:2] == ["parameter", "unit"]
    assert table[1].split() == ["k", "1", "10", "8.00001", "8", "25", "%", "1.3e-04", "%"]
    assert table[2].split()[1] == "mm²/ms" and table[2].endswith("25 %")
    assert table[3].split()[-1] == "—"  # no relative error for a true value of zero
    summary = error_summary(rows)
    assert format_error_summary(summary) == (
        "mean relative error 12.5 %, median 12.5 %, max 25 %")
    assert [format_percent(x) for x in (0.0, 4.2e-9, 1e-3, 0.25371, None)] == [
        "0 %", "4.2e-07 %", "0.1 %", "25.4 %", "—"]
    # An interval that could not be computed (NaN curvature on resting tissue) still prints.
    nan = float("nan")
    row = {**rows[0], "std_error": nan, "ci95_low": nan, "ci95_high": nan, "flag": ""}
    assert format_table([row]).splitlines()[1].endswith("[nan, nan]")
    # A std error the field solves left open prints its bracket beside the flag.
    intervals = {"k": {"std_error": None, "ci95_low": None, "ci95_high": None,
                       "flag": "unknown", "std_error_bounds": [0.0123, None]},
                 "D": {"std_error": None, "ci95_low": None, "ci95_high": None,
                       "flag": "unknown", "std_error_bounds": [0.001, 0.00456]}}
    rows = parameter_table(["k", "D"], {"k": 10.0, "D": 0.2}, {"k": 8.0, "D": 0.1}, truth,
                           intervals=intervals)
    lines = format_table(rows).splitlines()
    assert lines[1].endswith("unknown; std err within [0.0123, ∞)")
    assert lines[2].endswith("unknown; std err within [0.001, 0.00456]")
    # An interval the bracket only bounds from below says so too, with no flag beside it.
    intervals = {"k": {"std_error": 0.5, "ci95_low": 7.0, "ci95_high": 9.0, "flag": "",
                       "std_error_bounds": [0.5, None]}}
    rows = parameter_table(["k"], {"k": 10.0}, {"k": 8.0}, truth, intervals=intervals)
    line = format_table(rows).splitlines()[1]
    assert "[7, 9]" in line and line.endswith("  std err within [0.5, ∞)")
    # A fit stopped short of its optimum says where that optimum is (its interval spans it).
    intervals = {"k": {"std_error": 0.5, "ci95_low": 6.0, "ci95_high": 9.0, "optimum": 7.25,
                       "flag": "optimum not reached (1.5 std errors)"}}
    rows = parameter_table(["k"], {"k": 10.0}, {"k": 8.0}, truth, intervals=intervals)
    line = format_table(rows).splitlines()[1]
    assert "[6, 9]" in line and line.endswith("  optimum not reached (1.5 std errors) at 7.25")


def test_field_figure_has_colour_bars_residual_rows_and_units():
    times, shape = [0.0, 6.45], (2, 5, 6)
    observed = {"u": np.ones(shape), "v": np.zeros(shape)}
    observed["u"][:, 0, 0] = np.nan  # an unobserved point
    predicted = {"u": np.full(shape, 1.5), "v": np.zeros(shape)}
    fig = fields_figure(observed, predicted, times, {"u": "mV"}, "ms")
    images, bars = fig.axes[:12], fig.axes[12:]
    assert len(bars) == 6  # one per row: observed, predicted, difference of u and of v
    assert [b.get_ylabel() for b in bars[:3]] == ["u [mV]"] * 3
    assert bars[3].get_ylabel() == "v"  # no unit declared
    assert [images[k * 2].get_ylabel() for k in range(3)] == [
        "u observed", "u predicted", "u difference"]
    assert [images[j].get_title() for j in range(2)] == ["t = 0 ms", "t = 6.45 ms"]
    difference = images[4].get_images()[0].get_array()
    assert difference[0, 1] == pytest.approx(0.5) and np.ma.is_masked(difference[0, 0])
    assert describe_loss("relative_mse", ["u", "v"], ["smoothness"], {"v": 2.0}) == (
        "relative MSE(u) + 2·relative MSE(v) + regularisation (smoothness)")


def pulses(times, starts, n_pixels, speed=0.0):
    """A train of square-ish pulses (smooth upstrokes): pixel i activates at start + speed·i."""
    t = times[:, None]
    onset = np.asarray(starts)[:, None, None] + speed * np.arange(n_pixels)[None, None, :]
    u = np.zeros((len(times), n_pixels))
    for k in range(onset.shape[0]):
        u = np.maximum(u, 1.0 / (1.0 + np.exp(-(t - onset[k]) / 0.3)) * (t < onset[k] + 8.0))
    return u.reshape(len(times), 1, n_pixels)


def test_activation_times_and_their_error_for_a_shifted_wave():
    times = np.linspace(0.0, 60.0, 1201)
    truth = pulses(times, [5.0, 25.0, 45.0], 6, speed=0.5)
    found = activation_times(truth, times, 0.5)
    assert len(found) == 6
    for i, t in enumerate(found):
        np.testing.assert_allclose(t, [5.0 + 0.5 * i, 25.0 + 0.5 * i, 45.0 + 0.5 * i], atol=2e-3)
    late = pulses(times, [5.7, 25.7, 45.7], 6, speed=0.5)  # the model lags by 0.7
    result = activation_time_error(truth, late, times, 0.5, bins=6)
    assert result["overall"] == pytest.approx(0.7, abs=2e-3)
    assert result["missed"] == 0
    assert int(result["count"].sum()) == 18
    binned = result["mean_error"][np.isfinite(result["mean_error"])]
    np.testing.assert_allclose(binned, 0.7, atol=2e-3)
    # A model that never activates: every truth activation is missed, none is averaged.
    silent = activation_time_error(truth, np.zeros_like(truth), times, 0.5)
    assert silent["missed"] == 18 and np.isnan(silent["overall"])


def test_lyapunov_exponent_of_exponential_growth_with_saturation():
    times = np.linspace(0.0, 100.0, 501)
    rate = 0.23
    separation = np.minimum(1e-8 * np.exp(rate * times), 1.0)
    fit = lyapunov_exponent(times, separation)
    assert fit["exponent"] == pytest.approx(rate, rel=1e-9)
    # Fitted up to a tenth of the saturation level, not into the saturated tail.
    assert fit["fit_end"] < np.log(0.1 / 1e-8) / rate + 0.3 and fit["r2"] > 0.999
    # Noise-level wobble on top changes the estimate only a little.
    noisy = separation * np.exp(0.01 * np.random.default_rng(0).standard_normal(times.size))
    assert lyapunov_exponent(times, noisy)["exponent"] == pytest.approx(rate, rel=0.01)
    # Decay: no growth stretch, no estimate.
    assert lyapunov_exponent(times, 1e-3 * np.exp(-times))["exponent"] is None


# -- parameter ranking --------------------------------------------------------------------------

SMALL_BOCF = BOCF(parameter_set="TNNP", laplacian="9pt", init_stimuli=6, init_duration=60.0)


def test_ranking_is_stable_and_puts_inert_parameters_last():
    grid = Grid((24, 24), (1.0, 1.0))
    params = {**parameter_values("TNNP"), "D": 0.1}
    x0 = SMALL_BOCF.initial_state(grid, params, seed=0)
    rankings = [rank_parameters(SMALL_BOCF, grid, params, 0.05, "rush_larsen", x0, 400, 10,
                                factor=f, dtype=jnp.float64) for f in (1.5, 1.4)]
    names = [[r["name"] for r in rows] for rows in rankings]
    assert len(names[0]) == len(SMALL_BOCF.params) and [r["rank"] for r in rankings[0]] == list(
        range(1, 30))
    # The order of the influential parameters does not depend on the exact factor.
    assert set(names[0][:6]) == set(names[1][:6])
    # The paper's most influential parameter leads; u_o = 0 cannot move anything.
    assert names[0][0] == "u_s"
    assert names[0][-1] == "u_o" and rankings[0][-1]["mae"] == 0.0
    maes = [r["mae"] for r in rankings[0]]
    assert maes == sorted(maes, reverse=True)
    with pytest.raises(ValueError, match="unknown parameter"):
        rank_parameters(SMALL_BOCF, grid, params, 0.05, "rush_larsen", x0, 10, names=["nope"])


# -- commands end to end ------------------------------------------------------------------------

from tests.test_fit import SMALL, config  # noqa: E402  (shared compose helper and small config)


def test_rank_command_writes_table_and_plot(tmp_path):
    from pdefit.app.cli import rank

    cfg = config(tmp_path, *SMALL, "rank.top=3")
    rows = rank(cfg)
    stored = json.loads((tmp_path / "ranking.json").read_text())
    assert [r["name"] for r in stored["ranking"]] == [r["name"] for r in rows]
    assert (tmp_path / "ranking.png").stat().st_size > 0
    assert "rank" in (tmp_path / "ranking.txt").read_text()


def test_evaluate_of_an_exact_model_gives_zero_errors(tmp_path):
    """Start the fit at the truth: the forecast is the truth (up to the dataset's float32
    rounding), so the forecast is valid over the whole horizon and activation times agree.
    The truth (excited discs on 20²) dies out within it: the validity is reported as running
    into resting truth (tests/test_honest_evaluation.py has a truth that does not)."""
    from pdefit.app.cli import fit
    from pdefit.app.evaluate import evaluate_run, format_evaluation

    run = tmp_path / "run"
    fit(config(run, *SMALL, "precision=float64", "fit.perturb=null", "optim.steps=1"))
    logged = []
    result = evaluate_run(run, ["evaluate.horizon=60"], log=logged.append)
    assert result["valid_for"] == pytest.approx(60.0)
    # At rest: u > 0.5 (Aliev–Panfilov's declared activity) on fewer than 5 % of the points
    # from some frame to the horizon.
    active = np.asarray(result["curves"]["truth_active_fraction"])
    assert result["active_measure"] == "u > 0.5" and active[0] >= 0.05 and active[-1] < 0.05
    rest = result["truth_quiescent_from"]
    assert 0.0 < rest < 60.0 and np.all(active[result["curves"]["time"].index(rest):] < 0.05)
    assert result["forecast_runs_into_rest"] and result["valid_while_active"] == rest
    assert any(line.startswith("warning: the truth is at rest") for line in logged)
    assert "but the truth is at rest from" in format_evaluation(result)
    stored = json.loads((run / "evaluation.json").read_text())
    assert stored["truth_quiescent_from"] == rest and stored["forecast_runs_into_rest"]
    # Not exactly zero: the dataset stores float32, so the known initial fields are rounded.
    assert max(max(v) for v in result["curves"]["mae"].values()) < 1e-6
    assert result["activation_time_error_mean"] < 1e-5
    assert result["activation_time_missed"] == 0
    assert result["time_unit"] == "AP time units"
    for name in ("forecast_mae.png", "centre_trace.png", "difference_maps.png",
                 "separation.png", "activity.png", "evaluation.json"):
        assert (run / name).stat().st_size > 0, name


def test_evaluate_forecasts_against_the_refined_truth_the_data_came_from(tmp_path):
    """Data made at dt/4 (`simulate.refine`): the forecast's truth is stepped at dt/4 too, so
    the exact parameters at the fit's dt show their model error instead of a twin's zero; a
    refined grid is refused by name."""
    from pdefit.app.cli import fit
    from pdefit.app.evaluate import EvaluationError, evaluate_run

    run = tmp_path / "run"
    fit(config(run, *SMALL, "precision=float64", "fit.perturb=null", "optim.steps=1",
               "simulate.refine.dt_factor=4"))
    result = evaluate_run(run, ["evaluate.horizon=20"], log=lambda _: None)
    mae = np.asarray(result["curves"]["mae"]["u"])
    assert mae[0] < 1e-6 < 1e-4 < mae.max()  # the same start, then first-order model error
    cfg = (run / "config.yaml").read_text().replace("grid_factor: 1", "grid_factor: 2")
    (run / "config.yaml").write_text(cfg)
    with pytest.raises(EvaluationError, match=r"simulate\.refine\.grid_factor=2"):
        evaluate_run(run, ["evaluate.horizon=20"], log=lambda _: None)


def test_evaluate_a_fit_of_a_dataset_pdefit_simulated_elsewhere(tmp_path):
    """A fit on data.path that pdefit simulated with the run's own system and simulate
    settings is forecast against that truth, exactly as the run that simulated it; one whose
    dataset was simulated otherwise (another seed) is refused naming the key; a recording
    (no simulate settings in its provenance) is refused as having no truth."""
    from pdefit.app.cli import fit
    from pdefit.app.evaluate import EvaluationError, evaluate_run

    common = [*SMALL, "precision=float64", "fit.perturb=null", "optim.steps=1"]
    fit(config(tmp_path / "own", *common))
    data = tmp_path / "own" / "data.zarr"
    fit(config(tmp_path / "on_path", *common, "data=zarr", f"data.path={data}"))
    own = evaluate_run(tmp_path / "own", ["evaluate.horizon=20"], log=lambda _: None)
    on_path = evaluate_run(tmp_path / "on_path", ["evaluate.horizon=20"], log=lambda _: None)
    assert on_path["valid_for"] == own["valid_for"]
    assert on_path["curves"]["mae"] == own["curves"]["mae"]
    other = tmp_path / "other_seed"
    fit(config(other, *common, "data=zarr", f"data.path={data}", "simulate.seed=5"))
    with pytest.raises(EvaluationError, match=r"simulate\.seed: 0 in the dataset, 5 in the run"):
        evaluate_run(other, ["evaluate.horizon=20"], log=lambda _: None)
    # The same frames as a recording (written from memory, no simulate settings).
    from pdefit.analysis.forecast import simulated_truth
    from pdefit.api import frames_dataset
    from pdefit.app.config import to_options
    from pdefit.data import open_dataset
    from pdefit.systems.aliev_panfilov import AlievPanfilov

    made = open_dataset(data)
    recording = frames_dataset(tmp_path / "recording.zarr", AlievPanfilov(),
                               {f: made.read(f) for f in ("u", "v")}, Grid((20, 20), (1.0, 1.0)),
                               0.05, float(made.meta.frame_interval))
    cfg = to_options(config(tmp_path / "rec", *common, "data=zarr", f"data.path={recording}"))
    with pytest.raises(EvaluationError, match="a recording has no truth"):
        simulated_truth(tmp_path / "rec", cfg)


def test_evaluate_refuses_what_it_cannot_do(tmp_path):
    from pdefit.app.evaluate import EvaluationError, evaluate_run

    with pytest.raises(EvaluationError, match=r"config\.yaml"):
        evaluate_run(tmp_path)
    (tmp_path / "config.yaml").write_text("precision: float64\n")
    with pytest.raises(EvaluationError, match="only evaluate"):
        evaluate_run(tmp_path, ["optim.lr=3"])


SURROGATE = ["experiment=ap_from_bocf_long", "system.grid.shape=[16,16]",
             "simulate.system.grid.shape=[16,16]", "+simulate.system.options.init_stimuli=4",
             "+simulate.system.options.init_duration=200", "simulate.n_frames=5",
             "run.progress=false", "run.plots=false"]


def test_surrogate_fit_reads_only_observed_fields_on_the_model_clock(tmp_path):
    """AP fitted to BOCF data: the dataset's clock is divided by data.time_scale, only u is
    taken from it (BOCF's v is a different variable from AP's v), there is no reference."""
    from pdefit.app.cli import _dataset_for
    from pdefit.fitting import assemble

    cfg = config(tmp_path, *SURROGATE)
    dtype = assemble.set_precision("float64")
    setup = assemble.build_fit(cfg, _dataset_for(cfg, tmp_path, dtype), dtype)
    problem = setup.problem
    assert problem.system.name == "aliev_panfilov"
    assert problem.n_steps == 4 * 10  # 6.45 ms frames = 0.5 AP units = 10 steps of 0.05
    assert setup.reference is None and problem.fitted_fields == ("u", "v")
    # v(0) starts from AP's own first guess from the observed u, not from BOCF's v ≈ 1.
    u0 = setup.theta0["fields"]["u"]
    guess = problem.system.initial_guess({"u": u0}, problem.physical_params(setup.theta0))
    np.testing.assert_allclose(np.asarray(setup.theta0["fields"]["v"]), np.asarray(guess["v"]))
    assert float(np.abs(setup.theta0["fields"]["u"]).max()) > 0.5  # u(0) starts from the data
    assert setup.start_values["k"] == 8.0  # perturb: null, AP96 values
    with pytest.raises(assemble.ConfigError, match="not a multiple"):
        bad = config(tmp_path, *SURROGATE, "data.time_scale=10.0")
        assemble.build_fit(bad, _dataset_for(bad, tmp_path, dtype), dtype)
    from pdefit.data import DatasetError
    with pytest.raises(DatasetError, match="made by system 'bocf'"):
        other = config(tmp_path, *SURROGATE, "data.system=null")
        assemble.build_fit(other, _dataset_for(other, tmp_path, dtype), dtype)


def test_paper_surrogate_configs_validate_and_share_one_truth(tmp_path):
    """experiment=ap_from_bocf is the seed paper's case (50 ms of u, a frame per AP step, AP's
    parameters and both initial fields fitted), bocf_refit_for_ap fits BOCF to the same truth,
    and ap_from_bocf_long still composes; the same-truth check names a differing key."""
    from pdefit.analysis.truth import EvaluationError, check_same_truth
    from pdefit.app.validate import validate_fit
    from pdefit.fitting import assemble

    ap, bocf, long = (config(tmp_path, f"experiment={name}") for name in (
        "ap_from_bocf", "bocf_refit_for_ap", "ap_from_bocf_long"))
    for cfg in (ap, bocf, long):
        validate_fit(cfg, log=lambda _: None)
    meta = assemble.dataset_meta(ap)[0]
    assert meta.system == "bocf" and meta.n_frames == 78 and ap.simulate.steps_per_frame == 10
    assert meta.times[-1] == pytest.approx(49.665)  # ≈ 50 ms
    assert meta.frame_interval / ap.data.time_scale == pytest.approx(ap.system.dt)  # one step
    assert ap.simulate.system.integrator == "rush_larsen"
    assert ap.simulate.system.options.heaviside_width == 0.0
    assert list(ap.observe.fields) == ["u"] and dict(ap.fit.initial_fields) == {
        "u": "fit", "v": "fit"}
    assert "D" in ap.fit.params and pytest.approx(0.1 * 12.9) == ap.system.params.D
    assert ap.optim.steps == 2500
    check_same_truth(ap, bocf, tmp_path / "ap", tmp_path / "bocf")  # no error
    for cfg in (ap, bocf):  # the evaluation frames fall on both clocks
        for dt in (assemble.data_system_config(cfg).dt, cfg.system.dt * cfg.data.time_scale):
            ratio = cfg.evaluate.frame_interval / dt
            assert ratio == pytest.approx(round(ratio))
    assert ap.evaluate.frame_interval == bocf.evaluate.frame_interval
    other = config(tmp_path, "experiment=bocf_refit_for_ap", "system.params.D=0.05")
    with pytest.raises(EvaluationError, match=r"simulate\.system\.params\.D = 0\.1 in .*"
                                              r"system\.params\.D = 0\.05"):
        check_same_truth(ap, other, tmp_path / "ap", tmp_path / "bocf")
    with pytest.raises(EvaluationError, match=r"options\.heaviside_width"):
        check_same_truth(ap, config(tmp_path, "experiment=bocf_refit_for_ap",
                                    "system.options.heaviside_width=0.01"), "ap", "bocf")
    with pytest.raises(EvaluationError, match="precision = 'float64' in ap, precision = "
                                              "'float32' in bocf"):
        check_same_truth(ap, config(tmp_path, "experiment=bocf_refit_for_ap",
                                    "precision=float32"), "ap", "bocf")


def test_compare_forecasts_on_shared_fields_and_one_truth_frame_by_frame():
    """Validity on the fields both runs compare (a surrogate compares only u), normalised by
    the truth's range; a truth that parts from this run's at some frame is refused there."""
    from pdefit.analysis.forecast import EvaluationError, compare_forecasts

    times = np.arange(6.0)
    truth = {"truth_min": {"u": [0.0] * 6, "v": [0.0] * 6},
             "truth_max": {"u": [2.0] * 6, "v": [1.0] * 6}}

    def run(name, system, window, mae, fields=("u", "v")):
        return {"run_dir": f"runs/{name}", "model_system": system, "training_window": window,
                "truth_system": "bocf", "truth_quiescent_from": None, "compared_fields":
                list(fields), "curves": {"time": times.tolist(), "mae": mae, **truth}}

    bocf = run("bocf", "bocf", [0.0, 2.0], {"u": [0.0, 0.0, 0.0, 0.05, 0.2, 0.3],
                                           "v": [1.0] * 6})
    ap = run("ap", "aliev_panfilov", [0.0, 2.0], {"u": [0.01, 0.02, 0.2, 0.4, 0.6, 0.6]},
             fields=("u",))
    comparison = compare_forecasts(bocf, [ap], 0.05)
    assert comparison["fields"] == ["u"]  # v is BOCF's alone
    valid = {r["label"]: r["valid_for"] for r in comparison["runs"]}
    # MAE / 2 ≤ 0.05 up to t = 3 for BOCF (its v error does not count), t = 1 for AP.
    assert valid == {"bocf refit (bocf)": 3.0, "aliev_panfilov refit (ap)": 1.0}
    parted = run("ap2", "aliev_panfilov", [0.0, 2.0], {"u": [0.0] * 6}, fields=("u",))
    parted["curves"]["truth_max"] = {"u": [2.0, 2.0, 2.0, 2.0, 2.5, 2.0]}
    with pytest.raises(EvaluationError, match=r"differs from runs/bocf's at t = 4 "
                                              r"\(truth_max of u\)"):
        compare_forecasts(bocf, [parted], 0.05)


def test_evaluate_compares_forecasts_of_one_truth(tmp_path):
    """Two fits of one truth (one at the truth, a copy of it with k doubled) forecast side by
    side: evaluation.json holds both MAE curves, validities and training windows, the plot is
    written; a run of another truth is refused before anything is simulated."""
    import shutil

    import yaml

    from pdefit.app.cli import fit
    from pdefit.app.evaluate import EvaluationError, evaluate_run, format_evaluation

    base = [*SMALL, "precision=float64", "optim=adam", "optim.steps=1", "fit.params=[k,a]",
            "fit.uncertainty=false"]
    exact, rough = tmp_path / "exact", tmp_path / "rough"
    fit(config(exact, *base, "fit.perturb=null"))
    shutil.copytree(exact, rough)
    with np.load(exact / "fitted.npz") as stored:
        theta = dict(stored)
    theta["params/k"] = theta["params/k"] + np.log(2.0)  # k is fitted in log space
    np.savez(rough / "fitted.npz", **theta)
    result = evaluate_run(exact, ["evaluate.horizon=30", f"evaluate.compare=[{rough}]",
                                  "evaluate.activation_level=null",
                                  "evaluate.lyapunov_directions=1"], log=lambda _: None)
    stored = json.loads((exact / "evaluation.json").read_text())
    comparison = stored["comparison"]
    assert comparison == json.loads(json.dumps(result["comparison"]))
    assert comparison["fields"] == ["u", "v"] and comparison["threshold"] == 0.05
    runs = {Path(r["run_dir"]).name: r for r in comparison["runs"]}
    assert list(runs) == ["exact", "rough"]
    n = len(stored["curves"]["time"])
    assert n == 61 and all(len(r["mae"][f]) == n for r in runs.values() for f in ("u", "v"))
    assert runs["exact"]["training_window"] == [0.0, 1.5]
    assert runs["rough"]["training_window"] == [0.0, 1.5]
    assert max(runs["exact"]["mae"]["u"]) < 1e-6 < max(runs["rough"]["mae"]["u"])
    assert runs["exact"]["valid_for"] == pytest.approx(30.0)
    assert runs["rough"]["valid_for"] < 30.0
    assert (exact / "forecast_compare.png").stat().st_size > 0
    assert not (rough / "evaluation.json").exists()  # the compared run is left as it was
    assert "aliev_panfilov refit (rough): valid for" in format_evaluation(result)
    # Another truth: the same run with another simulate.seed, refused naming the key.
    other = tmp_path / "other"
    shutil.copytree(rough, other)
    saved = yaml.safe_load((other / "config.yaml").read_text())
    saved["simulate"]["seed"] += 1
    (other / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(EvaluationError, match=r"evaluate\.compare: .*simulate\.seed"):
        evaluate_run(exact, [f"evaluate.compare=[{other}]"], log=lambda _: None)
    # Data of another truth under a matching description: the first frames tell.
    from pdefit.analysis.truth import check_same_data
    from pdefit.fitting import assemble

    check_same_data(exact, rough)  # no error: one truth
    assemble.simulate_dataset(config(other, *SMALL, "simulate.seed=1"), other / "data.zarr",
                              assemble.set_precision("float64"), log=lambda _: None)
    with pytest.raises(EvaluationError, match="differ at their first frame"):
        check_same_data(exact, other)
    with pytest.raises(EvaluationError, match=r"evaluate\.compare: .*config\.yaml"):
        evaluate_run(exact, [f"evaluate.compare=[{tmp_path / 'nothing'}]"], log=lambda _: None)


def stage_values(run: Path, stage: int, name: str) -> list[float]:
    """The physical value of ``name`` at every step of ``stage`` (its metrics.jsonl)."""
    return [json.loads(line)["params"][name] for line in
            (run / f"stage-{stage}" / "metrics.jsonl").read_text().splitlines()]


def test_staged_fit_grows_the_window_and_resumes_per_stage(tmp_path):
    """Stages, fit.hold (k held in the first stage, fitted from the second) and resume."""
    from pdefit.app.cli import fit

    overrides = [*SMALL, "precision=float64", "fit.stages=[2,3]", "optim.steps=40",
                 "fit.params=[k,a]", "run.checkpoint_every=5", "+fit.hold.k=1"]
    summary = fit(config(tmp_path, *overrides))
    held = stage_values(tmp_path, 0, "k")
    assert len(held) > 1 and len(set(held)) == 1  # bit for bit through the stage
    assert held[0] == pytest.approx(summary["parameters"][0]["start"], rel=1e-14)
    assert stage_values(tmp_path, 1, "k")[-1] != held[0]  # released
    assert len(set(stage_values(tmp_path, 0, "a"))) > 1
    assert summary["stages"] == [2, 3, 4]
    assert summary["n_steps"] == 30  # the last stage sees all 4 frames
    per_stage = summary["optimizer_steps_per_stage"]
    assert len(per_stage) == 3 and summary["optimizer_steps"] == sum(per_stage)
    assert [json.loads(line)["step"] for line in (tmp_path / "stage-0" / "metrics.jsonl")
            .read_text().splitlines()][-1] == per_stage[0] - 1
    for i in range(3):
        assert (tmp_path / f"stage-{i}" / "status.json").exists()
    assert summary["max_rel_error"] < 1e-4
    # Run again: every stage is complete, so nothing is recomputed and the result is the same.
    again = fit(config(tmp_path, *overrides))
    assert again["parameters"] == summary["parameters"]
    # A hold of 0 stages changes nothing, so it does not refuse the resume either.
    assert fit(config(tmp_path, *overrides, "+fit.hold.a=0"))["parameters"] == \
        summary["parameters"]
    with pytest.raises(Exception, match=r"fit\.stages"):
        fit(config(tmp_path / "bad", *SMALL, "fit.stages=[3,2]"))
    for hold, key in [("mu1=1", r"fit\.hold\.mu1: 'mu1' is not a fitted parameter"),
                      ("k=-1", r"fit\.hold\.k must be an integer >= 0"),
                      ("k=3", r"fit\.hold\.k=3: there are 2 listed stages")]:
        with pytest.raises(ConfigError, match=key):
            fit(config(tmp_path / "bad", *overrides[:-1], f"+fit.hold.{hold}"))
    validate_fit(config(tmp_path / "ok", *overrides, "+fit.hold.mu1=0"))  # 0: no hold
    # Stages [2, 4] on 4 frames: the second listed stage is the last, which must fit k;
    # refused before the dataset is simulated, as is holding every fitted parameter.
    for extra, key in [(["fit.stages=[2,4]", "+fit.hold.k=2"],
                        r"fit\.hold\.k=2: the fit has 2 stage\(s\) on these data"),
                       (["+fit.hold.k=1", "+fit.hold.a=1"], r"fit\.hold holds every fitted"),
                       # Without stages, every held name in one line with how to drop them.
                       (["fit.stages=null", "+fit.hold.k=1", "+fit.hold.a=2"],
                        r"^fit\.hold: holding k, a needs a staged fit \(fit\.stages\);.*"
                        r"\(fit\.hold=null drops the whole hold, fit\.hold\.k=0 "
                        r"fit\.hold\.a=0 one by one\)$")]:
        with pytest.raises(ConfigError, match=key):
            fit(config(tmp_path / "early", *overrides[:-1], *extra))
        assert not (tmp_path / "early").exists()
    # fit.hold=null drops a hold that fit.hold={} would only merge into.
    validate_fit(config(tmp_path / "ok", *overrides, "fit.stages=null", "fit.hold=null"))
    with pytest.raises(ConfigError, match=r"^fit\.hold: holding k needs a staged fit"):
        validate_fit(config(tmp_path / "ok", *overrides, "fit.stages=null", "fit.hold={}"))


def test_patience_detects_a_stalled_loss():
    from pdefit.fitting.train import _stalled

    def records(losses):
        return [{"loss": x} for x in losses]

    assert not _stalled(records([5, 4, 3, 2, 1]), 3)
    assert _stalled(records([5, 1, 1, 1, 1]), 3)
    assert _stalled(records([5, 1, 2, 3, 1]), 3)  # no better than 1 since
    assert not _stalled(records([5, 1, 1, 1, 0.5]), 3)
    assert not _stalled(records([5, 1]), 3)  # too early to say
