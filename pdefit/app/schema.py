"""Hydra's schema: a writable twin of every options class of :mod:`pdefit.options` — same
name, fields, types and defaults, not frozen.

OmegaConf marks every node it makes from a frozen dataclass read-only, including the ones it
makes while merging (an optional group such as ``simulate.system``, ``None`` in the schema,
filled in by an experiment), and Hydra composes the YAML and the command line into those
nodes; the twins let it. :func:`pdefit.app.config.to_options` turns a composed config back
into the frozen classes.

The twins are made when this module is imported and live here under their classes' names, so
that a composed config pickles (submitit's launcher sends the task and its config to the
Slurm job) and unpickles in another process.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Any

from pdefit import options as _options


def _twin_of(options: type) -> type:
    """The writable twin of ``options`` (made once, registered in this module)."""
    twin = globals().get(options.__name__)
    if twin is not None and getattr(twin, "__twin_of__", None) is options:
        return twin
    hints = typing.get_type_hints(options)
    fields = [(f.name, _twin_type(hints[f.name]), _twin_default(f))
              for f in dataclasses.fields(options)]
    twin = dataclasses.make_dataclass(options.__name__, fields)
    twin.__module__, twin.__doc__, twin.__twin_of__ = __name__, options.__doc__, options
    globals()[options.__name__] = twin
    return twin


def _twin_type(hint: Any) -> Any:
    """``hint`` with an options class (alone or optional) replaced by its twin."""
    if dataclasses.is_dataclass(hint):
        return _twin_of(hint)
    args = typing.get_args(hint)
    if (typing.get_origin(hint) in (typing.Union, types.UnionType)
            and any(dataclasses.is_dataclass(a) for a in args)):
        return functools.reduce(lambda a, b: a | b, [_twin_type(a) for a in args])
    return hint


def _twin_default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        return dataclasses.field(default_factory=lambda: to_writable(factory()))
    return dataclasses.field(default=f.default)


def writable(options: type) -> type:
    """The registered writable twin of a frozen options class."""
    return _twin_of(options)


def to_writable(value: Any) -> Any:
    """A (nested) frozen options instance as its writable twin; other values as they are."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    return writable(type(value))(**{f.name: to_writable(getattr(value, f.name))
                                    for f in dataclasses.fields(value)})


def to_frozen(value: Any, options: type) -> Any:
    """A (nested) twin instance made by OmegaConf as the frozen ``options`` it mirrors."""
    hints = typing.get_type_hints(options)
    return options(**{f.name: _frozen_value(getattr(value, f.name), hints[f.name])
                      for f in dataclasses.fields(options)})


def _frozen_value(value: Any, hint: Any) -> Any:
    if value is None or not dataclasses.is_dataclass(value):
        return value
    kinds = [hint, *typing.get_args(hint)]
    options = next(k for k in kinds if dataclasses.is_dataclass(k)
                   and writable(k) is type(value))
    return to_frozen(value, options)


for _name, _cls in inspect.getmembers(_options, dataclasses.is_dataclass):
    if _cls.__module__ == _options.__name__:
        _twin_of(_cls)
