"""A simulated dataset written by the tasks of a Slurm job array (``slurm/simulate.sbatch``).

Task ``i`` of ``n`` simulates a contiguous block of the experiments and writes their shards;
shards never span experiments, so each shard has exactly one writer (Zarr 3 loses data when
two writers share one). The group and its arrays are created once, by the first task to take
a file lock next to the dataset; the others find them and only write data. A requeued task
simply writes its shards again. Noise is seeded by experiment and frame, so the dataset is bit
for bit the one ``pdefit-simulate`` writes in one process.

The dataset metadata and the per-experiment writing follow :func:`pdefit.fitting.assemble
.simulate_dataset` (which splits experiments over the JAX processes of one run instead).
"""

from __future__ import annotations

import dataclasses
import fcntl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from pdefit import data as zd
from pdefit.fitting import assemble
from pdefit.options import SimulateMainConfig


def experiments_of(task: int, tasks: int, n_experiments: int) -> range:
    """Task ``task`` of ``tasks``: experiments [task·n/tasks, (task+1)·n/tasks)."""
    if not 0 <= task < tasks:
        raise assemble.ConfigError(f"simulate.task must be in [0, {tasks}), got {task}")
    return range(task * n_experiments // tasks, (task + 1) * n_experiments // tasks)


def create_once(path: Path, meta: zd.DatasetMeta, frames_per_shard: int) -> bool:
    """Create the dataset unless the same one (provenance aside) is there already; under an
    exclusive lock on ``<path>.lock``, so concurrent tasks create it once. True if created."""
    lock = path.with_name(f"{path.name}.lock")
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if _same_dataset(path, meta, frames_per_shard):
            return False
        zd.create_dataset(path, meta, frames_per_shard=frames_per_shard, overwrite=True)
        return True


def _same_dataset(path: Path, meta: zd.DatasetMeta, frames_per_shard: int) -> bool:
    if not path.exists():
        return False
    try:
        existing = zd.open_dataset(path)
        layout = zd.shard_ranges(path)
    except zd.DatasetError:
        return False
    return (dataclasses.replace(existing.meta, provenance={})
            == dataclasses.replace(meta, provenance={})
            and layout == zd.plan_shards(meta.n_experiments, meta.n_frames, frames_per_shard))


def simulate_share(cfg: SimulateMainConfig, path: Path, dtype: Any, task: int, tasks: int,
                   log: Callable[[str], None] = print) -> range:
    """Array task ``task`` of ``tasks``: create the dataset if needed, then simulate and write
    this task's experiments. Returns them."""
    if jax.process_count() > 1:
        raise assemble.ConfigError("simulate.tasks > 1 splits the work over a job array of "
                                   "single processes; this is a multi-process run")
    sim = cfg.simulate
    mine = experiments_of(task, tasks, sim.n_experiments)
    meta, system, grid, params = assemble.dataset_meta(cfg)
    if create_once(path, meta, sim.frames_per_shard):
        log(f"task {task}: created {path} for {sim.n_experiments} experiments")
    for experiment in mine:
        assemble.write_experiment(cfg, path, meta, system, grid, params, experiment, dtype)
        log(f"task {task} of {tasks}: wrote experiment {experiment}")
    return mine
