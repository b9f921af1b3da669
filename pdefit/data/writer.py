"""Writing datasets: :func:`create_dataset` lays out the group, its arrays and metadata;
:func:`write_block` fills whole shards of one field (one writer per shard);
:func:`write_true_array` and :func:`write_dataset` (everything from one process).

Layout.  Field arrays are chunked per frame tile ``(1, 1, tile_y, tile_x)`` so a reader can
fetch single frames cheaply, and sharded along time ``(1, frames_per_shard, ny, nx)`` so a
long run does not explode into one file per frame.  A shard is zarr's unit of writing: zarr
updates a shard by read-modify-write of the whole shard file, so two processes writing
different frames of the same shard can silently lose each other's data.  Hence the
"one writer per shard" rule enforced by :func:`write_block`, and
:func:`~pdefit.data.reader.shard_ranges`, which hands out those writer assignments.

Metadata is written once by :func:`create_dataset`, before any writer runs, so parallel
writers only ever touch chunk data.  The group attributes (including the ``format`` marker)
are written last, so a half-created dataset is never mistaken for a valid one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import zarr
import zarr.errors

from pdefit.data.checks import DatasetError, PathLike, is_int, is_pair
from pdefit.data.reader import Dataset, open_checked, shard_frames
from pdefit.data.schema import (
    DEFAULT_FRAMES_PER_SHARD,
    EXPERIMENT_ARRAY,
    FORMAT,
    MASK_PREFIX,
    TIME_ARRAY,
    TRUE_PREFIX,
    DatasetMeta,
    check_not_empty,
    meta_to_attrs,
)

__all__ = ["create_dataset", "is_pdefit_dataset", "write_block", "write_dataset",
           "write_true_array"]

def _largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest divisor of ``n`` that is <= ``limit`` (at least 1)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _layout(
    grid_shape: tuple[int, int],
    n_frames: int,
    frames_per_shard: int,
    tile: tuple[int, int] | None,
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Chunk and shard shapes for a field array.

    Zarr 3 requires every shard dimension to be a multiple of the inner chunk dimension;
    the array shape itself need not be a multiple of the shard (the last shard along time
    is simply partial).  Since a shard spans the whole frame, the tile must divide the
    grid, so a requested tile is shrunk to the largest divisor of each grid dimension.
    The shard length is clipped to ``n_frames`` so short runs do not get mostly-empty
    shard files.
    """
    if not is_int(frames_per_shard) or frames_per_shard < 1:
        raise DatasetError(f"frames_per_shard must be an int >= 1, got {frames_per_shard!r}")
    ny, nx = grid_shape
    if tile is None:
        tile_y, tile_x = ny, nx
    else:
        if not is_pair(tuple(tile), int) or min(tile) < 1:
            raise DatasetError(f"tile must be two positive ints, got {tile!r}")
        tile_y = _largest_divisor_at_most(ny, tile[0])
        tile_x = _largest_divisor_at_most(nx, tile[1])
    shard_length = min(frames_per_shard, max(n_frames, 1))
    return (1, 1, tile_y, tile_x), (1, shard_length, ny, nx)


def create_dataset(
    path: PathLike,
    meta: DatasetMeta,
    *,
    masks: bool | Sequence[str] = False,
    frames_per_shard: int = DEFAULT_FRAMES_PER_SHARD,
    tile: tuple[int, int] | None = None,
    overwrite: bool = False,
) -> None:
    """Create the group, all arrays (unwritten) and all metadata at ``path``.

    Call once before any writer starts: afterwards writers only write chunk data.
    ``masks`` is True for a mask array per field, or the names of the fields that get one.
    Unwritten field values read as NaN and unwritten masks as False (unobserved), so a
    writer that never ran is caught by the finite check unless its frames are masked out.

    Empty datasets (``n_frames == 0`` or ``n_experiments == 0``) are refused here because
    they can never be fitted; :func:`open_dataset` refuses them too if made by other means.

    With ``overwrite=True`` an existing *pdefit dataset* at ``path`` is replaced; any other
    existing directory is refused, because zarr's overwrite mode deletes the directory's
    contents wholesale.
    """
    where = f"dataset {os.fspath(path)}"
    check_not_empty(meta, where)
    mask_fields = _mask_fields(meta, masks, where)
    chunks, shards = _layout(meta.grid_shape, meta.n_frames, frames_per_shard, tile)
    attrs = meta_to_attrs(meta)

    _check_replaceable(path, overwrite, where)
    group = zarr.open_group(os.fspath(path), mode="w", zarr_format=3)
    _create_coordinates(group, meta)
    _create_frame_arrays(group, meta, mask_fields, chunks, shards)
    _create_true_arrays(group, meta)
    # Last, so the "format" marker only appears once the dataset is complete.
    group.attrs.update(attrs)


def _check_replaceable(path: PathLike, overwrite: bool, where: str) -> None:
    """Refuse an existing ``path`` unless ``overwrite`` and it is a pdefit dataset."""
    if Path(path).exists():
        if not overwrite:
            raise DatasetError(f"{where} already exists; pass overwrite=True to replace it")
        if not is_pdefit_dataset(path):
            raise DatasetError(
                f"refusing to overwrite {os.fspath(path)}: it exists but is not a pdefit dataset"
            )


def _create_coordinates(group: zarr.Group, meta: DatasetMeta) -> None:
    """Write the coordinate arrays: times, experiment numbers and the two spatial axes."""
    # Coordinates: one-dimensional arrays named like their dimension, which xarray makes
    # the index of that dimension (ds.sel(time=...)).
    coordinates = [
        (TIME_ARRAY, meta.times, {"units": meta.time_unit, "long_name": "time", "axis": "T"}),
        (EXPERIMENT_ARRAY, np.arange(meta.n_experiments, dtype=np.int64),
         {"long_name": "experiment number"}),
        *((axis.name, np.asarray(axis.values, np.float64),
           {"units": axis.units, "long_name": axis.long_name, "axis": cf_axis})
          for axis, cf_axis in zip(meta.axes, ("Y", "X"), strict=True)),
    ]
    for name, values, attributes in coordinates:
        group.create_array(name, shape=values.shape, dtype=values.dtype, chunks=values.shape,
                           dimension_names=(name,), attributes=_cf_attrs(attributes))[...] = values


def _create_frame_arrays(
    group: zarr.Group,
    meta: DatasetMeta,
    mask_fields: Sequence[str],
    chunks: tuple[int, int, int, int],
    shards: tuple[int, int, int, int],
) -> None:
    """Create (unwritten) the field arrays, then the mask arrays of ``mask_fields``."""
    shape = (meta.n_experiments, meta.n_frames, *meta.grid_shape)
    dims = (EXPERIMENT_ARRAY, TIME_ARRAY, *(axis.name for axis in meta.axes))
    for name in meta.fields:
        group.create_array(
            name,
            shape=shape,
            dtype="float32",
            chunks=chunks,
            shards=shards,
            dimension_names=dims,
            fill_value=np.nan,
            attributes=_cf_attrs(meta.field_attrs.get(name, {})),
        )
    for name in mask_fields:
        group.create_array(
            MASK_PREFIX + name,
            shape=shape,
            dtype="bool",
            chunks=chunks,
            shards=shards,
            dimension_names=dims,
            fill_value=False,
            attributes={"long_name": f"where {name} is observed"},
        )


def _create_true_arrays(group: zarr.Group, meta: DatasetMeta) -> None:
    """Create (unwritten) the array of each array-valued true parameter."""
    for name, array_shape in meta.true_arrays.items():
        # One chunk: written once, by one writer (write_true_array), read whole.
        group.create_array(TRUE_PREFIX + name, shape=tuple(array_shape), dtype="float64",
                           chunks=tuple(array_shape), fill_value=np.nan,
                           dimension_names=tuple(meta.true_array_dims.get(name) or (
                               f"{name}_dim{i}" for i in range(len(array_shape)))),
                           attributes=_cf_attrs(meta.param_attrs.get(name, {})))


def _cf_attrs(attrs: Mapping[str, str]) -> dict[str, str]:
    """CF attributes without the empty ones (no unit declared is no ``units``)."""
    return {k: v for k, v in attrs.items() if v}


def _mask_fields(meta: DatasetMeta, masks: bool | Sequence[str], where: str) -> tuple[str, ...]:
    """The fields that get a mask array (``masks`` of :func:`create_dataset`), checked."""
    if masks is True:
        return meta.fields
    if masks is False:
        return ()
    unknown = [m for m in masks if m not in meta.fields]
    if unknown:
        raise DatasetError(
            f"{where}: masks requested for unknown fields {unknown}; fields are {list(meta.fields)}"
        )
    return tuple(dict.fromkeys(masks))


def is_pdefit_dataset(path: PathLike) -> bool:
    """Whether ``path`` opens as a Zarr v3 group marked as a pdefit dataset (not a symbolic
    link: replacing one would replace what it points to)."""
    if Path(path).is_symlink():
        return False
    try:
        group = zarr.open_group(os.fspath(path), mode="r", zarr_format=3)
    except (OSError, zarr.errors.BaseZarrError):
        return False
    return group.attrs.get("format") == FORMAT


def write_block(
    path: PathLike,
    field: str,
    values: np.ndarray,
    *,
    experiment: int,
    frame_start: int,
    mask: np.ndarray | None = None,
) -> None:
    """Write frames ``[frame_start, frame_start + n)`` of one experiment of one field.

    ``values`` (and ``mask``, required exactly when the field has a mask array) have shape
    ``(n, ny, nx)``.  The block must consist of whole shards: zarr 3 writes a shard by
    read-modify-write of the entire shard, so concurrent writers sharing a shard lose data.
    Use :func:`shard_ranges` to get valid, non-overlapping blocks.
    """
    # Full structural checks on every call: cheap next to a shard of data, and it stops a
    # writer pointed at the wrong path before it writes anything.
    ds = open_checked(path, mode="r+")
    where = f"dataset {ds.path} field {field!r}"
    ds._require_field(field)
    array = ds.group[field]
    values = np.asarray(values)
    frame_stop = _check_block(ds.meta, array, values, experiment, frame_start, where)
    mask = _check_mask(ds, field, mask, values.shape, where)
    region = (experiment, slice(frame_start, frame_stop))
    if mask is not None:
        ds.group[MASK_PREFIX + field][region] = mask
    array[region] = values.astype(np.float32, copy=False)


def _check_block(meta: DatasetMeta, array: zarr.Array, values: np.ndarray, experiment: int,
                 frame_start: int, where: str) -> int:
    """Check that ``values`` are whole shards of frames of one experiment of ``array``;
    return the frame after the block."""
    if values.ndim != 3 or values.shape[1:] != meta.grid_shape or values.shape[0] < 1:
        raise DatasetError(
            f"{where}: block must have shape (n >= 1, {meta.grid_shape[0]}, "
            f"{meta.grid_shape[1]}), got {values.shape}"
        )
    n = values.shape[0]
    if not is_int(experiment) or not 0 <= experiment < meta.n_experiments:
        raise DatasetError(
            f"{where}: experiment {experiment!r} out of range [0, {meta.n_experiments})"
        )
    frame_stop = frame_start + n
    if not is_int(frame_start) or frame_start < 0 or frame_stop > meta.n_frames:
        raise DatasetError(
            f"{where}: frames [{frame_start}, {frame_stop}) outside [0, {meta.n_frames})"
        )
    unit = shard_frames(array)
    if frame_start % unit or (frame_stop % unit and frame_stop != meta.n_frames):
        raise DatasetError(
            f"{where}: frames [{frame_start}, {frame_stop}) do not cover whole shards of "
            f"{unit} frames; zarr 3 rewrites a whole shard on every write "
            "(read-modify-write), so concurrent writers into the same shard lose data. "
            "Write blocks from shard_ranges()."
        )
    return frame_stop


def _check_mask(ds: Dataset, field: str, mask: np.ndarray | None, shape: tuple[int, ...],
                where: str) -> np.ndarray | None:
    """The mask as an array, given exactly when the field has one and shaped like the
    block (``shape``)."""
    has_mask = ds.has_mask(field)
    if mask is not None and not has_mask:
        raise DatasetError(f"{where}: a mask was given but the dataset has no mask for it")
    if mask is None and has_mask:
        raise DatasetError(
            f"{where}: the dataset has a mask for this field, so pass mask= "
            "(unwritten masks read as all-unobserved)"
        )
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != shape or mask.dtype != np.bool_:
            raise DatasetError(
                f"{where}: mask must be bool with shape {shape}, "
                f"got {mask.dtype} {mask.shape}"
            )
    return mask


def write_true_array(path: PathLike, name: str, values: np.ndarray) -> None:
    """Write the array-valued true parameter ``name`` (declared in ``meta.true_arrays``).
    One writer only: the array is a single chunk."""
    ds = open_checked(path, mode="r+")
    where = f"dataset {ds.path} true array {name!r}"
    if name not in ds.meta.true_arrays:
        raise DatasetError(f"{where} is not declared; it declares {sorted(ds.meta.true_arrays)}")
    shape = tuple(ds.meta.true_arrays[name])
    values = np.asarray(values, np.float64)
    if values.shape != shape:
        raise DatasetError(f"{where}: expected shape {shape}, got {values.shape}")
    ds.group[TRUE_PREFIX + name][...] = values


def write_dataset(
    path: PathLike,
    meta: DatasetMeta,
    fields: Mapping[str, np.ndarray],
    masks: Mapping[str, np.ndarray] | None = None,
    *,
    frames_per_shard: int = DEFAULT_FRAMES_PER_SHARD,
    tile: tuple[int, int] | None = None,
    overwrite: bool = False,
) -> None:
    """Create a dataset and write all of it from one process.

    ``fields`` must hold exactly ``meta.fields``, each ``(n_experiments, n_frames, ny, nx)``;
    ``masks`` (optional) maps a subset of fields to bool arrays of the same shape.  Shapes
    are checked before anything is written so a bad call leaves nothing on disk.
    """
    where = f"dataset {os.fspath(path)}"
    masks = dict(masks or {})
    if set(fields) != set(meta.fields):
        raise DatasetError(
            f"{where}: values given for fields {sorted(fields)} but meta.fields is "
            f"{list(meta.fields)}"
        )
    shape = (meta.n_experiments, meta.n_frames, *meta.grid_shape)
    for name, values in fields.items():
        if np.shape(values) != shape:
            raise DatasetError(
                f"{where} field {name!r}: expected shape {shape}, got {np.shape(values)}"
            )
    for name, mask in masks.items():
        if np.shape(mask) != shape or np.asarray(mask).dtype != np.bool_:
            raise DatasetError(
                f"{where} mask {name!r}: expected bool array of shape {shape}, "
                f"got {np.asarray(mask).dtype} {np.shape(mask)}"
            )
    create_dataset(
        path,
        meta,
        masks=tuple(masks),
        frames_per_shard=frames_per_shard,
        tile=tile,
        overwrite=overwrite,
    )
    # Single process owns every shard here, so whole-array writes are safe and fastest.
    group = zarr.open_group(os.fspath(path), mode="r+", zarr_format=3)
    for name, values in fields.items():
        group[name][...] = np.asarray(values, dtype=np.float32)
    for name, mask in masks.items():
        group[MASK_PREFIX + name][...] = np.asarray(mask)

