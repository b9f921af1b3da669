"""Several processes (hosts): starting ``jax.distributed`` and reading data per process.

:func:`initialize` is called once at start-up by every entry point. With one process it does
nothing. Under ``srun`` (Slurm), ``mpiexec`` (detected through mpi4py) or with explicit settings
it starts ``jax.distributed`` so that ``jax.devices()`` spans every process.

:func:`dataset_array` builds a global, sharded array straight from a Zarr dataset: each process
reads only the windows its own devices hold (``jax.make_array_from_callback``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from pdefit.data import Dataset

log = logging.getLogger("pdefit")

_MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class ProcessInfo:
    process_index: int
    process_count: int
    local_devices: int
    global_devices: int
    launcher: str  # "single", "explicit", "slurm" or "mpi"


def _detect_launcher(environ: dict[str, str]) -> str:
    if int(environ.get("SLURM_NTASKS", environ.get("SLURM_NPROCS", "1"))) > 1 and (
            "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ):
        return "slurm"
    for name in _MPI_SIZE_VARIABLES:
        if int(environ.get(name, "1")) > 1:
            return "mpi"
    return "single"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, environ: dict[str, str] | None = None,
               ) -> ProcessInfo:
    """Start ``jax.distributed`` if this is one of several processes; idempotent.

    Explicit ``coordinator_address``/``num_processes``/``process_id`` win; otherwise Slurm
    (under ``srun`` with more than one task) or MPI (``mpiexec``, via mpi4py) is detected from
    the environment. Under Slurm, ``PDEFIT_COORDINATOR`` may name the coordinator, since two
    multi-process steps of one job would otherwise collide on JAX's default port.
    """
    environ = dict(os.environ if environ is None else environ)
    if num_processes is not None and num_processes > 1:
        launcher = "explicit"
    else:
        launcher = _detect_launcher(environ)
    if launcher != "single" and not jax.distributed.is_initialized():
        if launcher == "explicit":
            jax.distributed.initialize(coordinator_address=coordinator_address,
                                       num_processes=num_processes, process_id=process_id)
        elif launcher == "slurm":
            jax.distributed.initialize(coordinator_address=environ.get("PDEFIT_COORDINATOR"))
        else:
            jax.distributed.initialize(cluster_detection_method="mpi4py")
    info = ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(),
                       jax.device_count(), launcher)
    log.info(f"process {info.process_index}/{info.process_count} ({launcher}): "
             f"{info.local_devices} local of {info.global_devices} devices")
    return info


def _window(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    assert step == 1, "shardings split arrays into contiguous blocks"
    return start, stop


def dataset_array(ds: Dataset, field: str, experiments: Sequence[int], frames: Sequence[int],
                  stride: int, sharding: Sharding, *, mask: bool = False, dtype: Any = None,
                  reads: list | None = None) -> jax.Array:
    """The global array ``(n_exp, n_frames, ny/stride, nx/stride)`` of a field (or its mask),
    placed with ``sharding``; each process reads only the windows of its own devices. Every
    window read is appended to ``reads`` as (field, experiments, frames, y range, x range)."""
    ny, nx = ds.meta.grid_shape
    shape = (len(experiments), len(frames), -(-ny // stride), -(-nx // stride))
    experiments, frames = np.asarray(experiments), np.asarray(frames)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        (e0, e1), (f0, f1), (y0, y1), (x0, x1) = (
            _window(i, n) for i, n in zip(index, shape, strict=True))
        region = (slice(y0 * stride, y1 * stride, stride), slice(x0 * stride, x1 * stride, stride))
        exps, frs = experiments[e0:e1].tolist(), frames[f0:f1].tolist()
        if reads is not None:
            reads.append((field, exps, frs, (y0, y1), (x0, x1)))
        if mask:
            block = ds.read_mask(field, experiments=exps, frames=frs, region=region)
            if block is None:
                block = np.ones((len(exps), len(frs), y1 - y0, x1 - x0), bool)
            return block
        block = ds.read(field, experiments=exps, frames=frs, region=region)
        return block if dtype is None else block.astype(dtype)

    return jax.make_array_from_callback(shape, sharding, read)


def host_array(x: jax.Array) -> np.ndarray:
    """A (small) global array on the host of every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def host_scalar(x: jax.Array) -> float:
    """A replicated scalar as a Python float, in any process (multi-process arrays are not
    fully addressable, but every process holds a copy of a replicated value)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return float(np.asarray(x))
