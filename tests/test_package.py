"""The package as a user installs it: a wheel built from the source tree, installed into a
fresh virtual environment, runs every console script from a directory outside the source tree
(configs inside the package, the physics under pdefit.systems, no top-level ``systems``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("pdefit-simulate", "pdefit-fit", "pdefit-gradcheck", "pdefit-rank",
           "pdefit-evaluate", "pdefit-lyapunov", "pdefit-sweep-summary", "pdefit-import")

# Run inside the fresh environment: the package comes from its site-packages, and every
# installed console script answers --help (its script file run in this one process: each
# process would pay JAX's import).
CHECKS = r"""
import contextlib, importlib.util, io, json, runpy, sys
from pathlib import Path
import pdefit
out = {"file": pdefit.__file__, "version": pdefit.__version__,
       "top_level_systems": importlib.util.find_spec("systems") is not None, "help": {}}
for script in sys.argv[1:]:
    sys.argv, text = [script, "--help"], io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            assert exit.code in (0, None), (script, exit.code)
    out["help"][Path(script).name] = text.getvalue()
print(json.dumps(out))
"""


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_wheel_runs_every_command_outside_the_source_tree(tmp_path):
    # Build from a copy, so the build leaves nothing (build/, *.egg-info) in the checkout.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pdefit", "systems", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp_path / "dist"), str(src)])
    (wheel,) = (tmp_path / "dist").glob("pdefit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("systems/", "conf/"))], names
    configs = [f"pdefit/{p.relative_to(ROOT)}" for p in (ROOT / "conf").rglob("*.yaml")]
    systems = [f"pdefit/{p.relative_to(ROOT)}" for p in (ROOT / "systems").glob("*.py")]
    missing = sorted(set(configs + systems) - set(names))
    assert configs and systems and not missing, missing

    # A fresh environment that sees this one's dependencies (offline and fast) but not its
    # editable pdefit: a path line in a .pth file does not run that directory's .pth files.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    scripts = [str(venv / "bin" / name) for name in SCRIPTS]
    checks = json.loads(_run([python, "-c", CHECKS, *scripts], cwd=elsewhere, env=env).stdout
                        .strip().splitlines()[-1])
    assert Path(checks["file"]).is_relative_to(site), checks["file"]
    assert checks["version"] == "0.1.0"
    assert not checks["top_level_systems"]
    assert sorted(checks["help"]) == sorted(SCRIPTS)
    for name, text in checks["help"].items():
        assert len(text.splitlines()) >= 2, (name, text)

    # A short real fit, by the installed script, simulating its own data (the packaged
    # configs: the default system group, conf/system/aliev_panfilov.yaml).
    run_dir = elsewhere / "run"
    fit = _run([venv / "bin" / "pdefit-fit", f"run.dir={run_dir}", "run.plots=false",
                "run.progress=false", "system.grid.shape=[16,16]",
                "+system.options.initial=blobs", "simulate.n_frames=3",
                "simulate.steps_per_frame=5", "fit.params=[k,a]", "optim.steps=2"],
               cwd=elsewhere, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["system"] == "aliev_panfilov" and summary["optimizer_steps"] == 2
    assert "recovered" in fit.stdout
    print(f"wheel {wheel.name}: {len(names)} files; pdefit {checks['version']} from "
          f"{checks['file']}")
    for name, text in sorted(checks["help"].items()):
        print(f"{name} --help: {len(text.splitlines())} lines, first: {text.splitlines()[0]!r}")
    print(fit.stdout)
