"""Run directories that a requeued job finds again.

A fit's directory is ``run.dir`` if given, else Hydra's output directory, which
``conf/fit.yaml`` names deterministically: ``runs/fit/<name>`` for one run and
``runs/sweep/<name>/<point>`` for a sweep, where ``<name>`` is ``run.name`` and ``<point>`` (and
``<name>`` when ``run.name`` is unset) comes from the command-line overrides. The same command
line therefore always gives the same directory — no timestamps — and a fit that starts in a
directory holding checkpoints resumes from them.

A run directory's record — Hydra's ``.hydra/`` (config, hydra config, overrides) and the
command's log ``<command>.log`` — is written by :func:`open_run_record` only once the command
has decided to work in that directory (for a fit: after its resume check), never by Hydra at
start-up: a refused resume or a signal during start-up must leave a run it finds untouched.
Until then log records wait in :class:`DeferredRunLog`.

Also here: the simulated dataset that the embedded default writes into its run directory is
reused on resume (so a restart cannot silently fit different data), and a run directory with
checkpoints is resumed only with the config it was made with (:func:`refuse_mismatched_resume`;
the comparison of a checkpoint's config with the current one is :mod:`pdefit.runtime.resume`).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import logging.handlers
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from omegaconf import DictConfig, OmegaConf

from pdefit.app.config import plain, to_yaml
from pdefit.fitting.train import resume_mismatch
from pdefit.options import FitConfig, SimulateMainConfig
from pdefit.runtime.checkpoint import CHECKPOINT_DIR
from pdefit.runtime.resume import config_differences

log = logging.getLogger("pdefit")

RESOLVER = "pdefit.dirname"
# Hydra lists are written with brackets, which tensorstore (under Orbax) cannot have in a
# path; parentheses read the same. Anything else outside this set becomes "_".
_BRACKETS = str.maketrans("[]{}", "()()")
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+@%:()~-]")
MAX_NAME = 120
# What the simulated dataset of the embedded default depends on.
SIMULATION_KEYS = ("system", "simulate", "precision")


def dirname(name: str | None, overrides: str | None = None) -> str:
    """A directory name: ``name`` if given, else the overrides string (Hydra's
    ``override_dirname``), else ``default``. Brackets become parentheses, path separators and
    other awkward characters ``_``, and long names are shortened with a hash, so the result is
    one safe path component, always the same for the same input."""
    text = str(name) if name not in (None, "", "None") else (overrides or "default")
    text = _UNSAFE.sub("_", text.translate(_BRACKETS)).strip("._") or "default"
    if len(text) > MAX_NAME:
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        text = f"{text[:MAX_NAME - 11]}-{digest}"
    return text


def given_or(value: str | None, default: str) -> str:
    """``value`` unless it is unset (``run.dir`` given on the command line wins over the
    default directory)."""
    return default if value in (None, "", "None") else str(value)


def command_name(argv: list[str] | None = None) -> str:
    """The running console command without its ``pdefit-`` prefix (``fit``, ``rank``, …);
    ``pdefit`` when started otherwise (``python -m``, a test)."""
    argv = sys.argv if argv is None else argv
    name = Path(argv[0]).name if argv else ""
    return name.removeprefix("pdefit-") if name.startswith("pdefit-") else "pdefit"


def command_help(argv: list[str] | None = None) -> str:
    """The ``--help`` description of the running console command: the docstring of its entry
    point (``$`` escaped for Hydra's help template)."""
    from importlib.metadata import entry_points

    argv = sys.argv if argv is None else argv
    name = Path(argv[0]).name if argv else ""
    doc = next((inspect.getdoc(point.load()) for point in
                entry_points(group="console_scripts", name=name)
                if point.value.startswith("pdefit.")), None)
    return (doc or "A pdefit command (see README.md).").replace("$", "$$")


def register_resolvers() -> None:
    """The resolvers of the configs (conf/fit.yaml, conf/simulate.yaml, conf/hydra/):
    ``${pdefit.dirname:<name>,<overrides>}`` and ``${pdefit.or:${run.dir},<default>}`` name the
    run directory, ``${pdefit.command:}`` its log file, ``${pdefit.help:}`` gives ``--help``."""
    functions = {RESOLVER: dirname, "pdefit.or": given_or, "pdefit.command": command_name,
                 "pdefit.help": command_help}
    for name, function in functions.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


# ---------------------------------------------------------------------------------------------
# Configs.


def plain_config(cfg: FitConfig | SimulateMainConfig | DictConfig | Mapping) -> dict[str, Any]:
    """The resolved config (typed options, a composed config or a mapping) as plain JSON-able
    data: what the checkpoints keep and compare."""
    if isinstance(cfg, Mapping) and not OmegaConf.is_config(cfg):
        return dict(cfg)
    return plain(cfg)


def refuse_mismatched_resume(cfg: FitConfig, out: Path) -> None:
    """A run directory with checkpoints is resumed only with the config it was made with
    (up to driving and stopping keys): compared here, before its dataset, config.yaml or
    checkpoints are touched. The checkpoints' own configs are checked again on restore."""
    saved_path = out / "config.yaml"
    if not cfg.run.resume or not saved_path.exists() or not _has_checkpoints(out):
        return
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=True)
    except Exception:  # an unreadable or foreign config.yaml: the restore's check decides
        return
    error = resume_mismatch(saved, plain_config(cfg), out)  # type: ignore[arg-type]
    if error is not None:
        raise error


def _has_checkpoints(out: Path) -> bool:
    directories = [out / CHECKPOINT_DIR, *out.glob(f"stage-*/{CHECKPOINT_DIR}")]
    return any(p.name.isdigit() for d in directories if d.is_dir() for p in d.iterdir())


# ---------------------------------------------------------------------------------------------
# The simulated dataset of a run.


def simulated_dataset(cfg: FitConfig | SimulateMainConfig, path: Path,
                      simulate: Callable[[Path], Path],
                      reuse: bool = True) -> Path:
    """The run's own simulated dataset at ``path``: the existing one if it was made from the
    same ``system``/``simulate``/``precision`` config (a resumed or repeated run), otherwise
    simulated afresh into a temporary directory that is renamed into place once complete, so
    a run killed while simulating never leaves a partial dataset that looks complete.

    ``simulate(path)`` is called by every process (each may write its own experiments); the
    decision to reuse is process 0's, so all processes take it together."""
    wanted = {k: plain_config(cfg).get(k) for k in SIMULATION_KEYS}
    saved = _simulation_config(path) if reuse and path.exists() else None
    found = saved is not None and not config_differences(saved, wanted, ignore=())
    if _from_process_0(found):
        log.info(f"reusing the simulated dataset {path} (same system/simulate config)")
        return path
    if path.exists() and reuse:
        log.warning(f"{path} was simulated from another config: simulating it again")
    tmp = path.with_name(f".{path.name}.tmp")
    primary = jax.process_index() == 0
    if primary:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier("pdefit-simulation-start")
    simulate(tmp)
    if primary:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    _barrier("pdefit-simulation-renamed")
    return path


def _from_process_0(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _simulation_config(path: Path) -> dict[str, Any] | None:
    from pdefit import data as zd

    try:
        provenance = zd.open_dataset(path).meta.provenance
    except Exception:  # unreadable: simulate again
        return None
    config = (provenance or {}).get("config") or {}
    return {k: config.get(k) for k in SIMULATION_KEYS}


# ---------------------------------------------------------------------------------------------
# The run's record: Hydra's .hydra/ and the command's log, written once the run is accepted.


class DeferredRunLog(logging.handlers.MemoryHandler):
    """The job-logging handler of ``<run dir>/<command>.log`` (conf/hydra/job_logging): holds
    the records until :func:`open_run_record` names the file, then writes them and every later
    one there. A run that stops before (a refused resume, a signal during start-up) writes no
    log into a directory it must not touch."""

    def __init__(self, capacity: int = 100_000) -> None:
        super().__init__(capacity, flushLevel=logging.CRITICAL + 1, target=None,
                         flushOnClose=False)

    def shouldFlush(self, record: logging.LogRecord) -> bool:  # noqa: N802 (logging's name)
        if self.target is None and len(self.buffer) > self.capacity:
            del self.buffer[0]  # never opened (another process, a refused run): keep the last
        return self.target is not None

    def open(self, path: Path) -> None:
        target = logging.FileHandler(path, mode="a", encoding="utf-8")
        target.setFormatter(self.formatter)
        self.setTarget(target)
        self.flush()


def output_dir(cfg: FitConfig) -> Path:
    """The command's run directory, created: Hydra's output directory under Hydra (it is
    run.dir when given, see conf/fit.yaml; a sweep point's own directory), else run.dir."""
    from hydra.core.hydra_config import HydraConfig

    out = (Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized()
           else Path(cfg.run.dir))
    out.mkdir(parents=True, exist_ok=True)
    return out


def open_run_record(out: Path, cfg: FitConfig) -> None:
    """Write the run's record into ``out``: ``.hydra/`` (config.yaml as composed,
    hydra.yaml, overrides.yaml) and ``<command>.log``, which gets the records held so far.
    Process 0 only (the run directory is shared); a no-op outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or jax.process_index() != 0:
        return
    hydra_cfg = HydraConfig.get()
    record = out / ".hydra"
    record.mkdir(parents=True, exist_ok=True)
    (record / "config.yaml").write_text(to_yaml(cfg))
    (record / "hydra.yaml").write_text(OmegaConf.to_yaml({"hydra": hydra_cfg}))
    (record / "overrides.yaml").write_text(OmegaConf.to_yaml(list(hydra_cfg.overrides.task)))
    for handler in logging.getLogger().handlers:
        if isinstance(handler, DeferredRunLog) and handler.target is None:
            handler.open(out / f"{command_name()}.log")
