"""The dataset format: its constants, its metadata (:class:`DatasetMeta`, validated as a
whole at construction), their group attributes, provenance, and the shard plan of writers.

One dataset is one Zarr v3 group.  Its attributes describe the data (grid, units, noise) and,
for data pdefit simulated, how they were made (system, time step ``dt`` and
``steps_per_frame``, true parameters, provenance); a recording made by no model of pdefit has
no ``dt`` and ``steps_per_frame`` (null) and may have an empty ``system``.  Its arrays hold the
coordinates — observation times ``time`` (the truth about when frames were observed; they
need not be evenly spaced), ``experiment`` numbers and the two spatial axes
(cell centres, or the system's own coordinates, e.g. latitude and longitude; named by the
system, ``y``/``x`` by default) — one float32 array per field with shape
``(n_experiments, n_frames, ny, nx)`` and, optionally, a boolean ``mask_<field>`` array
(True = observed) of the same shape and layout.  Every array names its dimensions and
carries CF-style ``units``/``long_name`` attributes where the system declares them, so
``xarray.open_zarr(path, consolidated=False)`` gives a dataset indexed by time.  Format
version 3 allows null ``dt``/``steps_per_frame`` and an empty ``system``; versions 1 and 2
(both still read) always had them; version 1 called the times array ``t`` and had no
coordinates or units.

Truths beyond scalars (synthetic data): ``true_per_experiment`` (attributes) holds, per
parameter that differs between experiments, its value in every experiment; each name in
``true_arrays`` (attributes: name -> shape) has a float64 array ``true_<name>`` holding an
array-valued true parameter (e.g. a force field on space–time nodes), written once by
:func:`~pdefit.data.writer.write_true_array` and read by
:meth:`~pdefit.data.reader.Dataset.read_true_array`.

Nothing here touches zarr: the writer (:mod:`pdefit.data.writer`) and the reader
(:mod:`pdefit.data.reader`) turn this metadata into arrays and back.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as _importlib_metadata
from typing import Any, NamedTuple

import numpy as np

from pdefit.data.checks import DatasetError, is_int, is_pair, is_real
from pdefit.data.noise import check_noise
from pdefit.data.timing import frame_time_problems, is_uniform, uniform_interval

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
    "DatasetMeta",
    "ShardRange",
    "make_provenance",
    "plan_shards",
]

FORMAT = "pdefit-dataset"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)

TIME_ARRAY = "time"
LEGACY_TIME_ARRAY = "t"  # format version 1
EXPERIMENT_ARRAY = "experiment"
MASK_PREFIX = "mask_"
TRUE_PREFIX = "true_"
DEFAULT_AXIS_NAMES = ("y", "x")
DEFAULT_FRAMES_PER_SHARD = 16

# Field names become array names and must not collide with ``t`` or the mask arrays.
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


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

    Time: a dataset pdefit simulated has ``dt`` and ``steps_per_frame`` (how it was made)
    and its frames lie at ``t0 + k * steps_per_frame * dt``; a recording has ``dt`` and
    ``steps_per_frame`` None and its observation times in ``frame_times`` (increasing, not
    necessarily evenly spaced; ``t0`` is the first).  Given both, they must agree.

    Dict-valued fields are excluded from hashing (dicts are unhashable) but still take
    part in equality.  Invalid combinations raise :class:`DatasetError` at construction, so
    a ``DatasetMeta`` in hand is always internally consistent.
    """

    system: str
    fields: tuple[str, ...]
    grid_shape: tuple[int, int]
    grid_spacing: tuple[float, float]
    boundaries: tuple[str, str]
    dt: float | None  # the simulation's time step; None for a recording
    steps_per_frame: int | None  # simulation steps between frames; None for a recording
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
    # The observation times (required without dt and steps_per_frame); None: derived.
    frame_times: tuple[float, ...] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.axes is None and is_pair(self.grid_shape, int) and is_pair(
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
        if isinstance(self.frame_times, list | np.ndarray):
            with contextlib.suppress(TypeError, ValueError):
                object.__setattr__(self, "frame_times",
                                   tuple(float(t) for t in self.frame_times))
        problems = _meta_problems(self)
        if problems:
            raise DatasetError("invalid dataset metadata: " + "; ".join(problems))

    @property
    def simulated_times(self) -> bool:
        """Whether the times follow from ``dt`` and ``steps_per_frame`` (data pdefit made)."""
        return self.dt is not None and self.steps_per_frame is not None

    @property
    def uniform_times(self) -> bool:
        """Whether the frames are evenly spaced in time."""
        return self.simulated_times or is_uniform(self.times)

    @property
    def frame_interval(self) -> float:
        """Time between consecutive frames; DatasetError where the times are not evenly
        spaced or there is a single frame of a recording."""
        if self.simulated_times:
            return self.steps_per_frame * self.dt
        return uniform_interval(self.times)

    @property
    def times(self) -> np.ndarray:
        """Observation times (float64): ``frame_times``, else ``t0 + k * steps_per_frame *
        dt``."""
        if self.frame_times is not None:
            return np.asarray(self.frame_times, dtype=np.float64)
        return self.t0 + np.arange(self.n_frames, dtype=np.float64) * (
            self.steps_per_frame * self.dt)


def _meta_problems(meta: DatasetMeta) -> list[str]:
    """List every inconsistency in ``meta`` (empty when valid), so one error names them all."""
    problems = _name_problems(meta)
    problems += _label_problems(meta)
    problems += _grid_problems(meta)
    problems += _time_problems(meta)
    problems += _truth_problems(meta)
    try:
        check_noise(meta.noise)
    except DatasetError as exc:
        problems.append(str(exc))
    if not isinstance(meta.provenance, dict):
        problems.append(f"provenance must be a dict, got {meta.provenance!r}")
    return problems


def _name_problems(meta: DatasetMeta) -> list[str]:
    """Inconsistencies of the system's name and the field names of ``meta``."""
    problems: list[str] = []
    if not isinstance(meta.system, str):  # "" for a recording that no model made
        problems.append(f"system must be a string, got {meta.system!r}")
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
    return problems


def _grid_problems(meta: DatasetMeta) -> list[str]:
    """Inconsistencies of the grid's shape, spacing and boundaries in ``meta``."""
    problems: list[str] = []
    if not is_pair(meta.grid_shape, int) or min(meta.grid_shape) < 1:
        problems.append(f"grid_shape must be two positive ints, got {meta.grid_shape!r}")
    if not is_pair(meta.grid_spacing, float) or not all(
        math.isfinite(h) and h > 0 for h in meta.grid_spacing
    ):
        problems.append(
            f"grid_spacing must be two positive finite floats, got {meta.grid_spacing!r}"
        )
    if not is_pair(meta.boundaries, str) or not all(meta.boundaries):
        problems.append(f"boundaries must be two non-empty strings, got {meta.boundaries!r}")
    return problems


def _time_problems(meta: DatasetMeta) -> list[str]:
    """Inconsistencies of the time stepping and the frame and experiment counts."""
    problems: list[str] = []
    if meta.dt is not None and (not is_real(meta.dt)
                                or not (math.isfinite(meta.dt) and meta.dt > 0)):
        problems.append(f"dt must be a positive finite float or None, got {meta.dt!r}")
    if meta.steps_per_frame is not None and (not is_int(meta.steps_per_frame)
                                             or meta.steps_per_frame < 1):
        problems.append(f"steps_per_frame must be an int >= 1 or None, got "
                        f"{meta.steps_per_frame!r}")
    if not is_real(meta.t0) or not math.isfinite(meta.t0):
        problems.append(f"t0 must be a finite float, got {meta.t0!r}")
    # Zero is allowed here so that an empty on-disk dataset can be described and then
    # rejected with a precise "empty" message; create_dataset refuses to make one.
    for name in ("n_frames", "n_experiments"):
        value = getattr(meta, name)
        if not is_int(value) or value < 0:
            problems.append(f"{name} must be an int >= 0, got {value!r}")
    if not problems:
        problems += frame_time_problems(meta.frame_times, meta.n_frames, meta.t0, meta.dt,
                                        meta.steps_per_frame)
    return problems


def _truth_problems(meta: DatasetMeta) -> list[str]:
    """Inconsistencies of the true parameters: scalar, per experiment and array-valued."""
    problems: list[str] = []
    if meta.true_params is not None and not (
        isinstance(meta.true_params, dict)
        and all(isinstance(k, str) and is_real(v) for k, v in meta.true_params.items())
    ):
        problems.append(
            f"true_params must be a dict str -> float or None, got {meta.true_params!r}"
        )
    if meta.true_per_experiment is not None and not (
        isinstance(meta.true_per_experiment, dict)
        and all(isinstance(k, str) and isinstance(v, list | tuple)
                and len(v) == meta.n_experiments and all(is_real(x) for x in v)
                for k, v in meta.true_per_experiment.items())
    ):
        problems.append(
            "true_per_experiment must be a dict str -> list of n_experiments floats or None, "
            f"got {meta.true_per_experiment!r}"
        )
    if not (isinstance(meta.true_arrays, dict) and all(
            isinstance(k, str) and _FIELD_NAME.fullmatch(k) and isinstance(v, list | tuple)
            and all(is_int(n) and n >= 1 for n in v) for k, v in meta.true_arrays.items())):
        problems.append(f"true_arrays must be a dict name -> shape (positive ints), got "
                        f"{meta.true_arrays!r}")
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
        shape = meta.grid_shape if is_pair(meta.grid_shape, int) else (None, None)
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


def meta_to_attrs(meta: DatasetMeta) -> dict[str, Any]:
    """The group attributes of ``meta`` (JSON-plain), with the format marker and version."""
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
        # null for a recording: the times array holds when its frames were observed.
        "dt": None if meta.dt is None else float(meta.dt),
        "steps_per_frame": None if meta.steps_per_frame is None else int(meta.steps_per_frame),
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
    # The axes' coordinate values are arrays of their own (read back by the reader).
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


def meta_from_attrs(attrs: Mapping[str, Any], times: np.ndarray, where: str,
                     axis_values: Sequence[Sequence[float]] | None = None) -> DatasetMeta:
    """Rebuild ``DatasetMeta`` from group attributes and the stored observation ``times``
    (kept as ``frame_times`` for a recording, which has no ``dt``/``steps_per_frame``;
    checked against them by the reader otherwise); ``axis_values`` (format version >= 2)
    from the coordinate arrays of ``attrs["axes"]``."""
    try:
        grid = attrs["grid"]
        # Format versions 1 and 2 always recorded the simulation's step; 3 may not.
        optional = attrs.get("format_version") not in (1, 2)
        dt = attrs.get("dt") if optional else attrs["dt"]
        steps_per_frame = attrs.get("steps_per_frame") if optional else attrs["steps_per_frame"]
        recorded = dt is None or steps_per_frame is None
        axes = None if axis_values is None else tuple(
            Axis(a["name"], tuple(float(v) for v in values), a["units"], a["long_name"])
            for a, values in zip(attrs["axes"], axis_values, strict=True))
        return DatasetMeta(
            system=attrs["system"],
            fields=tuple(attrs["fields"]),
            grid_shape=tuple(grid["shape"]),
            grid_spacing=tuple(float(h) for h in grid["spacing"]),
            boundaries=tuple(grid["boundaries"]),
            dt=None if dt is None else float(dt),
            steps_per_frame=steps_per_frame,
            t0=float(attrs["t0"]),
            n_frames=len(times),
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
            frame_times=tuple(float(t) for t in times) if recorded else None,
        )
    except KeyError as exc:
        raise DatasetError(f"{where}: attribute {exc.args[0]!r} is missing") from exc
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: malformed attributes: {exc}") from exc


# Writer assignment: one writer per shard (see pdefit.data.writer for why).


class ShardRange(NamedTuple):
    """Frames ``[frame_start, frame_stop)`` of one experiment: exactly one shard's worth."""

    experiment: int
    frame_start: int
    frame_stop: int



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



def check_not_empty(meta: DatasetMeta, where: str) -> None:
    """Refuse a dataset without frames or experiments: it can never be fitted."""
    if meta.n_frames == 0 or meta.n_experiments == 0:
        raise DatasetError(
            f"{where} is empty: n_experiments={meta.n_experiments}, n_frames={meta.n_frames}"
        )
