"""Bad numeric settings are refused before anything is written or compiled, each error naming
its key; legal but almost certainly wrong ones are warned about (issue 16, item 4 and 6)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pdefit.app import cli
from pdefit.options import ConfigError

CONF = str(Path(__file__).resolve().parents[1] / "conf")
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
        "simulate.steps_per_frame=10", "adjoint=store_all", "run.progress=false",
        "run.plots=false"]

# (overrides, the message the error must contain): every formerly silent or late case.
BAD = {
    "negative lr": (["optim=adam", "optim.lr=-1"], "optim.lr must be > 0"),
    "nan lr": (["optim=adam", "optim.lr=nan"], "optim.lr must be a finite number"),
    "negative clip": (["optim=adam", "optim.clip=-1"], "optim.clip must be > 0"),
    "negative regularization": (["regularization.params=-0.1"],
                                "regularization.params must be >= 0"),
    "zero steps": (["optim.steps=0"], "optim.steps must be an integer >= 1"),
    "nothing fitted": (["fit.params=[]"], "fit.params is empty"),
    "unknown field weight": (["+observe.field_weights.w=2"],
                             "observe.field_weights: ['w'] are not observed fields"),
    "negative max_nan_failures": (["optim.max_nan_failures=-1"],
                                  "optim.max_nan_failures must be an integer >= 0"),
    "warmup beyond steps": (["optim=adam", "optim.steps=10", "optim.warmup_steps=20"],
                            "optim.warmup_steps (20) must be less than optim.steps (10)"),
    "zero stride": (["observe.stride=0"], "observe.stride must be an integer >= 1"),
    "perturb low > high": (["fit.perturb.low=2", "fit.perturb.high=1"],
                           "fit.perturb.low (2.0) must not exceed fit.perturb.high"),
    "negative perturb": (["fit.perturb.low=-1"], "fit.perturb.low must be > 0"),
    "checkpoint_every 0": (["run.checkpoint_every=0"],
                           "run.checkpoint_every must be an integer >= 1"),
    "zero dt": (["system.dt=0"], "system.dt must be > 0"),
    # Issue 25: formerly accepted silently, or refused only after the data were simulated.
    "unknown key with +": (["+optim.lrr=0.1"], "optim.lrr: unknown key; did you mean optim.lr?"),
    "data=zarr without data.path": (["data=zarr"], "data.path is required"),
    "stride beyond the grid": (["system.grid.shape=[32,32]", "observe.stride=1000"],
                               "observe.stride=1000 observes 1×1 point(s) of the 32×32 grid"),
    "fit.params typo": (["fit.params=[kk,a]"], "fit.params: unknown parameter(s) ['kk'] for "
                                               "aliev_panfilov; did you mean 'k'?"),
    "fit.start typo": (["+fit.start.kk=1"], "fit.start: unknown parameter(s) ['kk']"),
    "observe.fields typo": (["observe.fields=[uu]"],
                            "observe.fields: unknown field(s) ['uu'] for aliev_panfilov; did you "
                            "mean 'u'?"),
    "system.params typo": (["+system.params.kk=1"], "system.params: unknown parameter(s) ['kk']"),
    "initial field typo": (["+fit.initial_fields.w=fit"],
                           "fit.initial_fields: unknown field(s) ['w']"),
    "memory budget too small": (["adjoint=revolve", "adjoint.snapshots=null",
                                 "adjoint.memory_budget_mb=0.001"],
                                "adjoint.memory_budget_mb=0.001 holds no snapshot"),
    "grid beyond the host's memory": (["system.grid.shape=[100000,100000]"],
                                      "system.grid.shape=[100000, 100000]: one state of"),
    "one simulated frame": (["simulate.n_frames=1"], "simulate.n_frames=1: a dataset needs at "
                                                     "least 2 frames"),
    "no segments": (["fit.shooting.segments=0"],
                    "fit.shooting.segments must be an integer >= 1"),
    "no continuity": (["fit.shooting.segments=2", "fit.shooting.continuity=0"],
                      "fit.shooting.continuity must be > 0"),
    "shooting on a mesh": (["fit.shooting.segments=2", "mesh.shape=[2,1]"],
                           "fit.shooting.segments=2: multiple shooting runs on one device"),
    "grid that does not split over the mesh": (
        ["mesh.shape=[3,1]"], "mesh.shape=[3, 1]: grid axis y of"),
}


def config(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[f"run.dir={run_dir}", *TINY, *overrides])


@pytest.mark.parametrize("case", list(BAD))
def test_bad_setting_is_refused_before_anything_is_written(tmp_path, no_training, case):
    overrides, message = BAD[case]
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        cli.fit(config(run_dir, *overrides))
    assert message in str(err.value)
    assert not run_dir.exists()  # refused before the run directory was made
    assert time.perf_counter() - started < 20  # nothing compiled (Hydra compose included)


def test_grid_too_small_for_the_initial_state_warns(tmp_path):
    from pdefit.app.validate import validate_fit

    warnings: list[str] = []
    validate_fit(config(tmp_path, "system.grid.shape=[3,3]", "~system.options.initial"),
                 log=warnings.append)
    assert any("system.grid.shape=[3, 3]" in w and "(nearly) constant" in w for w in warnings)
    quiet: list[str] = []
    validate_fit(config(tmp_path), log=quiet.append)  # blobs on 16×16: fine
    assert quiet == []


def test_checkpoint_every_step_warns(tmp_path):
    from pdefit.app.validate import validate_fit

    warnings: list[str] = []
    validate_fit(config(tmp_path, "run.checkpoint_every=1"), log=warnings.append)
    assert any("run.checkpoint_every=1" in w and "slower" in w for w in warnings)


def test_evaluate_horizon_must_be_positive(tmp_path):
    from pdefit.app.evaluate import EvaluationError, load_run_config

    (tmp_path / "config.yaml").write_text("run: {plots: false}\n")
    with pytest.raises(EvaluationError, match=r"evaluate.horizon must be a positive number"):
        load_run_config(tmp_path, ["evaluate.horizon=-1"])



def test_open_dicts_take_new_names_and_a_good_stride_passes(tmp_path):
    """Keys under dict-typed options (parameters, fields, a system's options) are free, and
    names the system knows pass the checks against it."""
    from pdefit.app.config import to_options
    from pdefit.app.validate import validate_fit

    cfg = to_options(config(tmp_path, "+system.params.k=8.5", "+fit.start.a=0.1",
                            "+fit.initial_fields.v=fit", "+observe.field_weights.u=2",
                            "+regularization.param_l2.k=0.1", "observe.stride=4"))
    validate_fit(cfg, log=lambda _: None)


def test_closest_key_of_an_unknown_one():
    from pdefit.app.config import closest_key, unknown_key_message
    from pdefit.options import SimulateMainConfig

    assert closest_key("optim.lrr") == "optim.lr"
    assert closest_key("optm.lr") == "optim.lr"
    assert closest_key("system.gird.shape") == "system.grid.shape"
    assert closest_key("simulate.overwrit", SimulateMainConfig) == "simulate.overwrite"
    assert "the keys under fit.perturb" in unknown_key_message("fit.perturb.zzz")


def test_simulate_is_validated_before_work(tmp_path):
    from pdefit.app.config import to_options
    from pdefit.app.validate import validate_simulate
    from pdefit.options import SimulateMainConfig

    def simulate_config(*overrides: str) -> SimulateMainConfig:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            return to_options(compose(config_name="simulate", overrides=[*TINY[:4], *overrides]),
                              SimulateMainConfig)

    validate_simulate(simulate_config())
    for overrides, message in (
            (["simulate.n_frames=1"], "simulate.n_frames=1: a dataset needs at least 2 frames"),
            (["+system.params.kk=1"], "system.params: unknown parameter(s) ['kk'] for "
                                      "aliev_panfilov; did you mean 'k'?"),
            (["system.grid.shape=[100000,100000]"], "system.grid.shape=[100000, 100000]")):
        with pytest.raises(ConfigError) as err:
            validate_simulate(simulate_config(*overrides))
        assert message in str(err.value)


def test_every_later_value_missing_is_refused_before_training(tmp_path, no_training):
    """observe.nan=mask with every u after frame 0 missing used to "converge at step 1" and
    report the start values as recovered."""
    import numpy as np
    import zarr

    from pdefit.fitting import assemble

    dataset = assemble.simulate_dataset(config(tmp_path / "sim"), tmp_path / "ap.zarr",
                                        assemble.set_precision("float32"), log=lambda _: None)
    u = zarr.open_group(dataset, mode="r+")["u"]
    values = u[:]
    values[:, 1:] = np.nan
    u[:] = values
    with pytest.raises(ConfigError, match=r"observe.nan=mask: no value of \['u'\] after the "
                                          "first frame"):
        cli.fit(config(tmp_path / "run", "data=zarr", f"data.path={dataset}",
                       "observe.nan=mask", "observe.fields=[u]",
                       # known initial state: a twin experiment
                       "+fit.initial_fields.v=data"))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (Path(CONF) / "experiment").glob(
    "*.yaml")))
def test_every_shipped_experiment_composes_and_validates(tmp_path, experiment):
    """Each ``conf/experiment/*.yaml`` composes with the schema, becomes typed options and
    passes the checks made before any work (a misspelt or retyped key fails here)."""
    from pdefit.app.config import to_options
    from pdefit.app.validate import validate_fit

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        composed = compose(config_name="fit", overrides=[f"run.dir={tmp_path}",
                                                          f"experiment={experiment}"])
    validate_fit(to_options(composed), log=lambda _: None)
