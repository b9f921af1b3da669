"""The one boundary between Hydra and pdefit: the typed options of :mod:`pdefit.options` are
registered as Hydra's schema (so a misspelt key or a value of the wrong type is an error
before anything runs), and a composed config is turned into those frozen dataclasses once,
here, by :func:`to_options`. Nothing below the app layer sees a ``DictConfig``.

A key the schema does not know is refused with the closest valid one, with or without
Hydra's ``+`` (which adds a key Hydra's own check would refuse). Keys that name system
parameters or fields (``system.params``, ``fit.start``, ...) are free dicts in the schema and
checked against the chosen system before anything runs (:mod:`pdefit.app.validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, ValidationError

from pdefit.app.schema import to_frozen, writable
from pdefit.options import ConfigError, FitConfig, SimulateMainConfig

# Where the command-line entry points find their configs: the repository's conf/, installed as
# the package pdefit.conf (an editable install maps it back to conf/).
CONF_DIR = "pkg://pdefit.conf"

Options = TypeVar("Options")


def schema(options: type) -> DictConfig:
    """The structured config of a frozen options class (through its writable twin,
    :mod:`pdefit.app.schema`), for composition."""
    return OmegaConf.structured(writable(options))


def register_configs() -> None:
    _register_required()
    store = ConfigStore.instance()
    store.store(name="fit_schema", node=schema(FitConfig))
    store.store(name="simulate_schema", node=schema(SimulateMainConfig))


def to_options(cfg: DictConfig, options: type[Options] = FitConfig) -> Options:  # type: ignore[assignment]
    """The frozen typed options of a composed config (interpolations resolved); ``cfg`` may
    be a plain mapping too. Keys the schema does not know are an error naming the key."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)
    refuse_unknown_keys(node, options)
    merged = OmegaConf.merge(schema(options), node)
    try:
        OmegaConf.resolve(merged)
    except InterpolationResolutionError as err:
        raised = raised_by_resolver(err)  # a required key (pdefit.required)
        if raised is not None:
            raise raised from None
        raise
    return to_frozen(OmegaConf.to_object(merged), options)


# -- unknown keys ---------------------------------------------------------------------------


def _options_class(hint: Any) -> type | None:
    """The options dataclass a field's type names (alone or optional), else None."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return classes[0] if classes else None
    return None


def _fields(options: type) -> dict[str, type | None]:
    """The fields of an options class: name -> its options class (None for a leaf; a dict
    field is a leaf whose keys are free: parameter names, fields, options of a system)."""
    hints = typing.get_type_hints(options)
    return {f.name: _options_class(hints[f.name]) for f in dataclasses.fields(options)}


def schema_keys(options: type, prefix: str = "") -> list[str]:
    """Every dotted key of ``options`` (leaves and groups): ``optim``, ``optim.lr``, ..."""
    keys = []
    for name, sub in _fields(options).items():
        keys.append(prefix + name)
        if sub is not None:
            keys += schema_keys(sub, f"{prefix}{name}.")
    return keys


def closest_key(key: str, options: type = FitConfig) -> str | None:
    """The valid key nearest to the unknown ``key``: among its siblings where its parent is
    valid (``optim.lrr`` -> ``optim.lr``), else among the keys as deep (``optm.lr`` ->
    ``optim.lr``); None if none is close."""
    keys = schema_keys(options)
    parent, _, last = key.rpartition(".")
    if not parent or parent in keys:
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        near = difflib.get_close_matches(last, siblings, n=1, cutoff=0.6)
        return (f"{parent}.{near[0]}" if parent else near[0]) if near else None
    level = [k for k in keys if k.count(".") == key.count(".")]
    near = difflib.get_close_matches(key, level, n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_key_message(key: str, options: type = FitConfig) -> str:
    """``key: unknown key; did you mean <closest>?`` (or the keys beside it)."""
    best = closest_key(key, options)
    if best is not None:
        return f"{key}: unknown key; did you mean {best}?"
    parent = key.rpartition(".")[0]
    beside = [k for k in schema_keys(options) if k.rpartition(".")[0] == parent]
    return f"{key}: unknown key; the keys {'under ' + parent if parent else 'are'}: {beside}"


def refuse_unknown_keys(node: Any, options: type, prefix: str = "",
                        root: type | None = None) -> None:
    """Raise :class:`ConfigError` for the first key of ``node`` (a composed config) that
    ``options`` does not declare, such as ``+optim.lrr=0.1``, which Hydra adds without a
    complaint; keys inside dict fields (``system.params.*``, ``fit.start.*``, ...) are free."""
    if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
        return
    root = options if root is None else root
    fields = _fields(options)
    for key in node:
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(unknown_key_message(dotted, root))
        sub = fields[key]
        if sub is not None:
            refuse_unknown_keys(node._get_node(key), sub, dotted + ".", root)


# -- required keys --------------------------------------------------------------------------


def _required(key: str, hint: str = "") -> Any:
    """``${pdefit.required:KEY,HINT}``: a value the command line must give (a config group
    such as ``data=zarr`` needs ``data.path``). OmegaConf keeps a value already in the schema
    when a later config merges ``???`` onto it, so ``???`` cannot say this."""
    raise ConfigError(f"{key} is required{': ' + hint if hint else ''}")


def raised_by_resolver(err: BaseException) -> ConfigError | None:
    """The :class:`ConfigError` a resolver raised, which OmegaConf wraps (once or twice) in
    an ``InterpolationResolutionError``; None if there is none."""
    seen = err
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _register_required() -> None:
    if not OmegaConf.has_resolver("pdefit.required"):
        OmegaConf.register_new_resolver("pdefit.required", _required)


def typed_options(options: type[Options], values: Mapping[str, Any], key: str) -> Options:
    """Plain ``values`` (a Python caller's keyword mapping) as frozen ``options``, each typed
    as the command line's config types it (``{"parameters": "no"}`` is false, ``{"dt_factor":
    "4"}`` is 4); an unknown key or a value its type cannot hold is a ValueError naming
    ``key`` (and the field)."""
    try:
        node = OmegaConf.structured(writable(options)(**values))
    except TypeError as err:
        raise ValueError(f"{key}: {err}") from None
    except ValidationError as err:
        raise ValueError(f"{key}.{err.full_key}: {err.msg}") from None
    return to_frozen(OmegaConf.to_object(node), options)


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
