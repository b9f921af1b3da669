"""From typed options (:class:`pdefit.options.FitConfig`) and a dataset to the fit a run
needs: :func:`build_fit` checks the options against the system and the dataset, reads the
training window and assembles the problem, its batch and its start. Every check that can fail
on user input runs here, before anything is compiled, and raises :class:`ConfigError` (or the
data module's ``DatasetError``) naming the offending key or value.

The pieces it builds from the options (system, grid, mesh, schedule, ...) are in
:mod:`pdefit.fitting.components`, synthetic datasets in :mod:`pdefit.fitting.synthetic`; their
names are importable from here too (``assemble.make_system``, ``assemble.simulate_dataset``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from pdefit import data as zd
from pdefit.fitting import shooting
from pdefit.fitting.components import (
    check_dynamics,
    check_tiled_step,
    make_domain,
    make_grid,
    make_regularization,
    make_schedule,
    make_system,
    observable_fields,
    set_precision,
    system_params,
)
from pdefit.fitting.fitted import FittedFileError, fitted_path, read_fitted
from pdefit.fitting.initial_fields import DATA, hidden_initial_fields, hidden_state_message
from pdefit.fitting.observe import (
    LOSSES,
    Observation,
    noise_levels,
    observable_names,
    observed_data,
    unobserved_after_first,
    weighted_by_noise,
)
from pdefit.fitting.optimisers import project_fields
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.fitting.synthetic import (
    data_system_config,
    dataset_meta,
    experiment_params,
    refine_factors,
    simulate_dataset,
    write_experiment,
)
from pdefit.fitting.window import Reader, Window, all_finite, read_observed, state_from_first_frames
from pdefit.model.params import ParameterError, ParameterLayout
from pdefit.model.system import System, made_by
from pdefit.numerics.grid import Grid
from pdefit.options import ConfigError, FitConfig
from pdefit.parallel.domain import FIELD, FRAMES, PER_EXPERIMENT, REPLICATED, Domain
from pdefit.parallel.processes import host_scalar

log = logging.getLogger("pdefit")

# What callers reach as assemble.<name>: the fit's assembly, and (re-exported) the pieces and
# synthetic datasets it is made of.
__all__ = [
    "ConfigError", "FitSetup", "build_fit", "check_dynamics", "data_system_config",
    "dataset_meta", "experiment_params", "make_domain", "make_grid", "make_regularization",
    "make_schedule", "make_system", "observable_fields", "refine_factors", "set_precision",
    "simulate_dataset", "system_params", "write_experiment",
]


class FitSetup(NamedTuple):
    """A fit ready to run (:func:`build_fit`, :func:`pdefit.build_problem`): the problem, the
    batch of data it reads, the starting point ``theta0`` (unconstrained), the starting values
    of the shared scalars in physical units, and the dataset's true parameters if known."""

    problem: FitProblem
    batch: Batch
    theta0: dict[str, Any]
    start_values: dict[str, float]
    reference: dict[str, float] | None  # the dataset's true parameters, if it has them
    reads: list  # the dataset windows this process read: (field, experiments, frames, y, x)
    meta: zd.DatasetMeta | None = None  # the dataset's metadata (how it was made)


class Source(NamedTuple):
    """The dataset as this fit reads it."""

    meta: zd.DatasetMeta
    surrogate: bool  # the data come from another system (a surrogate fit)
    time_scale: float  # dataset time units per model time unit
    data_fields: tuple[str, ...]  # the dataset's fields this fit may take


class Start(NamedTuple):
    """The fitted parameters and where they start."""

    layout: ParameterLayout
    values: dict[str, Any]  # physical start values of every parameter
    z0: dict[str, Any]  # the fitted ones, unconstrained, in the run's dtype
    reference: dict[str, float] | None  # the dataset's true parameters, if they apply
    warm_fields: dict[str, Any]  # fitted fields of fit.start_from (empty without it)


# ---------------------------------------------------------------------------------------------
# The fit problem.


def build_fit(cfg: FitConfig, dataset_path: Path, dtype: Any,
              system: System | None = None) -> FitSetup:
    """Validate config and dataset against each other and assemble the fit. ``cfg`` holds the
    typed options (:class:`pdefit.options.FitConfig`): the command line's config turned into
    them (:mod:`pdefit.app.config`), or those :func:`pdefit.api.build_problem` fills in;
    ``system`` is a system object to use instead of building one from ``cfg.system.name`` and
    its options."""
    system = make_system(cfg.system) if system is None else system
    grid = make_grid(cfg.system)
    params = system_params(system, cfg.system.params)
    check_dynamics(system, params, grid, cfg.system)
    ds = zd.open_dataset(dataset_path)
    derived = observable_names(system, grid)
    fitted_fields = _check_observation(cfg, system, derived)
    source = _source(cfg, system, grid, ds)
    window = _window(cfg, source)
    domain, placement = _mesh(cfg, system, grid, window)
    reader = Reader(ds, window, placement, dtype, [])
    observation, observed = _observed(cfg, system, derived, reader)
    initial, from_observed = _initial_fields(cfg, system, grid, reader, source, fitted_fields)
    start = _parameters(cfg, system, params, source, len(window.experiments), dtype)
    guesses = _first_guesses(tuple(cfg.observe.fields), system, reader, fitted_fields,
                             start.values)
    first_guess = _start_fields(cfg, grid, reader, source, fitted_fields,
                                {**guesses, **from_observed})
    problem = _problem(cfg, system, grid, source, window, start.layout, observation,
                       fitted_fields, domain, dtype)
    # A fit starts inside the ranges its steps keep the fields in (a warm start from an
    # unbounded fit, or a first guess past them, is projected there).
    first_guess = project_fields({"fields": first_guess}, problem.field_bounds)["fields"]
    theta0 = project_fields(
        _theta0(start, _warm_fields(first_guess, start.warm_fields), domain),
        problem.field_bounds)
    if window.n_steps == 0:
        raise ConfigError("the training window has no time steps: use at least two frames")
    # The fitted fields' first guess is the background their prior pulls towards; a warm
    # start (fit.start_from) moves where they start, never the prior.
    background = (theta0 if not start.warm_fields else _theta0(start, first_guess, domain))
    batch = Batch(observed, initial, dict(background["fields"]))
    # Multiple shooting: the segments start from the run of that first guess.
    theta0 = shooting.with_segments(problem, theta0, batch)
    # The table of start/recovered values shows numbers: shared scalars only.
    return FitSetup(problem, batch, theta0,
                    {n: float(start.values[n]) for n in start.layout.scalars},
                    start.reference, reader.reads, source.meta)


def _check_observation(cfg: FitConfig, system: System, derived: tuple[str, ...],
                       ) -> tuple[str, ...]:
    """``observe`` and ``fit.initial_fields`` checked against the system (``derived``: its
    observables); the state fields whose initial values are fitted."""
    obs_cfg = cfg.observe
    unknown = [f for f in obs_cfg.fields if f not in system.fields and f not in derived]
    if unknown:
        raise ConfigError(f"observe.fields: unknown field(s) {unknown} for {system.name}; it "
                          f"has fields {list(system.fields)} and observables {list(derived)}")
    if obs_cfg.loss not in LOSSES:
        raise ConfigError(f"observe.loss: unknown {obs_cfg.loss!r}; choose one of {LOSSES}")
    if obs_cfg.nan not in ("error", "mask"):
        raise ConfigError(f"observe.nan must be 'error' or 'mask', got {obs_cfg.nan!r}")
    fit_fields = dict(cfg.fit.initial_fields)
    for name, source in fit_fields.items():
        if name not in system.fields or source not in ("data", "fit"):
            raise ConfigError(f"fit.initial_fields: {name}={source} — fields are "
                              f"{list(system.fields)}, sources are data or fit")
    return tuple(f for f in system.fields if fit_fields.get(f) == "fit")


def _source(cfg: FitConfig, system: System, grid: Grid, ds: zd.Dataset) -> Source:
    """The dataset checked against the system, grid and observed fields (``data.*``)."""
    # A surrogate fit reads a dataset of another system: only the observed fields mean the
    # same thing in both (e.g. the voltage-like u), so only those are taken from it.
    surrogate = cfg.data.system is not None and not made_by(cfg.data.system, system)
    time_scale = float(cfg.data.time_scale)
    if not time_scale > 0:
        raise ConfigError(f"data.time_scale must be positive, got {time_scale}")
    # A dataset names the system that made it by its name or its import path (a user's
    # system: system_reference); a recording that no model made names none ("").
    recorded = ds.meta.system
    made_here = (recorded == cfg.data.system if surrogate else made_by(recorded, system))
    expected = recorded if made_here or not recorded else cfg.data.system or system.name
    # Values are checked for NaN/Inf below, on the windows this process loads anyway.
    zd.validate_dataset(ds, system=expected,
                        fields=list(cfg.observe.fields), grid_shape=grid.shape,
                        grid_spacing=grid.spacing, boundaries=grid.boundaries,
                        check_finite=False)
    meta = ds.meta
    data_fields = tuple(cfg.observe.fields) if surrogate else meta.fields
    return Source(meta, surrogate, time_scale, data_fields)


def _window(cfg: FitConfig, source: Source) -> Window:
    """The frames and experiments of ``data.*``; each used frame's stored time must fall on a
    step of the fit's dt (``system.dt``; the dataset's own step, if any, is not used)."""
    meta, time_scale = source.meta, source.time_scale
    frames = list(range(meta.n_frames)) if cfg.data.frames is None else list(cfg.data.frames)
    if not frames or sorted(set(frames)) != frames or frames[0] < 0 or frames[-1] >= meta.n_frames:
        raise ConfigError(f"data.frames must be increasing indices in [0, {meta.n_frames}), "
                          f"got {frames}")
    dt = float(cfg.system.dt)
    times = meta.times
    # Model time since the first used frame, in steps of dt: each must be a whole number.
    ratios = (times[frames] - times[frames[0]]) / time_scale / dt
    frame_steps = [round(r) for r in ratios]
    off = [f for f, r, k in zip(frames, ratios, frame_steps, strict=True)
           if abs(r - k) > 1e-6 * max(r, 1e-300) or (f != frames[0] and k < 1)]
    if off:
        shown = ", ".join(f"{times[f]:g}" for f in off[:4]) + (" …" if len(off) > 4 else "")
        raise ConfigError(
            f"system.dt={dt}: frame(s) {off[:4]}{' …' if len(off) > 4 else ''} at time(s) "
            f"{shown} (from the first used frame at {times[frames[0]]:g}, divided by "
            f"data.time_scale {time_scale:g}) are not a multiple of system.dt; choose a "
            "system.dt that divides the times between the frames")
    if sorted(set(frame_steps)) != frame_steps:
        raise ConfigError(f"system.dt={dt}: two used frames fall on one step (frame steps "
                          f"{frame_steps}); choose a smaller system.dt")
    experiments = (list(range(meta.n_experiments)) if cfg.data.experiments is None
                   else list(cfg.data.experiments))
    if not experiments or min(experiments) < 0 or max(experiments) >= meta.n_experiments:
        raise ConfigError(f"data.experiments must index [0, {meta.n_experiments}), got "
                          f"{experiments}")
    return Window(frames, experiments, frame_steps, frame_steps[-1])


def _mesh(cfg: FitConfig, system: System, grid: Grid, window: Window,
          ) -> tuple[Domain | None, Any]:
    """The device mesh (``mesh.*``; None on one device), checked against the window, and
    where the frames read go."""
    domain = make_domain(cfg.mesh)
    if domain is not None:
        try:
            domain.check(grid, len(window.experiments), cfg.observe.stride,
                         system.stencil_radius)
        except ValueError as err:
            raise ConfigError(f"mesh: {err}") from None
        # Before anything is compiled for the mesh: do the system's operators take their
        # halos from the neighbouring tiles? (One step, tiled and not, on a small grid.)
        check_tiled_step(system, grid, system_params(system, cfg.system.params),
                         domain.shape[1:], cfg.system.dt, cfg.system.integrator)
    placement = (domain.sharding(FRAMES) if domain is not None
                 else SingleDeviceSharding(jax.devices()[0]))
    return domain, placement


def _observed(cfg: FitConfig, system: System, derived: tuple[str, ...], reader: Reader,
              ) -> tuple[Observation, Any]:
    """The observation operator and the observed data of the window, their missing values
    treated as ``observe.nan`` says."""
    obs_cfg, window = cfg.observe, reader.window
    values, masks = read_observed(reader, obs_cfg.fields, obs_cfg.stride, obs_cfg.nan)
    unseen = unobserved_after_first(masks) if len(window.frames) > 1 else []
    if unseen:
        key = "observe.nan=mask" if obs_cfg.nan == "mask" else "observe.fields"
        raise ConfigError(
            f"{key}: no value of {unseen} after the first frame of the training window is "
            "observed (all missing: NaN or masked), so the fit would see nothing of it and "
            f"stop at its start values; drop {unseen[0]!r} from observe.fields, choose other "
            "data.frames, or fix the dataset")
    observation = Observation(tuple(obs_cfg.fields), obs_cfg.stride, obs_cfg.loss,
                              tuple(sorted(dict(obs_cfg.field_weights).items())),
                              system.observables if derived else None)
    try:  # each field weighted by its noise level, where it is known
        sigma, noise_source = noise_levels(obs_cfg.noise_sigma, reader.ds.meta.noise,
                                           obs_cfg.fields)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    observation = weighted_by_noise(observation, sigma, noise_source)
    observed = observed_data(observation, values, masks, window.frame_steps, window.n_steps,
                             reader.dtype)
    return observation, observed


def _initial_fields(cfg: FitConfig, system: System, grid: Grid, reader: Reader,
                    source: Source, fitted_fields: tuple[str, ...],
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The initial values of the fields that are not fitted, and the fields derived from the
    observed first frames. An observed field, or one named ``fit.initial_fields.<f>=data``
    (a known initial state), starts from the window's first frame; an unobserved one from
    what the system derives from the observed first frames; any other is refused (no hidden
    truth: :func:`pdefit.fitting.initial_fields.hidden_initial_fields`)."""
    observed = tuple(cfg.observe.fields)
    sources = dict(cfg.fit.initial_fields)
    hidden = hidden_initial_fields(system, grid, observed, sources)
    if hidden:
        raise ConfigError(hidden_state_message(hidden, observed))
    known = [f for f in system.fields if f not in fitted_fields
             and (f in observed or sources.get(f) == DATA)]
    absent = [f for f in known if f not in source.data_fields]
    if absent:
        f = absent[0]
        how = (f"fit.initial_fields.{f}=data: the dataset" if sources.get(f) == DATA
               else f"initial field {f!r}: the dataset")
        raise ConfigError(f"{how} holds no {f!r} to start from (it has "
                          f"{list(source.data_fields)}); fit it (fit.initial_fields.{f}=fit)")
    initial = {f: reader.first_frame(f) for f in known}
    # Derived from the observed frames only: the dataset's other fields are not read.
    from_observed = state_from_first_frames(system, grid, reader, (*observed, *known))
    initial.update({f: v for f, v in from_observed.items()
                    if f not in initial and f not in fitted_fields})
    missing = [f for f in system.fields if f not in fitted_fields and f not in initial]
    if missing:
        raise ConfigError(f"fit.initial_fields: no initial state of {missing}: fit them "
                          f"(fit.initial_fields.{missing[0]}=fit)")
    for name, field in initial.items():
        if not host_scalar(all_finite(field)):
            raise ConfigError(f"the initial frame of {name!r} has missing values: fit it "
                              f"(fit.initial_fields.{name}=fit)")
    return initial, from_observed


def _parameters(cfg: FitConfig, system: System, params: dict[str, Any], source: Source,
                n_experiments: int, dtype: Any) -> Start:
    """Which parameters are fitted (``fit.*``), their layout, and where they start."""
    meta = source.meta
    # Another system's true parameters are no reference for this one's.
    reference = dict(meta.true_params) if meta.true_params and not source.surrogate else None
    fitted = list(cfg.fit.params)
    per_experiment = list(getattr(cfg.fit, "per_experiment", None) or [])
    start_values = _default_starts(cfg, system, params, reference, fitted, per_experiment)
    warm = _warm_start(cfg, system, fitted, per_experiment, n_experiments)
    start_values.update(warm["physical"])
    for name, value in dict(cfg.fit.start).items():
        start_values[name] = value
    _check_fitted_names(cfg, system, fitted, per_experiment)
    try:
        layout = ParameterLayout.build(system.params, start_values, fitted,
                                       dict(cfg.fit.transforms), system.name, per_experiment,
                                       list(getattr(cfg.fit, "centered", None) or []))
        z0 = layout.unconstrained(start_values, n_experiments)
    except ParameterError as err:
        raise ConfigError(f"fit: {err}") from None
    z0 = {k: jnp.asarray(v, dtype) for k, v in z0.items()}
    return Start(layout, start_values, z0, reference, warm["fields"])


def _default_starts(cfg: FitConfig, system: System, params: dict[str, Any],
                    reference: dict[str, float] | None, fitted: list[str],
                    per_experiment: list[str]) -> dict[str, Any]:
    """Start values before ``fit.start_from`` and ``fit.start``: the parameters, the fitted
    shared scalars perturbed by ``fit.perturb``."""
    start_values = dict(params)
    # Perturbed starts are for shared scalars; arrays and per-experiment values start from
    # their defaults (zero force, no rotation) unless fit.start says otherwise.
    perturbed = [n for n in fitted if n in system.params and not system.params[n].shape
                 and n not in per_experiment]
    if cfg.fit.perturb is not None and perturbed:
        rng = np.random.default_rng(cfg.fit.perturb.seed)
        factors = rng.uniform(cfg.fit.perturb.low, cfg.fit.perturb.high, len(perturbed))
        base = reference or params
        for name, factor in zip(perturbed, factors, strict=True):
            if name in base:
                start_values[name] = float(base[name]) * float(factor)
    for name in fitted:
        spec = system.params.get(name)
        if spec is not None and (spec.shape or name in per_experiment):
            start_values[name] = spec.full(spec.default)
    return start_values


def _check_fitted_names(cfg: FitConfig, system: System, fitted: list[str],
                        per_experiment: list[str]) -> None:
    unknown = sorted((set(cfg.fit.start) | set(fitted)) - set(system.params))
    if unknown:
        raise ConfigError(f"fit: unknown parameter(s) {unknown} for {system.name}; it has "
                          f"{sorted(system.params)}")
    unknown = sorted(set(per_experiment) - set(fitted))
    if unknown:
        raise ConfigError(f"fit.per_experiment: {unknown} are not fitted parameters (fit.params "
                          f"is {fitted}); a per-experiment parameter must also be fitted")


def _first_guesses(observe: tuple[str, ...], system: System, reader: Reader,
                   fitted_fields: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """The system's first guess (its ``initial_guess`` hook) of the fitted fields that are not
    observed (``observe``: the observed names), from the observed first frames and the start
    parameters (empty without the hook)."""
    guess = getattr(system, "initial_guess", None)
    observed = [f for f in observe if f in system.fields]
    wanted = [f for f in fitted_fields if f not in observe]
    if guess is None or not wanted or not observed:
        return {}
    frames = {f: jnp.nan_to_num(reader.first_frame(f)) for f in observed}
    out = guess(frames, {n: v for n, v in values.items() if n in system.params})
    return {f: jnp.asarray(out[f], reader.dtype) for f in wanted if f in out}


def _start_fields(cfg: FitConfig, grid: Grid, reader: Reader, source: Source,
                  fitted_fields: tuple[str, ...], from_observed: dict[str, Any],
                  ) -> dict[str, Any]:
    """Each fitted initial field's first guess: where it starts without fit.start_from, and
    the background its prior pulls towards."""
    n_experiments, dtype = len(reader.window.experiments), reader.dtype
    fields0 = {}
    for name in fitted_fields:
        # Start a fitted field from its first observed frame when there is one, else from
        # what the system derives from (or guesses by) the observed first frame, else zero.
        # An unobserved field's values in the dataset (a synthetic dataset stores every
        # field) are the truth the fit should find, never its starting guess.
        guess = None
        if name in source.data_fields and name in cfg.observe.fields:
            guess = reader.first_frame(name)
            guess = jnp.where(jnp.isfinite(guess), guess, 0.0)
        elif name in from_observed:
            guess = from_observed[name]
        if guess is None:
            guess = jnp.zeros((n_experiments, *grid.shape), dtype)
        fields0[name] = guess
    return fields0


def _warm_fields(first_guess: dict[str, Any], warm_fields: dict[str, Any]) -> dict[str, Any]:
    """The fitted fields of fit.start_from where their shapes match, else the first guess."""
    fields0 = dict(first_guess)
    for name, guess in first_guess.items():
        previous = warm_fields.get(name)
        if previous is not None and previous.shape == guess.shape:
            fields0[name] = jnp.asarray(previous, guess.dtype)
        elif previous is not None:
            log.warning(f"fit.start_from: the fitted field {name!r} has shape "
                        f"{previous.shape}, this fit's is {guess.shape}: it starts as "
                        "without start_from")
    return fields0


def _theta0(start: Start, fields0: dict[str, Any], domain: Domain | None) -> dict[str, Any]:
    """The optimiser's starting point: unconstrained parameters and fitted fields."""
    theta0 = {"params": start.z0, "fields": fields0}
    if domain is not None:
        # Global arrays on the mesh: every argument of the jitted update must live there
        # (with several processes, a value on one local device is not a valid argument).
        shared, own = start.layout.split(start.z0)
        theta0 = {"params": {**jax.device_put(shared, domain.sharding(REPLICATED)),
                             **jax.device_put(own, domain.sharding(PER_EXPERIMENT))},
                  "fields": jax.device_put(fields0, domain.sharding(FIELD))}
    return theta0


def _problem(cfg: FitConfig, system: System, grid: Grid, source: Source, window: Window,
             layout: ParameterLayout, observation: Observation,
             fitted_fields: tuple[str, ...], domain: Domain | None, dtype: Any) -> FitProblem:
    """The fit problem: the model stepped over the window, its checkpoint schedule
    (``adjoint.*``) and regularization."""
    state_bytes = sum(np.prod(grid.shape) * jnp.dtype(dtype).itemsize for _ in system.fields)
    schedule = make_schedule(cfg.adjoint, int(state_bytes))
    segments = int(cfg.fit.shooting.segments)
    try:
        return FitProblem(
            system=system, grid=grid, dt=float(cfg.system.dt),
            integrator=cfg.system.integrator, n_steps=window.n_steps, layout=layout,
            observation=observation, schedule=schedule, fitted_fields=fitted_fields,
            t0=float(source.meta.times[window.frames[0]]) / source.time_scale,
            regularization=make_regularization(cfg, layout, system, grid), domain=domain,
            shooting=(shooting.Shooting(segments, float(cfg.fit.shooting.continuity))
                      if segments > 1 else None),
            field_bounds=bounded_fields(system, fitted_fields) if cfg.fit.bound_fields else ())
    except shooting.ShootingError as err:
        raise ConfigError(f"fit.shooting.segments={segments}: {err}") from None


def bounded_fields(system: System, fitted_fields: tuple[str, ...],
                   ) -> tuple[tuple[str, float, float], ...]:
    """(field, lower, upper) for each of ``fitted_fields`` that ``system`` bounds (its
    optional ``field_bounds`` hook)."""
    bounds = getattr(system, "field_bounds", None) or {}
    return tuple((f, float(bounds[f][0]), float(bounds[f][1])) for f in fitted_fields
                 if f in bounds)


def _warm_start(cfg: FitConfig, system: System, fitted: list[str], per_experiment: list[str],
                n_experiments: int) -> dict[str, dict[str, Any]]:
    """{"physical": start values, "fields": fitted fields} of ``fit.start_from`` (empty
    without it), for the parameters this fit fits; shapes checked against this fit's."""
    location = getattr(cfg.fit, "start_from", None)
    if not location:
        return {"physical": {}, "fields": {}}
    try:
        stored = read_fitted(Path(location))
    except FittedFileError as err:
        raise ConfigError(f"fit.start_from: {err}") from None
    if not stored["physical"] and stored["params"]:
        raise ConfigError(f"fit.start_from: {fitted_path(Path(location))} holds no physical "
                          "values (written by an older pdefit): run that fit once more with its "
                          "own config, which resumes at its last step and rewrites the file")
    physical = {}
    for name in fitted:
        if name not in stored["physical"] or name not in system.params:
            continue
        value = stored["physical"][name]
        shape = tuple(system.params[name].shape)
        want = (n_experiments, *shape) if name in per_experiment else shape
        if value.shape != want:
            raise ConfigError(f"fit.start_from: {name!r} there has shape {value.shape}, this "
                              f"fit needs {want}")
        physical[name] = float(value) if not want else value
    if not physical and not stored["fields"]:
        raise ConfigError(f"fit.start_from: {fitted_path(Path(location))} fitted none of "
                          f"{fitted}")
    log.info(f"fit.start_from {location}: {sorted(physical)} start from its values")
    return {"physical": physical, "fields": stored["fields"]}
