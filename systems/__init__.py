"""The physics: one module per PDE system, registered here by name.

A system knows its fields, parameters, right-hand side (or step), stability limit and initial
states; it knows nothing about adjoints, sharding or checkpoints (see :mod:`pdefit.system`).
"""

from __future__ import annotations

from typing import Any

from .aliev_panfilov import AlievPanfilov
from .bocf import BOCF
from .rayleigh_benard import RayleighBenard
from .sphere_ns import SphereNS

REGISTRY: dict[str, type] = {
    AlievPanfilov.name: AlievPanfilov,
    BOCF.name: BOCF,
    RayleighBenard.name: RayleighBenard,
    SphereNS.name: SphereNS,
}


def get_system(name: str, **options: Any) -> Any:
    """The system called ``name``, built with its static ``options``."""
    if name not in REGISTRY:
        raise ValueError(f"unknown system {name!r}; available: {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"bad options {options} for system {name!r}: {err}") from None
