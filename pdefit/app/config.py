"""The one boundary between Hydra and pdefit: the typed options of :mod:`pdefit.options` are
registered as Hydra's schema (so a misspelt key or a value of the wrong type is an error
before anything runs), and a composed config is turned into those frozen dataclasses once,
here, by :func:`to_options`. Nothing below the app layer sees a ``DictConfig``.

Keys that name system parameters or fields (``system.params``, ``fit.start``, ...) are free
dicts in the schema and checked against the chosen system when the fit is assembled
(:mod:`pdefit.fitting.assemble`), which names the offending key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from pdefit.app.schema import to_frozen, writable
from pdefit.options import FitConfig, SimulateMainConfig

# Where the command-line entry points find their configs: the repository's conf/, installed as
# the package pdefit.conf (an editable install maps it back to conf/).
CONF_DIR = "pkg://pdefit.conf"

Options = TypeVar("Options")


def schema(options: type) -> DictConfig:
    """The structured config of a frozen options class (through its writable twin,
    :mod:`pdefit.app.schema`), for composition."""
    return OmegaConf.structured(writable(options))


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
    return to_frozen(OmegaConf.to_object(merged), options)


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
