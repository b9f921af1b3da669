"""A PDE written outside pdefit (docs/write-your-own-pde.md, Gray–Scott): the page's code
blocks become a package in a temporary directory outside the repository; the command line
simulates it and fits two of its parameters, the Python API fits them again from that
dataset, and the system is found by import path and by entry point."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdefit.model.system import get_system

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
