"""The error of the dataset format and the value checks all its parts share.

:class:`DatasetError` is raised by the metadata (:mod:`pdefit.data.schema`), the noise
descriptions (:mod:`pdefit.data.noise`), the writers and the reader alike; ``is_int``,
``is_real`` and ``is_pair`` are the type checks behind their messages.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["DatasetError", "PathLike", "is_int", "is_pair", "is_real"]

PathLike = str | os.PathLike[str]


class DatasetError(ValueError):
    """A dataset is missing, malformed, or does not match what the caller asked for."""


def is_int(value: object) -> bool:
    # bool is an int subclass, but True frames is certainly a bug.
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    return is_int(value) or isinstance(value, float | np.floating)


def is_pair(value: object, kind: type) -> bool:
    check = {int: is_int, float: is_real}.get(kind, lambda v: isinstance(v, kind))
    return isinstance(value, tuple) and len(value) == 2 and all(check(v) for v in value)
