"""Is the fitted fields' background prior as wide as their first guess is wrong?
(pdefit.fitting.background)"""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import voltage_only_setup, voltage_only_truth
from hydra import compose, initialize_config_dir

from pdefit.app import cli, fit_report
from pdefit.fitting import background, bootstrap, outcome, uncertainty
from pdefit.options import ConfigError

CONF = str(Path(__file__).resolve().parents[1] / "conf")

SIGMA = 0.01


def _at_truth(offsets: dict[str, float]):
    """The voltage-only problem (noise σ = 0.01, background weight 1e-4) at the true initial
    fields, its background the truth plus Gaussian noise of ``offsets[f]`` × σ_b per cell;
    and σ_b = σ √(C / (N w)) (docs/design-decisions.md), N the observed values."""
    setup = voltage_only_setup(200)
    truth = voltage_only_truth(200)
    weight = setup.problem.regularization.field_background
    n_values = truth["u"].size
    cells = truth["u"][0].size
    prior_sigma = SIGMA * math.sqrt(cells / (n_values * weight))
    rng = np.random.default_rng(3)
    fields = {f: truth[f][0][None] for f in ("u", "v")}
    centre = {f: fields[f] + offsets[f] * prior_sigma * rng.standard_normal(fields[f].shape)
              for f in fields}
    theta = {**setup.theta0, "fields": {f: jnp.asarray(x) for f, x in fields.items()}}
    batch = setup.batch._replace(background={f: jnp.asarray(x) for f, x in centre.items()})
    weights = uncertainty.misfit_weights(setup.problem, batch)["u"]
    return setup.problem, theta, batch, prior_sigma, float(np.ravel(weights)[0]), n_values


def test_a_background_as_wide_as_its_error_is_not_flagged():
    """A background drawn about the truth with the σ_b the weight stands for, at the truth
    (all of it determined): each field sits about σ_b from it (ratio within 10 % of 1) and
    nothing is flagged. The misfit weight per value is 1/N."""
    problem, theta, batch, prior_sigma, misfit, n_values = _at_truth({"u": 1.0, "v": 1.0})
    assert misfit == pytest.approx(1.0 / n_values, rel=1e-12)
    check = background.background_check(problem, theta, batch, SIGMA, misfit)
    for name in ("u", "v"):
        row = check["fields"][name]
        assert row["prior_sigma"] == pytest.approx(prior_sigma, rel=1e-12)
        assert row["ratio"] == pytest.approx(1.0, abs=0.1), name
        assert not row["narrow"]
    assert check["narrow"] == [] and check["matching_weight"] is None


def test_a_first_guess_far_wrong_is_flagged_with_the_weight_that_matches():
    """v's background 3 σ_b off per cell: v is flagged (ratio ≈ 3), u is not, and the weight
    that makes σ_b match v's error is about the used weight / 9; the log says so, naming
    regularization.field_background."""
    problem, theta, batch, _, misfit, _ = _at_truth({"u": 0.1, "v": 3.0})
    check = background.background_check(problem, theta, batch, SIGMA, misfit)
    assert check["fields"]["v"]["ratio"] == pytest.approx(3.0, rel=0.1)
    assert check["fields"]["u"]["ratio"] < 0.2
    assert check["narrow"] == ["v"]
    distance = float(jnp.sqrt(jnp.mean((theta["fields"]["v"] - batch.background["v"]) ** 2)))
    assert check["fields"]["v"]["rms_from_background"] == pytest.approx(distance, rel=1e-12)
    cells = theta["fields"]["v"].size
    assert check["matching_weight"] == pytest.approx(SIGMA**2 * misfit * cells / distance**2,
                                                     rel=1e-12)
    assert check["matching_weight"] == pytest.approx(check["weight"] / 9, rel=0.2)
    lines = background.format_check(check)
    assert len(lines) == 3 and "regularization.field_background" in lines[-1]
    assert lines[-1].startswith("the background prior is narrower")


def test_the_ratio_counts_only_what_the_data_determine():
    """With a quarter of v determined, v's expected distance is σ_b √(1/4): the same
    distance (1.2 σ_b) is twice the ratio, flagged, and the matching weight carries the
    fraction. With 2.56 of its 256 values determined v is not judged: no ratio, no flag,
    whatever its distance."""
    problem, theta, batch, _, misfit, _ = _at_truth({"u": 1.0, "v": 1.2})
    whole = background.background_check(problem, theta, batch, SIGMA, misfit)
    quarter = background.background_check(problem, theta, batch, SIGMA, misfit,
                                          {"u": 1.0, "v": 0.25})
    assert quarter["fields"]["v"]["ratio"] == pytest.approx(
        2 * whole["fields"]["v"]["ratio"], rel=1e-12)
    assert quarter["narrow"] == ["v"]
    row = quarter["fields"]["v"]
    assert quarter["matching_weight"] == pytest.approx(
        SIGMA**2 * misfit * row["values"] * 0.25 / row["rms_from_background"]**2, rel=1e-12)
    problem, theta, batch, _, misfit, _ = _at_truth({"u": 0.1, "v": 3.0})
    hardly = background.background_check(problem, theta, batch, SIGMA, misfit,
                                         {"u": 1.0, "v": 0.01})
    assert not hardly["fields"]["v"]["judged"] and hardly["fields"]["v"]["ratio"] is None
    assert hardly["narrow"] == [] and hardly["matching_weight"] is None
    assert "too little of it" in background.format_check(hardly)[1]


def test_no_background_prior_no_check():
    problem, _, batch, *_ = _at_truth({"u": 1.0, "v": 1.0})
    assert background.available(problem, batch)
    assert not background.available(problem, batch._replace(background={}))


def test_the_fit_outcome_checks_only_a_sigma_it_can_trust():
    """outcome's check runs for one σ from the residual statistics (and names the matching
    weight where v's background is 3 σ_b off), but not for noise-free data (σ at rounding,
    against which any prior is narrow), per-field levels or a missing σ."""
    problem, theta, batch, *_ = _at_truth({"u": 0.1, "v": 3.0})
    lines = []
    stats = {"sigma": SIGMA, "sigma_per_field": None, "residual_at_roundoff": False}
    block = outcome._background(problem, theta, batch, stats, None, lines.append)
    assert block["field_background"]["narrow"] == ["v"] and len(lines) == 3
    for other in ({**stats, "residual_at_roundoff": True}, {**stats, "sigma": None},
                  {**stats, "sigma_per_field": {"u": SIGMA}}, None):
        assert outcome._background(problem, theta, batch, other, None, lines.append) == {}


def _voltage_only_config(tmp_path: Path, *overrides: str):
    """ap_from_voltage made small: 16², 9 frames, u(0) and v(0) fitted with k and a."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[
            "experiment=ap_from_voltage", f"run.dir={tmp_path}", "system.grid.shape=[16,16]",
            "+system.options.initial=blobs",
            "simulate.n_frames=9", "simulate.steps_per_frame=10", "fit.stages=null",
            "run.progress=false", "run.plots=false", "fit.discretization_check.enabled=false",
            *overrides])


def test_the_command_line_recentres_the_background_after_the_last_stage(tmp_path, monkeypatch):
    """fit.recentre_background=2: two more fits of the whole window after the last stage, each
    with the fields' prior centred on the previous fit's best fields (the real
    background.recentred, watched): stage-1 on stage-0's result, stage-2 on stage-1's, which
    is where stage-2 starts; the last fit is what fitted.npz holds. With fit.bootstrap=2 each
    replicate repeats that: the stage the re-centred refits followed, with the prior's
    background remade from the replicate's own first frame (u: that frame; never the data's
    moved background), then twice with it moved to its last result."""
    calls, recentred = [], background.recentred

    def watched(batch, theta):
        moved = recentred(batch, theta)
        calls.append((batch, theta, moved))
        return moved

    monkeypatch.setattr(background, "recentred", watched)
    refits, run_fit = [], fit_report.run_fit  # the bootstrap's refits alone call it there

    def recorded(loss, theta0, batch, cfg, **options):
        done = run_fit(loss, theta0, batch, cfg, **options)
        refits.append((theta0, done[1].best_theta))
        return done

    monkeypatch.setattr(fit_report, "run_fit", recorded)
    summary = cli.fit(_voltage_only_config(
        tmp_path, "fit.recentre_background=2", "fit.bootstrap=2", "optim.steps=5",
        "regularization.field_background=1e-2"))
    assert [(tmp_path / f"stage-{i}" / "metrics.jsonl").exists() for i in range(4)] == [
        True, True, True, False]
    assert len(calls) == 2 + 2 * 2  # the fit's two, then two per replicate
    fit_calls, replicate_calls = calls[:2], calls[2:]
    for _, theta, moved in fit_calls:
        for name in ("u", "v"):
            np.testing.assert_array_equal(np.asarray(moved.background[name]),
                                          np.asarray(theta["fields"][name]))
    first, second = (np.asarray(theta["fields"]["v"]) for _, theta, _ in fit_calls)
    assert np.abs(first - second).max() > 0  # stage-1 moved the fields it was centred on
    fitted = np.load(tmp_path / "fitted.npz")
    assert fitted["fields/v"].shape == first.shape
    block = summary["uncertainty"]["bootstrap"]
    assert block["replicates"] == 2
    # The two replicates' refits moved k to different values (3 steps were too few for their
    # Levenberg–Marquardt to accept any: both then ended at the start).
    assert block["parameters"]["k"]["std_error"] > 0
    data_frame = np.asarray(bootstrap.first_frames(fit_calls[0][0])["u"])
    for (batch, _, _), (again_batch, _, _) in zip(replicate_calls[::2], replicate_calls[1::2],
                                                  strict=True):
        own_frame = np.asarray(bootstrap.first_frames(batch)["u"])
        np.testing.assert_array_equal(np.asarray(batch.background["u"]).ravel(),
                                      own_frame.ravel())
        assert not np.array_equal(own_frame, data_frame)  # fresh noise
        for name in ("u", "v"):  # never the data's moved prior
            for _, theta, _ in fit_calls:
                assert not np.allclose(np.asarray(batch.background[name]),
                                       np.asarray(theta["fields"][name]))
        assert again_batch is batch  # both moves are of this replicate's own prior
    # Each replicate: 1 + 2 refits, the first from the fit's start parameters (the stage the
    # re-centred refits followed started there), each next one from the last one's result.
    assert len(refits) == 2 * 3
    start = {r["name"]: r["start"] for r in summary["parameters"]}
    for index, (theta0, _) in enumerate(refits):
        if index % 3 == 0:
            assert float(np.exp(theta0["params"]["k"])) == pytest.approx(start["k"], rel=1e-9)
        else:
            previous = refits[index - 1][1]
            for name in ("u", "v"):
                np.testing.assert_array_equal(np.asarray(theta0["fields"][name]),
                                              np.asarray(previous["fields"][name]))


@pytest.mark.parametrize("overrides", [
    ("fit.recentre_background=-1",),
    ("fit.recentre_background=1", "regularization.field_background=0"),
    ("fit.recentre_background=1", "fit.initial_fields={u: data, v: data}"),
    ("fit.recentre_background=1", "fit.shooting.segments=2")])
def test_a_recentred_background_without_one_to_move_is_refused(tmp_path, overrides):
    with pytest.raises(ConfigError, match=r"fit\.recentre_background"):
        cli.fit(_voltage_only_config(tmp_path, *overrides))
    assert not (tmp_path / "config.yaml").exists()



def test_the_python_api_recentres_the_background_too(tmp_path, monkeypatch):
    """pdefit.fit(..., recentre=1): one refit after the fit with the prior centred on its
    fields (checkpointed in run_dir/recentre-1); the reported check then measures the last
    refit's step, smaller than the fields' distance from their first guess. The bootstrap's
    replicates repeat the re-centring (the real background.recentred, watched): each refits
    with the prior at its own first guess, then once with it moved, never from the data's
    moved prior. Without a background prior to move the count is refused before any work."""
    import pdefit

    setup = voltage_only_setup(60)
    first_guess = np.asarray(setup.batch.background["v"])
    with pytest.raises(ValueError, match="recentre must be"):
        pdefit.fit(setup._replace(batch=setup.batch._replace(background={})), recentre=1)
    calls, recentred = [], background.recentred

    def watched(batch, theta):
        calls.append((batch, theta))
        return recentred(batch, theta)

    monkeypatch.setattr(background, "recentred", watched)
    result = pdefit.fit(setup, optimizer="levenberg_marquardt", steps=4, initial_damping=1.0,
                        discretization_check=False, recentre=1, bootstrap=2, run_dir=tmp_path)
    assert (tmp_path / "recentre-1" / "metrics.jsonl").exists()
    row = result.uncertainty["field_background"]["fields"]["v"]
    moved = float(np.sqrt(np.mean((result.fields["v"] - first_guess) ** 2)))
    assert row["rms_from_background"] < 0.5 * moved, (row, moved)  # 1 without the refit
    assert result.uncertainty["bootstrap"]["replicates"] == 2
    assert result.uncertainty["bootstrap"]["parameters"]["k"]["std_error"] > 0  # refits moved
    assert (tmp_path / "bootstrap.json").exists()
    assert not (tmp_path / "bootstrap").exists()  # the refits' checkpoints, once kept
    assert len(calls) == 3  # the fit's one, then one per replicate
    (data, fitted), *replicates = calls
    np.testing.assert_array_equal(np.asarray(data.background["v"]), first_guess)
    start = setup.problem.physical_params(setup.theta0)
    for batch, _ in replicates:
        own = bootstrap.first_guesses(setup.problem, batch, start)
        for name in ("u", "v"):
            np.testing.assert_allclose(np.asarray(batch.background[name]),
                                       np.asarray(own[name]).reshape(batch.background[name].shape),
                                       rtol=1e-6, atol=1e-9)
            assert not np.allclose(np.asarray(batch.background[name]),
                                   np.asarray(fitted["fields"][name]))
