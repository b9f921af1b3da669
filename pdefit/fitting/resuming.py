"""Resuming a fit from its run directory: the checkpoint store, the newest checkpoint in it,
and the checks that refuse to resume checkpoints of a different configuration or dataset.

Owns :class:`ResumeMismatchError`, :func:`resume_mismatch` (also asked by the command line
before it builds anything), :func:`data_fingerprint` (saved with each checkpoint) and
:func:`open_checkpoints`; the loop of :mod:`pdefit.fitting.train` turns what it restores into
the run's history.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.options import ConfigError
from pdefit.runtime.checkpoint import (
    CheckpointOptions,
    CheckpointStore,
    Restored,
    remove_checkpoints,
)
from pdefit.runtime.resume import CONTINUATION_KEYS, DRIVING_KEYS, config_differences


class ResumeMismatchError(ConfigError):
    """The run directory holds checkpoints of a different configuration or dataset (a
    :class:`~pdefit.options.ConfigError`: the command line reports it in one line)."""


def data_fingerprint(batch: Any) -> str:
    """A digest of the data a fit sees (values of every array this process holds whole,
    shapes and dtypes of the others), saved with each checkpoint so that resuming against
    changed data is an error rather than a silent change of problem."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        digest.update(f"{jax.tree_util.keystr(path)}:{np.shape(leaf)}:{jnp.result_type(leaf)}"
                      .encode())
        if getattr(leaf, "is_fully_addressable", True):
            digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


def open_checkpoints(options: CheckpointOptions, resume: bool, fresh: Any,
                     config: Mapping[str, Any], fingerprint: str | None,
                     log: Callable[[str], None]) -> tuple[CheckpointStore, Restored | None]:
    """The run's checkpoint store, and its newest checkpoint (shaped like ``fresh``) or None,
    checked against ``config`` and ``fingerprint``. With ``resume`` False the directory's
    checkpoints are removed first."""
    _require_one_directory(options.directory)
    if not resume:
        removed = remove_checkpoints(options.directory)
        if removed:
            log(f"run.resume=false: removed {removed} checkpoint(s) in {options.directory}; "
                "starting over")
    store = CheckpointStore(options)
    try:
        # The stored config first: a changed optimiser or parameter set also changes the
        # state's structure, and the restore would only say that the trees do not match.
        stored = store.read_config()
        if stored is not None:
            _check_config(stored[1], config, store)
        restored = store.restore(fresh)
        if restored is not None:
            _check_compatible(restored, config, fingerprint, store)
    except Exception:
        store.close()
        raise
    return store, restored


RESUME_HINT = ("Use another run.name or run.dir for this run, or run.resume=false to discard "
               "the checkpoints.")


def resume_mismatch(saved: Mapping[str, Any] | None, config: Mapping[str, Any],
                    where: Path | str) -> ResumeMismatchError | None:
    """The error for resuming ``where`` (checkpoints made with ``saved``) with ``config``, or
    None if they may go on together: keys that only drive the run and the stopping keys
    (``optim.steps``: a finished run can be continued) may change."""
    if not saved or not config:
        return None
    differences = config_differences(saved, config, ignore=DRIVING_KEYS + CONTINUATION_KEYS)
    if not differences:
        return None
    return ResumeMismatchError(
        f"{where} holds checkpoints of a different configuration: "
        + "; ".join(differences[:8]) + (" …" if len(differences) > 8 else "")
        + f". {RESUME_HINT}")


def _check_config(saved: Mapping[str, Any] | None, config: Mapping[str, Any],
                  store: CheckpointStore) -> None:
    error = resume_mismatch(saved, config, store.directory)
    if error is not None:
        raise error


def _check_compatible(restored: Any, config: Mapping[str, Any], fingerprint: str | None,
                      store: CheckpointStore) -> None:
    _check_config(restored.config, config, store)
    steps = (config.get("optim") or {}).get("steps")
    if isinstance(steps, int) and restored.step > steps:
        # Resuming would rewrite the results of the longer run as if it had stopped here.
        raise ResumeMismatchError(
            f"optim.steps: {store.directory} holds a fit checkpointed at step "
            f"{restored.step}, beyond optim.steps={steps}, and a resume cannot undo steps. "
            f"{RESUME_HINT}")
    saved = restored.meta.get("data_fingerprint")
    if saved and fingerprint and saved != fingerprint:
        raise ResumeMismatchError(
            f"the data differ from those the checkpoints in {store.directory} were made "
            f"with. {RESUME_HINT}")


def _require_one_directory(directory: Path) -> None:
    """The processes of one run save one checkpoint together (each writes its own shards), so
    they must name the same directory; otherwise each waits for the others' files forever."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = hashlib.sha256(str(Path(directory).absolute()).encode()).digest()[:8]
    digests = multihost_utils.process_allgather(np.frombuffer(digest, np.uint32))
    if not np.all(digests == digests[0:1]):
        raise ValueError(f"the {jax.process_count()} processes of this run use different "
                         f"checkpoint directories ({directory} in process "
                         f"{jax.process_index()}); give them one shared run.dir")

