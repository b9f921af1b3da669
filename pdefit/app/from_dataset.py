"""What a command line leaves unsaid, completed before anything runs: the grid of the dataset
it fits, and the defaults of a system it names.

- ``data.path``: the dataset records its grid (shape, spacing, boundaries), so the fit takes
  them from it; a value given on the command line that differs is an error naming both. The
  time step stays a setting of the fit (``system.dt``): the dataset records when its frames
  were observed, not how a model steps between them.
- ``system.name=<name>``: a system named by key, not by its config group (``system=<name>``),
  would keep the options, parameters, grid and dt of the group that is selected (by default
  ``aliev_panfilov``). A name that has a config group is refused with the group to select; a
  system without one (an import path ``pkg.mod:Class``, an entry point) starts from its own
  defaults: no options or parameter overrides but those given, its ``default_dt`` if it
  declares one, else ``system.dt`` must be given.

"Given" means given on the command line: Hydra's task overrides of this job (in a sweep, each
point's own). A config composed without Hydra's runtime (a test's or a script's ``compose``)
has no such record and is left as it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from pdefit import data as zd
from pdefit.model.system import system_class
from pdefit.options import ConfigError, FitConfig, GridConfig, SystemConfig

GRID_KEYS = ("shape", "spacing", "boundaries")
# The dataset's metadata field holding each grid key.
DATASET_GRID = {"shape": "grid_shape", "spacing": "grid_spacing", "boundaries": "boundaries"}


class CommandLine(NamedTuple):
    """What the command line said, as far as completing the config needs it."""

    given: frozenset[str]  # the keys it set (``a.b`` of ``a.b=1``, ``+a.b=1``, ``a=<group>``)
    system_group: str | None = None  # the selected ``system`` config group
    system_groups: frozenset[str] = frozenset()  # every ``system`` config group there is
    group_system: str | None = None  # the system the selected group names (None: unknown)


def override_keys(overrides: Iterable[str], groups: Iterable[str] = ()) -> frozenset[str]:
    """The keys of Hydra override strings (``+a.b=1``, ``++a=2``, ``~a`` → ``a.b``, ``a``),
    without the choices of config ``groups`` (``system=bocf`` selects a file: no value)."""
    keys = {o.split("=", 1)[0].lstrip("+~").strip() for o in overrides}
    return frozenset(keys - set(groups))


def is_given(key: str, given: Iterable[str]) -> bool:
    """Whether ``key`` (``system.grid.shape``) was set: itself, or a node above or below it."""
    return any(g == key or key.startswith(g + ".") or g.startswith(key + ".") for g in given)


def complete(cfg: FitConfig) -> FitConfig:
    """``cfg`` completed from the command line that made it (see the module): the named
    system's own defaults, then the dataset's grid; unchanged without Hydra's runtime."""
    line = command_line()
    return cfg if line is None else complete_config(cfg, line)


def complete_config(cfg: FitConfig, line: CommandLine) -> FitConfig:
    """:func:`complete` for a known command line."""
    cfg = dataclasses.replace(cfg, system=own_defaults(cfg.system, line))
    return grid_from_dataset(cfg, line.given)


def command_line() -> CommandLine | None:
    """This job's command line from Hydra's runtime; None when Hydra is not running it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    choice = choices.get("system")
    return CommandLine(override_keys(hydra_cfg.overrides.task, choices), choice,
                       _system_groups(), _group_system(choice))


def _system_groups() -> frozenset[str]:
    """The ``system`` config groups on Hydra's search path (pdefit's own at least)."""
    names = {p.stem for p in files("pdefit.conf").joinpath("system").iterdir()
             if p.name.endswith(".yaml")}
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # the search path a user's config added too
        names.update(GlobalHydra.instance().config_loader().get_group_options("system"))
    return frozenset(names)


def _group_system(choice: str | None) -> str | None:
    """The system name of pdefit's config group ``choice`` (None for another package's)."""
    if not choice:
        return None
    path = files("pdefit.conf").joinpath("system", f"{choice}.yaml")
    if not path.is_file():
        return None
    return str((yaml.safe_load(path.read_text()) or {}).get("name", choice))


# ---------------------------------------------------------------------------------------------


def own_defaults(system: SystemConfig, line: CommandLine) -> SystemConfig:
    """``system`` as the command line named it: unchanged unless ``system.name`` was given
    and differs from the selected group's system; then refused where the name has a config
    group of its own, else rebuilt from the system's own defaults and the given keys."""
    name = system.name
    if not is_given("system.name", line.given) or name in (line.system_group,
                                                           line.group_system):
        return system
    if name in line.system_groups:
        raise ConfigError(
            f"system.name={name} keeps the options, grid and dt of the selected config group "
            f"system={line.system_group}; select the system with system={name} instead")
    if line.system_group is not None and line.group_system is None:
        return system  # another package's group: which system it names is not known here
    return _from_own_defaults(system, line.given)


def _from_own_defaults(system: SystemConfig, given: frozenset[str]) -> SystemConfig:
    """A system without a config group: the given keys, the rest from the system (its
    ``default_dt``) or the schema's neutral defaults; ``system.dt`` required where the system
    declares no step."""
    defaults = SystemConfig(name=system.name)
    dt = system.dt if is_given("system.dt", given) else _default_dt(system.name)
    if dt is None:
        raise ConfigError(
            f"system.dt: {system.name} has no config group (conf/system/) and declares no "
            f"default_dt, so the time step must be given: add system.dt=<step> (the "
            f"selected group's dt={system.dt} belongs to another system)")
    return SystemConfig(
        name=system.name, options=_given_entries(system.options, "system.options", given),
        params=_given_entries(system.params, "system.params", given),
        grid=system.grid if is_given("system.grid", given) else defaults.grid,
        dt=float(dt),
        integrator=(system.integrator if is_given("system.integrator", given)
                    else defaults.integrator))


def _given_entries(values: dict[str, Any], key: str, given: frozenset[str]) -> dict[str, Any]:
    """The entries of ``values`` (at config ``key``) the command line set."""
    if key in given:
        return dict(values)
    names = {g[len(key) + 1:].split(".")[0] for g in given if g.startswith(key + ".")}
    return {k: v for k, v in values.items() if k in names}


def _default_dt(name: str) -> float | None:
    """The system's declared ``default_dt`` (a class attribute), None where it has none."""
    try:
        cls = system_class(name)
    except ValueError as err:
        raise ConfigError(f"system.name: {err}") from None
    value = getattr(cls, "default_dt", None)
    return None if value is None else float(value)


# ---------------------------------------------------------------------------------------------


def grid_from_dataset(cfg: FitConfig, given: Iterable[str]) -> FitConfig:
    """``cfg`` on the grid of its dataset (``data.path``): each grid key not given is taken
    from the dataset's metadata; one given with another value is an error naming both.
    Without ``data.path``, or where it names nothing (reported later, naming the key), as
    it is."""
    if not cfg.data.path:
        return cfg
    path = _absolute(cfg.data.path)
    if not path.exists():
        return cfg
    meta = zd.open_dataset(path).meta  # metadata only: the values are read lazily
    grid = cfg.system.grid
    values = {}
    for key in GRID_KEYS:
        recorded = list(getattr(meta, DATASET_GRID[key]))
        configured = list(getattr(grid, key))
        if is_given(f"system.grid.{key}", given):
            if not _same(configured, recorded):
                raise ConfigError(
                    f"system.grid.{key}={_listed(configured)} conflicts with the dataset's "
                    f"grid {key} {_listed(recorded)} (data.path={cfg.data.path}); drop the "
                    "override: the grid is the dataset's")
            values[key] = configured
        else:
            values[key] = recorded
    system = dataclasses.replace(cfg.system, grid=GridConfig(**values))
    return dataclasses.replace(cfg, system=system)


def _absolute(path: str) -> Path:
    """``path`` as the fit reads it (relative to where the command was started)."""
    from hydra.utils import to_absolute_path

    return Path(to_absolute_path(path))


def _same(configured: Sequence[Any], recorded: Sequence[Any]) -> bool:
    if len(configured) != len(recorded):
        return False
    return all(math.isclose(float(a), float(b), rel_tol=1e-6)
               if isinstance(b, float) or isinstance(a, float) else a == b
               for a, b in zip(configured, recorded, strict=True))


def _listed(values: Sequence[Any]) -> str:
    """Values as the command line writes them: ``[64,64]``, ``[neumann,periodic]``."""
    return "[" + ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values) + "]"
