"""The checks of a run that need the chosen system or the host, made before anything is
simulated, written or compiled (called by :mod:`pdefit.app.validate`), each error naming its
key: names of parameters and fields against the system (with the closest valid name), an
observation stride that leaves too few observed points, an unobserved field whose initial
state would be the dataset's hidden truth, the adjoint's memory budget against
the state it must hold, the grid's memory against the host's, and a spatial device mesh for a
system that needs the whole grid on one device.

A system says it cannot be split over a spatial mesh with ``spatial_mesh = False`` (spectral
systems: their transforms need the whole grid), or names the grid axes it can split with a
tuple (``spatial_mesh = ("y",)``: rows only); the engine never names a system.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable
from typing import Any

from pdefit.adjoint import snapshots_for_budget
from pdefit.fitting import assemble
from pdefit.fitting.initial_fields import SOURCES, hidden_initial_fields, hidden_state_message
from pdefit.fitting.observe import check_noise_sigma, observable_names
from pdefit.model.system import System
from pdefit.options import ConfigError, FitConfig, SimulateMainConfig, SystemConfig

MIN_OBSERVED_PER_AXIS = 4  # fewer observed points along an axis than this see no pattern
ADJOINT_RESERVE = 6  # working states beside the snapshots (pdefit.adjoint.snapshots_for_budget)
ITEMSIZE = {"float32": 4, "float64": 8}


def unknown_names(key: str, names: Iterable[Any], valid: Iterable[str], what: str,
                  owner: str, has: str | None = None) -> None:
    """Raise :class:`ConfigError` if any of ``names`` is not in ``valid``: "``key``: unknown
    <what>(s) ['kk'] for <owner>; did you mean 'k'? (it has [...])"."""
    valid = list(valid)
    unknown = [str(n) for n in names if str(n) not in valid]
    if not unknown:
        return
    near = {n: difflib.get_close_matches(n, valid, n=1, cutoff=0.5) for n in unknown}
    guesses = [(n, m[0]) for n, m in near.items() if m]
    if len(unknown) == 1 and guesses:
        hint = f"; did you mean {guesses[0][1]!r}?"
    else:
        hint = "".join(f"; {n!r}: did you mean {m!r}?" for n, m in guesses)
    has = f"{sorted(valid)}" if has is None else has
    raise ConfigError(f"{key}: unknown {what}(s) {unknown} for {owner}{hint} (it has {has})")


def check_fit_against_system(cfg: FitConfig) -> System:
    """The names of ``cfg`` checked against its system (and the data-making one), the
    observation stride, the adjoint's budget, the host's memory and the mesh; the system."""
    system = assemble.make_system(cfg.system)
    grid = assemble.make_grid(cfg.system)
    _mesh(cfg, system)
    _system_params(cfg.system, system)
    params = list(system.params)
    fit = cfg.fit
    unknown_names("fit.params", fit.params, params, "parameter", system.name)
    unknown_names("fit.start", dict(fit.start), params, "parameter", system.name)
    unknown_names("fit.transforms", dict(fit.transforms), params, "parameter", system.name)
    unknown_names("fit.initial_fields", dict(fit.initial_fields), system.fields, "field",
                  system.name)
    derived = observable_names(system, grid)
    unknown_names("observe.fields", cfg.observe.fields, [*system.fields, *derived], "field",
                  system.name, f"fields {list(system.fields)} and observables {list(derived)}")
    _initial_state(cfg, system, grid)
    try:
        check_noise_sigma(cfg.observe.noise_sigma, [str(f) for f in cfg.observe.fields])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.simulate.system is not None and not cfg.data.path:
        _system_params(cfg.simulate.system, assemble.make_system(cfg.simulate.system),
                       "simulate.system.params")
    _stride(cfg)
    _adjoint_budget(cfg, system)
    import jax  # the processes have joined (pdefit.app.cli._prepare_fit)

    check_host_memory(cfg.system, system, cfg.precision, _states_needed(cfg),
                      _experiments(cfg), jax.process_count())
    _hooks(cfg.system, system)  # after the memory check: a hook may need concrete values
    return system


def _hooks(system_cfg: SystemConfig, system: System) -> None:
    """The integrator, the time step's stability and the system's hooks (fields, shapes,
    dtypes: :func:`pdefit.model.system.check_system_on`) on the fit's grid, before anything
    is simulated; the assembly checks them again (cached) for the Python API."""
    grid = assemble.make_grid(system_cfg)
    params = assemble.system_params(system, system_cfg.params)
    assemble.check_dynamics(system, params, grid, system_cfg)


def check_simulation_against_system(cfg: SimulateMainConfig) -> None:
    """``pdefit-simulate``'s system: parameter names, the written fields (where the system
    declares its observables), the memory of one experiment's state and its successor.
    Without JAX: the processes of a multi-process run have not joined yet."""
    system = assemble.make_system(cfg.system)
    _system_params(cfg.system, system)
    declared = getattr(system, "observable_names", None)
    if cfg.simulate.fields is not None and (declared is not None
                                            or not hasattr(system, "observables")):
        unknown_names("simulate.fields", cfg.simulate.fields,
                      [*system.fields, *(declared or ())], "field", system.name)
    check_host_memory(cfg.system, system, cfg.precision, 2, 1)


def _initial_state(cfg: FitConfig, system: System, grid: Any) -> None:
    """``fit.initial_fields``: known sources, and no unobserved field left to start from the
    dataset's hidden truth (:func:`pdefit.fitting.initial_fields.hidden_initial_fields`)."""
    sources = dict(cfg.fit.initial_fields)
    bad = {f: s for f, s in sources.items() if s not in SOURCES}
    if bad:
        f, s = next(iter(bad.items()))
        raise ConfigError(f"fit.initial_fields.{f}={s}: the source is {' or '.join(SOURCES)} "
                          "(data: a known initial state, the dataset's first frame; fit: "
                          "fitted with the parameters)")
    observed = [str(f) for f in cfg.observe.fields]
    hidden = hidden_initial_fields(system, grid, observed, sources)
    if hidden:
        raise ConfigError(hidden_state_message(hidden, observed))


def _system_params(cfg: SystemConfig, system: System, key: str = "system.params") -> None:
    unknown_names(key, dict(cfg.params), system.params, "parameter", system.name)


def _stride(cfg: FitConfig) -> None:
    """``observe.stride``: at least :data:`MIN_OBSERVED_PER_AXIS` observed points per axis."""
    stride, shape = int(cfg.observe.stride), [int(n) for n in cfg.system.grid.shape]
    if stride == 1:
        return
    points = [math.ceil(n / stride) for n in shape]
    if min(points) >= MIN_OBSERVED_PER_AXIS:
        return
    fitting = [s for s in range(1, stride)
               if all(math.ceil(n / s) >= MIN_OBSERVED_PER_AXIS for n in shape)]
    advice = (f"use observe.stride={fitting[-1]} or less" if fitting
              else "observe every point (observe.stride=1)")
    raise ConfigError(
        f"observe.stride={stride} observes {'×'.join(map(str, points))} point(s) of the "
        f"{'×'.join(map(str, shape))} grid (system.grid.shape={shape}), fewer than "
        f"{MIN_OBSERVED_PER_AXIS} per axis; {advice}")


def _state_bytes(system_cfg: SystemConfig, system: System, precision: str) -> int:
    """Bytes of one experiment's state (every field on the grid)."""
    points = math.prod(int(n) for n in system_cfg.grid.shape)
    return points * ITEMSIZE.get(precision, 8) * len(system.fields)


def _adjoint_budget(cfg: FitConfig, system: System) -> None:
    """``adjoint.*``: a known schedule, and revolve's snapshots or a memory budget that holds
    at least one snapshot of the state beside the working states."""
    adjoint = cfg.adjoint
    if adjoint.kind not in ("store_all", "nested", "revolve"):
        raise ConfigError(f"adjoint.kind: unknown {adjoint.kind!r}; choose store_all, nested "
                          "or revolve")
    if adjoint.kind != "revolve":
        return
    if adjoint.snapshots is not None:
        if int(adjoint.snapshots) < 1:
            raise ConfigError(f"adjoint.snapshots must be >= 1, got {adjoint.snapshots}")
        return
    if adjoint.memory_budget_mb is None:
        raise ConfigError("adjoint: give revolve either adjoint.snapshots or "
                          "adjoint.memory_budget_mb")
    state = _state_bytes(cfg.system, system, cfg.precision)
    budget = float(adjoint.memory_budget_mb)
    try:
        snapshots_for_budget(budget * 2**20, state, ADJOINT_RESERVE)
    except ValueError:
        need = (ADJOINT_RESERVE + 1) * state / 2**20
        raise ConfigError(
            f"adjoint.memory_budget_mb={budget:g} holds no snapshot of the state "
            f"({state / 2**20:.3g} MiB: {len(system.fields)} field(s) on "
            f"{list(cfg.system.grid.shape)} in {cfg.precision}) beside {ADJOINT_RESERVE} "
            f"working states; give at least {need:.3g} MiB, or adjoint.snapshots") from None


def _mesh(cfg: FitConfig, system: System) -> None:
    """``mesh.shape``: enough devices, and a spatial split only along the grid axes the
    system can split (``spatial_mesh``: False none, a tuple of axes those)."""
    import jax

    mesh = cfg.mesh
    shape = [int(n) for n in mesh.shape]
    if len(shape) != 2 or min(shape) < 1:
        raise ConfigError(f"mesh.shape must be [py, px] of positive sizes, got {shape}")
    what = "mesh.all_devices=true" if mesh.all_devices else f"mesh.shape={shape}"
    tiles = [1, jax.device_count()] if mesh.all_devices else shape
    _spatial_split(system, tiles, what)
    grid = [int(n) for n in cfg.system.grid.shape]
    for axis, n, p in zip(("y", "x"), grid, tiles, strict=True):
        if n % p:
            raise ConfigError(f"{what}: grid axis {axis} of {n} cells (system.grid.shape={grid})"
                              f" does not split over {p} devices; use a mesh whose sizes divide "
                              "the grid")
    need = (1 if mesh.all_devices else math.prod(shape)) * int(mesh.experiments)
    if need > jax.device_count():
        raise ConfigError(f"mesh.shape={shape} with mesh.experiments={mesh.experiments} needs "
                          f"{need} devices; {jax.device_count()} available")


def _spatial_split(system: System, tiles: list[int], what: str) -> None:
    """The grid split into ``tiles`` = [py, px] only along the grid axes the system's
    ``spatial_mesh`` allows: True (the default) any, False none, a tuple of axes ("y", "x")
    those."""
    allowed = getattr(system, "spatial_mesh", True)
    split = [axis for axis, n in zip(("y", "x"), tiles, strict=True) if n > 1]
    if allowed is True or not split:
        return
    allowed = (allowed,) if isinstance(allowed, str) else tuple(allowed or ())
    if not allowed:
        raise ConfigError(
            f"{what}: {system.name} needs the whole grid on one device (its operators are "
            "global transforms) and cannot run on a spatially decomposed mesh; use "
            "mesh.shape=[1,1] and spread the experiments instead (mesh.experiments=<devices>)")
    refused = [axis for axis in split if axis not in allowed]
    if refused:
        n, only = math.prod(tiles), allowed[0]
        example = [n, 1] if only == "y" else [1, n]
        form = "[k, 1]" if only == "y" else "[1, k]"
        raise ConfigError(
            f"{what}: {system.name} can split only grid axis {' and '.join(allowed)} "
            f"(mesh.shape={form}), not {' and '.join(refused)}; use mesh.shape={example} or "
            "spread the experiments (mesh.experiments=<devices>)")


def _experiments(cfg: FitConfig) -> int:
    """How many experiments the run holds at once (a lower bound where the dataset decides)."""
    if cfg.data.experiments is not None:
        return max(1, len(cfg.data.experiments))
    return 1 if cfg.data.path else int(cfg.simulate.n_experiments)


def _states_needed(cfg: FitConfig) -> int:
    """A lower bound on the states of one experiment the fit holds at once: the state and
    its successor, and the adjoint's stored states where the settings fix their number."""
    adjoint = cfg.adjoint
    if adjoint.kind == "revolve" and adjoint.snapshots is not None:
        return int(adjoint.snapshots) + ADJOINT_RESERVE
    if adjoint.kind == "store_all" and not cfg.data.path:
        frames = (int(cfg.simulate.n_frames) if cfg.data.frames is None
                  else max(2, max(int(f) for f in cfg.data.frames) + 1))
        return (frames - 1) * int(cfg.simulate.steps_per_frame) + 1
    return 2


def host_memory() -> int | None:
    """Bytes of physical memory of this host (None where the system does not say)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(system_cfg: SystemConfig, system: System, precision: str,
                      states: int, experiments: int, processes: int = 1) -> None:
    """Refuse a grid whose ``states`` states of ``experiments`` experiments cannot fit in
    the memory of this host (shared by ``processes`` processes on as many hosts), naming
    ``system.grid.shape``."""
    host = host_memory()
    if host is None:
        return
    state = _state_bytes(system_cfg, system, precision)
    need = state * states * experiments / max(1, processes)
    if need <= host:
        return
    shape = [int(n) for n in system_cfg.grid.shape]
    raise ConfigError(
        f"system.grid.shape={shape}: one state of {system.name} ({len(system.fields)} "
        f"field(s) × {math.prod(shape)} points in {precision}) takes {state / 2**30:.3g} GiB, "
        f"and the run holds at least {states * experiments} at once ({need / 2**30:.3g} GiB), "
        f"more than this host's memory ({host / 2**30:.3g} GiB); use a smaller grid")
