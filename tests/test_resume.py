"""Checkpoints, preemption and resume, with real signals, real processes and real Orbax.

The claim tested throughout: a run that is stopped (a signal, a requeue, SIGKILL in the middle
of a checkpoint write) and started again ends with *exactly* the history and parameters of the
run that was never stopped — the same float bits, compared with ``==``.

Run as a script (``python tests/test_resume.py '<json>'``) this file is also the driver that
the multi-process tests start: it runs ``pdefit.app.cli.fit`` with signals sent to itself at
chosen steps.
"""

from __future__ import annotations

import functools
import json
import logging
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
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pdefit.app import cli, rundir
from pdefit.fitting import assemble
from pdefit.fitting.krylov import curvature_for
from pdefit.fitting.train import ResumeMismatchError, TrainingDivergedError, run_fit
from pdefit.runtime import resume
from pdefit.runtime.checkpoint import CheckpointOptions, CheckpointStore
from pdefit.runtime.signals import PREEMPTED_EXIT_CODE, Preempted

CONF = str(Path(__file__).resolve().parents[1] / "conf")
HERE = Path(__file__).resolve()

# A tiny Aliev–Panfilov problem: 16×16, 5 frames, 40 steps of dt; an optimiser step is a few ms.
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
        "simulate.steps_per_frame=10", "adjoint=store_all", "run.progress=false",
        "run.plots=false"]
ADAM = ["optim=adam", "optim.lr=0.05", "optim.steps=30", "fit.params=[k,a,b]"]


CACHE_OPTIONS = {"jax_compilation_cache_dir": None,
                 "jax_persistent_cache_min_compile_time_secs": 0.0,
                 "jax_persistent_cache_min_entry_size_bytes": -1}


@pytest.fixture(scope="module", autouse=True)
def jax_cache(tmp_path_factory):
    """A persistent compilation cache for this module and the processes it starts: every
    restart compiles the same programs, and a compile costs seconds on 2 cores. Switched off
    again afterwards, so other tests compile as they always do."""
    from jax._src import compilation_cache

    path = tmp_path_factory.mktemp("jax-cache")
    before = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    for name, value in {**CACHE_OPTIONS, "jax_compilation_cache_dir": str(path)}.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    yield path
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def make_config(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[f"run.dir={run_dir}", *TINY, *overrides])


def setup_fit(tmp: Path, *overrides: str):
    """Config, dataset (simulated once per directory) and the assembled fit."""
    cfg = make_config(tmp, *overrides)
    dtype = assemble.set_precision(cfg.precision)
    data = rundir.simulated_dataset(
        cfg, tmp / "data.zarr",
        lambda p: assemble.simulate_dataset(cfg, p, dtype, log=lambda _: None))
    return cfg, assemble.build_fit(cfg, data, dtype)


def fit_once(setup, cfg, directory: Path, **kwargs):
    if cfg.optim.name == "levenberg_marquardt":
        kwargs.setdefault("curvature", curvature_for(setup.problem))
        kwargs.setdefault("layout", setup.problem.layout)
    return run_fit(setup.problem.loss, setup.theta0, setup.batch, cfg.optim, progress=False,
                   log=kwargs.pop("log", lambda _: None), describe=_describe(setup),
                   checkpoint=CheckpointOptions(directory, every=10, keep=2),
                   config=rundir.plain_config(cfg), **kwargs)


def _describe(setup):
    layout = setup.problem.layout
    return lambda theta: {n: layout.physical(theta["params"])[n] for n in layout.fitted}


def without_time(records):
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def assert_same_leaves(a: Any, b: Any) -> None:
    """Same structure, dtypes and bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def signal_at(plan: dict[int, int]):
    """``on_step`` that sends the planned signal to this very process after that step, through
    the handlers run_fit installed: the real delivery path, only the timing is chosen."""
    pending = dict(plan)

    def on_step(step: int, record) -> None:
        if step in pending:
            os.kill(os.getpid(), pending.pop(step))

    return on_step


# ---------------------------------------------------------------------------------------------
# In one process: preempt, restore from disk, compare bit for bit.

CASES = {
    # adam in float32, fitting three parameters and the unobserved initial field v
    "adam-float32-field": (["precision=float32", *ADAM, "observe.fields=[u]",
                            "+fit.initial_fields.v=fit"], [7, 13]),
    # L-BFGS (its line-search state goes through Orbax too) in float64
    "lbfgs-float64": (["precision=float64", "optim=lbfgs", "optim.steps=8", "optim.grad_tol=0",
                       "fit.params=[k,a,b]"], [4]),
    # matrix-free Levenberg–Marquardt over k, a and the unobserved v(0) (its damping and the
    # key of its random probe go through Orbax)
    "lm-matrix-free-field": (["precision=float64", "optim=levenberg_marquardt",
                              "optim.steps=8", "optim.grad_tol=0", "optim.initial_damping=1.0",
                              "optim.krylov_iterations=5", "fit.params=[k,a]",
                              "observe.fields=[u]", "+fit.initial_fields.v=fit"], [4]),
    # an unstable learning rate: non-finite steps roll back before the interruption
    "adam-nan-rollbacks": (["precision=float32", "optim=adam", "optim.lr=8.0",
                            "optim.schedule=constant", "optim.steps=12",
                            "fit.params=[k,a,b,eps0,mu1,mu2]"], [3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, case):
    overrides, stops = CASES[case]
    cfg, setup = setup_fit(tmp_path, *overrides)
    ref_state, ref = fit_once(setup, cfg, tmp_path / "reference")

    directory = tmp_path / "interrupted"
    signals = [signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2]
    for i, stop in enumerate(stops):
        with pytest.raises(Preempted) as stopped:
            fit_once(setup, cfg, directory, on_step=signal_at({stop: signals[i % 3]}))
        assert stopped.value.code == PREEMPTED_EXIT_CODE and stopped.value.step == stop
        assert CheckpointStore(CheckpointOptions(directory)).latest_step() == stop
    state, resumed = fit_once(setup, cfg, directory)

    assert resumed.restarts == len(stops) and resumed.resumed_from == stops[-1]
    assert without_time(resumed.records) == without_time(ref.records)
    assert resumed.losses == ref.losses  # exact equality of floats
    assert resumed.nan_failures == ref.nan_failures
    assert_same_leaves(state, ref_state)  # θ, optimiser state, key, best-so-far, lr scale
    assert_same_leaves(resumed.best_theta, ref.best_theta)
    if case == "adam-nan-rollbacks":
        assert ref.nan_failures >= 1 and ref.records[-1]["lr_scale"] < 1.0


def test_unstable_learning_rate_rolls_back_reduces_lr_and_stops_after_n(tmp_path):
    cfg, setup = setup_fit(tmp_path, "precision=float32", "optim=adam", "optim.lr=8.0",
                           "optim.schedule=constant", "optim.steps=12",
                           "fit.params=[k,a,b,eps0,mu1,mu2]", "optim.nan_lr_factor=0.5")
    messages: list[str] = []
    state, history = fit_once(setup, cfg, tmp_path / "recovers", log=messages.append)
    rollbacks = [m for m in messages if "non-finite" in m]
    assert history.nan_failures == len(rollbacks) >= 1
    assert "learning rate scaled by 0.5" in rollbacks[0]
    scale = 0.5 ** history.nan_failures
    assert {r["lr_scale"] for r in history.records} == {scale}
    assert all(np.isfinite(history.losses)) and len(history.records) == 12
    # The bad step was never applied: after the rollback the run restarts from θ0.
    assert history.records[0]["loss"] == history.losses[0]
    assert int(state.step) == 12

    cfg.optim.max_nan_failures = history.nan_failures - 1
    with pytest.raises(TrainingDivergedError, match=rf"{history.nan_failures} failures, "
                       rf"optim.max_nan_failures={history.nan_failures - 1}.*Lower optim.lr"):
        fit_once(setup, cfg, tmp_path / "gives-up")


def test_a_resume_never_goes_back_before_its_checkpoint(tmp_path):
    """Fewer optim.steps than a run's checkpoint is refused (it used to rewrite the longer
    run's results as if it had stopped at the checkpoint); as many or more go on."""
    cfg, setup = setup_fit(tmp_path, "precision=float32", *ADAM, "optim.steps=12")
    fit_once(setup, cfg, tmp_path / "ck")
    cfg.optim.steps = 5
    with pytest.raises(ResumeMismatchError, match=r"optim.steps: .* checkpointed at step "
                                                  r"11, beyond optim.steps=5.*run.resume"):
        fit_once(setup, cfg, tmp_path / "ck")
    cfg.optim.steps = 13
    _, history = fit_once(setup, cfg, tmp_path / "ck")
    assert history.resumed_from == 11 and len(history.records) == 13


def test_restore_onto_another_device_layout(tmp_path):
    """A state saved sharded over 2 devices comes back on a 2×2 mesh and on one device, bit
    for bit (what a requeued job on another mesh or process count sees)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if jax.device_count() < 4:
        pytest.skip("needs 4 (virtual) devices")
    devices = np.array(jax.devices()[:4])
    field = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 7
    two = NamedSharding(Mesh(devices[:2], ("x",)), PartitionSpec(None, "x"))
    state = {"theta": {"field": jax.device_put(field, two)},
             "step": jax.device_put(jnp.asarray(3, jnp.int32), NamedSharding(two.mesh,
                                                                               PartitionSpec()))}
    store = CheckpointStore(CheckpointOptions(tmp_path / "ck"))
    store.save(3, state, {"records": []}, {"a": 1}, wait=True)

    square = Mesh(devices.reshape(2, 2), ("y", "x"))
    like_square = {"theta": {"field": jax.device_put(jnp.zeros_like(field), NamedSharding(
        square, PartitionSpec("y", "x")))},
        "step": jax.device_put(jnp.asarray(0, jnp.int32), NamedSharding(square, PartitionSpec()))}
    one = jax.devices()[5]
    like_one = jax.device_put({"theta": {"field": jnp.zeros_like(field)},
                               "step": jnp.asarray(0, jnp.int32)}, one)
    for like in (like_square, like_one):
        restored = CheckpointStore(CheckpointOptions(tmp_path / "ck")).restore(like)
        assert restored.step == 3 and restored.config == {"a": 1}
        assert restored.state["theta"]["field"].sharding == like["theta"]["field"].sharding
        assert_same_leaves(restored.state, state)


def test_cli_resumes_reuses_data_and_refuses_another_config(tmp_path, caplog):
    """Through ``cli.fit``: stop, start the same command again, it resumes (one clear log
    line), reuses the simulated dataset, reports the restart; a changed config is refused,
    ``run.resume=false`` starts over."""
    overrides = ["precision=float32", *ADAM, "optim.steps=10", "run.checkpoint_every=3"]
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, *overrides)
    fit = functools.partial(cli.run_fit, on_step=signal_at({6: signal.SIGTERM}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "run_fit", fit)
        with pytest.raises(Preempted):
            cli.fit(cfg)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
    data_mtime = (run_dir / "data.zarr" / "zarr.json").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level("INFO", logger="pdefit"):
        summary = cli.fit(cfg)
    assert any("resuming from checkpoint step 6" in r.message for r in caplog.records)
    assert any("reusing the simulated dataset" in r.message for r in caplog.records)
    assert (run_dir / "data.zarr" / "zarr.json").stat().st_mtime_ns == data_mtime
    assert summary["restarts"] == 1 and summary["optimizer_steps"] == 10
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(10))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "done"

    with pytest.raises(ResumeMismatchError, match=r"optim.lr: 0.05 → 0.02.*run.resume=false"):
        cli.fit(make_config(run_dir, *overrides, "optim.lr=0.02"))
    fresh = cli.fit(make_config(run_dir, *overrides, "optim.lr=0.02", "run.resume=false"))
    assert fresh["restarts"] == 0 and fresh["final_loss"] != summary["final_loss"]


def test_staged_fit_with_a_hold_resumes_inside_a_stage_bit_for_bit(tmp_path):
    """A staged fit holding k in its first stage, preempted inside that stage, resumes to the
    uninterrupted run's result bit for bit, k unchanged through the stage on either path."""
    overrides = ["precision=float64", "optim=adam", "optim.lr=0.05", "optim.steps=8",
                 "fit.params=[k,a]", "fit.stages=[2,3]", "+fit.hold.k=1",
                 "run.checkpoint_every=2"]
    reference = cli.fit(make_config(tmp_path / "whole", *overrides))
    run_dir = tmp_path / "interrupted"
    cfg = make_config(run_dir, *overrides)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "run_fit",
                      functools.partial(cli.run_fit, on_step=signal_at({5: signal.SIGTERM})))
        with pytest.raises(Preempted):
            cli.fit(cfg)
    assert not (run_dir / "stage-1").exists()  # stopped inside the first stage
    resumed = cli.fit(cfg)
    assert resumed["restarts"] == 1
    assert resumed["parameters"] == reference["parameters"]
    for run in (tmp_path / "whole", run_dir):
        held = [json.loads(line)["params"]["k"]
                for line in (run / "stage-0" / "metrics.jsonl").read_text().splitlines()]
        assert len(held) == 8 and len(set(held)) == 1


def test_multiple_shooting_fit_resumes_inside_its_shooting_stage_bit_for_bit(tmp_path):
    """``fit.shooting.segments=2`` without stages: a shooting stage (matrix-free
    Levenberg–Marquardt over k, a, v(0) and the second segment's start), then one trajectory
    on the same window. Preempted inside the shooting stage, the rerun resumes to the
    uninterrupted run's result bit for bit, and the summary says the fit shot."""
    overrides = ["precision=float64", "optim=levenberg_marquardt", "optim.steps=6",
                 "optim.grad_tol=0", "optim.initial_damping=1.0", "optim.krylov_iterations=5",
                 "fit.params=[k,a]", "observe.fields=[u]", "+fit.initial_fields.v=fit",
                 "fit.shooting.segments=2", "run.checkpoint_every=2"]
    reference = cli.fit(make_config(tmp_path / "whole", *overrides))
    assert reference["shooting"] == {"segments": 2, "continuity": 0.03, "stages": 1}
    assert reference["stages"] == [None, None]
    run_dir = tmp_path / "interrupted"
    cfg = make_config(run_dir, *overrides)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "run_fit",
                      functools.partial(cli.run_fit, on_step=signal_at({3: signal.SIGTERM})))
        with pytest.raises(Preempted):
            cli.fit(cfg)
    assert not (run_dir / "stage-1").exists()  # stopped inside the shooting stage
    resumed = cli.fit(cfg)
    assert resumed["restarts"] == 1
    assert resumed["parameters"] == reference["parameters"]
    assert resumed["uncertainty"]["available"]  # from the last stage: one trajectory


def test_a_key_added_after_a_run_was_saved_counts_as_its_default():
    """A run saved before an option existed resumes when the option keeps its default, and is
    refused when the option is set to something else."""
    current = rundir.plain_config(make_config(Path("/r")))
    saved = json.loads(json.dumps(current))
    del saved["simulate"]["refine"], saved["fit"]["discretization_check"]
    assert resume.config_differences(saved, current) == []
    current["simulate"]["refine"]["dt_factor"] = 4
    assert resume.config_differences(saved, current) == [
        "simulate.refine.dt_factor: '<unset>' → 4"]


def test_run_directories_are_deterministic(tmp_path):
    """The same command line gives the same directory, with no timestamp in it."""
    def run_dir(*overrides: str) -> str:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose(config_name="fit", overrides=list(overrides),
                          return_hydra_config=True)
        return str(cfg.hydra.run.dir)

    assert run_dir() == "runs/fit/default"
    assert run_dir("run.progress=false") == "runs/fit/default"  # not part of the result
    assert run_dir("run.name=spiral") == "runs/fit/spiral"
    a = run_dir("optim=adam", "fit.params=[k,a]")
    assert a == run_dir("fit.params=[k,a]", "optim=adam") == "runs/fit/fit.params=(k,a),optim=adam"
    assert rundir.dirname(None, "x" * 500) == rundir.dirname(None, "x" * 500)
    assert len(rundir.dirname(None, "x" * 500)) <= rundir.MAX_NAME


def test_local_multirun_gives_each_point_its_own_directory(tmp_path, jax_cache):
    """``pdefit-fit -m`` with Hydra's basic launcher: one deterministic directory per point,
    and the summary command's table of the sweep."""
    from pdefit.app import sweep

    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    fit = Path(sys.executable).with_name("pdefit-fit")
    done = subprocess.run([str(fit), "-m", "run.name=lr", *TINY, *ADAM, "optim.steps=8",
                           "optim.lr=0.02,0.05"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "runs" / "sweep" / "lr"
    points = sweep.find_points(root)
    assert [p.name.split("optim.lr=")[1][:4] for p in points] == ["0.02", "0.05"]
    rows = [sweep.point_row(p, label) for p, label in zip(points, sweep.labels(points, root),
                                                          strict=True)]
    assert [(r["point"], r["status"], r["steps"], r["restarts"]) for r in rows] == [
        ("optim.lr=0.02", "done", 8, 0), ("optim.lr=0.05", "done", 8, 0)]
    table = sweep.format_table(rows)
    assert table.splitlines()[0].split()[:4] == ["point", "status", "steps", "final"]
    print(f"\n{table}")


# ---------------------------------------------------------------------------------------------
# Separate processes: the CLI's fit in a child that signals itself at chosen steps.


def drive(spec: dict[str, Any]) -> None:
    """Child process: ``cli.fit`` once per planned signal (each resumes from disk), the last
    one ending the process with the preemption status — or, with ``finish``, one more
    ``cli.fit`` to the end. ``kill_in_save`` SIGKILLs the process inside Orbax's commit of
    that checkpoint step."""
    cfg = make_config(Path(spec["run_dir"]), *spec["overrides"])
    plan = [(int(step), int(sig)) for step, sig in spec.get("signals", [])]
    if spec.get("kill_in_save") is not None:
        _kill_while_committing(int(spec["kill_in_save"]))
    original = cli.run_fit

    def capture(*args, **kwargs):
        state, history = original(*args, **kwargs)
        leaves = {f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}
        np.savez(Path(spec["run_dir"]) / "final_state.npz", **leaves)
        return state, history

    cli.run_fit = capture
    for i, (step, sig) in enumerate(plan):
        cli.run_fit = functools.partial(capture, on_step=signal_at({step: sig}))
        try:
            cli.fit(cfg)
        except Preempted:
            if i == len(plan) - 1 and not spec.get("finish"):
                raise  # the real exit: status 75
            continue
        raise AssertionError(f"the signal planned at step {step} never stopped the fit")
    cli.run_fit = capture
    cli.fit(cfg)


def _kill_while_committing(step: int) -> None:
    """SIGKILL this process when Orbax is about to commit checkpoint ``step``: its files are
    written into the temporary directory, the rename that makes it a checkpoint is not done."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killing_finalize(self):
        if self.get_final().name == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        return await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize


def start_driver(spec: dict[str, Any], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    return subprocess.run([sys.executable, str(HERE), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=300)


def final_outputs(run_dir: Path) -> tuple[list[dict], dict, dict[str, np.ndarray]]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    with np.load(run_dir / "final_state.npz") as z:
        state = {k: z[k] for k in z.files}
    return without_time(records), summary, state


def assert_same_run(run_dir: Path, reference: Path) -> dict:
    records, summary, state = final_outputs(run_dir)
    ref_records, ref_summary, ref_state = final_outputs(reference)
    assert records == ref_records
    for key in ("final_loss", "best_loss", "initial_loss", "parameters", "optimizer_steps"):
        assert summary[key] == ref_summary[key], key
    assert state.keys() == ref_state.keys()
    for key in state:
        assert state[key].dtype == ref_state[key].dtype
        assert state[key].tobytes() == ref_state[key].tobytes(), key
    return summary


SIGNAL_OVERRIDES = ["precision=float32", *ADAM, "optim.steps=36", "run.checkpoint_every=5",
                    "run.checkpoint_keep=2"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, jax_cache) -> tuple[Path, Path]:
    """The uninterrupted run, in a child process like the interrupted ones."""
    tmp = tmp_path_factory.mktemp("signals")
    cache = jax_cache
    done = start_driver({"run_dir": str(tmp / "reference"), "overrides": SIGNAL_OVERRIDES},
                        cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "reference", cache


@pytest.mark.slow
def test_signals_at_ten_random_steps_then_same_result(tmp_path, reference_run):
    """SIGTERM, SIGUSR1 and SIGUSR2 at 10 random steps of one run, each followed by a restart
    (three of them in a new process, the rest in the same process, restored from disk)."""
    reference, cache = reference_run
    rng = random.Random(20240605)
    steps = sorted(rng.sample(range(1, 35), 10))
    kinds = [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2]
    plan = [(s, int(kinds[i % 3])) for i, s in enumerate(steps)]
    rng.shuffle(kinds)
    run_dir = tmp_path / "run"
    groups = [plan[0:3], plan[3:6], plan[6:8], plan[8:10]]
    started = time.perf_counter()
    for i, group in enumerate(groups):
        finish = i == len(groups) - 1
        done = start_driver({"run_dir": str(run_dir), "overrides": SIGNAL_OVERRIDES,
                             "signals": group, "finish": finish}, cache)
        assert done.returncode == (0 if finish else PREEMPTED_EXIT_CODE), done.stderr[-3000:]
        for step, _ in group:
            assert f"checkpoint at step {step} written" in done.stderr
    summary = assert_same_run(run_dir, reference)
    assert summary["restarts"] == 10
    print(f"\n10 signals at steps {steps} ({len(groups)} processes): same records, summary and "
          f"final state bits as the uninterrupted run; {time.perf_counter() - started:.1f} s")


def test_sigkill_during_a_checkpoint_write_then_resume(tmp_path, reference_run):
    reference, cache = reference_run
    run_dir = tmp_path / "run"
    killed = start_driver({"run_dir": str(run_dir), "overrides": SIGNAL_OVERRIDES,
                           "kill_in_save": 15}, cache)
    assert killed.returncode == -signal.SIGKILL
    checkpoints = run_dir / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert "15" not in names and "10" in names  # the killed write never became a checkpoint
    assert any(n.startswith("15.orbax-checkpoint-tmp") for n in names), names
    assert CheckpointStore(CheckpointOptions(checkpoints)).latest_step() == 10

    resumed = start_driver({"run_dir": str(run_dir), "overrides": SIGNAL_OVERRIDES}, cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from checkpoint step 10" in resumed.stderr
    assert not any(p.name.startswith("15.orbax") for p in checkpoints.iterdir())
    assert assert_same_run(run_dir, reference)["restarts"] == 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # the fit's events (checkpoints, resumes) are INFO
    jax.config.update("jax_enable_x64", False)
    drive(json.loads(sys.argv[1]))
