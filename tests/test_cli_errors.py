"""One line per mistake (issue 25, item 3): a configuration, dataset or system error on the
command line is one line ``<program>: error: <message>`` on stderr, exit status 2, no
traceback; ``PDEFIT_TRACEBACK=1`` shows it. Unknown keys, with or without ``+``, are refused
with the closest valid key. Real subprocesses, as a user runs the commands; each is refused
before anything is simulated, so each costs only the start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdefit.app.errors import one_line, one_line_errors
from pdefit.options import ConfigError
from pdefit.runtime.signals import Preempted

BIN = Path(sys.executable).parent
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=4",
        "simulate.steps_per_frame=5", "run.plots=false"]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("XLA_FLAGS", "HYDRA_FULL_ERROR", "PDEFIT_TRACEBACK")}


def command(name: str, *args: str, cwd: Path, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=240)


def error_line(done: subprocess.CompletedProcess, program: str = "pdefit-fit") -> str:
    """The one line of a refused command (asserting that it is one line, exit 2, no
    traceback)."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "[pdefit][" not in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{program}: error: ")
    return lines[0]


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=0.1", "optim.lrr: unknown key; did you mean optim.lr?"),
    ("+optim.lrr=0.1", "optim.lrr: unknown key; did you mean optim.lr?"),
    ("data=zarr", "data.path is required"),
    ("optim.lr=-1", "optim.lr must be > 0"),
])
def test_a_mistake_is_one_line_and_exit_2(tmp_path, override, message):
    line = error_line(command("pdefit-fit", *TINY, "run.dir=rd", override, cwd=tmp_path))
    assert message in line
    assert not (tmp_path / "rd" / "data.zarr").exists()  # refused before simulating


def test_a_new_entry_of_a_composed_dict_is_named_with_its_plus_form():
    """``fit.hold={...}`` with a key the experiment's fit.hold lacks: Hydra refuses the key
    inside it; the line names it and how to add it, not "unknown key fit.hold"."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from pdefit.app.config import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"), pytest.raises(
            ConfigCompositionException) as err:
        compose(config_name="fit", overrides=["experiment=bocf_recovery",
                                              "fit.hold={u_so: 2, k_s: 3}"])
    assert one_line(err.value) == (
        "fit.hold: 'k_s' is not among its composed entries; add it as +fit.hold.k_s=<value> "
        "(or give the whole value with ++fit.hold=...)")
    # The same entry given by its dotted key (the form docs and issues write).
    with initialize_config_dir(config_dir=conf, version_base="1.3"), pytest.raises(
            ConfigCompositionException) as err:
        compose(config_name="fit", overrides=["fit.initial_fields.v=fit"])
    assert one_line(err.value) == (
        "fit.initial_fields.v: 'v' is not among the composed entries of fit.initial_fields; "
        "add it as +fit.initial_fields.v=<value>")


def test_traceback_on_request_and_simulate_refuses_one_frame(tmp_path):
    done = command("pdefit-fit", *TINY, "run.dir=rd", "fit.params=[kk]", cwd=tmp_path,
                   env={"PDEFIT_TRACEBACK": "1"})
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "ConfigError" in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith(
        "pdefit-fit: error: fit.params: unknown parameter(s) ['kk'] for aliev_panfilov; did "
        "you mean 'k'?")
    line = error_line(command("pdefit-simulate", *TINY[:4], "simulate.output=one.zarr",
                              "simulate.n_frames=1", cwd=tmp_path), "pdefit-simulate")
    assert "simulate.n_frames=1" in line
    assert not (tmp_path / "one.zarr").exists()


def test_decorator_keeps_signal_exits_and_reports_mistakes(capsys):
    """In-process: a preempted run's SystemExit (75) passes untouched; a ConfigError is one
    line and exit 2."""

    @one_line_errors("pdefit-x")
    def preempted() -> None:
        raise Preempted(3, 15)

    @one_line_errors("pdefit-x")
    def mistaken() -> None:
        raise ConfigError("optim.lr must be > 0, got -1")

    with pytest.raises(SystemExit) as stop:
        preempted()
    assert stop.value.code == 75
    with pytest.raises(SystemExit) as stop:
        mistaken()
    assert stop.value.code == 2
    assert capsys.readouterr().err == "pdefit-x: error: optim.lr must be > 0, got -1\n"
