"""A user's recording in: :func:`write_recording` (public as ``pdefit.write_dataset``) writes
frames observed at given times on a grid of given spacing as a pdefit dataset, without any
model time step, with masks where values are missing (NaN), and never deletes a directory
that is not a pdefit dataset.

It checks everything (shapes, times, units, the target path) before writing anything, writes
into a sibling temporary directory and moves it into place only when complete, so an
interrupted or refused write leaves the target as it was.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdefit.data.checks import DatasetError, PathLike, is_pair
from pdefit.data.noise import recorded_noise
from pdefit.data.schema import (
    DEFAULT_AXIS_NAMES,
    DEFAULT_FRAMES_PER_SHARD,
    TIME_ARRAY,
    Axis,
    DatasetMeta,
    make_provenance,
)
from pdefit.data.writer import is_pdefit_dataset, write_dataset

__all__ = ["write_recording"]


def write_recording(
    path: PathLike,
    fields: Mapping[str, Any],
    times: Sequence[float] | np.ndarray,
    *,
    spacing: tuple[float, float] = (1.0, 1.0),
    boundaries: tuple[str, str] = ("neumann", "neumann"),
    masks: Mapping[str, Any] | None = None,
    units: Mapping[str, str] | None = None,
    time_unit: str = "",
    system: str = "",
    overwrite: bool = False,
    axis_names: tuple[str, str] = DEFAULT_AXIS_NAMES,
    coordinates: tuple[Sequence[float], Sequence[float]] | None = None,
    source: str | None = None,
    frames_per_shard: int = DEFAULT_FRAMES_PER_SHARD,
    noise_sigma: float | Mapping[str, float] | None = None,
) -> Path:
    """Write a recording as a pdefit dataset at ``path`` and return ``path``.

    ``fields``: name → array ``(n_frames, ny, nx)`` or ``(n_experiments, n_frames, ny, nx)``,
    all of one shape, NaN where unobserved; ``times``: the ``n_frames`` observation times
    (increasing, not necessarily evenly spaced). ``masks`` (name → bool array of the field's
    shape, True = observed) are combined with the NaNs: a field with either gets a mask.
    ``units``: name → unit of a field, of ``time`` or of an axis (``axis_names``; cell
    centres ``(i + ½)·h`` unless ``coordinates`` gives them). ``system`` names the system
    that made the data ("" for none); ``source`` says where the data came from (provenance).
    ``noise_sigma``: the additive noise level of the recording (one number, or field →
    number), recorded in the dataset's ``noise`` attribute (no seed: measured, not drawn), so
    that a fit weighs each field by it and judges its residual against it.

    An existing ``path`` is replaced only when it is a pdefit dataset and ``overwrite``;
    anything else there raises :class:`DatasetError` and is left untouched.
    """
    target = Path(path)
    arrays = _field_arrays(fields)
    shape = next(iter(arrays.values())).shape
    field_masks = _masks(arrays, masks)
    meta = _recording_meta(arrays, shape, times, spacing, boundaries, units, time_unit,
                           system, axis_names, coordinates, source)
    if noise_sigma is not None:
        meta = dataclasses.replace(meta, noise=recorded_noise(noise_sigma, tuple(arrays)))
    _check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    try:
        write_dataset(staging / "dataset", meta, arrays, field_masks,
                      frames_per_shard=frames_per_shard)
        _check_target(target, overwrite)  # again: something may have appeared meanwhile
        _move_into_place(staging / "dataset", target, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _field_arrays(fields: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The fields as float32 arrays ``(n_experiments, n_frames, ny, nx)`` of one shape."""
    if not isinstance(fields, Mapping) or not fields:
        raise DatasetError("fields must map at least one field name to an array "
                           "(n_frames, ny, nx) or (n_experiments, n_frames, ny, nx)")
    arrays: dict[str, np.ndarray] = {}
    for name, values in fields.items():
        try:
            array = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"field {name!r}: not an array of numbers ({exc})") from None
        if array.ndim not in (3, 4):
            raise DatasetError(f"field {name!r} has shape {array.shape}; expected (n_frames, "
                               "ny, nx) or (n_experiments, n_frames, ny, nx)")
        arrays[name] = (array[None] if array.ndim == 3 else array).astype(np.float32)
    first, shape = next(iter(arrays.items()))[0], next(iter(arrays.values())).shape
    for name, array in arrays.items():
        if array.shape != shape:
            raise DatasetError(f"field {name!r} has shape {array.shape} (as experiments, "
                               f"frames, ny, nx) but field {first!r} has {shape}; all fields "
                               "need one shape")
        if np.isinf(array).any():
            raise DatasetError(f"field {name!r} has {int(np.isinf(array).sum())} infinite "
                               "values; use NaN for unobserved points")
    if min(shape) < 1:
        raise DatasetError(f"fields have an empty dimension: shape {shape}")
    return arrays


def _masks(arrays: Mapping[str, np.ndarray], masks: Mapping[str, Any] | None,
           ) -> dict[str, np.ndarray]:
    """Per field with missing values or a given mask: True where observed (and not NaN)."""
    masks = dict(masks or {})
    unknown = sorted(set(masks) - set(arrays))
    if unknown:
        raise DatasetError(f"masks given for unknown field(s) {unknown}; fields are "
                           f"{list(arrays)}")
    out: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        observed = ~np.isnan(array)
        if name in masks:
            mask = np.asarray(masks[name])
            mask = mask[None] if mask.ndim == 3 else mask
            if mask.dtype != np.bool_ or mask.shape != array.shape:
                raise DatasetError(f"mask of field {name!r}: expected bool of shape "
                                   f"{array.shape}, got {mask.dtype} {mask.shape}")
            observed &= mask
        if name in masks or not observed.all():
            out[name] = observed
    return out


def _recording_meta(arrays: Mapping[str, np.ndarray], shape: tuple[int, ...], times: Any,
                    spacing: Any, boundaries: Any, units: Mapping[str, str] | None,
                    time_unit: str, system: str, axis_names: tuple[str, str],
                    coordinates: Any, source: str | None) -> DatasetMeta:
    """The metadata of a recording: no dt or steps_per_frame, its own times."""
    n_experiments, n_frames, ny, nx = shape
    frame_times = _times(times, n_frames)
    spacing = tuple(float(h) for h in spacing) if is_pair(tuple(spacing), float) else spacing
    units = dict(units or {})
    unknown = sorted(set(units) - {*arrays, TIME_ARRAY, *axis_names})
    if unknown or not all(isinstance(u, str) for u in units.values()):
        raise DatasetError(f"units: {unknown or units} — units are strings for the fields "
                           f"{list(arrays)}, {TIME_ARRAY!r} or the axes {list(axis_names)}")
    axes = _axes(axis_names, (ny, nx), spacing, coordinates, units)
    provenance = make_provenance()
    if source is not None:
        provenance["source"] = str(source)
    return DatasetMeta(
        system=system, fields=tuple(arrays), grid_shape=(ny, nx), grid_spacing=spacing,
        boundaries=tuple(boundaries), dt=None, steps_per_frame=None, t0=frame_times[0],
        n_frames=n_frames, n_experiments=n_experiments, provenance=provenance,
        time_unit=time_unit or units.get(TIME_ARRAY, ""), axes=axes,
        field_attrs={name: {"units": units[name], "long_name": name}
                     for name in arrays if units.get(name)},
        frame_times=frame_times)


def _times(times: Any, n_frames: int) -> tuple[float, ...]:
    """The observation times: ``n_frames`` finite, increasing numbers."""
    try:
        array = np.asarray(times, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"times: not numbers ({exc})") from None
    if array.shape != (n_frames,):
        raise DatasetError(f"times has shape {array.shape} but the fields have {n_frames} "
                           "frames; give one time per frame")
    if not np.isfinite(array).all() or np.any(np.diff(array) <= 0):
        raise DatasetError(f"times must be finite and increasing, got {_preview(array)}")
    return tuple(float(t) for t in array)


def _axes(names: tuple[str, str], shape: tuple[int, int], spacing: Any, coordinates: Any,
          units: Mapping[str, str]) -> tuple[Axis, Axis] | None:
    """The two axes: names, coordinates (cell centres by default) and units."""
    if not (is_pair(tuple(spacing), float) and all(h > 0 for h in spacing)):
        return None  # DatasetMeta names the bad spacing
    values = coordinates or [[(i + 0.5) * h for i in range(n)]
                             for n, h in zip(shape, spacing, strict=True)]
    if len(values) != 2 or any(len(v) != n for v, n in zip(values, shape, strict=True)):
        raise DatasetError(f"coordinates must give {shape[0]} and {shape[1]} values for the "
                           f"axes {list(names)}")
    return tuple(Axis(name, tuple(float(v) for v in vals), units.get(name, ""), name)
                 for name, vals in zip(names, values, strict=True))


def _preview(array: np.ndarray) -> str:
    """The first few values of ``array``, for a one-line message."""
    head = ", ".join(f"{v:g}" for v in array[:6])
    return f"[{head}{', …' if array.size > 6 else ''}]"


def _check_target(target: Path, overwrite: bool) -> None:
    """Refuse an existing target that is not a pdefit dataset, or one without overwrite."""
    if not (target.exists() or target.is_symlink()):
        return
    if not is_pdefit_dataset(target):
        raise DatasetError(f"refusing to write {os.fspath(target)}: it exists and is not a "
                           "pdefit dataset; choose a new path")
    if not overwrite:
        raise DatasetError(f"{os.fspath(target)} is already a pdefit dataset; pass "
                           "overwrite=True (--overwrite) to replace it")


def _move_into_place(written: Path, target: Path, staging: Path) -> None:
    """Put the complete dataset at ``target``; an old pdefit dataset there goes only once
    the new one is complete (moved aside into ``staging``, removed with it)."""
    replaced = staging / "replaced"
    if target.exists():
        os.replace(target, replaced)
    try:
        os.replace(written, target)
    except OSError:
        if replaced.exists():  # put the old dataset back
            os.replace(replaced, target)
        raise
