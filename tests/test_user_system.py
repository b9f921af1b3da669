"""A PDE written outside pdefit (docs/write-your-own-pde.md, Gray–Scott): the page's code
blocks become a package in a temporary directory outside the repository; the command line
simulates it and fits two of its parameters, the Python API fits them again from that
dataset, and the system is found by import path and by entry point."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pdefit
from pdefit.fitting.components import check_mesh_operators
from pdefit.fitting.synthetic import simulate_dataset
from pdefit.model.system import (
    SystemCheckError,
    check_system_on,
    default_params,
    get_system,
    system_reference,
)
from pdefit.numerics.grid import Grid
from pdefit.options import (
    FitConfig,
    GridConfig,
    MeshConfig,
    SimulateCommandConfig,
    SimulateMainConfig,
    SystemConfig,
)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "write-your-own-pde.md"
TOLERANCE = 1e-4  # relative error of the recovered F and k (noise-free data, float64)


def page_blocks() -> dict[str, str]:
    """The page's code blocks marked ``<!-- user-system: NAME -->``, by NAME."""
    found = re.findall(r"<!-- user-system: (\S+) -->\n```\w+\n(.*?)```", PAGE.read_text(),
                       re.DOTALL)
    return dict(found)


# The evaluation hook, in a module of its own: the fit's summary gets the ratio F/k.
REPORT = '''
from pdefit import SystemEvaluation
from my_pkg.models import GrayScott


class ReportedGrayScott(GrayScott):
    def evaluate_fit(self, problem, theta, dataset, experiments, out, plots):
        p = problem.physical_params(theta)
        ratio = float(p["F"]) / float(p["k"])
        return SystemEvaluation({"feed_over_kill": ratio}, f"F/k = {ratio:.6f}")
'''


@pytest.fixture(scope="module")
def user_package(tmp_path_factory) -> Path:
    """my_pkg (model, config group, hook) and an installed-package record offering it under
    the pdefit.systems entry-point group, in a directory outside the repository."""
    base = tmp_path_factory.mktemp("user")
    blocks = page_blocks()
    for name in ("my_pkg/models.py", "my_pkg/conf/system/gray_scott.yaml"):
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(blocks[name])
    for name in ("my_pkg/__init__.py", "my_pkg/conf/__init__.py"):
        (base / name).write_text("")
    (base / "my_pkg" / "report.py").write_text(REPORT)
    info = base / "my_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my_pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[pdefit.systems]\ngray_scott = my_pkg.models:GrayScott\n")
    return base


@pytest.fixture(scope="module")
def cli_run(user_package) -> Path:
    """The page's command, with the evaluation hook's subclass: simulate, then fit F and k."""
    command = page_blocks()["command"].replace("\\\n", " ")
    args = shlex.split(command)
    assert args[0] == "PYTHONPATH=." and args[1] == "pdefit-fit"
    executable = Path(sys.executable).parent / "pdefit-fit"
    env = {**os.environ, "PYTHONPATH": str(user_package), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [executable, *args[2:], "system.name=my_pkg.report:ReportedGrayScott",
         "run.progress=false"],
        cwd=user_package, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "F/k = " in result.stdout  # the hook's report is printed
    return user_package / "gs"


def test_user_system_through_the_command_line(cli_run):
    summary = json.loads((cli_run / "summary.json").read_text())
    assert summary["system"] == "gray_scott"
    rows = {r["name"]: r for r in summary["parameters"]}
    assert set(rows) == {"F", "k"}
    for row in rows.values():
        assert row["start_rel_error"] > 0.02, row  # it started away from the truth
        assert row["rel_error"] < TOLERANCE, row
    assert summary["feed_over_kill"] == pytest.approx(0.04 / 0.06, rel=TOLERANCE)
    assert (cli_run / "data.zarr").is_dir()


def test_user_system_through_the_python_api(cli_run, user_package, monkeypatch, capsys):
    """The page's Python block, run as written on the dataset the command line made."""
    monkeypatch.syspath_prepend(str(user_package))
    monkeypatch.chdir(user_package)
    namespace: dict = {}
    exec(compile(page_blocks()["python"], str(PAGE), "exec"), namespace)
    result = namespace["result"]
    assert "'F': 0.04" in capsys.readouterr().out
    assert result.start == {"F": 0.05, "k": 0.05} and result.reference["F"] == 0.04
    errors = result.relative_errors()
    assert set(errors) == {"F", "k"} and max(errors.values()) < TOLERANCE, result.params
    assert result.best_loss < 1e-6 * result.losses[0]


def test_user_system_by_entry_point_and_bad_names(user_package, monkeypatch):
    monkeypatch.syspath_prepend(str(user_package))
    system = get_system("gray_scott")  # installed under the pdefit.systems group
    assert type(system).__module__ == "my_pkg.models" and system.fields == ("u", "v")
    with pytest.raises(ValueError, match=r"unknown system 'grey_scott'.*gray_scott"):
        get_system("grey_scott")
    with pytest.raises(ValueError, match="has no class 'Missing'"):
        get_system("my_pkg.models:Missing")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_pkg\.models'"):
        get_system("no_such_pkg.models:GrayScott")
    (user_package / "my_pkg" / "broken.py").write_text(textwrap.dedent("""
        class NoPhysics:
            name = "no_physics"
    """))
    with pytest.raises(ValueError, match=r"lacks \['fields', 'params'"):
        get_system("my_pkg.broken:NoPhysics")


# Systems a user might write wrong (and one written right), subclasses of the page's model.
VARIANTS = '''
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from pdefit import ParamSpec
from my_pkg.models import GrayScott


class MissingField(GrayScott):
    name: ClassVar[str] = "missing_field"

    def rhs(self, state, p, t, grid):
        return {"u": super().rhs(state, p, t, grid)["u"]}


class FloatParam(GrayScott):
    params: ClassVar[dict] = {**GrayScott.params, "F": 0.04}


class WrongShape(GrayScott):
    def initial_state(self, grid, p, seed):
        ny, nx = grid.shape
        return {"u": jnp.ones((ny, nx + 1)), "v": jnp.zeros((ny, nx + 1))}


def rolled_laplacian(u, spacing):
    """The 5-point Laplacian with periodic neighbours taken by jnp.roll of the array itself."""
    dy, dx = spacing
    return ((jnp.roll(u, 1, -2) - 2 * u + jnp.roll(u, -1, -2)) / dy**2
            + (jnp.roll(u, 1, -1) - 2 * u + jnp.roll(u, -1, -1)) / dx**2)


class RolledGrayScott(GrayScott):
    name: ClassVar[str] = "rolled_gray_scott"

    def rhs(self, state, p, t, grid):
        u, v = state["u"], state["v"]
        uvv = u * v * v
        return {"u": p["Du"] * rolled_laplacian(u, grid.spacing) - uvv + p["F"] * (1.0 - u),
                "v": p["Dv"] * rolled_laplacian(v, grid.spacing) + uvv - (p["F"] + p["k"]) * v}


class Renamed(GrayScott):
    name: ClassVar[str] = "my_gray_scott"
'''

TINY_GRID = GridConfig([16, 16], [1.0, 1.0], ["periodic", "periodic"])


@pytest.fixture
def variants(user_package, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(user_package))
    (user_package / "my_pkg" / "variants.py").write_text(VARIANTS)
    return user_package


def simulate_options(name: str, path: Path) -> SimulateMainConfig:
    return SimulateMainConfig(
        system=SystemConfig(name=name, grid=TINY_GRID, dt=0.5),
        simulate=SimulateCommandConfig(n_frames=3, steps_per_frame=2, output=str(path)),
        precision="float64")


def test_user_system_hooks_checked_before_simulating(variants, tmp_path):
    """Each mistake names the system and the hook (or parameter), and nothing is written."""
    path = tmp_path / "data.zarr"
    cases = {
        "missing_field": ("MissingField", r"system 'missing_field': rhs returned fields "
                          r"\['u'\] for state fields \['u', 'v'\].*every field needs its time "
                          r"derivative"),
        "wrong_shape": ("WrongShape", r"system 'gray_scott': initial_state returned field 'u' "
                        r"of shape \(16, 17\); the grid's shape is \(16, 16\)"),
    }
    for name, pattern in cases.values():
        with pytest.raises(SystemCheckError, match=pattern):
            simulate_dataset(simulate_options(f"my_pkg.variants:{name}", path), path,
                             jnp.float64, log=lambda _: None)
        assert not path.exists()
    with pytest.raises(SystemCheckError, match=r"system 'gray_scott': parameter 'F' is a float "
                       r"\(0\.04\), not a pdefit\.ParamSpec; write 'F': ParamSpec\(0\.04\)"):
        get_system("my_pkg.variants:FloatParam")
    # The same checks for a system object handed to the Python API (no get_system).
    system = importlib.import_module("my_pkg.variants").MissingField()
    with pytest.raises(SystemCheckError, match="rhs returned fields"):
        check_system_on(system, Grid((64, 64), (1.0, 1.0)), default_params(system))


def test_halo_ignoring_operators_refused_on_a_mesh(variants):
    """A Laplacian built from jnp.roll runs on tiles with periodic neighbours inside each tile:
    refused on a 2×2 mesh, pointing to pdefit.numerics.stencils; the page's model (stencils
    on grid.pad blocks) passes, and so does the rolled one on one device."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (virtual) devices")

    def options(name: str, mesh: list[int]) -> FitConfig:
        return FitConfig(system=SystemConfig(name=name, grid=TINY_GRID, dt=0.5),
                         mesh=MeshConfig(shape=mesh), precision="float64")

    with pytest.raises(SystemCheckError, match=r"system 'rolled_gray_scott'.*mesh\.shape="
                       r"\[2, 2\].*ignore the halo.*jnp\.roll.*pdefit\.numerics\.stencils"):
        check_mesh_operators(options("my_pkg.variants:RolledGrayScott", [2, 2]))
    check_mesh_operators(options("my_pkg.variants:RolledGrayScott", [1, 1]))
    check_mesh_operators(options("my_pkg.models:GrayScott", [2, 2]))
    check_mesh_operators(options("my_pkg.models:GrayScott", [1, 4]))


def test_dataset_of_a_user_system_names_its_class(variants, tmp_path):
    """A dataset records the import path of a user's system, which finds it again and is
    accepted by a fit of it; an installed name stays the name."""
    renamed = get_system("my_pkg.variants:Renamed")
    assert system_reference(renamed) == "my_pkg.variants:Renamed"
    assert system_reference(get_system("my_pkg.models:GrayScott")) == "gray_scott"  # installed
    assert system_reference(get_system("aliev_panfilov")) == "aliev_panfilov"
    path = tmp_path / "renamed.zarr"
    simulate_dataset(simulate_options("my_pkg.variants:Renamed", path), path, jnp.float64,
                     log=lambda _: None)
    ds = pdefit.open_dataset(path)
    assert ds.meta.system == "my_pkg.variants:Renamed"
    assert type(pdefit.get_system(ds.meta.system)) is type(renamed)
    setup = pdefit.build_problem(pdefit.get_system(ds.meta.system), ds, fit=["F"])
    assert setup.problem.system.name == "my_gray_scott"
