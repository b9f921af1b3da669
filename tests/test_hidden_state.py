"""No hidden truth and noise as an input (issue 24, items 1 and 3): an unobserved field never
starts from the dataset's first frame unless ``fit.initial_fields.<f>=data`` says so, refused
before any work otherwise; the loss weighs each field by its noise level; a recording's noise
level (``pdefit-import --noise-sigma``, ``pdefit.write_dataset(noise_sigma=...)``,
``observe.noise_sigma``) is what the residual verdict judges against."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
import pytest

import pdefit
from pdefit import data as zd
from pdefit.app import cli, importer
from pdefit.options import ConfigError
from tests.test_validation import config

HIDDEN_V = ("fit.initial_fields: v is not observed (observe.fields=[u]) and would start from "
            "the dataset's first frame, a hidden truth a recording does not have; fit it "
            "(fit.initial_fields.v=fit) or, for a known initial state, fit.initial_fields.v=data")


@pytest.fixture(scope="module")
def ap_frames(tmp_path_factory) -> dict[str, np.ndarray]:
    """u and v of a small Aliev–Panfilov run (12², 5 frames 0.5 apart, float64)."""
    where = tmp_path_factory.mktemp("hidden")
    jax.config.update("jax_enable_x64", True)
    ds = pdefit.simulate_dataset(pdefit.get_system("aliev_panfilov", initial="blobs"),
                                 where / "ap.zarr",
                                 grid=pdefit.Grid((12, 12), (1.0, 1.0), ("neumann", "neumann")),
                                 dt=0.05, n_frames=5, steps_per_frame=10, precision="float64")
    return {f: ds.read(f)[0].astype(np.float64) for f in ("u", "v")}


def recording(path: Path, frames: dict[str, np.ndarray], **kwargs) -> Path:
    return pdefit.write_dataset(path, frames, 0.5 * np.arange(5), **kwargs)


def problem(path: Path, **kwargs):
    return pdefit.build_problem("aliev_panfilov", path, fit=["k"], start={"k": 6.0},
                                dt=0.05, precision="float64", **kwargs)


def test_hidden_initial_state_is_refused_before_any_work(tmp_path, no_training):
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        cli.fit(config(run_dir, "observe.fields=[u]"))
    assert str(err.value) == HIDDEN_V
    assert not run_dir.exists()  # before the embedded default's dataset is simulated
    assert time.perf_counter() - started < 20
    with pytest.raises(ConfigError, match=r"v, w, s are not observed \(observe.fields=\[u\]\)"
                                          r".*fit.initial_fields.v=fit fit.initial_fields.w="):
        cli.fit(config(run_dir, "system=bocf", "system.options.initial=rest", "observe.fields=[u]",
                       "fit.params=[tau_fi]"))
    with pytest.raises(ConfigError, match=r"fit.initial_fields.v=guess: the source is data or "
                                          "fit"):
        cli.fit(config(run_dir, "observe.fields=[u]", "+fit.initial_fields.v=guess"))
    with pytest.raises(ConfigError, match=r"observe.noise_sigma: the level of 'u' must be a "
                                          "positive number"):
        cli.fit(config(run_dir, "observe.noise_sigma={u: 0, v: 0.1}"))
    assert not run_dir.exists()


def test_build_problem_takes_a_known_initial_state_only_when_told(tmp_path, ap_frames):
    both = recording(tmp_path / "uv.zarr", ap_frames)
    with pytest.raises(ConfigError) as err:
        problem(both, observe=["u"])
    assert str(err.value) == HIDDEN_V
    # Known initial state (a twin experiment): the dataset's first frame of v.
    known = problem(both, observe=["u"], initial_fields={"v": "data"})
    np.testing.assert_array_equal(np.asarray(known.batch.initial["v"])[0], ap_frames["v"][0])
    # Fitted: it starts from the system's first guess from the observed u (v on its
    # nullcline above threshold), never from the truth; that guess is its prior's background.
    fitted = problem(both, observe=["u"], initial_fields={"v": "fit"})
    assert fitted.problem.fitted_fields == ("v",)
    start = np.asarray(fitted.theta0["fields"]["v"])[0]
    system = fitted.problem.system
    guess = system.initial_guess({"u": ap_frames["u"][0]},
                                 fitted.problem.physical_params(fitted.theta0))["v"]
    np.testing.assert_allclose(start, np.asarray(guess), rtol=1e-6)
    assert "v" not in fitted.batch.initial and not np.allclose(start, ap_frames["v"][0])
    np.testing.assert_array_equal(np.asarray(fitted.batch.background["v"]), start[None])
    only_u = recording(tmp_path / "u.zarr", {"u": ap_frames["u"]})
    with pytest.raises(ConfigError, match=r"fit.initial_fields.v=data: the dataset holds no "
                                          r"'v' .*fit.initial_fields.v=fit"):
        problem(only_u, observe=["u"], initial_fields={"v": "data"})


def test_loss_weighs_each_field_by_its_noise_level(tmp_path, ap_frames):
    plain = recording(tmp_path / "plain.zarr", ap_frames)
    noisy = recording(tmp_path / "sigma.zarr", ap_frames, noise_sigma={"u": 0.01, "v": 0.1})
    assert zd.open_dataset(noisy).meta.noise == {"kind": "additive",
                                                 "sigma": {"u": 0.01, "v": 0.1}}

    def loss(path, observe, **kwargs):
        setup = problem(path, observe=observe, **kwargs)
        return float(setup.problem.loss(setup.theta0, setup.batch))

    known = {"initial_fields": {"v": "data"}}
    per_field = {"u": loss(plain, ["u"], **known), "v": loss(plain, ["v"], initial_fields={
        "u": "data"})}
    mean = (1 / 0.01**2 + 1 / 0.1**2) / 2
    weighted = per_field["u"] / 0.01**2 / mean + per_field["v"] / 0.1**2 / mean
    assert loss(noisy, ["u", "v"]) == pytest.approx(weighted, rel=1e-12)
    assert loss(plain, ["u", "v"]) == pytest.approx(per_field["u"] + per_field["v"], rel=1e-12)
    # One field: the loss keeps its scale whatever its level.
    assert loss(noisy, ["u"], **known) == per_field["u"]


def test_given_noise_level_is_what_the_verdict_judges(tmp_path, ap_frames):
    rng = np.random.default_rng(4)
    sigma = 0.01
    # A known, noise-free initial state (a twin experiment); noise on every later frame.
    frames = {f: np.concatenate([v[:1], v[1:] + sigma * rng.standard_normal(v[1:].shape)])
              for f, v in ap_frames.items()}
    path = recording(tmp_path / "noisy.zarr", frames)
    assert zd.open_dataset(path).meta.noise == {"kind": "none"}
    summary = cli.fit(config(tmp_path / "run", "data=zarr", f"data.path={path}",
                             "system.grid.shape=[12,12]",
                             f"observe.noise_sigma={sigma}", "fit.params=[k,a]",
                             "fit.perturb.low=0.9", "fit.perturb.high=1.1",
                             "optim=lbfgs", "optim.steps=30", "precision=float64",
                             "fit.discretization_check.enabled=false"))
    residual = summary["residual"]
    assert residual["noise_source"] == "observe.noise_sigma"
    assert residual["noise_sigma"] == sigma
    assert 0.8 < residual["reduced_chi2"] < 1.3, residual
    assert summary["uncertainty"]["sigma_source"] == "observe.noise_sigma"


def test_recorded_noise_level_from_import_and_write_dataset(tmp_path, ap_frames):
    np.save(tmp_path / "u.npy", ap_frames["u"])
    importer.main([str(tmp_path / "u.npy"), str(tmp_path / "u.zarr"), "--field", "u",
                   "--time-step", "0.5", "--noise-sigma", "0.02"])
    assert zd.open_dataset(tmp_path / "u.zarr").meta.noise == {"kind": "additive",
                                                               "sigma": 0.02}
    with pytest.raises(SystemExit):
        importer.main([str(tmp_path / "u.npy"), str(tmp_path / "x.zarr"), "--field", "u",
                       "--time-step", "0.5", "--noise-sigma", "u=-1"])
    with pytest.raises(zd.DatasetError, match=r"noise_sigma names unknown field\(s\) \['w'\]"):
        recording(tmp_path / "w.zarr", ap_frames, noise_sigma={"w": 0.1})
    with pytest.raises(zd.DatasetError, match="cannot be drawn"):
        zd.add_noise(ap_frames["u"], {"kind": "additive", "sigma": 0.1})


def test_recorded_levels_per_field_weigh_the_fit_and_judge_its_residual(tmp_path, ap_frames):
    """u with σ = 0.005 and v with σ = 0.02 recorded per field (a known, noise-free initial
    state): the whitened residual is the noise, and the intervals cover the truth."""
    rng = np.random.default_rng(5)
    sigma = {"u": 0.005, "v": 0.02}
    frames = {f: np.concatenate([v[:1], v[1:] + sigma[f] * rng.standard_normal(v[1:].shape)])
              for f, v in ap_frames.items()}
    path = recording(tmp_path / "levels.zarr", frames, noise_sigma=sigma)
    setup = pdefit.build_problem("aliev_panfilov", path, fit=["k", "a"],
                                 start={"k": 7.5, "a": 0.16}, dt=0.05, precision="float64")
    weights = dict(setup.problem.observation.field_weights)
    assert weights["u"] / weights["v"] == pytest.approx(16.0)
    result = pdefit.fit(setup, optimizer="lbfgs", steps=40, discretization_check=False)
    assert result.residual["noise_sigma"] == sigma
    assert result.residual["noise_source"] == "dataset"
    assert 0.75 < result.residual["reduced_chi2"] < 1.3, result.residual
    for name, true in (("k", 8.0), ("a", 0.15)):
        low, high = result.intervals[name]
        assert low < true < high
