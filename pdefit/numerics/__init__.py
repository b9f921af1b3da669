"""Numerics: the discretization a system is written in — the global grid and its boundaries,
finite-difference stencils, spherical-harmonic transforms and the fixed-step integrators.

Owns: ``grid``, ``stencils``, ``spherical``, ``integrate``. Imports nothing of pdefit: it is
the ground floor that systems (``pdefit.systems`` and the user's own) and the engine stand on.
"""
