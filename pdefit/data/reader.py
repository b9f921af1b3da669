"""Reading datasets: :func:`open_dataset` checks a dataset's structure against its own
metadata and gives a :class:`Dataset`, whose values are read lazily, only for the selection
asked for; :func:`validate_dataset` checks it against what a fit configuration expects;
:func:`shard_ranges` hands out the writer assignments of an existing dataset.

Reading this with xarray needs ``xarray.open_zarr(path, consolidated=False)``: zarr v3 has
no standard consolidated metadata and we do not write any.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
import zarr.errors

from pdefit.data.checks import DatasetError, PathLike, is_int
from pdefit.data.schema import (
    FORMAT,
    LEGACY_TIME_ARRAY,
    MASK_PREFIX,
    READABLE_VERSIONS,
    TIME_ARRAY,
    TRUE_PREFIX,
    DatasetMeta,
    ShardRange,
    check_not_empty,
    meta_from_attrs,
    plan_shards,
)

__all__ = [
    "Dataset",
    "index_ranges",
    "open_dataset",
    "shard_ranges",
    "validate_dataset",
]

Selection = int | slice | Sequence[int] | np.ndarray


@dataclass(frozen=True)
class Dataset:
    """An opened dataset.  Values are read lazily, only for the selection asked for."""

    path: str
    meta: DatasetMeta
    masked_fields: frozenset[str]
    group: zarr.Group = field(repr=False, compare=False)

    def has_mask(self, field: str) -> bool:
        self._require_field(field)
        return field in self.masked_fields

    def read(
        self,
        field: str,
        experiments: Selection = slice(None),
        frames: Selection | None = None,
        stride: int = 1,
        region: tuple[slice, slice] | None = None,
    ) -> np.ndarray:
        """Field values as float32, shape ``(n_exp, n_frames, ny, nx)``.

        An int for ``experiments``/``frames`` drops that axis, as in numpy.  ``stride``
        subsamples the selected frames (applied after ``frames``).  ``region`` = (y slice,
        x slice) reads only that window of each frame (what one device's tile needs).
        """
        self._require_field(field)
        return self._read_array(field, field, experiments, frames, stride, region).astype(
            np.float32, copy=False
        )

    def read_mask(
        self,
        field: str,
        experiments: Selection = slice(None),
        frames: Selection | None = None,
        stride: int = 1,
        region: tuple[slice, slice] | None = None,
    ) -> np.ndarray | None:
        """Observation mask (True = observed) like :meth:`read`, or None if there is none."""
        if not self.has_mask(field):
            return None
        return self._read_array(MASK_PREFIX + field, field, experiments, frames, stride, region)

    def read_true_array(self, name: str) -> np.ndarray:
        """The array-valued true parameter ``name`` (NaN where never written)."""
        if name not in self.meta.true_arrays:
            raise DatasetError(f"dataset {self.path} has no true array {name!r}; it has "
                               f"{sorted(self.meta.true_arrays)}")
        return np.asarray(self.group[TRUE_PREFIX + name][...])

    def _read_array(
        self,
        name: str,
        field: str,
        experiments: Selection,
        frames: Selection | None,
        stride: int,
        region: tuple[slice, slice] | None = None,
    ) -> np.ndarray:
        where = f"dataset {self.path} field {field!r}"
        exp_sel = _normalise_selection(experiments, self.meta.n_experiments, 1, where, "experiment")
        frame_sel = _normalise_selection(
            slice(None) if frames is None else frames, self.meta.n_frames, stride, where, "frame"
        )
        ys, xs = region if region is not None else (slice(None), slice(None))
        # Orthogonal indexing so lists of experiments and frames combine like np.ix_.
        try:
            return np.asarray(self.group[name].oindex[exp_sel, frame_sel, ys, xs])
        except Exception as exc:  # a damaged shard: say which, not only Zarr's complaint
            exps = _indices(exp_sel, self.meta.n_experiments)
            frames_read = _indices(frame_sel, self.meta.n_frames)
            shards = self._unreadable_shards(name, exps, frames_read, ys, xs)
            raise DatasetError(
                f"{where}: cannot read experiment(s) {index_ranges(exps)}, frame(s) "
                f"{index_ranges(frames_read)} ({type(exc).__name__}: {exc}); the shard "
                "file(s) "
                f"{', '.join(f'{name}/{k}' for k in shards[:4])}{' …' if len(shards) > 4 else ''}"
                " of this dataset are damaged or truncated: simulate or copy it again"
            ) from exc

    def missing_frames(
        self, field: str, experiments: Sequence[int], frames: Sequence[int]
    ) -> dict[int, list[int]]:
        """{experiment: frames} of the selection whose shard files are not on disk (deleted,
        or never written by an interrupted writer): Zarr would return its fill value, NaN,
        for them, and they would look like NaN data. Empty when nothing is missing (and for
        datasets that are not local directories, which cannot be checked this way)."""
        self._require_field(field)
        root = Path(self.path)
        if not root.is_dir():
            return {}
        array = self.group[field]
        shard = array.shards or array.chunks
        encode = array.metadata.chunk_key_encoding.encode_chunk_key
        ny, nx = self.meta.grid_shape
        tiles = [(i, j) for i in range(-(-ny // shard[2])) for j in range(-(-nx // shard[3]))]
        missing: dict[int, list[int]] = {}
        for e in experiments:
            for f in frames:
                key = (int(e) // shard[0], int(f) // shard[1])
                if any(not (root / field / encode((*key, i, j))).exists() for i, j in tiles):
                    missing.setdefault(int(e), []).append(int(f))
        return missing

    def _unreadable_shards(self, name: str, experiments: Sequence[int], frames: Sequence[int],
                           ys: slice, xs: slice) -> list[str]:
        """The keys of the shards (experiment, frame block) of a failed read that fail on
        their own: the damaged files, found once a read has failed."""
        array = self.group[name]
        shard = array.shards or array.chunks
        encode = array.metadata.chunk_key_encoding.encode_chunk_key
        blocks = sorted({(int(e) // shard[0], int(f) // shard[1])
                         for e in experiments for f in frames})
        bad = []
        for e, f in blocks:
            try:
                array.oindex[slice(e * shard[0], (e + 1) * shard[0]),
                             slice(f * shard[1], (f + 1) * shard[1]), ys, xs]
            except Exception:
                bad.append(encode((e, f, 0, 0)))
        return bad

    def _require_field(self, field: str) -> None:
        if field not in self.meta.fields:
            raise DatasetError(
                f"dataset {self.path} has no field {field!r}; it has {list(self.meta.fields)}"
            )


def _indices(sel: int | slice | np.ndarray, n: int) -> list[int]:
    """A normalised selection as a list of indices."""
    if isinstance(sel, slice):
        return list(range(n)[sel])
    return [int(i) for i in np.atleast_1d(sel)]


def index_ranges(indices: Sequence[int]) -> str:
    """``0-15, 18`` for [0, 1, …, 15, 18]."""
    parts: list[tuple[int, int]] = []
    for i in sorted({int(x) for x in indices}):
        if parts and i == parts[-1][1] + 1:
            parts[-1] = (parts[-1][0], i)
        else:
            parts.append((i, i))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"


def _normalise_selection(
    sel: Selection, n: int, stride: int, where: str, axis: str
) -> int | slice | np.ndarray:
    """Turn a user selection along one axis into something zarr's ``oindex`` accepts.

    Zarr rejects negative steps and negative indices, so those are resolved here, and
    out-of-range indices get a DatasetError naming the axis instead of a bare IndexError.
    """
    if not is_int(stride) or stride < 1:
        raise DatasetError(f"{where}: stride must be an int >= 1, got {stride!r}")
    if is_int(sel):
        if stride != 1:
            raise DatasetError(f"{where}: stride needs a range of {axis}s, not a single index")
        if not -n <= sel < n:
            raise DatasetError(f"{where}: {axis} {sel} out of range for {n} {axis}s")
        return int(sel) % n
    if isinstance(sel, slice):
        r = range(n)[sel][::stride]
        if r.step > 0:
            return slice(r.start, r.stop, r.step)
        return np.asarray(r, dtype=np.int64)
    idx = np.asarray(sel)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise DatasetError(f"{where}: {axis} selection must be 1-D integers, got {sel!r}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise DatasetError(f"{where}: {axis} indices {sel!r} out of range for {n} {axis}s")
    return (idx % n)[::stride]


def open_dataset(path: PathLike) -> Dataset:
    """Open (read-only) and structurally check a dataset; no values are read except ``t``.

    Raises DatasetError if the path is missing, is not a Zarr v3 group, is not a pdefit
    dataset of a supported version, lacks arrays named in ``fields``, has array shapes that
    disagree with its attributes, or is empty.
    """
    return open_checked(path, mode="r")


def open_checked(path: PathLike, mode: Literal["r", "r+"]) -> Dataset:
    """:func:`open_dataset` in ``mode``: ``"r+"`` for the writers, which check as much."""
    spath = os.fspath(path)
    where = f"dataset {spath}"
    group, attrs = _open_pdefit_group(spath, mode, where)
    version = attrs["format_version"]
    time_name = LEGACY_TIME_ARRAY if version == 1 else TIME_ARRAY
    times = _get_array(group, time_name, where)
    if times.ndim != 1:
        raise DatasetError(f"{where}: array {time_name!r} must be 1-D, found shape "
                           f"{times.shape}")
    axis_values = _axis_values(group, attrs, version, where)
    stored_times = np.asarray(times[...], np.float64)
    meta = meta_from_attrs(attrs, stored_times, where, axis_values)
    check_not_empty(meta, where)
    _check_value_arrays(group, meta, where)
    masked = _masked_fields(group, meta, where)
    _check_times(stored_times, time_name, meta, where)
    return Dataset(path=spath, meta=meta, masked_fields=frozenset(masked), group=group)


def _open_pdefit_group(
    spath: str, mode: Literal["r", "r+"], where: str
) -> tuple[zarr.Group, dict[str, Any]]:
    """The Zarr v3 group at ``spath`` and its attributes, once they say it is a pdefit
    dataset of a version this pdefit reads."""
    if not Path(spath).exists():
        raise DatasetError(f"{where} does not exist")
    try:
        group = zarr.open_group(spath, mode=mode, zarr_format=3)
    except (OSError, zarr.errors.BaseZarrError) as exc:
        raise DatasetError(f"{spath} is not a Zarr v3 group ({exc})") from exc
    attrs = group.attrs.asdict()
    if attrs.get("format") != FORMAT:
        raise DatasetError(
            f"{spath} is not a pdefit dataset: attribute format is "
            f"{attrs.get('format')!r}, expected {FORMAT!r}"
        )
    version = attrs.get("format_version")
    if version not in READABLE_VERSIONS:
        raise DatasetError(
            f"{where} has format_version {version!r}; this pdefit reads versions "
            f"{list(READABLE_VERSIONS)}"
        )
    return group, attrs


def _axis_values(
    group: zarr.Group, attrs: Mapping[str, Any], version: int, where: str
) -> list[np.ndarray] | None:
    """The coordinates of the axes the attributes name (format version 2; None before)."""
    if version < 2:
        return None
    names = [axis.get("name") for axis in attrs.get("axes", [])
             if isinstance(axis, Mapping)]
    return [np.asarray(_get_array(group, name, where)[...]) for name in names]


def _check_value_arrays(group: zarr.Group, meta: DatasetMeta, where: str) -> None:
    """Each field array and true array is there, with the shape its attributes say."""
    expected = (meta.n_experiments, meta.n_frames, *meta.grid_shape)
    for name in meta.fields:
        array = _get_array(group, name, where)
        if array.shape != expected:
            raise DatasetError(
                f"{where} field {name!r}: array shape {array.shape} disagrees with the "
                f"attributes (n_experiments, n_frames, ny, nx) = {expected}"
            )
        if not np.issubdtype(array.dtype, np.floating):
            raise DatasetError(f"{where} field {name!r}: dtype {array.dtype} is not floating")
    for name, array_shape in meta.true_arrays.items():
        array = _get_array(group, TRUE_PREFIX + name, where)
        if array.shape != tuple(array_shape):
            raise DatasetError(f"{where} true array {name!r}: shape {array.shape} disagrees "
                               f"with the attributes {tuple(array_shape)}")


def _masked_fields(group: zarr.Group, meta: DatasetMeta, where: str) -> set[str]:
    """The fields with a mask array, each checked to be bool and shaped like its field."""
    expected = (meta.n_experiments, meta.n_frames, *meta.grid_shape)
    masked = set()
    for name in meta.fields:
        if MASK_PREFIX + name not in group:
            continue
        mask = _get_array(group, MASK_PREFIX + name, where)
        if mask.shape != expected or mask.dtype != np.bool_:
            raise DatasetError(
                f"{where} mask for {name!r}: expected bool {expected}, "
                f"found {mask.dtype} {mask.shape}"
            )
        masked.add(name)
    return masked


def _check_times(stored_times: np.ndarray, time_name: str, meta: DatasetMeta,
                 where: str) -> None:
    """The stored observation times are the ones the attributes describe (a recording's
    are its times, checked to increase when its metadata was built)."""
    if meta.frame_times is not None:
        return
    if not np.allclose(stored_times, meta.times, rtol=1e-9, atol=1e-9 * meta.frame_interval):
        raise DatasetError(
            f"{where}: array {time_name!r} disagrees with t0 + k * steps_per_frame * dt "
            f"(t0={meta.t0}, dt={meta.dt}, steps_per_frame={meta.steps_per_frame})"
        )


def _get_array(group: zarr.Group, name: str, where: str) -> zarr.Array:
    if name not in group:
        raise DatasetError(f"{where}: array {name!r} is missing")
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise DatasetError(f"{where}: {name!r} is a group, expected an array")
    return node


# Validation against a configuration


def validate_dataset(
    ds: Dataset,
    *,
    system: str,
    fields: Sequence[str],
    grid_shape: tuple[int, int],
    grid_spacing: tuple[float, float],
    boundaries: tuple[str, str],
    dt: float | None = None,
    check_finite: bool = True,
    frames_per_block: int | None = None,
) -> None:
    """Check that ``ds`` is what a fit configuration expects; raise DatasetError if not.

    Cheap metadata checks run first so a wrong dataset fails fast.  The finite check then
    reads each requested field block by block (one shard of frames by default), so memory
    stays bounded for large datasets.  Non-finite values are allowed where a mask says the
    point is unobserved; without a mask every value must be finite.
    """
    where = f"dataset {ds.path}"
    meta = ds.meta
    # A recording that no model made names no system: only its fields and grid are checked.
    if meta.system and meta.system != system:
        raise DatasetError(
            f"{where} was made by system {meta.system!r} but the config asks for {system!r}"
        )
    missing = [f for f in fields if f not in meta.fields]
    if missing:
        raise DatasetError(
            f"{where} has no observed field(s) {missing}; it has {list(meta.fields)}"
        )
    if tuple(grid_shape) != meta.grid_shape:
        raise DatasetError(
            f"{where}: grid shape mismatch: config expects {tuple(grid_shape)}, "
            f"dataset has {meta.grid_shape}"
        )
    spacing = tuple(grid_spacing)
    if len(spacing) != 2 or not all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip(spacing, meta.grid_spacing, strict=True)
    ):
        raise DatasetError(
            f"{where}: grid spacing mismatch: config expects {tuple(grid_spacing)}, "
            f"dataset has {meta.grid_spacing}"
        )
    if tuple(boundaries) != meta.boundaries:
        raise DatasetError(
            f"{where}: boundary mismatch: config expects {tuple(boundaries)}, "
            f"dataset has {meta.boundaries}"
        )
    if dt is not None and meta.dt is not None and not math.isclose(dt, meta.dt, rel_tol=1e-9):
        raise DatasetError(f"{where}: dt mismatch: config expects {dt}, dataset has {meta.dt}")
    check_not_empty(meta, where)
    if check_finite:
        for name in fields:
            _check_field_finite(ds, name, frames_per_block)


def _check_field_finite(ds: Dataset, name: str, frames_per_block: int | None) -> None:
    """Scan one field for NaN/Inf at observed points; report counts and the first index."""
    meta = ds.meta
    block = frames_per_block or shard_frames(ds.group[name])
    n_nan = n_inf = 0
    first: tuple[int, ...] | None = None
    for experiment, start, stop in plan_shards(meta.n_experiments, meta.n_frames, block):
        values = ds.read(name, experiment, slice(start, stop))
        bad = ~np.isfinite(values)
        mask = ds.read_mask(name, experiment, slice(start, stop))
        if mask is not None:
            bad &= mask
        if not bad.any():
            continue
        n_nan += int(np.count_nonzero(bad & np.isnan(values)))
        n_inf += int(np.count_nonzero(bad & np.isinf(values)))
        if first is None:
            frame, y, x = np.unravel_index(int(np.argmax(bad)), bad.shape)
            first = (experiment, start + int(frame), int(y), int(x))
    if first is not None:
        where = "observed points" if name in ds.masked_fields else "points (field has no mask)"
        raise DatasetError(
            f"dataset {ds.path} field {name!r} has {n_nan} NaN and {n_inf} Inf values at "
            f"{where}; first at (experiment, frame, y, x) = {first}"
        )


# Writer assignment


def shard_frames(array: zarr.Array) -> int:
    """Time length of the array's unit of writing (the shard, or the chunk if unsharded)."""
    return (array.shards or array.chunks)[1]


def shard_ranges(path: PathLike) -> list[ShardRange]:
    """Writer assignments for an existing (typically freshly created) dataset.

    Reads the shard length from the on-disk layout rather than trusting a parameter, so
    the assignments always match what zarr will actually read-modify-write.
    """
    ds = open_dataset(path)
    array = ds.group[ds.meta.fields[0]]
    return plan_shards(ds.meta.n_experiments, ds.meta.n_frames, shard_frames(array))

