"""The command line reads the dataset (issue 25, item 2): ``pdefit-fit data=zarr data.path=X``
takes the grid from the dataset, a conflicting override is an error naming both values, and a
system named by ``system.name`` starts from its own defaults (pdefit/app/from_dataset.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import pdefit
from pdefit.app.from_dataset import (
    CommandLine,
    complete_config,
    grid_from_dataset,
    is_given,
    override_keys,
    own_defaults,
)
from pdefit.options import ConfigError, DataConfig, FitConfig, GridConfig, SystemConfig

BIN = Path(sys.executable).parent
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
FAST = ["fit.params=[k]", "optim.steps=2", "run.plots=false", "run.progress=false",
        "fit.discretization_check.enabled=false", "fit.uncertainty=false"]
AP = CommandLine(frozenset(), "aliev_panfilov", frozenset({"aliev_panfilov", "bocf"}),
                 "aliev_panfilov")
# A user system outside pdefit with options and a step of its own, none of them
# Aliev–Panfilov's.
USER_SYSTEM = '''
from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from pdefit import ParamSpec
from pdefit.numerics.stencils import laplacian


@dataclass(frozen=True)
class Decay:
    strength: float = 1.0

    name: ClassVar[str] = "decay"
    fields: ClassVar[tuple[str, ...]] = ("u",)
    stencil_radius: ClassVar[int] = 1
    params: ClassVar[dict] = {"D": ParamSpec(0.1, "log"), "r": ParamSpec(0.5, "log")}

    def rhs(self, state, p, t, grid):
        return {"u": p["D"] * laplacian(state["u"], grid) - p["r"] * state["u"]}

    def max_stable_dt(self, p, grid):
        return 1.0

    def initial_state(self, grid, p, seed):
        rng = np.random.default_rng(seed)
        return {"u": jnp.asarray(self.strength * rng.random(grid.shape))}


@dataclass(frozen=True)
class StepDecay(Decay):
    default_dt: ClassVar[float] = 0.1
'''


def command(name: str, *args: str, cwd: Path, env: dict | None = None,
            ) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=cwd, env=env or ENV,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Aliev–Panfilov on a grid that is not the config's: 24 × 20 cells of 0.5, periodic in x."""
    path = tmp_path_factory.mktemp("from_dataset") / "ap.zarr"
    grid = pdefit.Grid((24, 20), (0.5, 0.5), ("neumann", "periodic"))
    pdefit.simulate_dataset(pdefit.get_system("aliev_panfilov", initial="blobs"), path,
                            grid=grid, dt=0.01, n_frames=3, steps_per_frame=4)
    return path


def typed(path: Path, **grid) -> FitConfig:
    return FitConfig(system=SystemConfig(name="aliev_panfilov", grid=GridConfig(**grid)),
                     data=DataConfig(path=str(path)))


def test_override_keys_and_what_counts_as_given():
    keys = override_keys(["+system.options.x=1", "++a.b=2", "~c", "system=bocf",
                          "system.grid.shape=[8,8]"], groups=["system", "optim"])
    assert keys == {"system.options.x", "a.b", "c", "system.grid.shape"}
    assert is_given("system.grid.shape", keys)
    assert is_given("system.grid.shape", {"system.grid"})  # a node above it
    assert not is_given("system.grid.spacing", keys)


def test_grid_comes_from_the_dataset_unless_given(dataset):
    filled = grid_from_dataset(typed(dataset), frozenset())
    assert filled.system.grid == GridConfig([24, 20], [0.5, 0.5], ["neumann", "periodic"])
    same = grid_from_dataset(typed(dataset, shape=[24, 20]), {"system.grid.shape"})
    assert same.system.grid.shape == [24, 20] and same.system.grid.spacing == [0.5, 0.5]
    with pytest.raises(ConfigError, match=r"^system\.grid\.spacing=\[1,1\] conflicts with the "
                                          r"dataset's grid spacing \[0\.5,0\.5\]"):
        grid_from_dataset(typed(dataset), {"system.grid.spacing"})
    # Nothing to read: left for the later check that names data.path.
    missing = typed(dataset.parent / "nothing.zarr")
    assert grid_from_dataset(missing, frozenset()) is missing


def test_a_system_with_a_config_group_is_selected_by_the_group():
    line = AP._replace(given=frozenset({"system.name"}))
    with pytest.raises(ConfigError, match=r"^system\.name=bocf keeps the options, grid and dt "
                                          r"of .*system=aliev_panfilov; select .*system=bocf"):
        own_defaults(SystemConfig(name="bocf"), line)
    # The same name as the group's, or no system.name on the command line: as composed.
    ap = SystemConfig(name="aliev_panfilov", options={"laplacian": "5pt"})
    assert own_defaults(ap, line) is ap
    assert own_defaults(SystemConfig(name="bocf"), AP) == SystemConfig(name="bocf")


def test_a_user_system_starts_from_its_own_defaults(tmp_path, monkeypatch):
    (tmp_path / "user_decay.py").write_text(USER_SYSTEM)
    monkeypatch.syspath_prepend(str(tmp_path))
    inherited = SystemConfig(name="user_decay:Decay", options={"laplacian": "5pt", "strength": 2},
                             params={"k": 8.0}, grid=GridConfig([16, 16]), dt=0.05)
    line = AP._replace(given=frozenset({"system.name", "system.options.strength"}))
    with pytest.raises(ConfigError, match=r"^system\.dt: user_decay:Decay .*system\.dt=<step>"):
        own_defaults(inherited, line)
    own = own_defaults(inherited, line._replace(given=line.given | {"system.dt"}))
    assert own == SystemConfig(name="user_decay:Decay", options={"strength": 2}, dt=0.05)
    stepped = own_defaults(dataclasses.replace(inherited, name="user_decay:StepDecay"), line)
    assert stepped.dt == 0.1 and stepped.options == {"strength": 2} and stepped.params == {}
    # Through the whole completion, with a dataset: the dataset's grid on top.
    cfg = FitConfig(system=inherited, data=DataConfig(path=None))
    assert complete_config(cfg, line._replace(given=line.given | {"system.dt"})).system == own


def test_cli_fits_a_dataset_on_its_own_grid_and_refuses_a_conflicting_one(tmp_path, dataset):
    done = command("pdefit-fit", "data=zarr", f"data.path={dataset}", "system.dt=0.01", *FAST,
                   "run.dir=rd", cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert json.loads((tmp_path / "rd" / "summary.json").read_text())["grid"] == [24, 20]
    saved = yaml.safe_load((tmp_path / "rd" / "config.yaml").read_text())["system"]["grid"]
    assert saved == {"shape": [24, 20], "spacing": [0.5, 0.5],
                     "boundaries": ["neumann", "periodic"]}

    refused = command("pdefit-fit", "data=zarr", f"data.path={dataset}", "system.dt=0.01",
                      "system.grid.shape=[32,32]", *FAST, "run.dir=rd2", cwd=tmp_path)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert (f"system.grid.shape=[32,32] conflicts with the dataset's grid shape [24,20] "
            f"(data.path={dataset})") in output
    assert not (tmp_path / "rd2" / "config.yaml").exists()


def test_cli_user_system_by_import_path_does_not_inherit_aliev_panfilov(tmp_path):
    (tmp_path / "user_decay.py").write_text(textwrap.dedent(USER_SYSTEM))
    env = {**ENV, "PYTHONPATH": str(tmp_path)}
    args = ["system.name=user_decay:Decay", "system.grid.shape=[8,8]", "simulate.n_frames=3",
            "simulate.steps_per_frame=2", "fit.params=[r]", "observe.fields=[u]",
            "optim.steps=2", "run.plots=false", "run.progress=false",
            "fit.discretization_check.enabled=false"]
    refused = command("pdefit-rank", *args, "run.dir=r1", cwd=tmp_path, env=env)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "system.dt: user_decay:Decay" in output
    assert "laplacian" not in output  # aliev_panfilov's option is not handed to it

    ranked = command("pdefit-rank", *args, "system.dt=0.1", "run.dir=r2", cwd=tmp_path, env=env)
    assert ranked.returncode == 0, (ranked.stdout + ranked.stderr)[-3000:]
    ranking = json.loads((tmp_path / "r2" / "ranking.json").read_text())
    assert ranking["system"] == "decay" and ranking["dt"] == 0.1
    assert ranking["grid"] == [8, 8]
