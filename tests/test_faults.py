"""Faults at any moment of a fit's life (issue 16): signals outside the step loop, resumes that
must not touch the run they protect, resumes with another optimiser or parameter set, a run
continued with more steps, and the fault harness — signals (and SIGKILL inside a checkpoint
write) at random times of the real ``pdefit-fit``, each run resumed and compared with the
uninterrupted one.

Run as a script (``python tests/test_faults.py '<json>'``) this file is the driver the tests
start: ``pdefit.app.cli.fit_main`` (the console entry point, signal handling included) with a real
signal sent to the process itself at a chosen phase.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hydra import compose, initialize_config_dir

from pdefit.app import cli
from pdefit.fitting.train import ResumeMismatchError
from pdefit.runtime.checkpoint import CheckpointError, CheckpointOptions, CheckpointStore
from pdefit.runtime.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

CONF = str(Path(__file__).resolve().parents[1] / "conf")
HERE = Path(__file__).resolve()
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
        "simulate.steps_per_frame=10", "adjoint=store_all", "run.progress=false",
        "run.plots=false", "precision=float32"]
ADAM = ["optim=adam", "optim.lr=0.05", "optim.steps=30", "fit.params=[k,a,b]",
        "run.checkpoint_every=5", "run.checkpoint_keep=2"]


def make_config(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[f"run.dir={run_dir}", *TINY, *overrides])


def history(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in lines]


def status(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "status.json"
    return json.loads(path.read_text()) if path.exists() else None


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file below ``run_dir``."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """Child processes share a persistent compilation cache: each compiles the same programs."""
    cache = tmp_path_factory.mktemp("jax-cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def pdefit_fit(run_dir: Path, *overrides: str) -> list[str]:
    return [str(Path(sys.executable).with_name("pdefit-fit")), f"run.dir={run_dir}", *TINY,
            *ADAM, *overrides]


def start_driver(spec: dict[str, Any], env: dict[str, str], cwd: Path):
    """The driver's run; its ``stdout`` holds stderr too (Hydra logs to stdout)."""
    return subprocess.run([sys.executable, str(HERE), json.dumps(spec)], env=env, cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


# ---------------------------------------------------------------------------------------------
# Signals outside the step loop.


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines()
                if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def test_signal_during_the_imports_exits_75_with_nothing_written(tmp_path, env):
    """The console script, signalled while it is still importing JAX: it used to die of the
    signal (138, status.json left "running"); now it exits 75 and leaves nothing behind."""
    run_dir = tmp_path / "run"
    child = subprocess.Popen(pdefit_fit(run_dir), env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Signal as soon as the process catches SIGUSR1 (pdefit's first import installs the
    # handler), so the signal lands inside the imports however loaded the machine is.
    deadline = time.monotonic() + 60
    while not _catches(child.pid, signal.SIGUSR1) and time.monotonic() < deadline:
        time.sleep(0.005)
    child.send_signal(signal.SIGUSR1)
    _, err = child.communicate(timeout=120)
    assert child.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "Traceback" not in err
    assert not run_dir.exists() or not any(run_dir.iterdir()), snapshot(run_dir)


@pytest.mark.parametrize("phase", ["simulate", "end"])
def test_signal_outside_the_step_loop_is_honoured(tmp_path, env, phase):
    """A signal while the dataset is simulated stops the fit with 75 before training, with a
    complete (reused) dataset and no half-written file; one in the end phase (fitted.npz,
    summary) lets it finish and exit 0 with every output written."""
    run_dir = tmp_path / "run"
    done = start_driver({"run_dir": str(run_dir), "overrides": ADAM, "signal_in": phase,
                         "signal": int(signal.SIGTERM)}, env, tmp_path)
    if phase == "simulate":
        assert done.returncode == PREEMPTED_EXIT_CODE, done.stdout[-3000:]
        assert "SIGTERM after the dataset was made" in done.stdout
        assert status(run_dir) is None and not (run_dir / "checkpoints").exists()
        assert not (run_dir / "config.yaml").exists()
    else:
        assert done.returncode == 0, done.stdout[-3000:]
        assert "SIGTERM arrived after the last step" in done.stdout
        assert status(run_dir)["status"] == "done"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["optimizer_steps"] == 30 and summary["stop_reason"] == "steps_done"
        assert (run_dir / "fitted.npz").exists()


# ---------------------------------------------------------------------------------------------
# Resume checks.


def test_rejected_resume_leaves_the_run_untouched(tmp_path, no_training):
    """A changed simulate.seed used to rewrite config.yaml and re-simulate data.zarr before
    the mismatch was noticed; now nothing in the run directory changes."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "5").mkdir(parents=True)  # a run with checkpoints …
    cfg = make_config(run_dir, *ADAM)
    from omegaconf import OmegaConf

    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "data.zarr").mkdir()  # … and its dataset (contents do not matter here)
    (run_dir / "data.zarr" / "zarr.json").write_text("{}")
    before = snapshot(run_dir)
    with pytest.raises(ResumeMismatchError,
                       match=r"simulate.seed: 0 → 1.*run.resume=false"):
        cli.fit(make_config(run_dir, *ADAM, "simulate.seed=1"))
    assert snapshot(run_dir) == before


def test_resume_with_another_optimiser_or_parameters_names_the_keys(tmp_path):
    """Another optimiser or fit.params changes the state's tree: the error is the key-by-key
    mismatch, not "tree structures do not match"; more optim.steps continue the run."""
    run_dir = tmp_path / "run"
    first = cli.fit(make_config(run_dir, *ADAM, "optim.steps=6"))
    assert first["optimizer_steps"] == 6 and first["stop_reason"] == "steps_done"
    for change, expected in ((["optim=lbfgs"], r"optim.name: 'adam' → 'lbfgs'"),
                             (["fit.params=[k,a]"], r"fit.params: \['k', 'a', 'b'\] → ")):
        config = make_config(run_dir, *ADAM, "optim.steps=6", *change)
        with pytest.raises(ResumeMismatchError, match=expected + ".*run.resume=false"):
            cli.fit(config)
        # Past the early check too (config.yaml gone): the checkpoints' configs are compared
        # before their arrays are restored.
        saved = (run_dir / "config.yaml").read_text()
        (run_dir / "config.yaml").unlink()
        with pytest.raises(ResumeMismatchError, match=expected + ".*run.resume=false"):
            cli.fit(config)
        (run_dir / "config.yaml").write_text(saved)
    extended = cli.fit(make_config(run_dir, *ADAM, "optim.steps=9"))
    assert extended["restarts"] == 1 and extended["optimizer_steps"] == 9
    assert [r["step"] for r in history(run_dir)] == list(range(9))


def test_unreadable_checkpoints_name_run_resume_false(tmp_path):
    store = CheckpointStore(CheckpointOptions(tmp_path / "ck"))
    state = {"x": jnp.arange(3.0)}
    store.save(1, state, {"records": []}, {"a": 1}, wait=True)
    store.close()
    for item in (tmp_path / "ck" / "1" / "state").rglob("*"):
        if item.is_file():
            item.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no readable checkpoint.*run.resume=false"):
        CheckpointStore(CheckpointOptions(tmp_path / "ck")).restore(state)


# ---------------------------------------------------------------------------------------------
# Stopping.


def test_lbfgs_stops_when_steps_no_longer_change_anything(tmp_path, caplog):
    """The issue's case on a small grid: L-BFGS (without a gradient tolerance) reaches a loss
    near 1e-15 in about a dozen steps and then repeats the same step; it used to run all 200.
    It stops as "stalled", says why, and summary.json and status.json name the reason."""
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="pdefit"):
        summary = cli.fit(make_config(run_dir, "fit.params=[k,a]", "+fit.start.k=6.0",
                                      "optim.grad_tol=0"))
    assert summary["stop_reason"] == "stalled" and summary["optimizer_steps"] < 40
    assert any("no longer changes the parameters" in r.message for r in caplog.records)
    assert status(run_dir)["stop_reason"] == "stalled"


# ---------------------------------------------------------------------------------------------
# The fault harness.

SIGNALS = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2,
           "INT": signal.SIGINT, "KILL": signal.SIGKILL}
EXPECTED = {"TERM": PREEMPTED_EXIT_CODE, "USR1": PREEMPTED_EXIT_CODE,
            "USR2": PREEMPTED_EXIT_CODE, "INT": INTERRUPTED_EXIT_CODE,
            "KILL": -signal.SIGKILL, "KILL-in-write": -signal.SIGKILL}
# Long enough that a random time often lands in the step loop, not only around it.
HARNESS = ["optim.steps=150", "run.checkpoint_every=10"]
TRUTHFUL = {PREEMPTED_EXIT_CODE: {None, "preempted"}, INTERRUPTED_EXIT_CODE: {None, "interrupted"},
            0: {"done"}}


def fault_trials(n: int, seed: int, workdir: Path, env: dict[str, str]) -> list[dict]:
    """``n`` interrupted runs of the real ``pdefit-fit``: a random signal at a random time of
    its life (one trial in five: SIGKILL inside a checkpoint write), then the same command
    again; each finished history is compared with the uninterrupted run's."""
    rng = random.Random(seed)
    reference = workdir / "reference"
    for run_dir in (workdir / "warm-up", reference):  # the second one runs from the cache
        started = time.perf_counter()
        done = subprocess.run(pdefit_fit(run_dir, *HARNESS), env=env, cwd=workdir,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
        span = time.perf_counter() - started
    rows = []
    for trial in range(n):
        run_dir = workdir / f"trial-{trial}"
        if trial % 5 == 4:
            name, at = "KILL-in-write", f"commit of step {10 * rng.randint(1, 10)}"
            child = start_driver({"run_dir": str(run_dir), "overrides": [*ADAM, *HARNESS],
                                  "kill_in_save": int(at.split()[-1])}, env, workdir)
            code = child.returncode
        else:
            name = rng.choice(list(SIGNALS))
            at = f"{rng.uniform(0.1, span):.2f} s"
            proc = subprocess.Popen(pdefit_fit(run_dir, *HARNESS), env=env, cwd=workdir,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            time.sleep(float(at.split()[0]))
            if proc.poll() is None:
                proc.send_signal(SIGNALS[name])
            _, err = proc.communicate(timeout=300)
            code = proc.returncode
            assert "Traceback" not in err, err[-3000:]
        after = status(run_dir) if run_dir.exists() else None
        if code in TRUTHFUL:
            assert (after or {}).get("status") in TRUTHFUL[code], (name, code, after)
        else:
            assert code == EXPECTED[name], (name, at, code)
        resumed = subprocess.run(pdefit_fit(run_dir, *HARNESS), env=env, cwd=workdir,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        same = history(run_dir) == history(reference)
        summary = json.loads((run_dir / "summary.json").read_text())
        ref_summary = json.loads((reference / "summary.json").read_text())
        same = same and summary["final_loss"] == ref_summary["final_loss"]
        left = "nothing written" if after is None else f"{after['status']} @ {after['step']}"
        rows.append({"trial": trial, "signal": name, "at": at, "exit": code, "left": left,
                     "resume exit": resumed.returncode, "identical": same})
    print(f"\n{'trial':>5} {'signal':<14} {'at':<18} {'exit':>5} {'status.json after':<18} "
          f"{'resume':>6} identical   (uninterrupted run: {span:.1f} s)")
    for r in rows:
        print(f"{r['trial']:>5} {r['signal']:<14} {r['at']:<18} {r['exit']:>5} {r['left']:<18} "
              f"{r['resume exit']:>6} {'yes' if r['identical'] else 'NO'}")
    return rows


def test_fault_harness_two_trials(tmp_path, env):
    rows = fault_trials(2, seed=16, workdir=tmp_path, env=env)
    assert all(r["identical"] for r in rows)


@pytest.mark.long
def test_fault_harness_ten_trials(tmp_path, env):
    rows = fault_trials(10, seed=1600, workdir=tmp_path, env=env)
    assert all(r["identical"] for r in rows)


# ---------------------------------------------------------------------------------------------
# The driver.


def drive(spec: dict[str, Any]) -> None:
    """Child process: ``cli.fit_main`` as the console script runs it, with a real signal sent
    to this process at ``signal_in`` (simulate: while the dataset is written; end: while the
    outputs are) or SIGKILL inside Orbax's commit of checkpoint ``kill_in_save``."""
    from pdefit.fitting import assemble

    sig = int(spec.get("signal", signal.SIGTERM))
    phase = spec.get("signal_in")
    if phase == "simulate":
        _signal_on_call(assemble, "simulate_dataset", sig)
    elif phase == "end":
        from pdefit.app import fit_report

        _signal_on_call(fit_report, "save_fitted", sig)  # fitted.npz, the end phase's first
    if spec.get("kill_in_save") is not None:
        from test_resume import _kill_while_committing

        _kill_while_committing(int(spec["kill_in_save"]))
    sys.argv = ["pdefit-fit", f"run.dir={spec['run_dir']}", *TINY, *spec["overrides"]]
    cli.fit_main()


def _signal_on_call(module: Any, name: str, sig: int) -> None:
    """``module.name`` sends ``sig`` to this process, then does its work."""
    original = getattr(module, name)

    def signal_then_call(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    setattr(module, name, signal_then_call)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    jax.config.update("jax_enable_x64", False)
    drive(json.loads(sys.argv[1]))
