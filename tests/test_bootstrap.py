"""The parametric bootstrap (pdefit.fitting.bootstrap): replicates are the fitted model's
predictions plus noise of the fit's level, the correction works in the fit's coordinates,
and on a fit whose prior pulls a parameter many standard errors off the truth, the
corrected estimate's interval holds the truth where the Laplace interval does not."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ap_problem, voltage_only_setup, voltage_only_truth
from hydra import compose, initialize_config_dir

import pdefit
from pdefit.app import cli
from pdefit.fitting import bootstrap, krylov
from pdefit.fitting.assemble import ConfigError
from pdefit.numerics.grid import Grid
from pdefit.runtime.signals import Preempted, PreemptionFlag

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_replicates_are_the_model_plus_noise_and_keep_missing_values_missing():
    problem, batch, theta, _ = ap_problem(shape=(16, 16), n_steps=20, every=5, fitted=("k",),
                                          observe=("u",))
    weights = batch.observed.weights["u"].at[:, 2].set(0.0)  # one frame missing
    batch = batch._replace(observed=batch.observed._replace(
        weights={"u": weights}, values={"u": batch.observed.values["u"].at[:, 2].set(0.0)}))
    mean = krylov.predictions(problem, theta, batch)["u"]
    replicate = bootstrap.replicate_batch(problem, theta, batch, {"u": 0.05},
                                          jax.random.PRNGKey(3))
    noise = np.asarray(replicate.observed.values["u"] - mean)[np.asarray(weights) > 0]
    assert noise.std() == pytest.approx(0.05, rel=0.1) and abs(noise.mean()) < 0.01
    np.testing.assert_array_equal(np.asarray(replicate.observed.values["u"][:, 2]), 0.0)
    again = bootstrap.replicate_batch(problem, theta, batch, {"u": 0.05}, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(again.observed.values["u"]),
                                  np.asarray(replicate.observed.values["u"]))
    # Without noise a replicate is the model itself.
    exact = bootstrap.replicate_batch(problem, theta, batch, {"u": 0.0}, jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(exact.observed.values["u"])[np.asarray(weights) > 0],
                               np.asarray(mean)[np.asarray(weights) > 0], rtol=0, atol=1e-12)


def test_a_known_initial_field_read_from_the_first_frame_takes_the_replicates_frame():
    """u(0) known and equal to the data's first frame (read from it): the replicate's u(0) is
    its own first frame; v(0), not observed, and a u(0) that is not the data's frame stay."""
    problem, batch, theta, _ = ap_problem(shape=(8, 8), n_steps=10, every=5, fitted=("k",),
                                          observe=("u",))
    replicate = bootstrap.replicate_batch(problem, theta, batch, {"u": 0.05},
                                          jax.random.PRNGKey(1))
    first = np.asarray(bootstrap.first_frames(replicate)["u"])
    np.testing.assert_array_equal(np.asarray(replicate.initial["u"]), first)
    assert not np.array_equal(first, np.asarray(batch.initial["u"]))
    np.testing.assert_array_equal(np.asarray(replicate.initial["v"]),
                                  np.asarray(batch.initial["v"]))
    given = batch._replace(initial={**batch.initial, "u": batch.initial["u"] + 0.1})
    kept = bootstrap.replicate_batch(problem, theta, given, {"u": 0.05}, jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(kept.initial["u"]), np.asarray(given.initial["u"]))


def test_a_replicates_first_guesses_are_made_as_the_datas_were():
    """The data's background is what first_guesses makes of their first frame, so that a
    replicate's start and background are remade from its own frame (u its frame, v the
    system's guess from it); a start that is not the first guess stays."""
    setup = voltage_only_setup(20)
    problem, batch, theta0 = setup.problem, setup.batch, setup.theta0
    start = problem.physical_params(theta0)
    guesses = bootstrap.first_guesses(problem, batch, start)
    assert set(guesses) == {"u", "v"}
    for name, guess in guesses.items():  # v through the start's transform and back
        np.testing.assert_allclose(np.asarray(guess).ravel(),
                                   np.asarray(batch.background[name]).ravel(), rtol=1e-12)
    replicate = bootstrap.replicate_batch(problem, theta0, batch, {"u": 0.01},
                                          jax.random.PRNGKey(0))
    moved = {**theta0, "fields": {**theta0["fields"], "v": theta0["fields"]["v"] + 0.1}}
    rebased, new_start = bootstrap.rebased_start(problem, moved, batch, replicate, start)
    first = np.asarray(bootstrap.first_frames(replicate)["u"]).ravel()
    np.testing.assert_array_equal(np.asarray(rebased.background["u"]).ravel(), first)
    np.testing.assert_array_equal(np.asarray(new_start["fields"]["u"]).ravel(), first)
    assert not np.array_equal(np.asarray(rebased.background["v"]), np.asarray(
        batch.background["v"]))
    np.testing.assert_array_equal(np.asarray(new_start["fields"]["v"]),
                                  np.asarray(moved["fields"]["v"]))


def test_kept_replicates_are_reused_only_for_the_same_estimate(tmp_path):
    """With a store, a second call refits only the replicates the first did not make, and
    gives what one call would have; a store made for another estimate is not reused. Each
    replicate is refitted in its own scratch directory, removed once it is kept; one left
    by an interrupted call is handed to the same replicate again, one of another estimate
    is removed (and nothing else in the scratch directory)."""
    problem, batch, theta, _ = ap_problem(shape=(8, 8), n_steps=10, every=5, fitted=("k",),
                                          observe=("u",))
    refits, lines, scratch = [], [], tmp_path / "bootstrap"

    def refit(replicate, start, where):  # a stand-in fit: k moved by the replicate's noise
        refits.append(None if where is None else (where.name, (where / "left").exists()))
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)  # as a checkpointed fit would
        shift = jnp.mean(replicate.observed.values["u"] - batch.observed.values["u"])
        return {**start, "params": {"k": start["params"]["k"] + shift}}

    def run(count, estimate, store, work=scratch):
        refits.clear()
        out = bootstrap.replicates(problem, batch, theta, estimate, {"u": 0.05}, count, refit,
                                   log=lines.append, store=store, scratch=work)
        return out, len(refits)

    store = tmp_path / "bootstrap.json"
    whole, _ = run(3, theta, None, None)
    assert refits == [None] * 3
    assert run(2, theta, store) == (whole[:2], 2)
    assert refits == [("replicate-0", False), ("replicate-1", False)]
    assert not scratch.exists()  # both kept: their directories and the marker removed
    scratch.mkdir()
    (scratch / "mine.txt").write_text("not the bootstrap's")
    (scratch / "replicate-notes").mkdir()  # not a name the bootstrap makes
    bootstrap._scratch(scratch, bootstrap._identity(problem, theta, {"u": 0.05}, 0), print)
    (scratch / "replicate-2").mkdir()
    (scratch / "replicate-2" / "left").write_text("an interrupted refit's checkpoint")
    (scratch / "replicate-0").mkdir()  # a kept one's, left by a kill while it was removed
    assert run(3, theta, store) == (whole, 1)
    assert refits == [("replicate-2", True)]  # the interrupted refit's directory, handed on
    assert sorted(p.name for p in scratch.iterdir()) == ["mine.txt", "replicate-notes"]
    assert "bootstrap: 2 replicate(s) kept" in "\n".join(lines)
    other = {**theta, "params": {"k": theta["params"]["k"] + 0.01}}
    (scratch / "replicate-1").mkdir()
    (scratch / "replicate-1" / "left").write_text("this estimate's")
    assert run(3, other, store)[1] == 3
    assert "belongs to another estimate" in "\n".join(lines)
    assert refits[1] == ("replicate-1", False)  # not resumed from another estimate's
    assert (scratch / "mine.txt").read_text() == "not the bootstrap's"
    assert (scratch / "replicate-notes").is_dir()


def test_a_replicate_whose_refit_accepted_no_step_is_counted_and_warned_about():
    """A refit that ends exactly at its start (no step accepted, as Levenberg–Marquardt with
    too few steps can) is logged, counted as ``unmoved`` and warned about in the block;
    records kept by an older store (no ``moved``) count as unknown, not unmoved."""
    problem, batch, theta, _ = ap_problem(shape=(8, 8), n_steps=10, every=5, fitted=("k",),
                                          observe=("u",))
    lines = []

    def refit(replicate, start, where):  # the first replicate stays at its start
        if len(lines) == 0:
            return start
        return {**start, "params": {"k": start["params"]["k"] + 0.01 * len(lines)}}

    fitted = bootstrap.replicates(problem, batch, theta, theta, {"u": 0.05}, 3, refit,
                                  log=lines.append)
    assert [f["moved"] for f in fitted] == [False, True, True]
    assert "no step accepted" in lines[0] and "no step accepted" not in lines[1]
    block = bootstrap.summary(problem, theta, fitted)
    assert block["unmoved"] == 1
    assert "warning: 1 of 3 refits accepted no step" in bootstrap.format_block(block)
    older = bootstrap.summary(problem, theta, [{"k": f["k"]} for f in fitted])
    assert older["unmoved"] == 0 and "warning" not in bootstrap.format_block(older)


def test_the_correction_is_made_in_the_fits_coordinates_and_held_at_a_bound():
    """k is log-transformed: replicates at log k̂ + (0.1, 0.3) mean a bias of 0.2 in log k,
    so the corrected k is k̂ e^(−0.2); the interval is ± t(0.975, 1)·√(3/2) spreads around
    it. A correction beyond k's upper bound is held there and says so."""
    problem, _, theta, _ = ap_problem(shape=(6, 6), fitted=("k",))
    z = float(theta["params"]["k"])
    block = bootstrap.summary(problem, theta, [{"k": z + 0.1}, {"k": z + 0.3}])
    row = block["parameters"]["k"]
    k_hat = float(np.exp(z))
    assert row["corrected"] == pytest.approx(k_hat * np.exp(-0.2))
    assert row["bias"] == pytest.approx(k_hat - row["corrected"])
    spread = np.std([0.1, 0.3], ddof=1)
    assert row["bias_in_spreads"] == pytest.approx(0.2 / spread)
    assert block["quantile"] == pytest.approx(12.706205 * np.sqrt(1.5), rel=1e-6)
    assert row["ci95_high"] == pytest.approx(row["corrected"] * np.exp(block["quantile"]
                                                                       * spread))
    assert not row["at_bound"]
    bounded = dataclasses.replace(problem.layout.specs["k"], upper=20.0)
    problem = dataclasses.replace(problem, layout=dataclasses.replace(
        problem.layout, specs={**problem.layout.specs, "k": bounded}))
    far = bootstrap.summary(problem, theta, [{"k": z - 6.0}, {"k": z - 6.1}])
    assert far["parameters"]["k"]["corrected"] == 20.0 and far["parameters"]["k"]["at_bound"]
    with pytest.raises(ValueError, match="at least 2"):
        bootstrap.summary(problem, theta, [{"k": z}])
    assert "corrected" in bootstrap.format_block(block)


@pytest.mark.slow
def test_the_bootstrap_removes_a_priors_pull_that_the_laplace_interval_misses():
    """u observed with σ = 0.01, u(0) and v(0) fitted under a background prior 100 × the
    experiments' weight, centred on a first guess of v that is wrong: the prior pulls a
    about 25 % (tens of standard errors) below its truth and the Laplace interval misses it;
    three replicates see the pull again and the corrected interval holds the truth."""
    frames = voltage_only_truth(100)
    u = np.asarray(frames["u"]) + 0.01 * np.random.default_rng(0).standard_normal(
        frames["u"].shape)
    setup = pdefit.build_problem(
        "aliev_panfilov", {"u": u}, fit=["k", "a"], start={"k": 9.0, "a": 0.12}, dt=0.05,
        frame_interval=0.5, grid=Grid((16, 16), (1.0, 1.0)),
        initial_fields={"u": "fit", "v": "fit"}, regularization={"field_background": 1e-2},
        precision="float64")
    result = pdefit.fit(setup, optimizer="levenberg_marquardt", steps=30, initial_damping=1.0,
                        krylov_iterations=40, discretization_check=False, bootstrap=3)
    laplace = result.uncertainty["parameters"]["a"]
    corrected = result.uncertainty["bootstrap"]["parameters"]["a"]
    assert abs(result.params["a"] - 0.15) > 10 * laplace["std_error"]
    assert not laplace["ci95_low"] <= 0.15 <= laplace["ci95_high"]
    assert corrected["ci95_low"] <= 0.15 <= corrected["ci95_high"]
    assert abs(corrected["corrected"] - 0.15) < 0.5 * abs(result.params["a"] - 0.15)
    assert result.uncertainty["bootstrap"]["replicates"] == 3


def _config(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[
            f"run.dir={tmp_path}", "system.grid.shape=[12,12]", "simulate.n_frames=4",
            "run.progress=false", "run.plots=false", "fit.params=[k,a]", *overrides])


@pytest.mark.parametrize(("overrides", "message"), [
    (("fit.bootstrap=1",), "fit.bootstrap=1"),
    (("fit.bootstrap=-2",), "fit.bootstrap"),
    (("fit.bootstrap=3", "fit.uncertainty=false"), "fit.bootstrap=3")])
def test_bad_bootstrap_options_are_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        cli.fit(_config(tmp_path, *overrides))
    assert not (tmp_path / "config.yaml").exists()


def test_the_command_line_reports_a_bootstrap_and_resumes_it_after_a_signal(
        tmp_path, capsys, caplog, monkeypatch):
    """Two replicates of a small fit: summary.json holds the block and the report prints it.
    A signal during the second replicate ends the run at its refit's next step (status 75),
    with the first kept in bootstrap.json and the refit's checkpoint in bootstrap/; the same
    command then goes on with the second from that step, and the block equals the
    uninterrupted run's to the last bit."""
    options = ("fit.bootstrap=2", "optim=levenberg_marquardt", "optim.steps=3",
               "simulate.steps_per_frame=5", "fit.discretization_check.enabled=false")
    summary = cli.fit(_config(tmp_path / "whole", *options))
    block = summary["uncertainty"]["bootstrap"]
    assert block["replicates"] == 2 and set(block["parameters"]) == {"k", "a"}
    for row in block["parameters"].values():
        assert row["ci95_low"] <= row["corrected"] <= row["ci95_high"]
        assert np.isfinite(row["std_error"])
    assert "bootstrap (2 refits" in capsys.readouterr().out
    assert jnp.isfinite(jnp.asarray(summary["best_loss"]))

    flag, made, calls = PreemptionFlag(), bootstrap.replicate_batch, []

    def signalled(*args, **kwargs):  # the signal arrives while the second replicate is made
        calls.append(1)
        if len(calls) == 2:
            flag.request(signal.SIGTERM)
        return made(*args, **kwargs)

    monkeypatch.setattr(bootstrap, "replicate_batch", signalled)
    with pytest.raises(Preempted) as stopped:
        cli.fit(_config(tmp_path / "cut", *options), preemption=flag)
    assert stopped.value.code == 75
    cut = tmp_path / "cut"
    kept = json.loads((cut / "bootstrap.json").read_text())
    assert len(kept["replicates"]) == 1 and not (cut / "summary.json").exists()
    # The second replicate's refit stopped at its first step boundary, its anchor saved.
    steps = [p.name for p in (cut / "bootstrap" / "replicate-1" / "refit-0" / "checkpoints")
             .iterdir() if p.name.isdigit()]
    assert len(steps) == 1, steps
    assert not (cut / "bootstrap" / "replicate-0").exists()  # kept, so removed
    monkeypatch.setattr(bootstrap, "replicate_batch", made)
    caplog.set_level(logging.DEBUG, logger="pdefit")
    caplog.clear()
    resumed = cli.fit(_config(tmp_path / "cut", *options))
    assert "bootstrap: 1 replicate(s) kept" in caplog.text
    assert "bootstrap replicate 1/2" not in caplog.text  # only the second is refitted,
    assert (f"resuming from checkpoint step {steps[0]} in "  # from its checkpoint
            f"{cut / 'bootstrap' / 'replicate-1' / 'refit-0'}") in caplog.text
    assert not (cut / "bootstrap").exists()
    assert resumed["uncertainty"]["bootstrap"] == block
