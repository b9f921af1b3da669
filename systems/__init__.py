"""The physics: one module per PDE system; the built-in ones are registered here by name.
Installed as ``pdefit.systems``. Systems of other packages need no registration: name them by
import path or entry point (:func:`pdefit.model.system.system_class`).

A system knows its fields, parameters, right-hand side (or step), stability limit and initial
states; it knows nothing about adjoints, sharding or checkpoints (see :mod:`pdefit.model.system`).
"""

from __future__ import annotations

from pdefit.model.system import get_system  # built-in, import-path and entry-point names

from .aliev_panfilov import AlievPanfilov
from .bocf import BOCF
from .rayleigh_benard import RayleighBenard
from .sphere_ns import SphereNS

__all__ = ["BOCF", "REGISTRY", "AlievPanfilov", "RayleighBenard", "SphereNS", "get_system"]

REGISTRY: dict[str, type] = {
    AlievPanfilov.name: AlievPanfilov,
    BOCF.name: BOCF,
    RayleighBenard.name: RayleighBenard,
    SphereNS.name: SphereNS,
}

