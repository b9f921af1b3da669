"""The one boundary between Hydra and pdefit: the typed options of :mod:`pdefit.options` are
registered as Hydra's schema (so a misspelt key or a value of the wrong type is an error
before anything runs), and a composed config is turned into those frozen dataclasses once,
here, by :func:`to_options`. Nothing below the app layer sees a ``DictConfig``.

Keys that name system parameters or fields (``system.params``, ``fit.start``, ...) are free
dicts in the schema and checked against the chosen system when the fit is assembled
(:mod:`pdefit.fitting.assemble`), which names the offending key.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Sequence
from os import PathLike
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pdefit.options import FitConfig, SimulateMainConfig

# Where the command-line entry points find their configs: the repository's conf/, installed as
# the package pdefit.conf (an editable install maps it back to conf/).
CONF_DIR = "pkg://pdefit.conf"

Options = TypeVar("Options")


@functools.cache
def _writable_class(options: type) -> type:
    """A mutable twin of a frozen options class: same name, fields, types and defaults.
    OmegaConf marks every node it makes from a frozen dataclass read-only, including the ones
    it makes while merging (an optional group such as ``simulate.system``, ``None`` in the
    schema, filled in by an experiment), and Hydra composes the YAML and the command line into
    those nodes; the twins let it. :func:`to_options` turns them back into the frozen class."""
    hints = typing.get_type_hints(options)
    fields = [(f.name, _writable_type(hints[f.name]), _writable_default(f))
              for f in dataclasses.fields(options)]
    twin = dataclasses.make_dataclass(options.__name__, fields)
    twin.__qualname__, twin.__doc__ = options.__qualname__, options.__doc__
    twin.__module__ = options.__module__
    return twin


def _writable_type(hint: Any) -> Any:
    """``hint`` with an options class (alone or optional) replaced by its twin."""
    if dataclasses.is_dataclass(hint):
        return _writable_class(hint)
    args = typing.get_args(hint)
    if (typing.get_origin(hint) in (typing.Union, types.UnionType)
            and any(dataclasses.is_dataclass(a) for a in args)):
        return functools.reduce(lambda a, b: a | b, [_writable_type(a) for a in args])
    return hint


def _writable_default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        return dataclasses.field(default_factory=lambda: _to_writable(factory()))
    return dataclasses.field(default=f.default)


def _to_writable(value: Any) -> Any:
    """A (nested) frozen options instance as its writable twin; other values as they are."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    twin = _writable_class(type(value))
    return twin(**{f.name: _to_writable(getattr(value, f.name))
                   for f in dataclasses.fields(value)})


def _to_frozen(value: Any, options: type) -> Any:
    """A (nested) twin instance made by OmegaConf as the frozen ``options`` it mirrors."""
    hints = typing.get_type_hints(options)
    return options(**{f.name: _frozen_value(getattr(value, f.name), hints[f.name])
                      for f in dataclasses.fields(options)})


def _frozen_value(value: Any, hint: Any) -> Any:
    if value is None or not dataclasses.is_dataclass(value):
        return value
    kinds = [hint, *typing.get_args(hint)]
    options = next(k for k in kinds if dataclasses.is_dataclass(k)
                   and _writable_class(k) is type(value))
    return _to_frozen(value, options)


def schema(options: type) -> DictConfig:
    """The structured config of a frozen options class (through its writable twin), for
    composition."""
    return OmegaConf.structured(_writable_class(options))


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="fit_schema", node=schema(FitConfig))
    store.store(name="simulate_schema", node=schema(SimulateMainConfig))


def to_options(cfg: DictConfig, options: type[Options] = FitConfig) -> Options:  # type: ignore[assignment]
    """The frozen typed options of a composed config (interpolations resolved); ``cfg`` may
    be a plain mapping too. Keys the schema does not know are an error naming the key."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)
    merged = OmegaConf.merge(schema(options), node)
    OmegaConf.resolve(merged)
    return _to_frozen(OmegaConf.to_object(merged), options)


def as_options(cfg: Any, options: type[Options] = FitConfig) -> Options:  # type: ignore[assignment]
    """``cfg`` as typed options: a composed config (a test's, a script's) is converted by
    :func:`to_options`; typed options are returned as they are."""
    return cfg if isinstance(cfg, options) else to_options(cfg, options)


def load_options(path: str | PathLike, overrides: Sequence[str] = ()) -> FitConfig:
    """A run's saved ``config.yaml`` with dotted ``key=value`` overrides, as typed options."""
    cfg = OmegaConf.merge(schema(FitConfig), OmegaConf.load(path))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return to_options(cfg)


def plain(options: Any) -> Any:
    """Typed options (or a config) as plain dicts and lists, for JSON, YAML and comparison."""
    node = options if OmegaConf.is_config(options) else OmegaConf.structured(options)
    return OmegaConf.to_container(node, resolve=True)


def to_yaml(options: Any) -> str:
    """Typed options as the YAML a run directory keeps (``config.yaml``)."""
    return OmegaConf.to_yaml(plain(options))
