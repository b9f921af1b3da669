"""On-disk observation datasets: the Zarr v3 schema, writing, reading, validation and noise.

One dataset is one Zarr v3 group.  Its attributes describe how the data were generated
(system, grid, time stepping, true parameters, noise, provenance, units); its arrays hold the
coordinates — observation times ``time``, ``experiment`` numbers and the two spatial axes
(cell centres, or the system's own coordinates, e.g. latitude and longitude; named by the
system, ``y``/``x`` by default) — one float32 array per field with shape
``(n_experiments, n_frames, ny, nx)`` and, optionally, a boolean ``mask_<field>`` array
(True = observed) of the same shape and layout.  Every array names its dimensions and
carries CF-style ``units``/``long_name`` attributes where the system declares them, so
``xarray.open_zarr(path, consolidated=False)`` gives a dataset indexed by time (format
version 1, still read, called the times array ``t`` and had no coordinates or units).

Truths beyond scalars (synthetic data): ``true_per_experiment`` (attributes) holds, per
parameter that differs between experiments, its value in every experiment; each name in
``true_arrays`` (attributes: name -> shape) has a float64 array ``true_<name>`` holding an
array-valued true parameter (e.g. a force field on space–time nodes), written once by
:func:`write_true_array` and read by :meth:`Dataset.read_true_array`.

Layout.  Field arrays are chunked per frame tile ``(1, 1, tile_y, tile_x)`` so a reader can
fetch single frames cheaply, and sharded along time ``(1, frames_per_shard, ny, nx)`` so a
long run does not explode into one file per frame.  A shard is zarr's unit of writing: zarr
updates a shard by read-modify-write of the whole shard file, so two processes writing
different frames of the same shard can silently lose each other's data.  Hence the
"one writer per shard" rule enforced by :func:`write_block`, and :func:`shard_ranges`,
which hands out those writer assignments.

Metadata is written once by :func:`create_dataset`, before any writer runs, so parallel
writers only ever touch chunk data.  The group attributes (including the ``format`` marker)
are written last, so a half-created dataset is never mistaken for a valid one.

Reading this with xarray needs ``xarray.open_zarr(path, consolidated=False)``: zarr v3 has
no standard consolidated metadata and we do not write any.

This module deliberately imports only numpy and zarr, so it stays cheap to import.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as _importlib_metadata
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import zarr
import zarr.errors

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Axis",
    "Dataset",
    "DatasetError",
    "DatasetMeta",
    "ShardRange",
    "add_noise",
    "add_noise_block",
    "check_noise",
    "create_dataset",
    "make_provenance",
    "open_dataset",
    "plan_shards",
    "shard_ranges",
    "validate_dataset",
    "write_block",
    "write_dataset",
    "write_true_array",
]

FORMAT = "pdefit-dataset"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

TIME_ARRAY = "time"
LEGACY_TIME_ARRAY = "t"  # format version 1
EXPERIMENT_ARRAY = "experiment"
MASK_PREFIX = "mask_"
TRUE_PREFIX = "true_"
DEFAULT_AXIS_NAMES = ("y", "x")
DEFAULT_FRAMES_PER_SHARD = 16

# Field names become array names and must not collide with ``t`` or the mask arrays.
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

# Keys each noise kind accepts; anything else is most likely a typo (e.g. "sigam") that
# would otherwise silently produce noise-free data.
_NOISE_KEYS = {
    "none": frozenset({"kind"}),
    "additive": frozenset({"kind", "sigma", "seed"}),
    "relative": frozenset({"kind", "sigma", "seed"}),
}

PathLike = str | os.PathLike[str]


class DatasetError(ValueError):
    """A dataset is missing, malformed, or does not match what the caller asked for."""


# --------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------


class Axis(NamedTuple):
    """One spatial axis of the grid: its dimension name, the coordinate of each row (or
    column), and CF-style units and long name."""

    name: str
    values: tuple[float, ...]
    units: str = ""
    long_name: str = ""


def _cell_centres(n: int, h: float) -> tuple[float, ...]:
    return tuple(float((i + 0.5) * h) for i in range(n))


@dataclass(frozen=True)
class DatasetMeta:
    """Everything about a dataset except the observed values.

    Dict-valued fields are excluded from hashing (dicts are unhashable) but still take
    part in equality.  Invalid combinations raise :class:`DatasetError` at construction, so
    a ``DatasetMeta`` in hand is always internally consistent.
    """

    system: str
    fields: tuple[str, ...]
    grid_shape: tuple[int, int]
    grid_spacing: tuple[float, float]
    boundaries: tuple[str, str]
    dt: float
    steps_per_frame: int
    t0: float
    n_frames: int
    n_experiments: int
    true_params: dict[str, float] | None = field(default=None, hash=False)
    noise: dict[str, Any] = field(default_factory=lambda: {"kind": "none"}, hash=False)
    provenance: dict[str, Any] = field(default_factory=dict, hash=False)
    # name -> per-experiment true values (n_experiments of them)
    true_per_experiment: dict[str, list[float]] | None = field(default=None, hash=False)
    # name -> shape of an array-valued true parameter, stored as array true_<name>
    true_arrays: dict[str, list[int]] = field(default_factory=dict, hash=False)
    # Labels (CF-style): the unit of time; the grid's axes (None: cell centres (i + ½)·h
    # named y, x, without unit); field name -> {"units", "long_name"}; the same for true
    # parameters.
    time_unit: str = ""
    axes: tuple[Axis, Axis] | None = field(default=None, hash=False)
    field_attrs: dict[str, dict[str, str]] = field(default_factory=dict, hash=False)
    param_attrs: dict[str, dict[str, str]] = field(default_factory=dict, hash=False)
    # name -> dimension names of the array true_<name> (default <name>_dim<i>)
    true_array_dims: dict[str, list[str]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.axes is None and _is_pair(self.grid_shape, int) and _is_pair(
                self.grid_spacing, float):
            object.__setattr__(self, "axes", tuple(
                Axis(name, _cell_centres(n, h), "", name) for name, n, h in zip(
                    DEFAULT_AXIS_NAMES, self.grid_shape, self.grid_spacing, strict=True)))
        elif isinstance(self.axes, tuple | list):
            # Plain (name, values, units, long_name) tuples, e.g. from a system; what does
            # not convert is reported by _meta_problems.
            with contextlib.suppress(TypeError, ValueError, IndexError):
                object.__setattr__(self, "axes", tuple(
                    Axis(a[0], tuple(float(v) for v in a[1]), *a[2:]) for a in self.axes))
        problems = _meta_problems(self)
        if problems:
            raise DatasetError("invalid dataset metadata: " + "; ".join(problems))

    @property
    def frame_interval(self) -> float:
        """Time between consecutive frames."""
        return self.steps_per_frame * self.dt

    @property
    def times(self) -> np.ndarray:
        """Observation times ``t0 + k * steps_per_frame * dt`` (float64)."""
        return self.t0 + np.arange(self.n_frames, dtype=np.float64) * self.frame_interval


def _meta_problems(meta: DatasetMeta) -> list[str]:
    """List every inconsistency in ``meta`` (empty when valid), so one error names them all."""
    problems: list[str] = []
    if not isinstance(meta.system, str) or not meta.system:
        problems.append(f"system must be a non-empty string, got {meta.system!r}")
    if not isinstance(meta.fields, tuple) or not meta.fields:
        problems.append(f"fields must be a non-empty tuple of names, got {meta.fields!r}")
    else:
        for name in meta.fields:
            if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name):
                problems.append(f"field name {name!r} must match {_FIELD_NAME.pattern}")
            elif name in _reserved_names(meta) or name.startswith((MASK_PREFIX, TRUE_PREFIX)):
                problems.append(f"field name {name!r} clashes with the reserved array names")
        if len(set(meta.fields)) != len(meta.fields):
            problems.append(f"field names must be unique, got {meta.fields!r}")
    problems += _label_problems(meta)
    if not _is_pair(meta.grid_shape, int) or min(meta.grid_shape) < 1:
        problems.append(f"grid_shape must be two positive ints, got {meta.grid_shape!r}")
    if not _is_pair(meta.grid_spacing, float) or not all(
        math.isfinite(h) and h > 0 for h in meta.grid_spacing
    ):
        problems.append(
            f"grid_spacing must be two positive finite floats, got {meta.grid_spacing!r}"
        )
    if not _is_pair(meta.boundaries, str) or not all(meta.boundaries):
        problems.append(f"boundaries must be two non-empty strings, got {meta.boundaries!r}")
    if not _is_real(meta.dt) or not (math.isfinite(meta.dt) and meta.dt > 0):
        problems.append(f"dt must be a positive finite float, got {meta.dt!r}")
    if not _is_int(meta.steps_per_frame) or meta.steps_per_frame < 1:
        problems.append(f"steps_per_frame must be an int >= 1, got {meta.steps_per_frame!r}")
    if not _is_real(meta.t0) or not math.isfinite(meta.t0):
        problems.append(f"t0 must be a finite float, got {meta.t0!r}")
    # Zero is allowed here so that an empty on-disk dataset can be described and then
    # rejected with a precise "empty" message; create_dataset refuses to make one.
    for name in ("n_frames", "n_experiments"):
        value = getattr(meta, name)
        if not _is_int(value) or value < 0:
            problems.append(f"{name} must be an int >= 0, got {value!r}")
    if meta.true_params is not None and not (
        isinstance(meta.true_params, dict)
        and all(isinstance(k, str) and _is_real(v) for k, v in meta.true_params.items())
    ):
        problems.append(
            f"true_params must be a dict str -> float or None, got {meta.true_params!r}"
        )
    if meta.true_per_experiment is not None and not (
        isinstance(meta.true_per_experiment, dict)
        and all(isinstance(k, str) and isinstance(v, list | tuple)
                and len(v) == meta.n_experiments and all(_is_real(x) for x in v)
                for k, v in meta.true_per_experiment.items())
    ):
        problems.append(
            "true_per_experiment must be a dict str -> list of n_experiments floats or None, "
            f"got {meta.true_per_experiment!r}"
        )
    if not (isinstance(meta.true_arrays, dict) and all(
            isinstance(k, str) and _FIELD_NAME.fullmatch(k) and isinstance(v, list | tuple)
            and all(_is_int(n) and n >= 1 for n in v) for k, v in meta.true_arrays.items())):
        problems.append(f"true_arrays must be a dict name -> shape (positive ints), got "
                        f"{meta.true_arrays!r}")
    try:
        check_noise(meta.noise)
    except DatasetError as exc:
        problems.append(str(exc))
    if not isinstance(meta.provenance, dict):
        problems.append(f"provenance must be a dict, got {meta.provenance!r}")
    return problems


def _reserved_names(meta: DatasetMeta) -> set[str]:
    """Array names a field may not take: the coordinates'."""
    names = {TIME_ARRAY, LEGACY_TIME_ARRAY, EXPERIMENT_ARRAY}
    if isinstance(meta.axes, tuple):
        names |= {getattr(a, "name", None) for a in meta.axes}
    return names


def _label_problems(meta: DatasetMeta) -> list[str]:
    """Inconsistencies of the units, long names and axes of ``meta``."""
    problems: list[str] = []
    if not isinstance(meta.time_unit, str):
        problems.append(f"time_unit must be a string, got {meta.time_unit!r}")
    if meta.axes is not None:
        axes = meta.axes
        shape = meta.grid_shape if _is_pair(meta.grid_shape, int) else (None, None)
        if not (isinstance(axes, tuple) and len(axes) == 2
                and all(isinstance(a, Axis) for a in axes)):
            problems.append(f"axes must be two (name, values, units, long_name), got {axes!r}")
        else:
            for axis, n in zip(axes, shape, strict=True):
                if not (isinstance(axis.name, str) and _FIELD_NAME.fullmatch(axis.name)
                        and axis.name not in (TIME_ARRAY, LEGACY_TIME_ARRAY, EXPERIMENT_ARRAY)
                        and not axis.name.startswith((MASK_PREFIX, TRUE_PREFIX))):
                    problems.append(f"axis name {axis.name!r} must match "
                                    f"{_FIELD_NAME.pattern} and not be a reserved name")
                if n is not None and len(axis.values) != n:
                    problems.append(f"axis {axis.name!r} has {len(axis.values)} coordinates "
                                    f"for a grid dimension of {n}")
                if not all(math.isfinite(v) for v in axis.values):
                    problems.append(f"axis {axis.name!r} has non-finite coordinates")
                if not (isinstance(axis.units, str) and isinstance(axis.long_name, str)):
                    problems.append(f"axis {axis.name!r}: units and long_name must be strings")
            if axes[0].name == axes[1].name:
                problems.append(f"the two axes need different names, got {axes[0].name!r}")
    for what, attrs, names in (("field_attrs", meta.field_attrs, meta.fields),
                               ("param_attrs", meta.param_attrs, None)):
        if not (isinstance(attrs, dict) and all(
                isinstance(k, str) and isinstance(v, dict)
                and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items())
                for k, v in attrs.items())):
            problems.append(f"{what} must be a dict name -> {{str: str}}, got {attrs!r}")
        elif names is not None and isinstance(names, tuple) and set(attrs) - set(names):
            problems.append(f"{what} names unknown fields {sorted(set(attrs) - set(names))}")
    dims, shapes = meta.true_array_dims, meta.true_arrays
    if not (isinstance(dims, dict) and isinstance(shapes, dict) and all(
            k in shapes and isinstance(v, list | tuple) and len(v) == len(shapes[k])
            and all(isinstance(d, str) and _FIELD_NAME.fullmatch(d)
                    and d not in _reserved_names(meta) for d in v)
            for k, v in dims.items())):
        problems.append("true_array_dims must name each dimension of a declared true array "
                        f"(not a coordinate's name), got {dims!r}")
    return problems


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True frames is certainly a bug.
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return _is_int(value) or isinstance(value, float | np.floating)


def _is_pair(value: object, kind: type) -> bool:
    check = {int: _is_int, float: _is_real}.get(kind, lambda v: isinstance(v, kind))
    return isinstance(value, tuple) and len(value) == 2 and all(check(v) for v in value)


def make_provenance(config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Provenance record for a new dataset: package version, UTC creation time, config.

    The config is copied through a JSON round trip so the record cannot alias (and later
    silently change with) the caller's objects, and so non-JSON values fail here, early.
    """
    try:
        version = _importlib_metadata.version("pdefit")
    except _importlib_metadata.PackageNotFoundError:
        # Running from a source checkout that was never pip-installed.
        version = "0+unknown"
    try:
        config_copy = json.loads(json.dumps(dict(config or {})))
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"provenance config is not JSON-serialisable: {exc}") from exc
    return {
        "pdefit_version": version,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "config": config_copy,
    }


def _meta_to_attrs(meta: DatasetMeta) -> dict[str, Any]:
    attrs = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "system": meta.system,
        "fields": list(meta.fields),
        "grid": {
            "shape": [int(n) for n in meta.grid_shape],
            "spacing": [float(h) for h in meta.grid_spacing],
            "boundaries": list(meta.boundaries),
        },
        "dt": float(meta.dt),
        "steps_per_frame": int(meta.steps_per_frame),
        "t0": float(meta.t0),
        "true_params": (
            None if meta.true_params is None else {k: float(v) for k, v in meta.true_params.items()}
        ),
        "noise": dict(meta.noise),
        "provenance": dict(meta.provenance),
        "n_experiments": int(meta.n_experiments),
    }
    # Only when present, so datasets without them keep exactly their former attributes.
    if meta.true_per_experiment is not None:
        attrs["true_per_experiment"] = {k: [float(x) for x in v]
                                        for k, v in meta.true_per_experiment.items()}
    if meta.true_arrays:
        attrs["true_arrays"] = {k: [int(n) for n in v] for k, v in meta.true_arrays.items()}
    # The axes' coordinate values are arrays of their own (read back by _open_dataset).
    attrs["axes"] = [{"name": a.name, "units": a.units, "long_name": a.long_name}
                     for a in meta.axes]
    attrs["time_unit"] = meta.time_unit
    attrs["field_attrs"] = meta.field_attrs
    attrs["param_attrs"] = meta.param_attrs
    if meta.true_array_dims:
        attrs["true_array_dims"] = {k: list(v) for k, v in meta.true_array_dims.items()}
    try:
        # Fail with a clear message instead of deep inside zarr's JSON encoder.
        return json.loads(json.dumps(attrs))
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"dataset metadata is not JSON-serialisable: {exc}") from exc


def _meta_from_attrs(attrs: Mapping[str, Any], n_frames: int, where: str,
                     axis_values: Sequence[Sequence[float]] | None = None) -> DatasetMeta:
    """Rebuild ``DatasetMeta`` from group attributes; ``n_frames`` comes from the times
    array, ``axis_values`` (format version 2) from the coordinate arrays of ``attrs["axes"]``."""
    try:
        grid = attrs["grid"]
        axes = None if axis_values is None else tuple(
            Axis(a["name"], tuple(float(v) for v in values), a["units"], a["long_name"])
            for a, values in zip(attrs["axes"], axis_values, strict=True))
        return DatasetMeta(
            system=attrs["system"],
            fields=tuple(attrs["fields"]),
            grid_shape=tuple(grid["shape"]),
            grid_spacing=tuple(float(h) for h in grid["spacing"]),
            boundaries=tuple(grid["boundaries"]),
            dt=float(attrs["dt"]),
            steps_per_frame=attrs["steps_per_frame"],
            t0=float(attrs["t0"]),
            n_frames=n_frames,
            n_experiments=attrs["n_experiments"],
            true_params=attrs.get("true_params"),
            noise=attrs.get("noise", {"kind": "none"}),
            provenance=attrs.get("provenance", {}),
            true_per_experiment=attrs.get("true_per_experiment"),
            true_arrays=attrs.get("true_arrays", {}),
            time_unit=attrs.get("time_unit", ""),
            axes=axes,
            field_attrs=attrs.get("field_attrs", {}),
            param_attrs=attrs.get("param_attrs", {}),
            true_array_dims=attrs.get("true_array_dims", {}),
        )
    except KeyError as exc:
        raise DatasetError(f"{where}: attribute {exc.args[0]!r} is missing") from exc
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: malformed attributes: {exc}") from exc


# --------------------------------------------------------------------------------------
# Layout and writer assignment
# --------------------------------------------------------------------------------------


class ShardRange(NamedTuple):
    """Frames ``[frame_start, frame_stop)`` of one experiment: exactly one shard's worth."""

    experiment: int
    frame_start: int
    frame_stop: int


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
    if not _is_int(frames_per_shard) or frames_per_shard < 1:
        raise DatasetError(f"frames_per_shard must be an int >= 1, got {frames_per_shard!r}")
    ny, nx = grid_shape
    if tile is None:
        tile_y, tile_x = ny, nx
    else:
        if not _is_pair(tuple(tile), int) or min(tile) < 1:
            raise DatasetError(f"tile must be two positive ints, got {tile!r}")
        tile_y = _largest_divisor_at_most(ny, tile[0])
        tile_x = _largest_divisor_at_most(nx, tile[1])
    shard_frames = min(frames_per_shard, max(n_frames, 1))
    return (1, 1, tile_y, tile_x), (1, shard_frames, ny, nx)


def plan_shards(n_experiments: int, n_frames: int, frames_per_shard: int) -> list[ShardRange]:
    """Writer assignments covering every frame of every experiment, one per shard.

    Ordered experiment-major so a writer pool working down the list fills experiments in
    turn.
    """
    if frames_per_shard < 1:
        raise DatasetError(f"frames_per_shard must be >= 1, got {frames_per_shard}")
    return [
        ShardRange(e, start, min(start + frames_per_shard, n_frames))
        for e in range(n_experiments)
        for start in range(0, n_frames, frames_per_shard)
    ]


def _shard_frames(array: zarr.Array) -> int:
    """Time length of the array's unit of writing (the shard, or the chunk if unsharded)."""
    return (array.shards or array.chunks)[1]


def shard_ranges(path: PathLike) -> list[ShardRange]:
    """Writer assignments for an existing (typically freshly created) dataset.

    Reads the shard length from the on-disk layout rather than trusting a parameter, so
    the assignments always match what zarr will actually read-modify-write.
    """
    ds = open_dataset(path)
    array = ds.group[ds.meta.fields[0]]
    return plan_shards(ds.meta.n_experiments, ds.meta.n_frames, _shard_frames(array))


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


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
    _check_not_empty(meta, where)
    mask_fields = _mask_fields(meta, masks, where)
    chunks, shards = _layout(meta.grid_shape, meta.n_frames, frames_per_shard, tile)
    attrs = _meta_to_attrs(meta)

    if Path(path).exists():
        if not overwrite:
            raise DatasetError(f"{where} already exists; pass overwrite=True to replace it")
        if not _is_pdefit_dataset(path):
            raise DatasetError(
                f"refusing to overwrite {os.fspath(path)}: it exists but is not a pdefit dataset"
            )
    group = zarr.open_group(os.fspath(path), mode="w", zarr_format=3)

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
    for name, array_shape in meta.true_arrays.items():
        # One chunk: written once, by one writer (write_true_array), read whole.
        group.create_array(TRUE_PREFIX + name, shape=tuple(array_shape), dtype="float64",
                           chunks=tuple(array_shape), fill_value=np.nan,
                           dimension_names=tuple(meta.true_array_dims.get(name) or (
                               f"{name}_dim{i}" for i in range(len(array_shape)))),
                           attributes=_cf_attrs(meta.param_attrs.get(name, {})))
    # Last, so the "format" marker only appears once the dataset is complete.
    group.attrs.update(attrs)


def _cf_attrs(attrs: Mapping[str, str]) -> dict[str, str]:
    """CF attributes without the empty ones (no unit declared is no ``units``)."""
    return {k: v for k, v in attrs.items() if v}


def _mask_fields(meta: DatasetMeta, masks: bool | Sequence[str], where: str) -> tuple[str, ...]:
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


def _is_pdefit_dataset(path: PathLike) -> bool:
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
    ds = _open_dataset(path, mode="r+")
    where = f"dataset {ds.path} field {field!r}"
    ds._require_field(field)
    meta = ds.meta
    array = ds.group[field]
    values = np.asarray(values)
    if values.ndim != 3 or values.shape[1:] != meta.grid_shape or values.shape[0] < 1:
        raise DatasetError(
            f"{where}: block must have shape (n >= 1, {meta.grid_shape[0]}, "
            f"{meta.grid_shape[1]}), got {values.shape}"
        )
    n = values.shape[0]
    if not _is_int(experiment) or not 0 <= experiment < meta.n_experiments:
        raise DatasetError(
            f"{where}: experiment {experiment!r} out of range [0, {meta.n_experiments})"
        )
    frame_stop = frame_start + n
    if not _is_int(frame_start) or frame_start < 0 or frame_stop > meta.n_frames:
        raise DatasetError(
            f"{where}: frames [{frame_start}, {frame_stop}) outside [0, {meta.n_frames})"
        )
    unit = _shard_frames(array)
    if frame_start % unit or (frame_stop % unit and frame_stop != meta.n_frames):
        raise DatasetError(
            f"{where}: frames [{frame_start}, {frame_stop}) do not cover whole shards of "
            f"{unit} frames; zarr 3 rewrites a whole shard on every write "
            "(read-modify-write), so concurrent writers into the same shard lose data. "
            "Write blocks from shard_ranges()."
        )
    has_mask = ds.has_mask(field)
    if mask is not None and not has_mask:
        raise DatasetError(f"{where}: a mask was given but the dataset has no mask for it")
    if mask is None and has_mask:
        raise DatasetError(
            f"{where}: the dataset has a mask for this field, so pass mask= "
            "(unwritten masks read as all-unobserved)"
        )
    region = (experiment, slice(frame_start, frame_stop))
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != values.shape or mask.dtype != np.bool_:
            raise DatasetError(
                f"{where}: mask must be bool with shape {values.shape}, "
                f"got {mask.dtype} {mask.shape}"
            )
        ds.group[MASK_PREFIX + field][region] = mask
    array[region] = values.astype(np.float32, copy=False)


def write_true_array(path: PathLike, name: str, values: np.ndarray) -> None:
    """Write the array-valued true parameter ``name`` (declared in ``meta.true_arrays``).
    One writer only: the array is a single chunk."""
    ds = _open_dataset(path, mode="r+")
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


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------

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
    if not _is_int(stride) or stride < 1:
        raise DatasetError(f"{where}: stride must be an int >= 1, got {stride!r}")
    if _is_int(sel):
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
    return _open_dataset(path, mode="r")


def _open_dataset(path: PathLike, mode: Literal["r", "r+"]) -> Dataset:
    spath = os.fspath(path)
    where = f"dataset {spath}"
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
    time_name = LEGACY_TIME_ARRAY if version == 1 else TIME_ARRAY
    times = _get_array(group, time_name, where)
    if times.ndim != 1:
        raise DatasetError(f"{where}: array {time_name!r} must be 1-D, found shape "
                           f"{times.shape}")
    axis_values = None
    if version >= 2:
        names = [axis.get("name") for axis in attrs.get("axes", [])
                 if isinstance(axis, Mapping)]
        axis_values = [np.asarray(_get_array(group, name, where)[...]) for name in names]
    meta = _meta_from_attrs(attrs, times.shape[0], where, axis_values)
    _check_not_empty(meta, where)

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

    stored_times = np.asarray(times[...])
    if not np.allclose(stored_times, meta.times, rtol=1e-9, atol=1e-9 * meta.frame_interval):
        raise DatasetError(
            f"{where}: array {time_name!r} disagrees with t0 + k * steps_per_frame * dt "
            f"(t0={meta.t0}, dt={meta.dt}, steps_per_frame={meta.steps_per_frame})"
        )
    return Dataset(path=spath, meta=meta, masked_fields=frozenset(masked), group=group)


def _get_array(group: zarr.Group, name: str, where: str) -> zarr.Array:
    if name not in group:
        raise DatasetError(f"{where}: array {name!r} is missing")
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise DatasetError(f"{where}: {name!r} is a group, expected an array")
    return node


def _check_not_empty(meta: DatasetMeta, where: str) -> None:
    if meta.n_frames == 0 or meta.n_experiments == 0:
        raise DatasetError(
            f"{where} is empty: n_experiments={meta.n_experiments}, n_frames={meta.n_frames}"
        )


# --------------------------------------------------------------------------------------
# Validation against a configuration
# --------------------------------------------------------------------------------------


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
    if meta.system != system:
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
    if dt is not None and not math.isclose(dt, meta.dt, rel_tol=1e-9):
        raise DatasetError(f"{where}: dt mismatch: config expects {dt}, dataset has {meta.dt}")
    _check_not_empty(meta, where)
    if check_finite:
        for name in fields:
            _check_field_finite(ds, name, frames_per_block)


def _check_field_finite(ds: Dataset, name: str, frames_per_block: int | None) -> None:
    """Scan one field for NaN/Inf at observed points; report counts and the first index."""
    meta = ds.meta
    block = frames_per_block or _shard_frames(ds.group[name])
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


# --------------------------------------------------------------------------------------
# Noise
# --------------------------------------------------------------------------------------


def check_noise(noise: Mapping[str, Any]) -> None:
    """Raise DatasetError unless ``noise`` is a valid noise description.

    A seed is required for random kinds: the description is stored with the dataset, and
    it is only worth storing if it regenerates the same data.
    """
    if not isinstance(noise, Mapping) or "kind" not in noise:
        raise DatasetError(f"noise must be a dict with a 'kind' key, got {noise!r}")
    kind = noise["kind"]
    if kind not in _NOISE_KEYS:
        raise DatasetError(f"unknown noise kind {kind!r}; expected one of {sorted(_NOISE_KEYS)}")
    extra = set(noise) - _NOISE_KEYS[kind]
    if extra:
        raise DatasetError(
            f"noise kind {kind!r} takes keys {sorted(_NOISE_KEYS[kind])}, got unexpected "
            f"{sorted(extra)}"
        )
    if kind == "none":
        return
    sigma = noise.get("sigma")
    if not _is_real(sigma) or not math.isfinite(sigma) or sigma < 0:
        raise DatasetError(f"noise sigma must be a finite float >= 0, got {sigma!r}")
    seed = noise.get("seed")
    if not _is_int(seed) or seed < 0:
        raise DatasetError(f"noise kind {kind!r} needs an int seed >= 0, got {seed!r}")


def add_noise(
    values: np.ndarray, noise: Mapping[str, Any], *, key: Sequence[int] = ()
) -> np.ndarray:
    """Return ``values`` with noise applied, as float32.

    ``"additive"``: ``values + sigma * N(0, 1)``; ``"relative"``: ``values * (1 + sigma *
    N(0, 1))``; ``"none"``: unchanged.  The generator is ``np.random.default_rng(seed)``, or
    ``default_rng([seed, *key])`` when ``key`` is given, which gives independent streams
    for different parts of a dataset (see :func:`add_noise_block`).
    """
    check_noise(noise)
    values = np.asarray(values)
    if noise["kind"] == "none":
        return values.astype(np.float32)
    seed = int(noise["seed"])
    rng = np.random.default_rng([seed, *map(int, key)] if key else seed)
    # Draw in float64 so float32 inputs do not change the random stream or its precision.
    scaled = float(noise["sigma"]) * rng.standard_normal(values.shape)
    if noise["kind"] == "additive":
        return (values + scaled).astype(np.float32)
    return (values * (1.0 + scaled)).astype(np.float32)


def add_noise_block(
    values: np.ndarray, noise: Mapping[str, Any], *, experiment: int, frame_start: int
) -> np.ndarray:
    """Noise for a ``(n, ny, nx)`` block of frames, identical however frames are blocked.

    Each frame gets its own stream keyed by (experiment, frame), so a dataset written by
    parallel shard writers carries the same noise as one written in a single pass, and
    writers never reuse each other's random numbers.
    """
    values = np.asarray(values)
    out = np.empty(values.shape, dtype=np.float32)
    for i, frame in enumerate(values):
        out[i] = add_noise(frame, noise, key=(experiment, frame_start + i))
    return out
