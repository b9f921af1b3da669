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
the comparison of a checkpoint's config with the current one is :mod:`pdefit.runtime.resume`),
never with fewer optim.steps than it has done, and a finished one is not redone
(:func:`finished_fit`).

Nothing is deleted that pdefit did not make: ``run.dir`` is checked before any work
(:func:`check_run_dir`), a run directory is locked while a command works in it
(:func:`lock_run_dir`, :mod:`pdefit.runtime.lock`), a run's ``data.zarr`` is replaced only
when the run recorded writing it (:data:`RUN_DATA_RECORD`), and ``simulate.overwrite``
replaces only a pdefit dataset (:func:`refuse_replacing`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import logging.handlers
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import hydra
import jax
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pdefit import data as zd
from pdefit.app.config import plain, to_yaml
from pdefit.fitting.train import resume_mismatch
from pdefit.options import ConfigError, FitConfig, SimulateMainConfig
from pdefit.runtime.checkpoint import CHECKPOINT_DIR, write_json_atomic
from pdefit.runtime.lock import DirectoryLock, lock_directory, no_lock
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
# In a run directory: the digest of the data.zarr the run simulated there (of its zarr.json,
# which holds the dataset's attributes and provenance): only that data.zarr is ever replaced.
RUN_DATA_RECORD = ".pdefit-data.json"
# What a fit leaves in its run directory (besides checkpoints): its results.
RESULT_FILES = ("summary.json", "fitted.npz", "metrics.jsonl", "status.json")


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
    default directory); checked (:func:`check_run_dir`) before Hydra creates it."""
    chosen = default if value in (None, "", "None") else str(value)
    check_run_dir(Path(chosen))
    return chosen


def check_run_dir(path: Path, key: str = "run.dir") -> None:
    """Refuse, before any work, a run directory that cannot hold a run: a path with brackets
    (tensorstore, under Orbax, cannot open checkpoints below one), a file, a path under a
    file, or a directory (or the existing parent it would be made in) that is not writable."""
    where = path.absolute()
    if "[" in str(where) or "]" in str(where):
        raise ConfigError(f"{key}: {where} contains '[' or ']', which the checkpoints' storage "
                          "(tensorstore, under Orbax) cannot open; choose a directory without "
                          "brackets")
    existing = where
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == where else f"lies under {existing}, which is a file"
        raise ConfigError(f"{key}: {where} {what}, not a directory; choose a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == where else (
            f"cannot be created: {existing} is not writable")
        raise ConfigError(f"{key}: {where} {what} (permission denied); choose a directory "
                          "you can write")


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
    if not cfg.run.resume or not _has_checkpoints(out):
        return
    done = max(_checkpoint_steps(out))
    if done > cfg.optim.steps:
        raise ConfigError(
            f"optim.steps: {out} holds a fit checkpointed at step {done}, beyond "
            f"optim.steps={cfg.optim.steps}, and a resume cannot undo steps; to fit "
            f"{cfg.optim.steps} steps afresh choose another run.dir (or run.resume=false, "
            f"which discards its checkpoints), or give optim.steps >= {done}")
    saved = _saved_config(out)
    if saved is None:  # an unreadable or foreign config.yaml: the restore's check decides
        return
    error = resume_mismatch(saved, plain_config(cfg), out)
    if error is not None:
        raise error


def finished_fit(cfg: FitConfig, out: Path) -> dict[str, Any] | None:
    """The summary of the finished fit in ``out`` when ``cfg`` would only repeat it (same
    config up to where and how it runs: the same optim.steps and stopping rules), else None.
    Such a fit is not redone: resuming it would take a step past its end and rewrite its
    results. Finished: every status.json says "done" and summary.json is newer than them and
    than config.yaml (which a continued fit rewrites when it starts)."""
    summary = out / "summary.json"
    statuses = [out / "status.json", *out.glob("stage-*/status.json")]
    statuses = [p for p in statuses if p.exists()]
    if not cfg.run.resume or not summary.exists() or not statuses or not _has_checkpoints(out):
        return None
    saved = _saved_config(out)
    newest = max(p.stat().st_mtime_ns for p in [*statuses, out / "config.yaml"]
                 if p.exists())
    if (saved is None or summary.stat().st_mtime_ns < newest
            or config_differences(saved, plain_config(cfg), ignore=_RUNNING_KEYS)
            or any(_read_json(p).get("status") != "done" for p in statuses)):
        return None
    return _read_json(summary) or None


# What a rerun of a finished fit may change and still be the same fit (see finished_fit).
_RUNNING_KEYS = ("run.", "mesh.", "distributed.")


def _saved_config(out: Path) -> dict[str, Any] | None:
    try:
        saved = OmegaConf.to_container(OmegaConf.load(out / "config.yaml"), resolve=True)
    except Exception:  # missing, unreadable or foreign
        return None
    return saved if isinstance(saved, dict) else None  # type: ignore[return-value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _checkpoint_steps(out: Path) -> list[int]:
    """The steps of every checkpoint in ``out`` (its stages' included)."""
    directories = [out / CHECKPOINT_DIR, *out.glob(f"stage-*/{CHECKPOINT_DIR}")]
    return [int(p.name) for d in directories if d.is_dir() for p in d.iterdir()
            if p.name.isdigit()]


def _has_checkpoints(out: Path) -> bool:
    return bool(_checkpoint_steps(out))


def _has_results(out: Path) -> bool:
    """Whether a fit has left results (or checkpoints) in ``out``."""
    return (_has_checkpoints(out) or any((out / name).exists() for name in RESULT_FILES)
            or any(out.glob("stage-*")))


# ---------------------------------------------------------------------------------------------
# The simulated dataset of a run.


def simulated_dataset(cfg: FitConfig | SimulateMainConfig, path: Path,
                      simulate: Callable[[Path], Path],
                      reuse: bool = True, overwrite: bool = False) -> Path:
    """A simulated dataset at ``path``, written into a temporary directory of a name of its
    own that is renamed into place once complete, so a run killed while simulating never
    leaves a partial dataset that looks complete (nor removes anything but its own).

    ``reuse``: ``path`` is a run's own ``data.zarr``: the existing one is kept if it was made
    from the same ``system``/``simulate``/``precision`` config (a resumed or repeated run),
    and replaced only if the run recorded writing it (:func:`refuse_replacing_run_data`).
    Otherwise (``pdefit-simulate``) an existing ``path`` is replaced only with ``overwrite``
    and only if it is a pdefit dataset.

    ``simulate(path)`` is called by every process (each may write its own experiments); the
    decision to reuse is process 0's, so all processes take it together."""
    wanted = {k: plain_config(cfg).get(k) for k in SIMULATION_KEYS}
    saved = _simulation_config(path) if reuse and path.exists() else None
    found = saved is not None and not config_differences(saved, wanted, ignore=())
    if _from_process_0(found):
        log.info(f"reusing the simulated dataset {path} (same system/simulate config)")
        return path
    if reuse and refuse_replacing_run_data(cfg, path):
        log.warning(f"{path} was simulated from another config: simulating it again")
    tmp = path.with_name(f".{path.name}.tmp-{_shared_token()}")
    primary = jax.process_index() == 0
    _barrier("pdefit-simulation-start")
    try:
        simulate(tmp)
        if primary:
            _put_in_place(tmp, path, reuse, overwrite)
    except BaseException:
        if primary:  # only our own temporary dataset (its name is this run's)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier("pdefit-simulation-renamed")
    return path


def _put_in_place(tmp: Path, path: Path, own: bool, overwrite: bool) -> None:
    """Rename the complete dataset ``tmp`` to ``path``, replacing what is there only as
    decided before simulating (checked again: something may have appeared meanwhile)."""
    if os.path.lexists(path):
        if own and not _written_by_run(path):
            raise ConfigError(f"run.dir: {path.parent} holds a {path.name} that this run did "
                              "not write (it appeared while simulating); move it")
        if not own and not overwrite:
            raise ConfigError(f"simulate.output: {path} appeared while simulating; choose "
                              "another simulate.output or replace it with "
                              "simulate.overwrite=true")
        if not own:
            refuse_replacing(path)
        shutil.rmtree(path)
    tmp.rename(path)
    if own:  # the record that makes this data.zarr the run's own, to replace later
        write_json_atomic(path.parent / RUN_DATA_RECORD, {path.name: _dataset_digest(path)})


def refuse_replacing_run_data(cfg: FitConfig | SimulateMainConfig, path: Path) -> list[str]:
    """Whether the run's ``data.zarr`` at ``path`` must be simulated again: the differences of
    its simulation config from ``cfg``'s (empty when it is absent or can be reused). One to
    be replaced must have been written there by the run (recorded in
    :data:`RUN_DATA_RECORD`), and must not lie under a fit's results (they would lose the
    data they were fitted to) unless ``run.resume=false`` starts the run over; otherwise a
    ConfigError naming run.dir. Asked before the run directory is touched."""
    if not os.path.lexists(path):
        return []
    wanted = {k: plain_config(cfg).get(k) for k in SIMULATION_KEYS}
    saved = _simulation_config(path)
    differences = (["(an unreadable dataset)"] if saved is None
                   else config_differences(saved, wanted, ignore=()))
    if not differences:
        return []
    out = path.parent
    if not _written_by_run(path):
        raise ConfigError(
            f"run.dir: {out} holds a {path.name} that this run did not write; move it, or "
            f"fit it with data=zarr data.path={path}")
    run = getattr(cfg, "run", None)
    if run is not None and run.resume and _has_results(out):
        raise ConfigError(
            f"run.dir: {out} holds the results of a fit of its {path.name}, which was "
            f"simulated from another config ({'; '.join(differences[:4])}); replacing the "
            "data would leave them without it: choose another run.dir, or run.resume=false "
            "to start this run over")
    return differences


def _written_by_run(path: Path) -> bool:
    digest = _dataset_digest(path)
    return digest is not None and _read_json(path.parent / RUN_DATA_RECORD).get(
        path.name) == digest


def _dataset_digest(path: Path) -> str | None:
    """The digest of a dataset's group metadata (attributes and provenance included)."""
    try:
        return hashlib.sha256((path / "zarr.json").read_bytes()).hexdigest()
    except OSError:
        return None


def refuse_replacing(path: Path, key: str = "simulate.output") -> None:
    """``simulate.overwrite`` replaces only a pdefit dataset: not a file, a folder, a run
    directory, nor the current directory or one that contains it."""
    where, resolved = path.absolute(), path.resolve()
    here = {Path.cwd().resolve(), Path(hydra.utils.get_original_cwd()).resolve()
            } if HydraConfig.initialized() else {Path.cwd().resolve()}
    if any(resolved == h or resolved in h.parents for h in here):
        what = "it is the current directory or contains it"
    elif zd.is_pdefit_dataset(path):
        return
    else:
        what = ("a file" if where.is_file() else "a symbolic link" if where.is_symlink()
                else "a directory without a pdefit dataset's zarr.json")
    raise ConfigError(f"{key}: {where} is not a pdefit dataset ({what}); pdefit replaces only "
                      f"datasets it wrote — choose another {key}")


def _shared_token() -> str:
    """A random name part, the same in every process (they write one dataset together)."""
    token = np.frombuffer(os.urandom(8), np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = np.asarray(multihost_utils.broadcast_one_to_all(token.astype(np.int32)))
    return "".join(f"{int(x) & 0xFFFFFFFF:08x}" for x in token)


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
    """The command's run directory, checked (:func:`check_run_dir`) and created: Hydra's
    output directory under Hydra (it is run.dir when given, see conf/fit.yaml; a sweep
    point's own directory), else run.dir."""
    out = (Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized()
           else Path(cfg.run.dir))
    check_run_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.dir: {out.absolute()} cannot be created ({err.strerror})"
                          ) from None
    return out


def lock_run_dir(out: Path) -> DirectoryLock:
    """Lock the run directory ``out`` for this command (process 0 of a multi-process run: the
    processes share it), or refuse at once when another command works in it."""
    return lock_directory(out, "run.dir") if jax.process_index() == 0 else no_lock(out)


def open_run_record(out: Path, cfg: FitConfig) -> None:
    """Write the run's record into ``out``: ``.hydra/`` (config.yaml as composed,
    hydra.yaml, overrides.yaml) and ``<command>.log``, which gets the records held so far.
    Process 0 only (the run directory is shared); a no-op outside Hydra."""
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
