"""Datasets on disk: the pdefit Zarr v3 format (frames of named fields per experiment, their
axes, units, times, masks, noise record, true parameters and provenance), its writers, its
validating reader and observation noise.

- :mod:`pdefit.data.schema`: the format's constants, :class:`DatasetMeta` and :class:`Axis`
  (metadata, validated at construction), their attributes on disk, :func:`make_provenance`,
  and the shard plan of writers (:class:`ShardRange`, :func:`plan_shards`);
- :mod:`pdefit.data.writer`: :func:`create_dataset`, :func:`write_block`,
  :func:`write_true_array`, :func:`write_dataset` (from a :class:`DatasetMeta`),
  :func:`is_pdefit_dataset`;
- :mod:`pdefit.data.recording`: :func:`write_recording` (public as ``pdefit.write_dataset``:
  a user's frames, times and grid in, masks from NaN, no model time step);
- :mod:`pdefit.data.reader`: :class:`Dataset`, :func:`open_dataset`,
  :func:`validate_dataset`, :func:`shard_ranges`, :func:`index_ranges`;
- :mod:`pdefit.data.noise`: :func:`check_noise`, :func:`add_noise`, :func:`add_noise_block`;
- :mod:`pdefit.data.timing`: the checks of observation times and their spacing;
- :mod:`pdefit.data.checks`: :class:`DatasetError` and the value checks the others share.

Imports nothing of pdefit: a dataset is described by its own metadata, not by a system.
Only numpy and zarr are imported, so it stays cheap to import.
Use it as ``from pdefit import data`` (``data.open_dataset(path)``).
"""

from pdefit.data.checks import DatasetError
from pdefit.data.noise import PER_FIELD, add_noise, add_noise_block, check_noise
from pdefit.data.reader import (
    Dataset,
    index_ranges,
    open_dataset,
    shard_ranges,
    validate_dataset,
)
from pdefit.data.recording import write_recording
from pdefit.data.schema import (
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
    DatasetMeta,
    ShardRange,
    make_provenance,
    plan_shards,
)
from pdefit.data.writer import (
    create_dataset,
    is_pdefit_dataset,
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
    "PER_FIELD",
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
    "is_pdefit_dataset",
    "make_provenance",
    "open_dataset",
    "plan_shards",
    "shard_ranges",
    "validate_dataset",
    "write_block",
    "write_dataset",
    "write_recording",
    "write_true_array",
]
