"""Batch workflow on a real Slurm (started by a session fixture from tests/slurm_cluster.py):
slurm/fit.sbatch interrupted by ``scontrol requeue`` and by the time-limit signal, a
two-process fit over two emulated nodes, a Hydra multirun through the submitit launcher with
a submitit preemption (USR2) in the middle, the simulate job array, and the batch shell's trap.

Every scenario is submitted at once when the first test starts, and a watcher thread per
scenario does its interruptions (requeue at step k, a signal at step m): Slurm runs them side
by side, so their waits (a requeued job waits ~10 s before it starts again) overlap. Each test
then waits for its scenario and checks it.

Interrupted single-process runs must end with exactly the records, summary and final
checkpoint of the uninterrupted run. These tests skip only where Debian's slurm-wlm and munge
are not installed (CI installs them and sets PDEFIT_REQUIRE_SLURM=1, which makes their absence
an error).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from slurm_cluster import DEBIAN_PACKAGES, SlurmCluster, missing_programs, start_cluster

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FIT_SBATCH = REPO / "slurm" / "fit.sbatch"
SIMULATE_SBATCH = REPO / "slurm" / "simulate.sbatch"

# A tiny fit whose 100 optimiser steps take a few seconds: long enough to interrupt twice.
# A constant learning rate makes a shorter run's records a prefix of a longer one's.
FIT = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
       "simulate.steps_per_frame=10", "adjoint=store_all", "run.progress=false",
       "run.plots=false", "precision=float32", "optim=adam", "optim.lr=0.05",
       "optim.schedule=constant", "optim.steps=100", "fit.params=[k,a,b]",
       "run.checkpoint_every=20"]
SIMULATE = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
            "simulate.steps_per_frame=10", "simulate.n_experiments=3",
            "simulate.noise.kind=additive", "simulate.noise.sigma=0.01",
            "simulate.frames_per_shard=2"]
TIMEOUT = 300

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# Helpers.


class Submitted:
    """A fit.sbatch job: its id, work directory (Hydra's runs/ live below it) and log."""

    def __init__(self, cluster: SlurmCluster, work: Path, name: str, env: dict[str, str],
                 *overrides: str, options: tuple[str, ...] = ()) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.cluster, self.work, self.log = cluster, work, work / f"{name}.out"
        self.run_dir = work / "runs" / "fit" / name
        self.submitted = time.perf_counter()
        self.id = cluster.sbatch(FIT_SBATCH, *FIT, f"run.name={name}", *overrides,
                                 options=(f"--output={self.log}", f"--job-name={name}",
                                          *options), env=env, cwd=work)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait(self, states=("COMPLETED",)) -> dict[str, str]:
        info = self.cluster.wait_for(self.id, (*states, "FAILED", "CANCELLED", "TIMEOUT",
                                               "NODE_FAIL", "OUT_OF_MEMORY"), TIMEOUT)
        assert info["JobState"] in states, f"{info}\n{self.text()[-4000:]}"
        self.seconds = time.perf_counter() - self.submitted
        return info


class Watcher:
    """Runs a scenario's interruptions in a thread; ``join`` re-raises what went wrong."""

    def __init__(self, steps: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(steps,), daemon=True)
        self.thread.start()

    def _run(self, steps: Callable[[], Any]) -> None:
        try:
            self.result = steps()
        except BaseException as err:  # handed to the test by join()
            self.error = err

    def join(self) -> Any:
        self.thread.join(TIMEOUT)
        if self.thread.is_alive():
            raise TimeoutError("scenario still running")
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def last_step(run_dir: Path | None) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (TypeError, FileNotFoundError, json.JSONDecodeError, IndexError, KeyError):
        return -1


def outputs(run_dir: Path, arrays: bool = True) -> tuple[list[dict], dict, list[np.ndarray]]:
    """Records without wall times, the summary, and the arrays of the last checkpoint (of a
    single-process run: arrays saved by several processes need a target layout to load)."""
    records = [{k: v for k, v in json.loads(x).items() if k != "time"}
               for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    if not arrays:
        return records, summary, []
    import jax
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(run_dir / "checkpoints", item_names=("state",))
    state = manager.restore(manager.latest_step(),
                            args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    manager.close()
    return records, summary, [np.asarray(x) for x in jax.tree.leaves(state.state)]


def assert_same_as(run_dir: Path, reference: Path) -> int:
    records, summary, leaves = outputs(run_dir)
    ref_records, ref_summary, ref_leaves = outputs(reference)
    assert records == ref_records  # every loss, gradient norm and parameter, exactly
    for key in ("final_loss", "best_loss", "initial_loss", "parameters", "optimizer_steps"):
        assert summary[key] == ref_summary[key], key
    assert len(leaves) == len(ref_leaves)
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return len(records)


def task_pid(job_id: str, procid: int) -> int:
    """The pid of one task's Python process (the cluster runs on this machine)."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={procid}".encode()}
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if want <= environ and b"pdefit-fit" in cmdline and b"srun" not in cmdline:
            return int(proc.name)
    raise LookupError(f"no task {procid} of job {job_id}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# The cluster and the scenarios.


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    missing = missing_programs()
    if missing:
        reason = (f"Slurm tests need Debian's {DEBIAN_PACKAGES} ({', '.join(missing)} not "
                  "found); install them as root with `apt-get install -y slurm-wlm munge` "
                  "(`make slurm-deps`; make test and .ci/run do this where they can)")
        if os.environ.get("PDEFIT_REQUIRE_SLURM"):
            pytest.fail(reason)
        pytest.skip(reason)
    started = time.perf_counter()
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    print(f"\nSlurm up in {time.perf_counter() - started:.1f} s: "
          + cluster.run("sinfo", "-h", "-N", "-o", "%N:%t").stdout.replace("\n", " "))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def scenarios(slurm, tmp_path_factory) -> dict[str, Any]:
    """Everything submitted at once; see the module docstring."""
    cache = tmp_path_factory.mktemp("jax-cache")
    env = {"PDEFIT_FIT": str(BIN / "pdefit-fit"), "PDEFIT_SIMULATE": str(BIN / "pdefit-simulate"),
           "JAX_COMPILATION_CACHE_DIR": str(cache),  # every job compiles the same programs
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    tmp = tmp_path_factory.mktemp("scenarios")
    started = time.perf_counter()
    return {"env": env, "started": started,
            # the slowest first: two processes exchange halos through TCP every time step
            "two_nodes": _two_nodes(slurm, tmp / "two-nodes", env),
            "requeue": _requeue(slurm, tmp / "requeue", env),
            "reference": Submitted(slurm, tmp / "reference", "reference", env),
            "multirun": _multirun(slurm, tmp / "multirun", env),
            "simulate": _simulate(slurm, tmp / "simulate", env),
            "trap": _trap(slurm, tmp / "trap")}


def _requeue(slurm: SlurmCluster, work: Path, env: dict[str, str]) -> tuple[Submitted, Watcher]:
    job = Submitted(slurm, work, "requeued", env)

    def interrupt() -> int:
        wait_until(lambda: last_step(job.run_dir) >= 15, "first steps")
        slurm.run("scontrol", "requeue", job.id)  # SIGTERM to the whole job, then requeue
        wait_until(lambda: "restart 1" in job.text() and "resuming from" in job.text(),
                   "restart 1")
        resumed_at = json.loads((job.run_dir / "status.json").read_text())["step"]
        # Then the time-limit warning, which only the fit's step receives: soon after the
        # restart. Sent 30 steps after it, one full-suite run ended with Restarts 1 (its log
        # not kept): most likely the fit's last steps outran scancel's round trip.
        wait_until(lambda: last_step(job.run_dir) >= resumed_at + 5, "steps after restart")
        slurm.run("scancel", "--signal=USR1", job.id)
        return resumed_at

    return job, Watcher(interrupt)


def _two_nodes(slurm: SlurmCluster, work: Path, env: dict[str, str],
               ) -> tuple[Submitted, Watcher]:
    env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PDEFIT_COORDINATOR": f"127.0.0.1:{free_port()}"}
    # Collectives between processes are slow on a loaded CPU: 24 steps, interrupted at ~5.
    job = Submitted(slurm, work, "two-nodes", env, "mesh.shape=[2,2]", "optim.steps=24",
                    options=("--nodes=2", "--ntasks-per-node=1"))

    def interrupt() -> str:
        wait_until(lambda: last_step(job.run_dir) >= 4, "both processes stepping")
        nodes = slurm.job(job.id)["NodeList"]
        os.kill(task_pid(job.id, 1), signal.SIGUSR1)  # one process only
        return nodes

    return job, Watcher(interrupt)


def _multirun(slurm: SlurmCluster, work: Path, env: dict[str, str],
              ) -> tuple[subprocess.Popen, Path, Watcher]:
    work.mkdir(parents=True)
    sweep = work / "runs" / "sweep" / "lr"
    command = [str(BIN / "pdefit-fit"), "-m", "hydra/launcher=slurm",
               "hydra.launcher.partition=debug", "run.name=lr", *FIT, "optim.lr=0.02,0.05"]
    launcher = subprocess.Popen(command, cwd=work, env={**slurm.env, **env},
                                stdout=(work / "launcher.out").open("w"),
                                stderr=subprocess.STDOUT)

    def point0() -> Path | None:
        return next(iter(sorted(sweep.glob("*optim.lr=0.02*"))), None)

    def interrupt() -> str:
        wait_until(lambda: last_step(point0()) >= 15, "point 0 running")
        array_task = sorted((sweep / ".submitit").glob("*_0"))[0].name  # "<array id>_0"
        slurm.run("scancel", "--signal=USR2", array_task)  # what submitit calls preemption
        launcher.wait(TIMEOUT)
        return array_task

    return launcher, sweep, Watcher(interrupt)


def _simulate(slurm: SlurmCluster, work: Path, env: dict[str, str]) -> tuple[str, Path]:
    work.mkdir(parents=True)
    array = slurm.sbatch(SIMULATE_SBATCH, *SIMULATE, f"simulate.output={work / 'array.zarr'}",
                         options=("--array=0-2", f"--output={work}/sim-%A_%a.out"),
                         env=env, cwd=work)
    return array, work


def _trap(slurm: SlurmCluster, work: Path) -> tuple[str, Path, Watcher]:
    """A stand-in step that takes 4 s and exits 75; SIGTERM goes to the batch shell alone."""
    work.mkdir(parents=True)
    step = work / "step.sh"
    step.write_text("#!/bin/bash\ntrap 'echo step-got-TERM' TERM\nsleep 4 & wait\n"
                    "echo step-done\nexit 75\n")
    step.chmod(0o755)
    log = work / "trap.out"
    job = slurm.sbatch(FIT_SBATCH, options=(f"--output={log}",),
                       env={"PDEFIT_FIT": str(step)}, cwd=work)

    def interrupt() -> None:
        wait_until(lambda: log.exists() and "restart 0" in log.read_text(), "job start")
        time.sleep(1)
        slurm.run("scancel", "--batch", "--signal=TERM", job)

    return job, log, Watcher(interrupt)


# ---------------------------------------------------------------------------------------------
# The tests.


def test_fit_sbatch_requeue_and_time_limit_signal_resume_exactly(scenarios):
    job, watcher = scenarios["requeue"]
    reference = scenarios["reference"]
    resumed_at = watcher.join()
    info = job.wait()
    log = job.text()

    assert info["Restarts"] == "2" and info["ExitCode"] == "0:0", info
    assert "SIGTERM: the fit checkpoints and exits" in log  # the batch shell survived TERM
    assert "after SIGTERM: Slurm requeues or cancels the job" in log
    assert "fit checkpointed (status 75): requeueing job" in log  # the USR1 branch
    assert "restart 1 on" in log and "restart 2 on" in log  # SLURM_RESTART_COUNT 1, then 2
    resumed = [line.split("] - ")[-1] for line in log.splitlines()
               if "resuming from checkpoint step" in line]
    assert len(resumed) == 2 and f"step {resumed_at} " in resumed[0], log[-4000:]
    reference.wait()
    n = assert_same_as(job.run_dir, reference.run_dir)
    assert json.loads((job.run_dir / "summary.json").read_text())["restarts"] == 2
    print(f"\njob {job.id}: scontrol requeue after step 15, USR1 5 steps after the restart; "
          f"Restarts={info['Restarts']}"
          f"\n  {resumed[0]}\n  {resumed[1]}\n  {n} records, summary and final checkpoint "
          f"identical to uninterrupted job {reference.id}; {job.seconds:.0f} s")


def test_two_node_two_process_fit_agrees_on_preemption(scenarios):
    """Two slurmd (n1, n2), one task on each: one fit in two JAX processes (2 CPU devices
    each, a 2×2 mesh). SIGUSR1 goes to process 1 only; both stop after the same step, write
    one checkpoint together and exit 75; the batch script requeues the job; both resume."""
    job, watcher = scenarios["two_nodes"]
    nodes = watcher.join()
    info = job.wait()
    log = job.text()
    assert nodes == "n[1-2]"
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0", info
    assert "process 1/2 (slurm): 2 local of 4 devices" in log
    stops = [line.split("checkpoint at step ")[1].split()[0]
             for line in log.splitlines() if "SIGUSR1: checkpoint at step" in line]
    assert len(stops) == 2 and stops[0] == stops[1], log[-4000:]  # both, at one step
    assert "fit checkpointed (status 75): requeueing job" in log
    assert log.count("resuming from checkpoint step") == 2  # each process
    records, summary, _ = outputs(job.run_dir, arrays=False)
    assert [r["step"] for r in records] == list(range(24)) and summary["restarts"] == 1
    reference = scenarios["reference"]
    reference.wait()
    # Another layout (tiles, psum order) changes float32 round-off, not the fit.
    for record, ref in zip(records, outputs(reference.run_dir)[0][:24], strict=True):
        assert record["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-9)
        assert record["params"] == pytest.approx(ref["params"], rel=1e-5)
    print(f"\njob {job.id} on {nodes}: 2 processes, USR1 to process 1 only, both checkpointed at "
          f"step {stops[0]}, Restarts={info['Restarts']}, both resumed; 24 records equal to the "
          f"single-process run's to float32 round-off; {job.seconds:.0f} s")


def test_multirun_through_submitit_with_a_preemption(scenarios, slurm):
    """``pdefit-fit -m hydra/launcher=slurm`` submits a 2-point array; point 0 gets USR2:
    pdefit checkpoints first, then submitit's own handler requeues the task, which resumes;
    the summary command lists both points."""
    launcher, sweep, watcher = scenarios["multirun"]
    array_task = watcher.join()
    out = (sweep.parents[2] / "launcher.out").read_text()
    assert launcher.returncode == 0, out[-4000:]
    assert slurm.job(array_task)["Restarts"] == "1"
    task_log = "".join(p.read_text() for p in (sweep / ".submitit" / array_task).glob("*_log.*"))
    assert "SIGUSR2: checkpoint at step" in task_log  # pdefit saved first …
    assert "Caught signal SIGUSR2" in task_log  # … then submitit's handler requeued the task
    assert "resuming from checkpoint" in task_log

    table = subprocess.run([str(BIN / "pdefit-sweep-summary"), str(sweep)], check=True,
                           capture_output=True, text=True).stdout
    lines = table.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["optim.lr=0.02", "done"],
                                                        ["optim.lr=0.05", "done"]], table
    assert [line.split()[-2] for line in lines[1:]] == ["1", "0"], table  # restarts
    print(f"\nsweep {sweep.name} (array job {array_task.split('_')[0]}): point 0 preempted by "
          f"USR2, requeued by submitit, resumed\n{table}")


def test_simulate_job_array_writes_the_same_dataset(scenarios, slurm):
    """A 3-task array, one experiment per task (each owns its shards), gives the dataset that
    one process writes."""
    from pdefit import data as zd

    array, work = scenarios["simulate"]
    subprocess.run([str(BIN / "pdefit-simulate"), *SIMULATE,
                    f"simulate.output={work / 'one.zarr'}"], cwd=work, check=True,
                   capture_output=True, env={**os.environ, **scenarios["env"]})
    for task in range(3):
        info = slurm.wait_for(f"{array}_{task}", ("COMPLETED", "FAILED", "CANCELLED"), TIMEOUT)
        assert info["JobState"] == "COMPLETED", (work / f"sim-{array}_{task}.out").read_text()
    one, many = zd.open_dataset(work / "one.zarr"), zd.open_dataset(work / "array.zarr")
    assert many.meta.n_experiments == 3
    for name in one.meta.fields:
        a, b = one.read(name), many.read(name)
        assert np.all(np.isfinite(b)) and a.tobytes() == b.tobytes(), name
    print(f"\nsimulate array job {array}: 3 tasks, the same bits as one process")


def test_batch_shell_survives_sigterm_to_itself(scenarios, slurm):
    """The trap: SIGTERM to the batch shell alone (scancel --batch) neither kills the step nor
    ends the script before the step has finished; the script passes the step's status on and
    does not requeue (Slurm does that, or the job was cancelled)."""
    job, log, watcher = scenarios["trap"]
    watcher.join()
    info = slurm.wait_for(job, ("COMPLETED", "FAILED"), TIMEOUT)
    text = log.read_text()
    assert "SIGTERM: the fit checkpoints and exits; waiting for it" in text
    assert "step-done" in text and "step-got-TERM" not in text
    assert "Slurm requeues or cancels the job" in text and info["ExitCode"] == "75:0"
    print(f"\nall Slurm scenarios done {time.perf_counter() - scenarios['started']:.0f} s "
          "after submission")
