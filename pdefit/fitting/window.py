"""The training window of a dataset, read onto the fit's devices: which frames and
experiments (:class:`Window`), the reader that places them and records every read
(:class:`Reader`), the checks of what was read (shards missing on disk, NaN/Inf at observed
points, how much of the window a mask leaves) and the state fields a system derives from the
observed first frames. Used by :func:`pdefit.fitting.assemble.build_fit`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit import data as zd
from pdefit.fitting.observe import observable_names
from pdefit.model.system import System
from pdefit.numerics.grid import Grid
from pdefit.parallel.processes import dataset_array, host_scalar

log = logging.getLogger("pdefit")


class Window(NamedTuple):
    """The training window: which frames and experiments, and the model steps they fall on."""

    frames: list[int]  # dataset frame indices
    experiments: list[int]  # dataset experiment indices
    frame_steps: list[int]  # the model step of each frame, the first at step 0
    n_steps: int  # model steps from the first frame to the last


@dataclass(frozen=True)
class Reader:
    """Reads a field (or its mask) over the window onto the fit's devices (``placement``);
    every window read is recorded in ``reads``."""

    ds: zd.Dataset
    window: Window
    placement: Any
    dtype: Any
    reads: list

    def frames(self, name: str, stride: int = 1, mask: bool = False, first: bool = False,
               ) -> jax.Array:
        """``(experiment, frame, y, x)`` of ``name`` (its mask with ``mask``): every frame of
        the window, or its first only with ``first``."""
        frames = self.window.frames[:1] if first else self.window.frames
        if mask:
            return dataset_array(self.ds, name, self.window.experiments, frames, stride,
                                 self.placement, mask=True, reads=self.reads)
        return dataset_array(self.ds, name, self.window.experiments, frames, stride,
                             self.placement, dtype=np.dtype(self.dtype), reads=self.reads)

    def first_frame(self, name: str, mask: bool = False) -> jax.Array:
        """``(experiment, y, x)`` of the window's first frame of ``name`` (or of its mask)."""
        return _first_frame(self.frames(name, 1, mask=mask, first=True))


@jax.jit
def _first_frame(frames):
    return frames[:, 0]


@jax.jit
def all_finite(x):
    return jnp.all(jnp.isfinite(x))


@jax.jit
def _finite_and(values, mask):
    finite = jnp.isfinite(values)
    return finite if mask is None else finite & mask


@jax.jit
def _non_finite_observed(values, mask):
    bad = ~jnp.isfinite(values)
    if mask is not None:
        bad = bad & mask
    return jnp.sum(bad), jnp.argmax(bad.reshape(-1))


def _check_finite(ds: zd.Dataset, name: str, values, mask) -> None:
    count, first = _non_finite_observed(values, mask)
    count = int(host_scalar(count))
    if count:
        where = np.unravel_index(int(host_scalar(first)), values.shape)
        raise zd.DatasetError(
            f"dataset {ds.path} field {name!r}: {count} NaN/Inf value(s) at observed points, "
            f"first at (experiment, frame, y, x) = {tuple(int(i) for i in where)} of the "
            "selection; mask them or use observe.nan=mask to treat NaN as missing")


def _check_missing(ds: zd.Dataset, name: str, experiments: list[int], frames: list[int],
                   policy: str) -> None:
    """Frames whose shard files are gone are missing data, not NaN: an error, or with
    ``observe.nan=mask`` unobserved frames, said so."""
    missing = ds.missing_frames(name, experiments, frames)
    if not missing:
        return
    listed = "; ".join(f"experiment {e}: frame(s) {zd.index_ranges(f)}"
                       for e, f in missing.items())
    count = sum(len(f) for f in missing.values())
    if policy != "mask":
        raise zd.DatasetError(
            f"dataset {ds.path} field {name!r}: missing data — {count} frame(s) of the "
            f"selection are not on disk (shard files deleted or never written): {listed}. "
            "Re-create or copy the dataset again, choose other data.frames, or use "
            "observe.nan=mask to fit without them")
    log.warning(
        f"dataset {ds.path} field {name!r}: {count} frame(s) are missing on disk ({listed}); "
        "observe.nan=mask: they are treated as unobserved")


@jax.jit
def _mask_counts(mask):
    observed_per_frame = jnp.sum(mask, axis=(2, 3))
    return jnp.sum(mask), mask.size, jnp.sum(observed_per_frame == 0), observed_per_frame.size


def _report_masked(ds: zd.Dataset, name: str, mask) -> None:
    """With ``observe.nan=mask``: how much of the window is unobserved, and an error when a
    field has no data in it at all (the fit would see nothing of it)."""
    observed, total, empty, frames = (int(host_scalar(x)) for x in _mask_counts(mask))
    if observed == 0:
        raise zd.DatasetError(
            f"dataset {ds.path} field {name!r}: no observed (finite, unmasked) value in the "
            "training window; choose other data.frames or data.experiments, or drop it "
            "from observe.fields")
    if observed < total:
        log.warning(
            f"observe.nan=mask: field {name!r}: {total - observed} of {total} points masked "
            f"({empty} of {frames} frames have no data)")


def read_observed(reader: Reader, fields: Sequence[str], stride: int, nan: str,
                  ) -> tuple[dict[str, jax.Array], dict[str, jax.Array | None]]:
    """The observed ``fields`` over the window, with ``stride``, and their masks (None: all
    observed), checked as ``observe.nan`` (``nan``) says: NaN/Inf at an observed point is an
    error, or (``mask``) marks the point unobserved."""
    values, masks = {}, {}
    for name in fields:
        _check_missing(reader.ds, name, reader.window.experiments, reader.window.frames, nan)
        v = reader.frames(name, stride)
        m = reader.frames(name, stride, mask=True) if reader.ds.has_mask(name) else None
        if nan == "mask":
            m = _finite_and(v, m)
            _report_masked(reader.ds, name, m)
        else:
            _check_finite(reader.ds, name, v, m)
        values[name], masks[name] = v, m
    return values, masks


def state_from_first_frames(system: System, grid: Grid, reader: Reader, data_fields: Any,
                            ) -> dict[str, Any]:
    """State fields the system derives from the observed first frames (e.g. a vorticity from
    a velocity), for fields the dataset does not hold; empty if it cannot."""
    derive = getattr(system, "state_from_observables", None)
    names = observable_names(system, grid)
    if derive is None or not names or any(n not in data_fields for n in names):
        return {}
    if all(f in data_fields for f in system.fields):
        return {}
    first = {}
    for n in names:
        values = reader.first_frame(n)
        if reader.ds.has_mask(n):
            # Unobserved points carry no information: zero, not whatever the file holds.
            mask = reader.first_frame(n, mask=True)
            values = jnp.where(mask, values, 0.0)
        first[n] = jnp.where(jnp.isfinite(values), values, 0.0)
    derived = jax.jit(derive)(first)
    return {f: jnp.asarray(v, reader.dtype) for f, v in derived.items() if f not in data_fields}
