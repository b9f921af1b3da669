"""The Python API (pdefit.get_system / open_dataset / build_problem / fit): the README's
snippet run as written on a small dataset, the same problem as the command line's, errors
before compilation, and a docstring on every public name."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import pdefit
from pdefit.app.config import register_configs
from pdefit.data import DatasetError
from pdefit.fitting import assemble
from pdefit.fitting.train import ResumeMismatchError

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
SMALL = ["system.grid.shape=[20,20]", "+system.options.initial=blobs", "simulate.n_frames=7",
         "simulate.steps_per_frame=10", "run.progress=false", "run.plots=false"]


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"<!-- api-snippet -->\n```python\n(.*?)```", text, re.DOTALL)
    return block


def config(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[*SMALL, *overrides])


@pytest.fixture(scope="module")
def ap_zarr(tmp_path_factory) -> Path:
    """A 20×20 Aliev–Panfilov dataset of 7 frames, written where the snippet looks."""
    where = tmp_path_factory.mktemp("api")
    jax.config.update("jax_enable_x64", True)
    dtype = assemble.set_precision("float64")
    return assemble.simulate_dataset(config(), where / "ap.zarr", dtype, log=lambda _: None)


def test_readme_snippet_fits_a_dataset(ap_zarr, monkeypatch, capsys):
    snippet = readme_snippet()
    assert len(snippet.strip().splitlines()) <= 20
    monkeypatch.chdir(ap_zarr.parent)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "aliev_panfilov (20, 20) 7 frames" in printed
    result = namespace["result"]
    assert set(result.params) == {"k", "a"} and result.start == {"k": 6.0, "a": 0.1}
    assert result.reference["k"] == 8.0
    errors = result.relative_errors()
    assert max(errors.values()) < 1e-4, (result.params, errors)
    assert result.steps <= 50 and result.best_loss < 1e-8 * result.losses[0]


def test_refined_data_are_fitted_at_the_step_they_were_made_for(tmp_path):
    """Without dt= and integrator=, data made at dt/4 with Heun are fitted at dt with Heun:
    the dataset records the step it simulated (dt/4) and the refinement."""
    dtype = assemble.set_precision("float64")
    path = assemble.simulate_dataset(
        config("simulate.n_frames=3", "system.integrator=heun", "system.dt=0.04",
               "simulate.refine.dt_factor=4"), tmp_path / "fine.zarr", dtype, log=lambda _: None)
    assert pdefit.open_dataset(path).meta.dt == pytest.approx(0.01)
    setup = pdefit.build_problem("aliev_panfilov", path, fit=["k"])
    assert setup.problem.dt == pytest.approx(0.04) and setup.problem.integrator == "heun"
    assert setup.problem.n_steps == 20  # 2 frame intervals of 10 steps at dt = 0.04
    other = pdefit.build_problem("aliev_panfilov", path, fit=["k"], dt=0.02, integrator="rk4")
    assert other.problem.dt == 0.02 and other.problem.integrator == "rk4"


def test_api_and_command_line_build_the_same_problem(ap_zarr):
    """build_problem and the Hydra path share assemble.build_fit: same loss at the start."""
    api = pdefit.build_problem("aliev_panfilov", ap_zarr, fit=["k", "a"],
                               start={"k": 6.0, "a": 0.1}, frames=range(6))
    cfg = config(f"data.path={ap_zarr}", "data.frames=[0,1,2,3,4,5]", "fit.params=[k,a]",
                 "+fit.start.k=6.0", "+fit.start.a=0.1", "fit.perturb=null",
                 "system.dt=0.05", "precision=float64")
    cli = assemble.build_fit(cfg, ap_zarr, assemble.set_precision("float64"))
    assert api.problem.n_steps == cli.problem.n_steps == 50
    assert api.start_values == cli.start_values
    loss_api = jax.jit(api.problem.loss)(api.theta0, api.batch)
    loss_cli = jax.jit(cli.problem.loss)(cli.theta0, cli.batch)
    np.testing.assert_allclose(float(loss_api), float(loss_cli), rtol=1e-12)


def test_frames_in_memory_give_the_same_problem(ap_zarr):
    ds = pdefit.open_dataset(ap_zarr)
    meta = ds.meta
    frames = {name: ds.read(name)[0] for name in meta.fields}  # (n_frames, ny, nx) each
    grid = pdefit.Grid(meta.grid_shape, meta.grid_spacing, meta.boundaries)
    common = {"fit": ["k"], "start": {"k": 6.0}, "frames": [0, 1, 2]}
    memory = pdefit.build_problem("aliev_panfilov", frames, grid=grid, dt=meta.dt,
                                  frame_interval=meta.frame_interval, **common)
    disk = pdefit.build_problem("aliev_panfilov", ds, **common)
    assert memory.reference is None and disk.reference["k"] == 8.0
    loss = jax.jit(disk.problem.loss)
    assert float(loss(memory.theta0, memory.batch)) == float(loss(disk.theta0, disk.batch))
    with pytest.raises(ValueError, match="not a multiple of dt"):
        pdefit.build_problem("aliev_panfilov", frames, grid=grid, dt=meta.dt,
                             frame_interval=0.7 * meta.dt, **common)


def test_fit_with_a_run_directory_resumes(ap_zarr, tmp_path):
    setup = pdefit.build_problem("aliev_panfilov", ap_zarr, fit=["k"], start={"k": 6.0},
                                 frames=[0, 1])
    first = pdefit.fit(setup, optimizer="adam", steps=2, lr=0.05, run_dir=tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    again = pdefit.fit(setup, optimizer="adam", steps=4, lr=0.05, run_dir=tmp_path)
    assert first.steps == 2 and again.steps == 4 and again.history.restarts == 1
    assert again.losses[:2] == first.losses[:2]
    # Another start or optimiser is not continued from these checkpoints.
    other = pdefit.build_problem("aliev_panfilov", ap_zarr, fit=["k"], start={"k": 7.0},
                                 frames=[0, 1])
    with pytest.raises(ResumeMismatchError, match=r"start\.k: 6\.0 → 7\.0"):
        pdefit.fit(other, optimizer="adam", steps=4, lr=0.05, run_dir=tmp_path)
    with pytest.raises(ResumeMismatchError, match=r"optim\.lr"):
        pdefit.fit(setup, optimizer="adam", steps=4, lr=0.1, run_dir=tmp_path)


def test_api_rejects_bad_input_before_compiling(ap_zarr):
    with pytest.raises(assemble.ConfigError, match=r"fit: unknown parameter\(s\) \['kk'\]"):
        pdefit.build_problem("aliev_panfilov", ap_zarr, fit=["kk"])
    with pytest.raises(DatasetError, match="bocf"):
        pdefit.build_problem("bocf", ap_zarr, fit=["tau_fi"], observe=["u"])
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        pdefit.get_system("nope")
    setup = pdefit.build_problem("aliev_panfilov", ap_zarr, fit=["k"], frames=[0, 1])
    with pytest.raises(ValueError, match=r"unknown optimizer option\(s\) \['learning_rate'\]"):
        pdefit.fit(setup, optimizer="adam", steps=1, learning_rate=0.1)


def test_every_public_name_has_a_docstring():
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", pdefit.__version__)
    missing = []
    for name in pdefit.__all__:
        if name == "__version__":
            continue
        doc = (getattr(pdefit, name).__doc__ or "").strip()
        # A NamedTuple's or dataclass's generated docstring is just its signature.
        if len(doc) < 20 or doc.startswith(f"{name}("):
            missing.append(name)
    assert not missing, missing


def test_simulate_dataset_then_fit_reports_intervals_verdict_and_stop_reason(tmp_path):
    """pdefit.simulate_dataset writes a dataset from Python (no config names) that
    build_problem and fit recover from; the result carries the command line's 95 %
    intervals, the residual's verdict and why the optimiser stopped."""
    system = pdefit.get_system("aliev_panfilov", initial="blobs")
    grid = pdefit.Grid((12, 12), (1.0, 1.0), ("neumann", "neumann"))
    ds = pdefit.simulate_dataset(system, tmp_path / "noisy.zarr", grid=grid, dt=0.05,
                                 n_frames=5, steps_per_frame=10, params={"k": 7.0},
                                 noise_sigma=1e-3, precision="float64")
    meta = ds.meta
    assert meta.grid_shape == (12, 12) and meta.n_frames == 5 and meta.true_params["k"] == 7.0
    assert meta.noise == {"kind": "additive", "sigma": 1e-3, "seed": 0, "streams": "per_field"}
    with pytest.raises(DatasetError, match="overwrite=True"):
        pdefit.simulate_dataset(system, ds.path, grid=grid, dt=0.05, n_frames=5,
                                steps_per_frame=10)

    setup = pdefit.build_problem(system, ds, fit=["k"], start={"k": 6.0})
    result = pdefit.fit(setup, optimizer="lbfgs", steps=40, discretization_check=False)
    assert result.stop_reason == result.history.stop_reason == "converged"
    low, high = result.intervals["k"]
    assert low < 7.0 < high and high - low < 0.1
    assert result.uncertainty["sigma_source"] == "dataset"
    # The initial state is the noisy first frame: its noise is carried into the later ones.
    assert result.uncertainty["copied_initial_values"] > 0
    assert result.residual["verdict"] == "noise", result.residual
    assert 1.0 < result.residual["reduced_chi2"] < 2.0
    assert "carried by the initial state" in result.residual["message"]
    assert result.residual["noise_sigma"] == 1e-3

    short = pdefit.fit(setup, optimizer="adam", steps=2, lr=0.05, uncertainty=False,
                       discretization_check=False)
    assert short.stop_reason == "steps_done" and short.steps == 2
    assert short.uncertainty is None and short.residual is None and short.intervals == {}


def test_residual_verdicts():
    from pdefit.fitting.outcome import residual_verdict

    block = {"available": True, "rss": 100e-6, "n_values": 101, "dof": 100,
             "sigma": 1e-3, "sigma_source": "dataset", "residual_at_roundoff": False}
    assert residual_verdict(block)["verdict"] == "noise"
    copied = {**block, "rss": 170e-6, "copied_initial_values": 144}
    assert residual_verdict(copied)["verdict"] == "noise"
    assert residual_verdict({**copied, "copied_initial_values": 0})["verdict"] == "above_noise"
    assert residual_verdict({**block, "rss": 400e-6})["verdict"] == "above_noise"
    assert residual_verdict({**block, "rss": 10e-6})["verdict"] == "below_noise"
    assert residual_verdict({**block, "model_error_dominated": True})["verdict"] == "model_error"
    estimated = {**block, "sigma_source": "residual"}
    assert residual_verdict(estimated)["verdict"] == "estimated"
    assert residual_verdict({**estimated, "residual_at_roundoff": True})["verdict"] == "roundoff"
    # A twin fitted to its rounding: the discretization check's flag is no model error.
    assert residual_verdict({**estimated, "residual_at_roundoff": True,
                             "model_error_dominated": True})["verdict"] == "roundoff"
    assert residual_verdict({"available": False, "reason": "x"})["verdict"] == "unknown"
