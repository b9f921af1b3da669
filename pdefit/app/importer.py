"""``pdefit-import``: a user's recording in — NumPy (``.npy``, ``.npz``) or any file xarray
reads (netCDF, Zarr) — written as a pdefit dataset by :func:`pdefit.data.write_recording`:
frames, observation times, grid spacing, boundaries and units, masks where values are
missing; no model time step (the fit chooses its own).

Plain argparse, no Hydra: it reads files, not a fit configuration. Bad input (a missing
option, mismatched shapes, a path that is not a pdefit dataset) prints one line and exits 2.

    pdefit-import INPUT OUTPUT [--field u] [--variable name=field ...]
                  [--time-step 0.5 | --times-from VAR] [--spacing 0.025 0.025]
                  [--boundaries neumann neumann] [--units u=mV ...] [--time-unit ms]
                  [--mask-nan] [--system NAME] [--overwrite]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from pdefit.data import (
    DEFAULT_AXIS_NAMES,
    MASK_PREFIX,
    DatasetError,
    open_dataset,
    write_recording,
)

__all__ = ["Recording", "import_recording", "main", "read_recording"]

TIME_NAMES = ("time", "t")  # arrays or dimensions taken as the observation times


class InputError(ValueError):
    """Input the importer cannot turn into a dataset (reported as one line, exit 2)."""


@dataclass(frozen=True)
class Recording:
    """What was read: fields ``(…, n_frames, ny, nx)``, masks, times (None: not in the
    file), and what the file says of the grid and units."""

    fields: dict[str, np.ndarray]
    masks: dict[str, np.ndarray] = field(default_factory=dict)
    times: np.ndarray | None = None
    spacing: tuple[float, float] | None = None
    axis_names: tuple[str, str] = DEFAULT_AXIS_NAMES
    coordinates: tuple[np.ndarray, np.ndarray] | None = None
    units: dict[str, str] = field(default_factory=dict)
    time_unit: str = ""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (exit 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pdefit-import", description=(
        "Write a recording (.npy, .npz, or a netCDF/Zarr file read by xarray) as a pdefit "
        "dataset: frames, observation times, grid spacing and units; NaN = unobserved."))
    p.add_argument("input", help="a .npy, .npz, netCDF (.nc) or Zarr file")
    p.add_argument("output", help="the pdefit dataset to write (a new path)")
    p.add_argument("--field", help="the field name of a .npy array; for other files, import "
                   "only this variable")
    p.add_argument("--variable", action="append", default=[], metavar="NAME=FIELD",
                   help="import variable NAME as field FIELD (repeatable; only these)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--time-step", type=float, help="time between frames (frame k at k·step)")
    when.add_argument("--times-from", metavar="VAR", help="the array or coordinate holding the "
                      "observation times (default: 'time' or 't' when present)")
    p.add_argument("--spacing", type=float, nargs=2, metavar=("DY", "DX"),
                   help="grid spacing (default: from the file's coordinates, else 1 1)")
    p.add_argument("--boundaries", nargs=2, default=["neumann", "neumann"], metavar=("Y", "X"),
                   help="the boundary condition of each axis (default: neumann neumann)")
    p.add_argument("--units", action="append", default=[], metavar="NAME=UNIT",
                   help="unit of a field, of time or of an axis (repeatable)")
    p.add_argument("--time-unit", default=None, help="unit of the times (e.g. ms)")
    p.add_argument("--mask-nan", action="store_true",
                   help="NaN values are unobserved points (masked); without it NaN is refused")
    p.add_argument("--system", default="", help="the system that made the data (default: none)")
    p.add_argument("--noise-sigma", action="append", default=[], metavar="SIGMA|FIELD=SIGMA",
                   help="the recording's additive noise level, recorded in the dataset: one "
                        "number for every field, or FIELD=SIGMA per field (repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUTPUT if it is a pdefit dataset (never anything else)")
    return p


def _pairs(items: Sequence[str], option: str) -> dict[str, str]:
    """``["a=b", …]`` as a dict; one-line error naming ``option`` otherwise."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InputError(f"{option} {item!r}: expected NAME=VALUE")
        out[key] = value
    return out


# -- reading ----------------------------------------------------------------------------------


def read_recording(path: Path, args: argparse.Namespace) -> Recording:
    """The recording in ``path``, by its kind: ``.npy``, ``.npz`` or anything xarray reads."""
    if not path.exists():
        raise InputError(f"{path} does not exist")
    if path.suffix == ".npy":
        return _read_npy(path, args)
    if path.suffix == ".npz":
        return _read_npz(path, args)
    return _read_xarray(path, args)


def _read_npy(path: Path, args: argparse.Namespace) -> Recording:
    if not args.field:
        raise InputError(f"{path.name}: a .npy file holds one array; name its field with "
                           "--field NAME")
    if args.time_step is None:
        raise InputError(f"{path.name}: a .npy file holds no times; give --time-step")
    return Recording(fields={args.field: _load_npy(path)})


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable NumPy file ({exc})") from None


def _selection(names: Sequence[str], args: argparse.Namespace) -> dict[str, str]:
    """Source variable → field name: ``--variable``/``--field``, else every name given."""
    chosen = _pairs(args.variable, "--variable")
    if args.field:
        chosen.setdefault(args.field, args.field)
    missing = [n for n in chosen if n not in names]
    if missing:
        raise InputError(f"variable(s) {missing} not in the input; it has {sorted(names)}")
    return chosen or {n: n for n in names}


def _read_npz(path: Path, args: argparse.Namespace) -> Recording:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable .npz archive ({exc})") from None
    time_name = args.times_from or next((n for n in TIME_NAMES if n in arrays), None)
    if args.times_from and args.times_from not in arrays:
        raise InputError(f"--times-from {args.times_from}: no such array; the archive has "
                           f"{sorted(arrays)}")
    candidates = [n for n in arrays if n != time_name and not n.startswith(MASK_PREFIX)]
    chosen = _selection(candidates, args)
    masks = {chosen[n[len(MASK_PREFIX):]]: arrays[n] for n in arrays
             if n.startswith(MASK_PREFIX) and n[len(MASK_PREFIX):] in chosen}
    times = arrays[time_name] if time_name is not None else None
    return Recording(fields={chosen[n]: arrays[n] for n in chosen}, masks=masks, times=times)


def _open_xarray(path: Path) -> Any:
    """The file as an xarray Dataset; one line saying what to install if xarray (or a
    netCDF engine) is missing."""
    try:
        import xarray as xr
    except ImportError:
        raise InputError("reading netCDF or Zarr needs xarray: pip install xarray (or "
                         "pdefit[io]; for netCDF4/HDF5 files also netCDF4 or h5netcdf)") from None
    try:
        if path.is_dir() or path.suffix == ".zarr":
            with warnings.catch_warnings():  # consolidated metadata or not: either is fine
                warnings.simplefilter("ignore", RuntimeWarning)
                return xr.open_zarr(path, consolidated=None)
        return xr.open_dataset(path)
    except (ValueError, ImportError) as exc:
        raise InputError(f"{path}: xarray cannot read it ({exc}); for netCDF4/HDF5 files "
                           "pip install netCDF4 or h5netcdf (netCDF3 reads with scipy)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc})") from None


def _read_xarray(path: Path, args: argparse.Namespace) -> Recording:
    """Fields, masks, times, axes and units of an xarray-readable file."""
    ds = _open_xarray(path)
    if args.times_from and args.times_from not in ds.variables:
        raise InputError(f"--times-from {args.times_from}: no such variable or coordinate; "
                       f"the file has {sorted(map(str, ds.variables))}")
    time_name = args.times_from or next(
        (n for n in TIME_NAMES if n in ds.variables or n in ds.dims), None)
    time_dim = (ds[time_name].dims[0] if time_name in ds.variables and ds[time_name].ndim == 1
                else time_name)
    candidates = [str(n) for n, v in ds.data_vars.items()
                  if v.ndim in (3, 4) and not str(n).startswith(MASK_PREFIX)]
    if not candidates:
        raise InputError(f"{path}: no variable with dimensions (time, y, x) or "
                           "(experiment, time, y, x)")
    chosen = _selection(candidates, args)
    first = ds[next(iter(chosen))]
    ydim, xdim = [d for d in first.dims if d != time_dim][-2:]
    order = [*(d for d in first.dims if d not in (time_dim, ydim, xdim)), time_dim, ydim, xdim]
    if time_dim is None or time_dim not in first.dims:
        order = list(first.dims)  # no time dimension named: frames along the third-last axis
    fields = {chosen[n]: _ordered(ds[n], order, n) for n in chosen}
    masks = {chosen[n]: _ordered(ds[MASK_PREFIX + n], order, n).astype(bool) for n in chosen
             if MASK_PREFIX + n in ds.variables}
    units = {chosen[n]: str(ds[n].attrs["units"]) for n in chosen if ds[n].attrs.get("units")}
    times, time_unit = _xarray_times(ds, time_name)
    spacing, coordinates, names = _xarray_axes(ds, ydim, xdim, units)
    return Recording(fields=fields, masks=masks, times=times, spacing=spacing,
                     axis_names=names, coordinates=coordinates, units=units,
                     time_unit=time_unit)


def _ordered(variable: Any, order: Sequence[str], name: str) -> np.ndarray:
    if set(variable.dims) != set(order):
        raise InputError(f"variable {name!r} has dimensions {list(variable.dims)}, the "
                           f"first one chosen has {list(order)}; import them separately")
    return np.asarray(variable.transpose(*order).values)


def _xarray_times(ds: Any, name: str | None) -> tuple[np.ndarray | None, str]:
    """The times (seconds since the first for dates) and their unit, if the file has them."""
    if name is None or name not in ds.variables:
        return None, ""
    values = np.asarray(ds[name].values)
    if np.issubdtype(values.dtype, np.datetime64):
        return (values - values[0]) / np.timedelta64(1, "s"), "s"
    if np.issubdtype(values.dtype, np.timedelta64):
        return values / np.timedelta64(1, "s"), "s"
    return values.astype(np.float64), str(ds[name].attrs.get("units", ""))


def _xarray_axes(ds: Any, ydim: str, xdim: str, units: dict[str, str],
                 ) -> tuple[tuple[float, float] | None, Any, tuple[str, str]]:
    """Spacing and coordinates of the two spatial dimensions where the file has them (the
    spacing must then be uniform), and the axis names (the file's, when usable)."""
    names = tuple(str(d) if str(d).isidentifier() and str(d) not in (*TIME_NAMES,
                  "experiment") else default for d, default in
                  zip((ydim, xdim), DEFAULT_AXIS_NAMES, strict=True))
    if names[0] == names[1]:
        names = DEFAULT_AXIS_NAMES
    if not all(d in ds.coords for d in (ydim, xdim)):
        return None, None, names
    coords = [np.asarray(ds[d].values, np.float64) for d in (ydim, xdim)]
    spacing = []
    for dim, values in zip((ydim, xdim), coords, strict=True):
        steps = np.diff(values)
        if values.size < 2 or not np.allclose(steps, steps[0], rtol=1e-6):
            raise InputError(f"coordinate {dim!r} is not evenly spaced; give --spacing")
        spacing.append(abs(float(steps.mean())))
        if ds[dim].attrs.get("units"):
            units.setdefault(names[len(spacing) - 1], str(ds[dim].attrs["units"]))
    return (spacing[0], spacing[1]), (coords[0], coords[1]), names


# -- writing ----------------------------------------------------------------------------------


def import_recording(args: argparse.Namespace) -> Path:
    """Read ``args.input`` and write it as a pdefit dataset at ``args.output``."""
    source = Path(args.input)
    rec = read_recording(source, args)
    fields = {name: np.asarray(values, np.float64) for name, values in rec.fields.items()}
    if not args.mask_nan:
        for name, values in fields.items():
            if np.isnan(values).any():
                raise InputError(f"field {name!r} has {int(np.isnan(values).sum())} NaN "
                                   "values; pass --mask-nan to treat them as unobserved points")
    n_frames = _frame_count(fields)
    times = _times(rec.times, args.time_step, n_frames, source)
    units = {**rec.units, **_pairs(args.units, "--units")}
    spacing = tuple(args.spacing) if args.spacing else rec.spacing or (1.0, 1.0)
    coordinates = rec.coordinates if not args.spacing else None
    return write_recording(
        args.output, fields, times, spacing=spacing, boundaries=tuple(args.boundaries),
        masks=rec.masks or None, units=units, time_unit=args.time_unit or rec.time_unit,
        system=args.system, overwrite=args.overwrite, axis_names=rec.axis_names,
        coordinates=coordinates, source=str(source.resolve()),
        noise_sigma=_noise_sigma(args.noise_sigma))


def _noise_sigma(items: Sequence[str]) -> float | dict[str, float] | None:
    """``--noise-sigma``: None, one level, or field → level."""
    if not items:
        return None
    per_field = [i for i in items if "=" in i]
    if per_field and len(per_field) != len(items):
        raise InputError(f"--noise-sigma: give one number or FIELD=SIGMA per field, not both "
                         f"(got {list(items)})")
    if not per_field and len(items) > 1:
        raise InputError(f"--noise-sigma: one number for every field, got {list(items)}")
    pairs = _pairs(items, "--noise-sigma") if per_field else {}
    try:
        if not per_field:
            return float(items[0])
        return {name: float(value) for name, value in pairs.items()}
    except ValueError:
        raise InputError(f"--noise-sigma: not a number in {list(items)}") from None


def _frame_count(fields: Mapping[str, np.ndarray]) -> int:
    """The number of frames: the third-last axis of the first field (shapes are checked by
    the writer, which names a mismatched field)."""
    name, values = next(iter(fields.items()))
    if values.ndim not in (3, 4):
        raise InputError(f"field {name!r} has shape {values.shape}; expected (n_frames, ny, "
                           "nx) or (n_experiments, n_frames, ny, nx)")
    return values.shape[-3]


def _times(stored: np.ndarray | None, step: float | None, n_frames: int,
           source: Path) -> np.ndarray:
    """``--time-step`` times, else the file's, else an error saying what to give."""
    if step is not None:
        if not step > 0:
            raise InputError(f"--time-step must be positive, got {step}")
        return step * np.arange(n_frames, dtype=np.float64)
    if stored is None:
        raise InputError(f"{source.name} holds no times ('time' or 't'); give --time-step "
                           "or --times-from VAR")
    return np.asarray(stored, np.float64).reshape(-1)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: import, print where the dataset went, exit 2 on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        path = import_recording(args)
    except (InputError, DatasetError, ValueError) as exc:
        parser.exit(2, f"pdefit-import: error: {' '.join(str(exc).split())}\n")
    except OSError as exc:
        parser.exit(2, f"pdefit-import: error: {exc.strerror or exc}: {exc.filename}\n")
    print(f"pdefit-import: wrote {path}: {_contents(path)}")


def _contents(path: Path) -> str:
    """What the new dataset holds, in one line: fields, frames and times, grid, masks."""
    dataset = open_dataset(path)
    meta, times = dataset.meta, dataset.meta.times
    masked = sorted(dataset.masked_fields)
    unit = f" {meta.time_unit}" if meta.time_unit else ""
    return (f"fields {list(meta.fields)}, {meta.n_experiments} experiment(s) × {meta.n_frames} "
            f"frames at t = {times[0]:g} … {times[-1]:g}{unit}, grid {list(meta.grid_shape)} "
            f"spacing {list(meta.grid_spacing)} {list(meta.boundaries)}"
            + (f", masks for {masked}" if masked else ""))


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
