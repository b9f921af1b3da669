"""Command-line conventions: where commands write, what they print, --help, progress, logging.

The console scripts run as real subprocesses with their output captured (not a terminal), as in
a batch job; each costs a few seconds of JAX start-up, so the checks are batched into few."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pdefit.app import rundir
from pdefit.app.config import register_configs
from pdefit.fitting.ranking import rank_parameters
from pdefit.numerics.grid import Grid
from pdefit.runtime.progress import Progress, ProgressOptions
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=4",
        "simulate.steps_per_frame=5"]
# One process, as a user with one CPU device would run the commands.
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def command(name: str, *args: str, cwd: Path, timeout: float = 240,
            ) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_fit_run_dir_owns_hydra_record_and_log_with_plain_progress(tmp_path):
    """run.dir holds .hydra/ and fit.log and nothing lands in ./runs; redirected output
    gets plain progress lines (no carriage returns), the compile is announced, normal events
    are INFO and jax's TPU probe is not shown."""
    done = command("pdefit-fit", *TINY, "adjoint=store_all", "fit.params=[k]", "optim.steps=12",
                   "optim.grad_tol=0.1", "run.log_every=1", "run.plots=false", "run.dir=rd",
                   cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    run = tmp_path / "rd"
    assert (run / ".hydra" / "overrides.yaml").read_text().count("run.dir=rd") == 1
    assert not (tmp_path / "runs").exists()
    log = (run / "fit.log").read_text()
    assert "fit: compiling the loss and gradient (15 time steps)" in log
    assert "fit: compiled and ran the first step in" in log
    assert "fit: step 1/12, loss " in log and "fit: step 1/12" in done.stdout
    assert "\r" not in output
    assert "[pdefit][INFO] - converged at step" in output
    assert "WARNING" not in output and "backend 'tpu'" not in output

    # A resume refused for a changed config leaves the run it protects untouched: its record
    # (.hydra/), its log and everything else.
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    refused = command("pdefit-fit", *TINY, "adjoint=store_all", "fit.params=[k]",
                      "optim.steps=12", "optim.grad_tol=0.1", "run.plots=false", "run.dir=rd",
                      "simulate.seed=7", cwd=tmp_path)
    assert refused.returncode != 0
    assert "run.resume=false" in refused.stdout + refused.stderr
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


def test_run_dir_is_hydra_output_directory():
    """run.dir names Hydra's output directory (so .hydra/ and the log go there), for one run
    and as the root of a sweep's points; the log is named after the command."""
    register_configs()
    rundir.register_resolvers()

    def hydra_dirs(*overrides: str) -> tuple[str, str, str]:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="fit", overrides=list(overrides),
                          return_hydra_config=True)
        log_handler = cfg.hydra.job_logging.handlers.file["class"]
        return str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir), log_handler

    assert hydra_dirs("run.dir=/data/my run")[:2] == ("/data/my run", "/data/my run")
    assert hydra_dirs("run.dir=rel/x", "optim.lr=0.1")[:2] == ("rel/x", "rel/x")
    assert hydra_dirs("run.name=a")[:2] == ("runs/fit/a", "runs/sweep/a")
    assert hydra_dirs()[:2] == ("runs/fit/default", "runs/sweep/default")
    # Hydra writes neither .hydra/ nor the log itself: pdefit does, once the run is accepted.
    assert hydra_dirs()[2] == "pdefit.app.rundir.DeferredRunLog"
    assert rundir.command_name(["/venv/bin/pdefit-rank", "x=1"]) == "rank"
    assert rundir.command_name(["python"]) == "pdefit"


def test_simulate_writes_where_asked_and_overwrites_only_with_consent(tmp_path):
    from pdefit.data import open_dataset

    target = tmp_path / "sub" / "d.zarr"
    args = [*TINY, "simulate.output=sub/d.zarr", "simulate.n_experiments=2"]
    earlier = command("pdefit-simulate", *TINY, "simulate.output=sub/d.zarr", cwd=tmp_path)
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    refused = command("pdefit-simulate", *args, cwd=tmp_path)
    assert refused.returncode != 0
    assert f"simulate.output: {target} exists" in refused.stderr
    assert "simulate.overwrite=true" in refused.stderr
    assert open_dataset(target).meta.n_experiments == 1

    # Only a pdefit dataset is replaced (tests/test_file_safety.py: nothing else).
    done = command("pdefit-simulate", *args, "simulate.overwrite=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert open_dataset(target).meta.n_experiments == 2
    # Only the dataset: no run directory, no Hydra record, no log, no temporary left over.
    assert sorted(p.name for p in tmp_path.rglob("*") if p.parent in (tmp_path, target.parent)
                  ) == ["d.zarr", "sub"]


HELP_SCRIPT = """
import contextlib, io, json, sys
from importlib.metadata import entry_points
from hydra.core.global_hydra import GlobalHydra
texts = {}
for name in sys.argv[1:]:
    (point,) = entry_points(group="console_scripts", name=name)
    sys.argv = [name, "--help"]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
        point.load()()
    GlobalHydra.instance().clear()
    texts[name] = buffer.getvalue()
print(json.dumps(texts))
"""


def test_help_describes_each_command(tmp_path):
    """Each command's --help (run in one process, as its console script is) says what the
    command does and gives an example; the Hydra ones list the config groups."""
    names = ["pdefit-fit", "pdefit-simulate", "pdefit-gradcheck", "pdefit-rank",
             "pdefit-lyapunov", "pdefit-evaluate"]
    done = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *names], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    texts = json.loads(done.stdout)
    for name, text in texts.items():
        assert "powered by Hydra" not in text, name
        assert f"{name} " in text and "xample" in text, name
    for name in names[:-1]:
        assert texts[name].startswith(f"{name}: "), texts[name][:200]
        assert "--cfg job" in texts[name]
    for name in names[:-1]:
        if name != "pdefit-simulate":  # has no config group but system
            assert "== Config groups (group=option) ==" in texts[name]
            assert "optim: adam, lbfgs" in texts[name]
    assert "Config groups" not in texts["pdefit-simulate"]
    assert not list(tmp_path.iterdir())  # --help writes nothing


def test_progress_is_plain_lines_when_not_a_terminal(caplog):
    stream = io.StringIO()  # not a terminal
    options = ProgressOptions(label="stage 2/3 (6 frames)", every=3, rollout_steps=50,
                              later_work=10.0)
    with caplog.at_level(logging.INFO, logger="pdefit"):
        bar = Progress(7, 0, options, stream=stream)
        for step in range(7):
            bar.set_postfix(loss=f"{1.0 / (step + 1):.3e}", refresh=False)
            bar.update(1)
        bar.close()
    assert stream.getvalue() == ""  # no bar
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "stage 2/3 (6 frames): compiling the loss and gradient (50 time steps)…"
    assert lines[1].startswith("stage 2/3 (6 frames): compiled and ran the first step in")
    steps = [line.split(",")[0] for line in lines[2:]]
    assert steps == [f"stage 2/3 (6 frames): step {n}/7" for n in (3, 6, 7)]
    assert all("s/step, ETA" in line and "all stages ETA ~" in line for line in lines[2:])
    assert "loss 1.429e-01" in lines[-1]


def test_rank_reports_each_simulation():
    grid = Grid((12, 12), (1.0, 1.0))
    system = AlievPanfilov()
    x0 = {"u": jnp.zeros(grid.shape).at[4:8, 4:8].set(1.0), "v": jnp.zeros(grid.shape)}
    messages: list[str] = []
    rows = rank_parameters(system, grid, dict(AP96), 0.05, "euler", x0, 20, 5,
                           names=["k", "a"], dtype=jnp.float64, log=messages.append)
    assert messages[0] == ("rank: simulating the reference (20 steps), then 2 perturbed "
                           "runs…")
    assert messages[1].startswith("rank: reference done in ")
    assert [m.split(":")[1].split()[:2] for m in messages[2:]] == [["1/2", "k"], ["2/2", "a"]]
    assert {r["name"] for r in rows} == {"k", "a"}
    for row in rows:
        assert f"{row['name']} × 1.5: MAE {row['mae']:.3e}" in " ".join(messages)


def load_make_results(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_results",
                                                  ROOT / "docs" / "make_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = tmp_path / "runs"
    monkeypatch.setattr(module, "RUN_DIRS", {
        "bocf_ranking": [runs / "results/bocf_ranking", runs / "fit/bocf_ranking"],
        "bocf_ranking_sharp": [runs / "results/bocf_ranking_sharp"],
        "bocf_recovery": [runs / "results/bocf_recovery", runs / "fit/bocf"],
        "bocf_recovery_sharp": [runs / "results/bocf_recovery_sharp"],
        "ap_from_bocf": [runs / "results/ap_from_bocf", runs / "fit/ap"]})
    monkeypatch.setattr(module, "PAGE", tmp_path / "results.md")
    monkeypatch.setattr(module, "FIGURES", tmp_path / "figures")
    monkeypatch.setattr(module, "FORWARD", tmp_path / "forward.json")
    return module


def test_make_results_reads_readme_runs_and_keeps_measured_sections(tmp_path, monkeypatch):
    """With only the README's `run.name=ap` run on disk, the AP section is generated from it
    and every other section keeps the measured text the page already had."""
    make_results = load_make_results(tmp_path, monkeypatch)
    measured = "**Mean absolute relative deviation 8.5e-07 %, measured earlier.**"
    page = (ROOT / "docs" / "results.md").read_text()
    heading = "## BOCF parameter recovery (`experiment=bocf_recovery`)"
    start = page.index(heading)
    end = page.index("\n#", start + 1)
    make_results.PAGE.write_text(page[:start] + f"{heading}\n\n{measured}\n" + page[end:])
    ap = tmp_path / "runs" / "fit" / "ap"
    ap.mkdir(parents=True)
    rows = [{"name": "k", "true": None, "start": 7.0, "recovered": 8.25, "start_rel_error": None,
             "rel_error": None}]
    (ap / "summary.json").write_text(json.dumps({
        "system": "aliev_panfilov", "grid": [128, 128], "n_steps": 1000, "stages": [3, 101],
        "schedule": "Revolve(snapshots=32)", "initial_loss": 0.5, "best_loss": 0.001,
        "wall_time_s": 12.0, "mean_rel_error": None, "parameters": rows}))
    make_results.main([])
    text = make_results.PAGE.read_text()
    assert measured in text
    assert "not run" not in text.lower()
    assert "aliev_panfilov on 128×128, 1000 steps, windows of 3 → 101 frames" in text
    assert "| k | — | 7 | 8.25 |" in text
    for old_heading in make_results.sections_of(page):
        assert old_heading in text
    with pytest.raises(SystemExit, match="usage"):
        make_results.main(["nonsense=x"])


def test_fitted_initial_field_is_compared_with_the_truth(tmp_path, capsys):
    """A fit of the unobserved v(0) reports its error against the dataset's own first frame
    of v (summary.json, the output, initial_fields.png)."""
    from pdefit.app import cli
    from pdefit.data import open_dataset
    from pdefit.fitting import assemble
    from tests.test_fit import SMALL, config

    dtype = assemble.set_precision("float32")
    data = assemble.simulate_dataset(config(tmp_path, *SMALL), tmp_path / "ap.zarr", dtype,
                                     log=lambda _: None)
    run = tmp_path / "run"
    summary = cli.fit(config(run, *SMALL, f"data.path={data}", "observe.fields=[u]",
                             "fit.params=[k]", "+fit.initial_fields.v=fit", "optim=adam",
                             "optim.lr=0.05", "optim.steps=3", "run.plots=true"))
    fitted = np.load(run / "fitted.npz")["fields/v"].astype(np.float64)
    truth = open_dataset(data).read("v", frames=[0])[:, 0].astype(np.float64)
    expected = np.linalg.norm(fitted - truth) / np.linalg.norm(truth)
    error = summary["initial_fields"]["v"]
    assert error["rel_l2_error"] == pytest.approx(expected, rel=1e-5)
    # v(0) starts at the system's first guess from u (on its nullcline above threshold; the
    # blobs' v is unrelated to u, so it is far off), then moves.
    assert 0 < expected < 3
    assert error["max_abs_error"] == pytest.approx(np.abs(fitted - truth).max(), rel=1e-5)
    assert json.loads((run / "summary.json").read_text())["initial_fields"] == summary[
        "initial_fields"]
    assert (run / "initial_fields.png").stat().st_size > 0
    assert f"initial v: relative L2 error {100 * expected:.3g} %" in capsys.readouterr().out


def test_a_composed_config_pickles_for_the_slurm_launcher(tmp_path):
    """submitit's launcher pickles the composed config into the Slurm job: it must unpickle
    in a fresh interpreter (the schema's writable twins are importable by name) into the same
    typed options, an experiment's optional group (``simulate.system``) included."""
    import pickle

    from pdefit.app.config import to_options
    from tests.test_fit import config

    cfg = config(tmp_path, "experiment=ap_from_bocf")
    (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(cfg))
    (tmp_path / "options.pkl").write_bytes(pickle.dumps(to_options(cfg)))
    script = ("import pickle, sys; from pdefit.app.config import to_options; "
              "cfg = pickle.load(open(sys.argv[1], 'rb')); "
              "assert to_options(cfg) == pickle.load(open(sys.argv[2], 'rb')); "
              "print(cfg.simulate.system.name)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cfg.pkl"),
                           str(tmp_path / "options.pkl")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "bocf"
