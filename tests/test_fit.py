"""End to end through the configs: the embedded default fit, the simulate → Zarr → fit path,
the gradient check command, and every bad input rejected before anything is compiled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from pdefit import data as zd
from pdefit.app import cli
from pdefit.fitting import assemble
from pdefit.model.params import ParameterError
from pdefit.model.system import UnstableTimeStepError

CONF = str(Path(__file__).resolve().parents[1] / "conf")

# A small, fast variant of the default problem (Neumann 20×20, a few frames).
SMALL = ["system.grid.shape=[20,20]", "+system.options.initial=blobs", "simulate.n_frames=4",
         "simulate.steps_per_frame=10",
         "simulate.noise.kind=none", "run.progress=false", "run.plots=false"]
# The fit that the single- and multi-process tests compare.
MULTIPROCESS_FIT = [*SMALL, "optim=adam", "optim.steps=8", "fit.params=[k,a,eps0]",
                    "precision=float64"]


def config(tmp_path: Path, *overrides: str, name: str = "fit"):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=[f"run.dir={tmp_path}", *overrides]
                       if name == "fit" else list(overrides))


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    """A simulated 20×20 AP dataset (4 frames) shared by the bad-input tests."""
    tmp = tmp_path_factory.mktemp("data")
    cfg = config(tmp, *SMALL)
    dtype = assemble.set_precision("float32")
    path = assemble.simulate_dataset(cfg, tmp / "ap.zarr", dtype, log=lambda _: None)
    jax.config.update("jax_enable_x64", True)
    return path


def test_default_fit_recovers_parameters(tmp_path):
    """The README's run command: AP on 64×64 with noisy data, six parameters from ±50 %."""
    summary = cli.fit(config(tmp_path, "run.progress=false"))
    assert summary["mean_rel_error"] <= 0.01, summary["parameters"]
    starts = [row["start_rel_error"] for row in summary["parameters"]]
    assert np.mean(starts) > 0.2  # it really started far away
    for name in ("summary.json", "metrics.jsonl", "loss.png", "fields.png", "config.yaml"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {r["name"] for r in saved["parameters"]} == {"k", "a", "b", "eps0", "mu1", "mu2"}
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert set(first["params"]) == {"k", "a", "b", "eps0", "mu1", "mu2"}


def test_fit_from_zarr_with_store_all_and_adam(tmp_path, small_dataset):
    """A dataset written by the simulator is read back and fitted (float64, adam)."""
    cfg = config(tmp_path, *SMALL, f"data.path={small_dataset}", "adjoint=store_all",
                 "optim=adam", "optim.steps=60", "optim.lr=0.05", "fit.params=[k,a]",
                 "precision=float64")
    summary = cli.fit(cfg)
    assert summary["final_loss"] < 1e-2 * summary["initial_loss"]
    assert summary["mean_rel_error"] < 0.02


def test_xarray_opens_simulated_dataset(small_dataset):
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(small_dataset, consolidated=False)
    assert ds["u"].dims == ("experiment", "time", "y", "x")
    assert ds["u"].shape == (1, 4, 20, 20)
    meta = zd.open_dataset(small_dataset).meta
    assert meta.true_params["k"] == 8.0 and meta.system == "aliev_panfilov"
    np.testing.assert_allclose(ds["time"].values, [0.0, 0.5, 1.0, 1.5])


def test_gradcheck_command_prints_second_order_table(tmp_path, small_dataset, capsys):
    cfg = config(tmp_path, *SMALL, f"data.path={small_dataset}", "precision=float64",
                 "+fit.initial_fields.v=fit")
    rows = cli.gradcheck(cfg)
    orders = [r["order"] for r in rows[1:]]
    assert all(1.7 < o < 2.3 for o in orders), rows
    assert "order" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Bad input: each case raises a message naming the problem, before the training loop.

BAD_INPUT = [
    (["system.name=nonesuch"], assemble.ConfigError, "unknown system 'nonesuch'"),
    (["fit.params=[k,zeta]"], assemble.ConfigError, r"unknown parameter\(s\) \['zeta'\]"),
    (["+system.params.zeta=1.0"], assemble.ConfigError, r"unknown parameter\(s\) \['zeta'\]"),
    (["system.grid.shape=[24,20]"], zd.DatasetError, "grid shape mismatch"),
    (["system.grid.spacing=[0.9,0.9]"], zd.DatasetError, "grid spacing mismatch"),
    (["observe.fields=[u,w]"], assemble.ConfigError, r"unknown field\(s\) \['w'\]"),
    (["system.dt=0.5"], UnstableTimeStepError, "exceeds the stability limit"),
    (["+fit.start.a=1.5", "fit.params=[a]"], assemble.ConfigError, "outside its bounds"),
    (["+fit.start.eps0=-0.1", "fit.params=[eps0]"], assemble.ConfigError, "needs a value > 0"),
    (["data.frames=[]"], assemble.ConfigError, "data.frames"),
    (["system.dt=0.03"], assemble.ConfigError, "not a multiple of system.dt"),
    (["adjoint.snapshots=0"], assemble.ConfigError, "adjoint.snapshots"),
    (["system.integrator=rush_larsen"], assemble.ConfigError, "no gating variables"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_INPUT,
                         ids=[" ".join(o[0]) for o in BAD_INPUT])
def test_bad_input_is_rejected_before_training(tmp_path, small_dataset, no_training,
                                               overrides, error, message):
    cfg = config(tmp_path, *SMALL, f"data.path={small_dataset}", *overrides)
    with pytest.raises(error, match=message):
        cli.fit(cfg)


def test_misspelt_config_key_is_an_error(tmp_path):
    with pytest.raises(ConfigCompositionException):
        config(tmp_path, "optim.lrr=0.1")
    with pytest.raises(ConfigCompositionException):
        config(tmp_path, "optim.steps=many")


def test_missing_dataset_and_missing_field(tmp_path, no_training):
    with pytest.raises(zd.DatasetError):
        cli.fit(config(tmp_path, *SMALL, f"data.path={tmp_path / 'nothing.zarr'}"))
    # A dataset that only has u cannot provide the initial v unless v is fitted.
    meta = zd.DatasetMeta(system="aliev_panfilov", fields=("u",), grid_shape=(20, 20),
                          grid_spacing=(1.0, 1.0), boundaries=("neumann", "neumann"), dt=0.05,
                          steps_per_frame=10, t0=0.0, n_frames=3, n_experiments=1)
    path = tmp_path / "u_only.zarr"
    zd.write_dataset(path, meta, {"u": np.zeros((1, 3, 20, 20), np.float32)})
    with pytest.raises(zd.DatasetError, match=r"no observed field\(s\) \['v'\]"):
        cli.fit(config(tmp_path, *SMALL, f"data.path={path}"))
    with pytest.raises(assemble.ConfigError, match=r"fit\.initial_fields\.v=fit"):
        cli.fit(config(tmp_path, *SMALL, f"data.path={path}", "observe.fields=[u]"))


def test_nan_in_data_outside_mask_is_rejected_and_maskable(tmp_path, monkeypatch):
    meta = zd.DatasetMeta(system="aliev_panfilov", fields=("u", "v"), grid_shape=(20, 20),
                          grid_spacing=(1.0, 1.0), boundaries=("neumann", "neumann"), dt=0.05,
                          steps_per_frame=10, t0=0.0, n_frames=3, n_experiments=1)
    u = np.full((1, 3, 20, 20), 0.1, np.float32)
    u[0, 2, 5, 7] = np.nan
    path = tmp_path / "nan.zarr"
    zd.write_dataset(path, meta, {"u": u, "v": np.zeros_like(u)})
    forbidden = pytest.fail
    monkeypatch.setattr(cli, "run_fit", lambda *a, **k: forbidden("reached training"))
    with pytest.raises(zd.DatasetError, match="NaN"):
        cli.fit(config(tmp_path, *SMALL, f"data.path={path}"))
    # With observe.nan=mask the NaN is a missing value: the build succeeds and weights it out.
    cfg = config(tmp_path, *SMALL, f"data.path={path}", "observe.nan=mask")
    setup = assemble.build_fit(cfg, path, assemble.set_precision("float64"))
    weights = np.asarray(setup.batch.observed.weights["u"])
    assert weights[0, 2, 5, 7] == 0 and weights.sum() == weights.size - 1
    assert np.all(np.isfinite(np.asarray(setup.batch.observed.values["u"])))


def test_parameter_layout_rejects_unknown_transform():
    from pdefit.model.params import ParamSpec
    with pytest.raises(ParameterError, match="unknown transform"):
        ParamSpec(1.0, "sqrt")
    assert math.isclose(float(ParamSpec(0.3, "bounded", 0.0, 1.0).to_physical(
        ParamSpec(0.3, "bounded", 0.0, 1.0).to_unconstrained(0.3))), 0.3)


def test_start_from_a_finished_run(tmp_path, small_dataset):
    """fit.start_from continues from a finished run's fitted values: parameters in physical
    units (so another transform is fine), fitted fields where their shapes match; fit.start
    still wins; a missing file and a wrong shape are config errors."""
    from pdefit.fitting.fitted import read_fitted, save_fitted

    first = tmp_path / "first"
    cli.fit(config(first, *SMALL, f"data.path={small_dataset}", "optim=adam", "optim.steps=5",
                   "optim.lr=0.05", "fit.params=[k,a]", "+fit.initial_fields.v=fit",
                   "precision=float64"))
    stored = read_fitted(first)
    assert set(stored["physical"]) == {"k", "a"} and set(stored["fields"]) == {"v"}
    dtype = assemble.set_precision("float64")
    again = ["fit.params=[k,a,b]", "+fit.initial_fields.v=fit", "precision=float64",
             "+fit.transforms.k=identity"]
    setup = assemble.build_fit(config(tmp_path / "second", *SMALL, f"data.path={small_dataset}",
                                      f"fit.start_from={first}", *again), small_dataset, dtype)
    z = setup.theta0["params"]
    assert float(z["k"]) == pytest.approx(float(stored["physical"]["k"]), rel=1e-12)  # identity
    physical = setup.problem.physical_params(setup.theta0)
    assert float(physical["a"]) == pytest.approx(float(stored["physical"]["a"]), rel=1e-12)
    np.testing.assert_array_equal(np.asarray(setup.theta0["fields"]["v"]), stored["fields"]["v"])
    # The warm start moves where v starts, not its prior: the background is the first guess
    # a cold start from the same parameter values makes.
    same_start = assemble.build_fit(config(
        tmp_path / "same", *SMALL, f"data.path={small_dataset}", *again,
        *(f"+fit.start.{n}={float(stored['physical'][n])!r}" for n in ("k", "a"))),
        small_dataset, dtype)
    np.testing.assert_array_equal(np.asarray(setup.batch.background["v"]),
                                  np.asarray(same_start.batch.background["v"]))
    assert not np.array_equal(np.asarray(setup.batch.background["v"]), stored["fields"]["v"])
    cold = assemble.build_fit(config(tmp_path / "cold", *SMALL, f"data.path={small_dataset}",
                                     *again), small_dataset, dtype)
    assert float(setup.start_values["b"]) == float(cold.start_values["b"])  # not in the file
    assert float(setup.start_values["k"]) != float(cold.start_values["k"])
    explicit = assemble.build_fit(config(tmp_path / "third", *SMALL,
                                         f"data.path={small_dataset}", f"fit.start_from={first}",
                                         "+fit.start.k=7.5", *again), small_dataset, dtype)
    assert explicit.start_values["k"] == 7.5

    with pytest.raises(assemble.ConfigError, match="does not exist"):
        assemble.build_fit(config(tmp_path / "x", *SMALL, f"data.path={small_dataset}",
                                  f"fit.start_from={tmp_path / 'nowhere'}"), small_dataset, dtype)
    wrong = tmp_path / "wrong.npz"
    save_fitted(wrong, {"params": {"k": np.zeros(3)}}, {"k": np.zeros(3)})
    with pytest.raises(assemble.ConfigError, match=r"'k' there has shape \(3,\)"):
        assemble.build_fit(config(tmp_path / "y", *SMALL, f"data.path={small_dataset}",
                                  f"fit.start_from={wrong}"), small_dataset, dtype)


def test_parameter_check_names_the_first_bad_element():
    """Scalars and arrays share one validity rule; an array's message names its element."""
    from pdefit.model.params import ParamSpec

    rate = ParamSpec(1.0, "log", shape=(3,))
    rate.check("p", np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ParameterError, match=r"'p\[1\]' has a log transform"):
        rate.check("p", np.array([1.0, -1.0, 2.0]))
    with pytest.raises(ParameterError, match=r"'p\[2\]': value nan is not finite"):
        rate.check("p", np.array([1.0, 2.0, np.nan]))
    fraction = ParamSpec(0.5, "bounded", 0.0, 1.0)
    with pytest.raises(ParameterError, match=r"'q': value 1.0 is outside its bounds"):
        fraction.check("q", 1.0)  # the bounded transform excludes its bounds
    ParamSpec(0.5, "identity", 0.0, 1.0).check("r", 1.0)  # identity includes them
    assert list(fraction.valid(np.array([0.0, 0.5, 1.0]))) == [False, True, False]


def test_system_penalty_maps_over_experiments_only_when_it_reads_their_values():
    """A system penalty that reads only shared parameters is traced once on them; one that
    reads a per-experiment parameter is averaged over the experiments' values."""
    import jax.numpy as jnp

    from pdefit.fitting.problem import system_term

    shared, own = {"a": jnp.asarray(2.0)}, {"b": jnp.asarray([1.0, 2.0, 6.0])}
    calls = []

    def shared_only(params):
        calls.append(sorted(params))
        return params["a"] ** 2

    assert float(system_term(shared_only, shared, own)) == 4.0
    assert calls == [["a"]]  # never given, nor mapped over, the per-experiment values
    assert float(system_term(lambda p: p["a"] * p["b"], shared, own)) == pytest.approx(6.0)
    with pytest.raises(KeyError):
        system_term(lambda p: p["missing"], shared, {})
