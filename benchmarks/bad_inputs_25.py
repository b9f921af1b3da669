"""The cases of issue 25 for benchmarks/bad_inputs.py: files pdefit did not make, two fits on
one run directory, settings accepted silently or refused late, user systems that break their
contract, and a dataset's grid on the command line. Run through bad_inputs.py (it passes its
helpers in)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
Row = tuple[str, int, float, str, str]


def table_25(work: Path, fit: Callable, run: Callable, message: Callable, shown: Callable,
             checksum: Callable, tiny: list[str], adam: list[str]) -> list[Row]:
    """Every case, in the order of the issue."""
    work = work / "issue25"
    work.mkdir(parents=True, exist_ok=True)

    def row(case: str, result: tuple[int, float, str], note: str = "") -> Row:
        code, seconds, out = result
        return (case, code, seconds, shown(out), message(out) + note)

    dataset = work / "ap.zarr"
    made = run([str(BIN / "pdefit-simulate"), f"simulate.output={dataset}", *tiny[:4]], work)
    assert made[0] == 0, made[2][-2000:]
    rows = _destructive(work, dataset, fit, run, row, checksum, adam)
    rows.append(_lock(work, fit, row, adam))
    rows += _silent_and_late(work, dataset, fit, run, row, adam)
    rows += _user_systems(work, fit, run, row)
    rows += _dataset_grid(work, dataset, run, row, tiny)
    return rows


def _kept(checksum: Callable, path: Path, before: str) -> str:
    return "" if path.exists() and checksum(path) == before else "  [FILES CHANGED]"


def _destructive(work: Path, dataset: Path, fit: Callable, run: Callable, row: Callable,
                 checksum: Callable, adam: list[str]) -> list[Row]:
    simulate = [str(BIN / "pdefit-simulate"), "system.grid.shape=[16,16]",
                "+system.options.initial=blobs", "simulate.n_frames=3",
                "simulate.steps_per_frame=5", "simulate.overwrite=true"]
    folder = work / "my-notes"
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("a week of lab notes\n")
    finished = work / "finished-run"
    assert run(fit(finished, *adam), work)[0] == 0
    cwd = work / "cwd"
    cwd.mkdir(exist_ok=True)
    (cwd / "analysis.py").write_text("print('mine')\n")
    rows = []
    for case, target, where in (
            ("simulate.output=<a user's folder> simulate.overwrite=true", folder, work),
            ("simulate.output=. simulate.overwrite=true", cwd, cwd),
            ("simulate.output=<a finished run> simulate.overwrite=true", finished, work)):
        before = checksum(target)
        output = "." if where == target else str(target)
        result = run([*simulate, f"simulate.output={output}"], where)
        rows.append(row(case, result, _kept(checksum, target, before)))
    foreign = work / "foreign-run"
    foreign.mkdir(exist_ok=True)
    shutil.copytree(dataset, foreign / "data.zarr", dirs_exist_ok=True)
    before = checksum(foreign / "data.zarr")
    result = run(fit(foreign, *adam, "simulate.seed=3"), work)
    rows.append(row("pdefit-fit run.dir=<holds a data.zarr it did not write>", result,
                    _kept(checksum, foreign / "data.zarr", before)))
    return rows


def _lock(work: Path, fit: Callable, row: Callable, adam: list[str]) -> Row:
    """A second fit on a run directory while the first runs."""
    busy = work / "busy-run"
    first = subprocess.Popen(fit(busy, "optim=adam", "optim.steps=100000", "fit.params=[k,a]",
                                 "run.checkpoint_every=1000"), cwd=work,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (busy / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.5)
        started = time.perf_counter()
        done = subprocess.run(fit(busy, *adam), cwd=work, capture_output=True, text=True,
                              timeout=600)
        result = (done.returncode, time.perf_counter() - started, done.stdout + done.stderr)
    finally:
        first.terminate()
        first.wait(timeout=120)
    return row("a second pdefit-fit on a run directory in use", result)


def _recording_without_u(work: Path, dataset: Path) -> Path:
    """The dataset with every u value after frame 0 missing (NaN)."""
    import pdefit

    ds = pdefit.open_dataset(dataset)
    fields = {f: np.asarray(ds.read(f), np.float64) for f in ds.meta.fields}
    fields["u"][:, 1:] = np.nan
    path = work / "u-missing.zarr"
    shutil.rmtree(path, ignore_errors=True)
    pdefit.write_dataset(path, fields, ds.meta.times, spacing=ds.meta.grid_spacing,
                         boundaries=ds.meta.boundaries, system=ds.meta.system)
    return path


def _silent_and_late(work: Path, dataset: Path, fit: Callable, run: Callable, row: Callable,
                     adam: list[str]) -> list[Row]:
    cases: list[tuple[str, list[str]]] = [
        ("+optim.lrr=0.1 (unknown key)", ["+optim.lrr=0.1"]),
        ("optim.lrr=0.1 (unknown key, no +)", ["optim.lrr=0.1"]),
        ("data=zarr without data.path", ["data=zarr"]),
        ("observe.stride=1000 on 32²", ["system.grid.shape=[32,32]", "observe.stride=1000"]),
        ("system.grid.shape=[100000,100000]", ["system.grid.shape=[100000,100000]"]),
        ("adjoint.memory_budget_mb=0.001", ["adjoint=revolve", "adjoint.snapshots=null",
                                            "adjoint.memory_budget_mb=0.001"]),
        ("fit.params=[kk] (typo)", ["fit.params=[kk]"]),
        ("+fit.start.kk=1 (typo)", ["+fit.start.kk=1"]),
        ("observe.fields=[uu] (typo)", ["observe.fields=[uu]"]),
        ("system.name=bocf (another system by name)", ["system.name=bocf"]),
    ]
    rows = [row(case, run(fit(work / "x", *extra), work)) for case, extra in cases]
    missing = _recording_without_u(work, dataset)
    rows.append(row("observe.nan=mask, every u after frame 0 missing", run(fit(
        work / "nan", f"data.path={missing}", "data=zarr", "observe.nan=mask",
        "observe.fields=[u,v]", "optim.steps=3"), work)))
    done = work / "done-12"
    assert run(fit(done, "optim=adam", "optim.steps=12", "fit.params=[k,a]"), work)[0] == 0
    rows.append(row("finished 12-step run rerun with optim.steps=8",
                    run(fit(done, "optim=adam", "optim.steps=8", "fit.params=[k,a]"), work)))
    rows.append(row("pdefit-simulate simulate.n_frames=1", run(
        [str(BIN / "pdefit-simulate"), f"simulate.output={work / 'one.zarr'}",
         "simulate.n_frames=1", "system.grid.shape=[16,16]"], work)))
    a_file = work / "a-file"
    a_file.write_text("not a directory\n")
    readonly = work / "read-only"
    readonly.mkdir(exist_ok=True)
    readonly.chmod(0o555)
    for case, where in (("run.dir=<a file>", a_file), ("run.dir=<under a file>", a_file / "x"),
                        ("run.dir=<read-only>" + (" (as root: writable)" if os.geteuid() == 0
                                                  else ""), readonly / "run"),
                        ("run.dir=<name with [brackets]>", work / "run[1]")):
        quoted = [f"run.dir='{where}'", *fit(where, *adam)[2:]]  # Hydra's quoting of [ ]
        rows.append(row(case, run([fit(where)[0], *quoted], work)))
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    rows.append(row("system=sphere_ns mesh.shape=[1,2] (a longitude split) on 2 devices", run(
        [str(BIN / "pdefit-fit"), f"run.dir={work / 'sphere'}", "system=sphere_ns",
         "fit.params=[nu]", "mesh.shape=[1,2]", "run.progress=false", "run.plots=false"],
        work, env=two)))
    return rows


def _user_systems(work: Path, fit: Callable, run: Callable, row: Callable) -> list[Row]:
    env = {"PYTHONPATH": str(HERE)}

    def user_fit(name: str, cls: str, *extra: str) -> list[str]:
        return [str(BIN / "pdefit-fit"), f"run.dir={work / name}",
                f"system.name=bad_user_system:{cls}", "system.grid.shape=[16,16]",
                "system.dt=0.01", "simulate.n_frames=5", "simulate.steps_per_frame=10",
                "fit.params=[a,b]", "observe.fields=[u,v]", "optim=adam", "optim.steps=2",
                "adjoint=store_all", "run.progress=false", "run.plots=false", *extra]

    rows = []
    for case, cls in (("user system: rhs misses a field", "MissingField"),
                      ("user system: a parameter is a float", "FloatParameter"),
                      ("user system: initial state of the wrong shape", "WrongShape")):
        rows.append(row(case, run(user_fit(f"user-{cls}", cls), work, env=env)))
    four = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    for cls in ("RolledLaplacian", "Good"):
        case = f"user system on a 2×2 mesh: {cls}" + (" (runs)" if cls == "Good" else "")
        rows.append(row(case, run(user_fit(f"mesh-{cls}", cls, "mesh.shape=[2,2]"), work,
                                  env=four)))
    return rows


def _dataset_grid(work: Path, dataset: Path, run: Callable, row: Callable,
                  tiny: list[str]) -> list[Row]:
    """A recording imported from NumPy and fitted with no grid override; a conflicting one."""
    import pdefit

    ds = pdefit.open_dataset(dataset)
    npz = work / "recording.npz"
    np.savez(npz, u=np.asarray(ds.read("u"))[0], v=np.asarray(ds.read("v"))[0],
             time=ds.meta.times)
    imported = work / "imported.zarr"
    shutil.rmtree(imported, ignore_errors=True)
    rows = [row("pdefit-import recording.npz (u, v, time)", run(
        [str(BIN / "pdefit-import"), str(npz), str(imported), "--spacing", "1", "1"], work))]
    rows.append(row("pdefit-import into a user's folder", run(
        [str(BIN / "pdefit-import"), str(npz), str(work / "my-notes")], work)))
    base = [str(BIN / "pdefit-fit"), "data=zarr", f"data.path={imported}", "optim=adam",
            "optim.steps=3", "fit.params=[k,a]", "adjoint=store_all", "run.progress=false",
            "run.plots=false"]
    rows.append(row("fit the imported recording, no grid override (runs)",
                    run([*base, f"run.dir={work / 'imp'}"], work)))
    rows.append(row("the same with system.grid.shape=[32,32]",
                    run([*base, f"run.dir={work / 'imp2'}", "system.grid.shape=[32,32]"],
                        work)))
    return rows
