"""Nothing deleted that pdefit did not make (issue 25): ``simulate.overwrite`` replaces only a
pdefit dataset, a run directory's ``data.zarr`` only when the run wrote it, a run directory is
locked while a fit works in it, an unusable ``run.dir`` is refused before any work, and a
finished run is neither cut short nor rewritten by a rerun.

Real command lines (subprocesses) on tiny problems; every protected file is compared byte for
byte before and after. The first four are regression tests of files that were destroyed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdefit.app.rundir import check_run_dir
from pdefit.options import ConfigError
from pdefit.runtime.lock import LOCK_FILE, lock_directory

BIN = Path(sys.executable).parent
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
        "simulate.steps_per_frame=10"]
FIT = [*TINY, "adjoint=store_all", "run.progress=false", "run.plots=false", "fit.params=[k]",
       "optim=adam", "fit.discretization_check.enabled=false"]
# One process, as a user with one CPU device would run the commands.
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def command(name: str, *args: str, cwd: Path, timeout: float = 240,
            ) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def refused(done: subprocess.CompletedProcess, *keys: str) -> str:
    """The output of a command that had to fail, checked to name every one of ``keys``."""
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    for key in keys:
        assert key in output, output[-3000:]
    return output


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``root`` (itself included when a file), with its bytes."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("three years of recordings\n")
    (path / "raw").mkdir()
    (path / "raw" / "cell1.npy").write_bytes(bytes(range(256)))
    return path


def test_simulate_overwrite_replaces_only_a_pdefit_dataset(tmp_path):
    """A user's folder, the current directory and its parent are refused (nothing removed, before
    simulating); a pdefit dataset is replaced, and a folder named like the old temporary
    dataset survives that."""
    mine = user_folder(tmp_path / "mine")
    (tmp_path / "file.txt").write_text("keep me\n")
    before = snapshot(tmp_path)
    overwrite = [*TINY, "simulate.overwrite=true"]
    for output in ("mine", ".", str(tmp_path.parent)):
        done = command("pdefit-simulate", *overwrite, f"simulate.output={output}", cwd=tmp_path)
        text = refused(done, "simulate.output: ", "is not a pdefit dataset",
                       "choose another simulate.output")
        assert "simulating" not in text  # refused before any work
        assert snapshot(tmp_path) == before, output
    assert (mine / "notes.txt").exists()

    decoy = user_folder(tmp_path / ".ap.zarr.tmp")  # the temporary name that was rmtree'd
    decoy_bytes = snapshot(decoy)
    for seed in (0, 1):
        done = command("pdefit-simulate", *overwrite, "simulate.output=ap.zarr",
                       f"simulate.seed={seed}", cwd=tmp_path)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert snapshot(decoy) == decoy_bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ap.zarr.tmp-")]


def test_a_finished_run_is_neither_replaced_cut_short_nor_rewritten(tmp_path):
    """A finished run's directory given as simulate.output is refused; the same fit again
    finds it finished and rewrites nothing; fewer optim.steps than its checkpoint is refused
    before work (it used to rewrite the results from the later step)."""
    run = tmp_path / "run"
    done = command("pdefit-fit", *FIT, "optim.steps=6", f"run.dir={run}", cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    before = snapshot(run)

    done = command("pdefit-simulate", *TINY, "simulate.overwrite=true", "simulate.output=run",
                   cwd=tmp_path)
    refused(done, "simulate.output: ", "is not a pdefit dataset")
    assert snapshot(run) == before

    again = command("pdefit-fit", *FIT, "optim.steps=6", f"run.dir={run}", cwd=tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "finished" in again.stdout + again.stderr
    assert "nothing to do" in again.stdout + again.stderr
    assert snapshot(run) == before

    fewer = command("pdefit-fit", *FIT, "optim.steps=3", f"run.dir={run}", cwd=tmp_path)
    text = refused(fewer, "optim.steps", "optim.steps=3", "run.resume=false",
                   "another run.dir")
    assert "simulating" not in text and "compiling" not in text
    assert snapshot(run) == before


def test_a_data_zarr_the_run_did_not_write_survives(tmp_path):
    """A dataset (here another pdefit dataset) or a folder named data.zarr in run.dir is
    refused, byte-identical, and the message says how to fit it instead."""
    run = tmp_path / "run"
    run.mkdir()
    made = command("pdefit-simulate", *TINY, "simulate.seed=3",
                   f"simulate.output={run / 'data.zarr'}", cwd=tmp_path)
    assert made.returncode == 0, (made.stdout + made.stderr)[-3000:]
    before = snapshot(run / "data.zarr")
    done = command("pdefit-fit", *FIT, "optim.steps=2", f"run.dir={run}", cwd=tmp_path)
    refused(done, "run.dir: ", "holds a data.zarr that this run did not write",
            f"data.path={run / 'data.zarr'}")
    assert snapshot(run / "data.zarr") == before

    other = tmp_path / "other"
    user_folder(other / "data.zarr")
    before = snapshot(other)
    done = command("pdefit-fit", *FIT, "optim.steps=2", f"run.dir={other}", cwd=tmp_path)
    refused(done, "holds a data.zarr that this run did not write")
    assert snapshot(other) == before  # the lock file, too, is gone


def test_a_second_fit_on_a_locked_run_directory_exits_at_once(tmp_path):
    """While a fit works in a run directory a second one on it stops within seconds, naming
    run.dir and the first one's process; the first goes on undisturbed."""
    run = tmp_path / "run"
    first = subprocess.Popen(
        [str(BIN / "pdefit-fit"), *FIT, "optim.steps=1000000", f"run.dir={run}"],
        cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "fit.log").exists():  # written once the run directory is taken
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.1)
        start = time.monotonic()
        second = command("pdefit-fit", *FIT, "optim.steps=1000000",
                         f"run.dir={run}", cwd=tmp_path, timeout=60)
        refused(second, "run.dir: ", str(run), "in use by another pdefit process",
                f"pid {first.pid}")
        assert time.monotonic() - start < 30
        assert first.poll() is None  # the first fit is still running
    finally:
        first.send_signal(signal.SIGTERM)  # it checkpoints and exits
        first.communicate(timeout=120)


def test_lock_is_exclusive_and_released(tmp_path):
    with lock_directory(tmp_path), pytest.raises(
            ConfigError, match=r"run.dir: .* in use by another pdefit process"):
        lock_directory(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()  # removed on release
    (tmp_path / LOCK_FILE).write_bytes(b"")  # one left by a killed holder is no lock
    with lock_directory(tmp_path) as lock:
        assert lock.held
    assert not (tmp_path / LOCK_FILE).exists()


def test_an_unusable_run_dir_is_refused_before_work(tmp_path):
    """run.dir a file, under a file or read-only: one ConfigError naming run.dir, the path
    and the reason (it used to be a raw FileExistsError/NotADirectoryError/PermissionError);
    the command line for a file, the check itself for the others."""
    (tmp_path / "a_file").write_text("keep me\n")
    done = command("pdefit-fit", *FIT, "run.dir=a_file", cwd=tmp_path)
    text = refused(done, "run.dir: ", str(tmp_path / "a_file"), "is a file")
    assert "FileExistsError" not in text and "Traceback" not in text
    assert (tmp_path / "a_file").read_text() == "keep me\n"

    with pytest.raises(ConfigError, match=r"run.dir: .*a_file/run lies under .*a_file, which "
                                          r"is a file"):
        check_run_dir(tmp_path / "a_file" / "run")
    if os.geteuid() != 0:  # root writes into read-only directories
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(ConfigError, match=r"run.dir: .*locked/run cannot be created: "
                                              r".*locked is not writable"):
            check_run_dir(locked / "run")
        with pytest.raises(ConfigError, match=r"run.dir: .*locked is not writable"):
            check_run_dir(locked)


def test_a_run_dir_with_brackets_is_refused_before_work(tmp_path):
    """tensorstore (under Orbax) cannot open checkpoints below a path with brackets: refused
    before simulating (it used to fail after)."""
    done = command("pdefit-fit", *FIT, "run.dir='runs/a[1]'", cwd=tmp_path)
    text = refused(done, "run.dir: ", "'[' or ']'")
    assert "simulating" not in text
    assert not (tmp_path / "runs" / "a[1]" / "data.zarr").exists()
