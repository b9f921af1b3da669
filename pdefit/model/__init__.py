"""The model's contract: what a PDE system declares (:class:`~pdefit.model.system.System`:
fields, parameters, ``rhs``/``step``, stability limit, initial states), how it is found by
name (built-in, import path or entry point) and how a parameter is specified
(:class:`~pdefit.model.params.ParamSpec`: default, unit, bounds, transform) and laid out in a
fit's parameter vector.

Owns: ``system``, ``params``. Imports :mod:`pdefit.numerics` only (and ``pdefit.systems`` by
name, at run time, for the registry). Systems import this package and the numerics; nothing
here knows about adjoints, sharding, data or checkpoints.
"""
