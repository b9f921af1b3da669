"""The fitted θ of a finished run on disk (``fitted.npz`` in its run directory): what
``pdefit-evaluate`` reads back and what ``fit.start_from`` starts another fit from.

Keys are ``params/<name>`` (unconstrained, the optimiser's coordinates), ``physical/<name>``
(the same parameters in physical units, so a later fit may use other transforms) and
``fields/<name>`` (fitted initial fields, (n_exp, ny, nx)).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.parallel.processes import host_array

FITTED_FILE = "fitted.npz"
GROUPS = ("params", "physical", "fields")


class FittedFileError(ValueError):
    """A fitted.npz that is missing or does not hold what is asked of it."""


def save_fitted(path: Path, theta: Mapping[str, Any],
                physical: Mapping[str, Any] | None = None) -> None:
    """θ (unconstrained parameters and fitted initial fields) and the parameters' physical
    values as one ``.npz``. Every process must call this (gathering a sharded field is
    collective); only process 0 writes."""
    groups = {"params": theta.get("params", {}), "fields": theta.get("fields", {}),
              "physical": physical or {}}
    arrays = {f"{group}/{name}": host_array(value)
              for group, values in groups.items() for name, value in values.items()}
    if jax.process_index() == 0:
        np.savez(path, **arrays)


def fitted_path(location: Path) -> Path:
    """A run directory's fitted.npz, or ``location`` itself if it is a file."""
    location = Path(location)
    return location / FITTED_FILE if location.is_dir() else location


def read_fitted(location: Path) -> dict[str, dict[str, np.ndarray]]:
    """{group: {name: array}} of a run directory's (or a file's) fitted θ."""
    path = fitted_path(location)
    if not path.exists():
        raise FittedFileError(f"{path} does not exist: only a run whose fit has finished has "
                              f"its fitted values in {FITTED_FILE}")
    out: dict[str, dict[str, np.ndarray]] = {g: {} for g in GROUPS}
    with np.load(path) as stored:
        for key in stored.files:
            group, name = key.split("/", 1)
            out.setdefault(group, {})[name] = np.asarray(stored[key])
    return out


def load_fitted(path: Path, dtype: Any) -> dict[str, dict[str, jnp.ndarray]]:
    """θ = {"params": unconstrained values, "fields": fitted initial fields} as arrays."""
    stored = read_fitted(path)
    return {g: {k: jnp.asarray(v, dtype) for k, v in stored[g].items()}
            for g in ("params", "fields")}
