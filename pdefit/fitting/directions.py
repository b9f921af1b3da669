"""Which fitted parameters get no interval, and why: the curvature's near-singular directions.

The curvature B of the intervals (:mod:`pdefit.fitting.uncertainty`) is scaled to unit diagonal
and decomposed: an eigenvalue below ``rcond`` × the largest marks a direction the data do not
determine, and the parameters with a large share in it (squared component ≥ :data:`SHARE`) get
no interval, flagged as not determined. A Gauss–Newton curvature is positive semi-definite, so
an eigenvalue below −:data:`INDEFINITE` × the largest is no such direction but a curvature
computed wrong; its parameters, and those whose std error the fields' block solves left
bracketed wider than :data:`pdefit.fitting.marginal.SPREAD`, are flagged as unknown, with a note.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

SHARE = 0.1  # squared eigenvector component above which a parameter is named in a direction
NOT_DETERMINED = "not determined by the data"
# A Gauss–Newton curvature is positive semi-definite: a scaled eigenvalue below −INDEFINITE
# of the largest is one computed wrong, not a flat direction of the data.
INDEFINITE = 1e-3
UNRESOLVED = "unknown: its curvature was not resolved (see the note)"


def near_singular(bread: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Eigen-decomposition of ``bread`` scaled to unit diagonal (a zero diagonal, a parameter
    the data never see, stays zero): (scaling d, eigenvalues, eigenvectors, condition number);
    B = diag(1/d) · V Λ Vᵀ · diag(1/d)."""
    diagonal = np.diag(bread).copy()
    d = np.where(diagonal > 0, 1.0 / np.sqrt(np.where(diagonal > 0, diagonal, 1.0)), 1.0)
    scaled = d[:, None] * bread * d[None, :]
    values, vectors = np.linalg.eigh(0.5 * (scaled + scaled.T))
    low, top = float(values.min()), float(values.max())
    return d, values, vectors, top / low if low > 0 else math.inf


def pseudo_inverse(bread: np.ndarray, rcond: float,
                   ) -> tuple[np.ndarray, list[np.ndarray], float, np.ndarray]:
    """(B⁺, near-singular directions as unit vectors, condition number, the relative
    eigenvalue of each direction); B⁺ leaves out the directions with a relative eigenvalue
    below ``rcond``."""
    d, values, vectors, condition = near_singular(bread)
    top = max(float(values.max()), 0.0)
    keep = values > rcond * top if top > 0 else np.zeros_like(values, bool)
    inverse_scaled = (vectors[:, keep] / values[keep]) @ vectors[:, keep].T
    directions = [vectors[:, i] for i in np.flatnonzero(~keep)]
    ratios = values[~keep] / top if top > 0 else np.zeros(int((~keep).sum()))
    return d[:, None] * inverse_scaled * d[None, :], directions, condition, ratios


def default_rcond(dtype: Any) -> float:
    """Relative eigenvalue below which a direction counts as undetermined: 1e-10, or more where
    the curvature's own rounding (float32) is larger."""
    return max(1e-10, 1e3 * float(jnp.finfo(dtype).eps))


def unresolved_flags(named: Sequence[Mapping[str, Any]], lost: Sequence[str],
                     ) -> tuple[dict[str, str], str | None]:
    """(name → flag of each parameter without an interval, the note): those in near-singular
    ``named`` directions are not determined, unless the curvature is indefinite there or
    their curvature was ``lost`` in the solves' error: then it is unknown."""
    wrong = [d for d in named if d["relative_eigenvalue"] < -INDEFINITE]
    unknown = set(lost) | {n for d in wrong for n in d["parameters"]}
    flags = {n: NOT_DETERMINED for d in named for n in d["parameters"]}
    flags.update(dict.fromkeys(unknown, UNRESOLVED))
    if not unknown:
        return flags, None
    lowest = min([d["relative_eigenvalue"] for d in wrong], default=None)
    return flags, (f"no interval for {sorted(unknown)}: their curvature was not computed to "
                   "any accuracy" + ("" if lowest is None else
                                     f" (indefinite: relative eigenvalue {lowest:.2g})")
                   + ("; with the initial fields fitted, the fields' block solves stopped at "
                      "their cap before they bracket the std error (std_error_bounds: where it "
                      "lies)" if lost else ""))
