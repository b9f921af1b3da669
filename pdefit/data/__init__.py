"""Datasets on disk: the pdefit Zarr v3 format (frames of named fields per experiment, their
axes, units, times, masks, noise record, true parameters and provenance), its writers, its
validating reader and observation noise.

Imports nothing of pdefit: a dataset is described by its own metadata, not by a system.
Use it as ``from pdefit import data`` (``data.open_dataset(path)``).
"""

from pdefit.data.dataset import (
    DEFAULT_AXIS_NAMES,
    DEFAULT_FRAMES_PER_SHARD,
    EXPERIMENT_ARRAY,
    FORMAT,
    FORMAT_VERSION,
    LEGACY_TIME_ARRAY,
    MASK_PREFIX,
    READABLE_VERSIONS,
    TIME_ARRAY,
    TRUE_PREFIX,
    Axis,
    Dataset,
    DatasetError,
    DatasetMeta,
    ShardRange,
    add_noise,
    add_noise_block,
    check_noise,
    create_dataset,
    index_ranges,
    make_provenance,
    open_dataset,
    plan_shards,
    shard_ranges,
    validate_dataset,
    write_block,
    write_dataset,
    write_true_array,
)

__all__ = [
    "DEFAULT_AXIS_NAMES",
    "DEFAULT_FRAMES_PER_SHARD",
    "EXPERIMENT_ARRAY",
    "FORMAT",
    "FORMAT_VERSION",
    "LEGACY_TIME_ARRAY",
    "MASK_PREFIX",
    "READABLE_VERSIONS",
    "TIME_ARRAY",
    "TRUE_PREFIX",
    "Axis",
    "Dataset",
    "DatasetError",
    "DatasetMeta",
    "ShardRange",
    "add_noise",
    "add_noise_block",
    "check_noise",
    "create_dataset",
    "index_ranges",
    "make_provenance",
    "open_dataset",
    "plan_shards",
    "shard_ranges",
    "validate_dataset",
    "write_block",
    "write_dataset",
    "write_true_array",
]
