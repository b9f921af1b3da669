"""When frames were observed: the checks of a dataset's observation times (a recording's own
times, or a simulation's ``t0 + k * steps_per_frame * dt``) and their spacing.

A recording's times need not be evenly spaced; what needs one frame interval asks
:func:`uniform_interval`, which says clearly when there is none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pdefit.data.checks import DatasetError, is_real

__all__ = ["frame_time_problems", "is_uniform", "uniform_interval"]

# Evenly spaced: every interval within this fraction of the mean interval.
UNIFORM_RTOL = 1e-6


def is_uniform(times: np.ndarray) -> bool:
    """Whether ``times`` are evenly spaced (fewer than three always are)."""
    if len(times) < 3:
        return True
    steps = np.diff(np.asarray(times, np.float64))
    return bool(np.allclose(steps, steps.mean(), rtol=UNIFORM_RTOL, atol=0.0))


def uniform_interval(times: np.ndarray) -> float:
    """The one interval between evenly spaced ``times``; DatasetError where there is none
    (a single frame, or uneven times)."""
    if len(times) < 2:
        raise DatasetError("a dataset of one frame has no frame interval")
    if not is_uniform(times):
        steps = np.diff(times)
        raise DatasetError(
            f"the dataset's frames are not evenly spaced in time (intervals from "
            f"{steps.min():g} to {steps.max():g}), so it has no single frame interval")
    return float((times[-1] - times[0]) / (len(times) - 1))


def frame_time_problems(times: Sequence[float] | None, n_frames: int, t0: float,
                        dt: float | None, steps_per_frame: int | None) -> list[str]:
    """Inconsistencies of observation ``times`` with the frame count, ``t0`` and, where
    given, the simulation's stepping (empty when consistent)."""
    if times is None:
        if dt is None or steps_per_frame is None:
            return ["frame_times (the observation times) are required when dt or "
                    "steps_per_frame is None"]
        return []
    if not (isinstance(times, tuple) and all(is_real(t) and math.isfinite(t) for t in times)):
        return [f"frame_times must be finite floats, got {times!r}"]
    if len(times) != n_frames:
        return [f"frame_times has {len(times)} times for n_frames={n_frames}"]
    if not times:
        return []
    array = np.asarray(times, np.float64)
    if np.any(np.diff(array) <= 0):
        k = int(np.argmax(np.diff(array) <= 0))
        return [f"frame_times must increase, but frame {k + 1} at {times[k + 1]} follows "
                f"frame {k} at {times[k]}"]
    scale = max(abs(times[-1] - times[0]), abs(times[0]), 1e-300)
    if abs(times[0] - t0) > 1e-9 * scale:
        return [f"t0={t0} differs from the first frame time {times[0]}"]
    if dt is not None and steps_per_frame is not None:
        derived = t0 + np.arange(n_frames) * (steps_per_frame * dt)
        if not np.allclose(array, derived, rtol=1e-9, atol=1e-9 * scale):
            return [f"frame_times disagree with t0 + k * steps_per_frame * dt (t0={t0}, "
                    f"dt={dt}, steps_per_frame={steps_per_frame})"]
    return []
