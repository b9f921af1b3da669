"""Training state on disk: an Orbax ``CheckpointManager`` under ``<run dir>/checkpoints``.

Each checkpoint step holds three items: ``state`` (a pytree of arrays, written by every process
for its own shards), ``meta`` (JSON: metric history, counters) and ``config`` (JSON: the
resolved run config). Orbax writes a step into a temporary directory and renames it when
complete, so a process killed mid-write leaves the previous steps intact; the partial
directory is ignored and removed by the next manager.

Restoring goes through an *abstract* state built from a fresh state of the current run, so
arrays come back with the current shapes, dtypes and shardings, whatever mesh or process count
wrote them, and bit for bit.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax

log = logging.getLogger("pdefit")

CHECKPOINT_DIR = "checkpoints"
FORMAT_VERSION = 1


class Restored(NamedTuple):
    step: int
    state: Any
    meta: dict[str, Any]
    config: dict[str, Any] | None


@dataclass(frozen=True)
class CheckpointOptions:
    """``every``: optimiser steps between checkpoints; ``keep``: how many to keep."""

    directory: Path
    every: int = 25
    keep: int = 3

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint every and keep must be >= 1, got {self.every}, "
                             f"{self.keep}")


class CheckpointStore:
    """Save and restore ``(state, meta, config)`` by step; a thin layer over Orbax."""

    def __init__(self, options: CheckpointOptions) -> None:
        import orbax.checkpoint as ocp

        # Orbax logs every phase of every save at INFO through absl; under Hydra's INFO root
        # logger that buries the fit's own lines.
        logging.getLogger("absl").setLevel(logging.WARNING)
        self._ocp = ocp
        self.options = options
        self.directory = Path(options.directory).absolute()
        if "[" in str(self.directory) or "]" in str(self.directory):
            # tensorstore (under Orbax) cannot open arrays below such a path.
            raise ValueError(f"checkpoint directory {self.directory} contains '[' or ']'; "
                             "choose a run directory without brackets")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=options.keep, create=True,
                # Leftovers of a write that was killed: never a valid step, safe to delete.
                cleanup_tmp_directories=True,
                enable_async_checkpointing=True),
            item_names=("state", "meta", "config"))
        self._started: set[int] = set()  # steps whose (possibly async) write has begun

    # -- queries --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    # -- save -----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any],
             config: Mapping[str, Any] | None = None, *, wait: bool = False) -> bool:
        """Start writing ``step`` (in the background unless ``wait``). False if that step is
        already on disk (its content is then equivalent: see :mod:`pdefit.fitting.train`)."""
        if step in self._started or step in self._manager.all_steps():
            if wait:
                self.wait()
            return False
        args = self._ocp.args
        self._manager.save(step, args=args.Composite(
            state=args.StandardSave(state),
            meta=args.JsonSave({"format_version": FORMAT_VERSION, **meta}),
            config=args.JsonSave(dict(config or {}))), force=True)
        self._started.add(step)
        if wait:
            self.wait()
        return True

    def wait(self) -> None:
        """Block until the last save is complete on disk (all processes)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    # -- restore --------------------------------------------------------------------------------

    def read_config(self) -> tuple[int, dict[str, Any] | None] | None:
        """(step, stored config) of the newest checkpoint whose config item reads, without
        touching its arrays: what a resume compares with the requested config *before*
        restoring a state whose structure may no longer match (another optimiser, other
        fitted parameters). None if there is no readable one."""
        args = self._ocp.args
        for step in reversed(self.steps()):
            try:
                restored = self._manager.restore(step, args=args.Composite(
                    config=args.JsonRestore()))
            except Exception:  # unreadable: restore() reports it
                continue
            return step, dict(restored.config) if restored.config else None
        return None

    def restore(self, like: Any) -> Restored | None:
        """The newest readable checkpoint, with arrays shaped, typed and sharded like ``like``
        (a state of the current run); None if there is none. A step that fails to read (a
        damaged disk, a changed state structure) is reported and the one before is tried."""
        abstract = jax.tree.map(_abstract, like)
        args = self._ocp.args
        errors = []
        for step in reversed(self.steps()):
            try:
                restored = self._manager.restore(step, args=args.Composite(
                    state=args.StandardRestore(abstract), meta=args.JsonRestore(),
                    config=args.JsonRestore()))
            except Exception as err:  # any unreadable step: try the one before
                errors.append(f"step {step}: {type(err).__name__}: {err}")
                log.warning(f"checkpoint step {step} in {self.directory} is unreadable "
                            f"({type(err).__name__}: {err}); trying an older one")
                continue
            meta = dict(restored.meta or {})
            config = dict(restored.config) if restored.config else None
            return Restored(step, restored.state, meta, config)
        if errors:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} ("
                + "; ".join(e.splitlines()[0][:200] for e in errors)
                + "). Start over with run.resume=false (deletes them), or use another "
                "run.dir or run.name.")
        return None


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be restored."""


def _abstract(x: Any) -> Any:
    """Shape, dtype and sharding of a leaf: what Orbax restores into."""
    import orbax.checkpoint as ocp

    return ocp.utils.to_shape_dtype_struct(x)


def remove_checkpoints(directory: Path) -> int:
    """Delete a run's checkpoints (``run.resume=false``: start over). Returns how many."""
    directory = Path(directory)
    if not directory.exists():
        return 0
    n = sum(1 for p in directory.iterdir() if p.is_dir())
    if jax.process_index() == 0:
        shutil.rmtree(directory)
    _barrier("pdefit-remove-checkpoints")
    return n


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so readers (the sweep summary, a resumed
    run) never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_atomic(path: Path, data: Any) -> None:
    """:func:`write_text_atomic` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2))
