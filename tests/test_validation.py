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

