"""The Python API: fit a system to a dataset without Hydra.

    import pdefit

    ds = pdefit.open_dataset("data.zarr")
    system = pdefit.get_system(ds.meta.system)                # or "my_pkg.models:GrayScott"
    setup = pdefit.build_problem(system, ds, fit=["F", "k"], start={"F": 0.05, "k": 0.05})
    result = pdefit.fit(setup, optimizer="lbfgs", steps=50)
    print(result.params, result.relative_errors())

:func:`build_problem` fills in the typed options the command line's config becomes
(:class:`pdefit.options.FitConfig`, see :mod:`pdefit.app.config`) and hands them to
:func:`pdefit.fitting.assemble.build_fit`, so both paths run one implementation with the same
checks and error messages; :func:`fit` runs the same optimiser loop
(:func:`pdefit.fitting.train.run_fit`) and types its ``discretization_check`` as the command
line's config types ``fit.discretization_check``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
from collections.abc import Mapping, Sequence
from importlib.resources import files
from os import PathLike
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from pdefit import data as zd
from pdefit.app.config import typed_options
from pdefit.app.validate import validate_discretization_check
from pdefit.fitting import assemble, background, discretization, multistart, outcome, synthetic
from pdefit.fitting import bootstrap as fit_bootstrap
from pdefit.fitting import shooting as multiple_shooting
from pdefit.fitting.krylov import curvature_for
from pdefit.fitting.train import LEVENBERG_MARQUARDT, FitHistory, run_fit
from pdefit.model.system import System, made_by, system_reference
from pdefit.model.system import get_system as _get_system
from pdefit.numerics.grid import Grid
from pdefit.options import (
    AdjointConfig,
    DataConfig,
    DiscretizationCheckConfig,
    FitConfig,
    FitSpecConfig,
    GridConfig,
    NoiseConfig,
    ObserveConfig,
    OptimConfig,
    PerturbConfig,
    RegularizationConfig,
    SimulateCommandConfig,
    SimulateMainConfig,
    SystemConfig,
)
from pdefit.parallel.processes import host_array
from pdefit.runtime.checkpoint import CHECKPOINT_DIR, CheckpointOptions

log = logging.getLogger("pdefit")

__all__ = ["FitResult", "FitSetup", "build_problem", "fit", "get_system", "open_dataset",
           "simulate_dataset"]

FitSetup = assemble.FitSetup
FitResult = outcome.FitResult


def get_system(name: str, **options: Any) -> System:
    """The system called ``name``: a built-in one (the names of ``pdefit.systems.REGISTRY``),
    an import path ``"package.module:Class"`` (what a dataset of a user's system records as
    ``ds.meta.system``) or a name installed under the ``pdefit.systems`` entry-point group;
    ``options`` are its static options (e.g. ``laplacian="9pt"``). A system that breaks the
    contract (a parameter that is not a ``ParamSpec``, no fields, ...) raises
    :class:`pdefit.model.system.SystemCheckError` naming it; its hooks are checked on a grid
    when a fit or a simulation uses it."""
    return _get_system(name, **options)


def open_dataset(path: str | PathLike) -> zd.Dataset:
    """Open a pdefit Zarr v3 dataset (validated metadata; values are read lazily):
    ``ds.meta`` holds grid, times, fields and true parameters, ``ds.read(field, ...)`` reads
    values as ``(experiment, frame, y, x)``."""
    return zd.open_dataset(path)


def build_problem(system: System | str,
                  dataset: zd.Dataset | str | PathLike | Mapping[str, Any], *,
                  fit: Sequence[str], start: Mapping[str, Any] | None = None,
                  params: Mapping[str, Any] | None = None, observe: Sequence[str] | None = None,
                  dt: float | None = None, integrator: str | None = None,
                  frames: Sequence[int] | None = None, experiments: Sequence[int] | None = None,
                  initial_fields: Mapping[str, str] | None = None, bound_fields: bool = True,
                  perturb: tuple[float, float, int] | None = None,
                  transforms: Mapping[str, str] | None = None, stride: int = 1,
                  loss: str = "mse", snapshots: int | None = 32, adjoint: str = "revolve",
                  regularization: Mapping[str, Any] | None = None, precision: str | None = None,
                  grid: Grid | None = None, frame_interval: float | None = None) -> FitSetup:
    """Check ``system`` and ``dataset`` against each other and build the fit of the
    parameters named in ``fit``.

    ``start`` sets starting values (physical units; default: the system's defaults with
    ``params`` applied, or the dataset truth × U(low, high) with ``perturb=(low, high,
    seed)``); ``params`` overrides fixed parameter values. ``observe`` names the observed
    fields (default: the system's fields the dataset holds). The grid is the dataset's; ``dt`` and
    ``integrator`` default to those the dataset was made for: its simulation step (times
    ``simulate.refine.dt_factor`` for data made at a finer step, so that refined data are
    fitted at the coarse step they were made to test) and its integrator (``euler`` when it
    does not say, or when another system made the data). ``frames``/``experiments`` select
    indices of the dataset; ``initial_fields`` maps a field to ``"fit"`` to fit its initial values
    or to ``"data"`` for a known initial state (the dataset's first frame): a field that is not
    observed needs one of them unless the system derives it from the observed fields;
    ``bound_fields`` keeps fitted fields in their system's ``field_bounds`` (BOCF's gates).
    ``dataset`` may also be frames in memory: field name → array ``(n_frames, ny, nx)`` or
    ``(n_experiments, n_frames, ny, nx)`` (NaN: unobserved), with ``grid``, ``dt`` and
    ``frame_interval`` (a multiple of ``dt``; default ``dt``) saying where and when they lie,
    the first frame at time 0; they pass through a temporary dataset, and so through the same
    checks as a file.
    ``adjoint`` is ``revolve`` (with ``snapshots``), ``nested`` or ``store_all``;
    ``regularization`` takes the keys of :class:`pdefit.options.RegularizationConfig`.
    ``precision`` (``float32``/``float64``) switches JAX's precision; default: as it is.

    Returns a :class:`FitSetup`: ``problem`` (:class:`~pdefit.FitProblem`), ``batch``,
    ``theta0``, ``start_values`` and ``reference`` (the dataset's true parameters, if any).
    Bad input raises :class:`pdefit.fitting.assemble.ConfigError` or ``DatasetError`` naming the
    problem, as on the command line (the keys named are those of the config schema)."""
    if isinstance(system, str):
        system = get_system(system)
    with contextlib.ExitStack() as cleanup:
        if isinstance(dataset, Mapping):
            dataset = _temporary_dataset(cleanup, system, dataset, grid, dt, frame_interval)
        ds = dataset if isinstance(dataset, zd.Dataset) else open_dataset(dataset)
        if precision is None:
            precision = "float64" if jax.config.jax_enable_x64 else "float32"
        dtype = assemble.set_precision(precision)
        cfg = FitConfig(
            system=_system_options(system, ds.meta, params, dt, integrator),
            data=DataConfig(path=str(ds.path), frames=_listed(frames),
                            experiments=_listed(experiments)),
            observe=ObserveConfig(fields=_observed_fields(system, ds.meta, observe),
                                  stride=stride, loss=loss),
            fit=_fit_spec(fit, start, perturb, transforms, initial_fields, bound_fields),
            adjoint=AdjointConfig(kind=adjoint, snapshots=snapshots),
            regularization=RegularizationConfig(**dict(regularization or {})),
            precision=precision)
        return assemble.build_fit(cfg, Path(ds.path), dtype, system=system)


def _temporary_dataset(cleanup: contextlib.ExitStack, system: System,
                       frames: Mapping[str, Any], grid: Grid | None, dt: float | None,
                       frame_interval: float | None) -> Path:
    """Frames in memory written as a dataset in a temporary directory that ``cleanup``
    removes."""
    if grid is None or dt is None:
        raise ValueError("frames in memory need grid= and dt=")
    # Everything is read into arrays while the problem is built; then it goes.
    tmp = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdefit-frames-"))
    return frames_dataset(Path(tmp) / "frames.zarr", system, frames, grid, dt,
                          frame_interval or dt)


def _observed_fields(system: System, meta: zd.DatasetMeta, observe: Sequence[str] | None,
                     ) -> list[str]:
    """``observe``, by default the system's fields the dataset holds (all of the dataset's
    when it holds none of them)."""
    if observe is None:
        observe = [f for f in meta.fields if f in system.fields] or list(meta.fields)
    return list(observe)


def _system_options(system: System, meta: zd.DatasetMeta, params: Mapping[str, Any] | None,
                    dt: float | None, integrator: str | None) -> SystemConfig:
    """The system on the dataset's grid, stepped at ``dt`` with ``integrator``, by default
    as the dataset was made."""
    # How the dataset was made says how to fit it only when this system made it (a
    # surrogate fit of another system's data steps its own way).
    made = ((meta.provenance or {}).get("discretization") or {}
            if made_by(meta.system, system) else {})
    if dt is None and meta.dt is not None:
        dt = meta.dt * int(made.get("dt_factor", 1))
    if dt is None:  # a recording: no model made it, so the system's default step, if any
        preset = files("pdefit.conf") / "system" / f"{system.name}.yaml"
        dt = getattr(system, "default_dt", None) or (
            (yaml.safe_load(preset.read_text()) or {}).get("dt")
            if system.name.isidentifier() and preset.is_file() else None)
    if dt is None:
        raise ValueError(f"dt=… is required: the dataset records no model time step "
                         f"and system {system.name!r} declares no default_dt; pass "
                         "build_problem(..., dt=<a step that divides the frame times>)")
    if integrator is None:
        integrator = str(made.get("integrator", "euler"))
    return SystemConfig(
        name=system.name, params=dict(params or {}), dt=float(dt), integrator=integrator,
        grid=GridConfig(list(meta.grid_shape), list(meta.grid_spacing), list(meta.boundaries)))


def _fit_spec(fit: Sequence[str], start: Mapping[str, Any] | None,
              perturb: tuple[float, float, int] | None, transforms: Mapping[str, str] | None,
              initial_fields: Mapping[str, str] | None, bound_fields: bool = True,
              ) -> FitSpecConfig:
    return FitSpecConfig(params=list(fit), start=dict(start or {}),
                         perturb=None if perturb is None else PerturbConfig(*perturb),
                         transforms=dict(transforms or {}),
                         initial_fields=dict(initial_fields or {}), bound_fields=bound_fields)


def _listed(indices: Sequence[int] | None) -> list[int] | None:
    return None if indices is None else list(indices)


def frames_dataset(path: str | PathLike, system: System, frames: Mapping[str, Any],
                   grid: Grid, dt: float, frame_interval: float) -> Path:
    """Write frames in memory (field → ``(n_frames, ny, nx)`` or ``(n_experiments,
    n_frames, ny, nx)``, NaN where unobserved) as a dataset of ``system`` at ``path``."""
    arrays = {k: np.asarray(v, np.float32) for k, v in frames.items()}
    arrays = {k: v[None] if v.ndim == 3 else v for k, v in arrays.items()}
    shapes = {v.shape for v in arrays.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ValueError(f"frames must share one shape (n_frames, ny, nx) or (n_experiments, "
                         f"n_frames, ny, nx); got {({k: v.shape for k, v in arrays.items()})}")
    n_experiments, n_frames = next(iter(shapes))[:2]
    steps = round(frame_interval / dt)
    if steps < 1 or abs(steps * dt - frame_interval) > 1e-9 * frame_interval:
        raise ValueError(f"frame_interval={frame_interval} is not a multiple of dt={dt}")
    meta = zd.DatasetMeta(
        system=system_reference(system), fields=tuple(arrays), grid_shape=grid.shape,
        grid_spacing=grid.spacing, boundaries=grid.boundaries, dt=None, steps_per_frame=None,
        t0=0.0, n_frames=n_frames, n_experiments=n_experiments,
        # Frames in memory are observations, not our simulation: they record times only.
        frame_times=tuple(k * float(frame_interval) for k in range(n_frames)))
    masks = {k: np.isfinite(v) for k, v in arrays.items() if not np.isfinite(v).all()}
    zd.write_dataset(path, meta, arrays, masks)
    return Path(path)


def simulate_dataset(system: System | str, path: str | PathLike, *, grid: Grid, dt: float,
                     n_frames: int, steps_per_frame: int, n_experiments: int = 1,
                     seed: int = 0, params: Mapping[str, Any] | None = None,
                     noise_sigma: float = 0.0, noise_kind: str = "additive",
                     integrator: str = "euler", fields: Sequence[str] | None = None,
                     precision: str | None = None, overwrite: bool = False) -> zd.Dataset:
    """Simulate ``system`` (a :class:`~pdefit.System`, or a name as :func:`get_system` takes
    it) into a new dataset at ``path`` and open it: ``n_experiments`` runs from the system's
    initial states (seeds ``seed``, ``seed + 1``, ...) with ``params`` (default: the
    system's defaults), ``n_frames`` frames each ``steps_per_frame`` steps of ``dt`` apart
    with ``integrator``, on ``grid``; ``noise_sigma`` > 0 adds ``noise_kind`` noise
    (``additive`` or ``relative``); ``fields`` names the written fields (default: the state's).
    The same simulation and checks as ``pdefit-simulate`` (:mod:`pdefit.fitting.synthetic`),
    so ``build_problem`` and :func:`fit` can recover ``params`` from it. An existing ``path``
    is replaced only with ``overwrite=True``, and only when it is a pdefit dataset."""
    if Path(path).exists() and not overwrite:
        raise zd.DatasetError(f"{path} already exists; pass overwrite=True to replace it")
    name, options = _system_reference(system)
    if precision is None:
        precision = "float64" if jax.config.jax_enable_x64 else "float32"
    dtype = assemble.set_precision(precision)
    sim = SimulateCommandConfig(
        seed=int(seed), n_experiments=int(n_experiments), n_frames=int(n_frames),
        steps_per_frame=int(steps_per_frame), output=str(path), overwrite=overwrite,
        noise=NoiseConfig(kind=noise_kind if noise_sigma else "none",
                          sigma=float(noise_sigma), seed=int(seed)),
        fields=None if fields is None else list(fields))
    cfg = SimulateMainConfig(
        system=SystemConfig(name=name, options=options, params=dict(params or {}),
                            grid=GridConfig(list(grid.shape), list(grid.spacing),
                                            list(grid.boundaries)),
                            dt=float(dt), integrator=integrator),
        simulate=sim, precision=precision)
    synthetic.simulate_dataset(cfg, Path(path), dtype, log=log.info)
    return open_dataset(path)


def _system_reference(system: System | str) -> tuple[str, dict[str, Any]]:
    """(name, options) that :func:`get_system` builds ``system`` from: a built-in's name, or
    its class's import path; the options are its dataclass fields."""
    if isinstance(system, str):
        return system, {}
    options = ({f.name: getattr(system, f.name) for f in dataclasses.fields(system) if f.init}
               if dataclasses.is_dataclass(system) else {})
    return system_reference(system), options


def optimizer_config(optimizer: str, steps: int | None = None, **options: Any) -> OptimConfig:
    """The optimiser settings of the command line's preset ``conf/optim/<optimizer>.yaml``
    (where there is one), with ``steps`` and ``options`` (fields of
    :class:`pdefit.options.OptimConfig`, e.g. ``lr``, ``grad_tol``) replacing its values."""
    preset_file = files("pdefit.conf") / "optim" / f"{optimizer}.yaml"
    preset = yaml.safe_load(preset_file.read_text()) if preset_file.is_file() else {}
    values = {**(preset or {}), "name": optimizer, **options}
    if steps is not None:
        values["steps"] = steps
    known = {f.name for f in dataclasses.fields(OptimConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown optimizer option(s) {unknown}; valid: {sorted(known)}")
    return OptimConfig(**values)


def fit(setup: FitSetup, *, optimizer: str = "lbfgs", steps: int | None = None,
        progress: bool = False, run_dir: str | PathLike | None = None,
        discretization_check: bool | Mapping[str, Any] = True, uncertainty: bool = True,
        starts: int = 1, shooting: int = 1, continuity: float = 0.03, bootstrap: int = 0,
        recentre: int = 0, **options: Any) -> FitResult:
    """Minimise ``setup``'s loss with ``optimizer`` (``lbfgs``, ``adam``, ``adamw``, ``sgd``,
    ``levenberg_marquardt``) for at most ``steps`` steps; ``options`` are further fields of
    :class:`pdefit.options.OptimConfig` (``lr``, ``grad_tol``, ``patience``, ...), the
    defaults those of the command line's ``optim=<optimizer>``. With ``run_dir`` the fit
    writes ``metrics.jsonl`` and Orbax checkpoints there and resumes from them.
    ``discretization_check``: after the fit, re-run the fitted model at a finer time step
    (the keys of :class:`pdefit.options.DiscretizationCheckConfig`, e.g. ``{"dt_factor": 4,
    "parameters": True}``; False skips it); the result is ``FitResult.discretization``.
    ``uncertainty``: the fitted scalars' 95 % intervals and the residual's verdict
    (``FitResult.uncertainty``, ``.intervals``, ``.residual``; one forward-tangent sweep
    after the fit, as ``fit.uncertainty`` on the command line; False skips them).
    ``starts`` > 1: a multi-start (:mod:`pdefit.fitting.multistart`): the given start and
    ``starts`` − 1 more (its shared scalars × U(0.5, 1.5), seeds 1, 2, ...), each probed for
    10 % of the steps; the fit continues from the best probe (``FitResult.history``'s run
    starts there; ``start`` is the winning start).
    ``shooting`` > 1: first that many segments joined by ``continuity`` × their mean squared
    gaps (:mod:`pdefit.fitting.shooting`; checkpoints in ``run_dir/shooting``), then one
    trajectory from their result, each up to ``steps`` steps (``fit.shooting`` in the CLI).
    ``bootstrap`` ≥ 2: then that many refits of the fitted model's data with fresh noise
    (:mod:`pdefit.fitting.bootstrap`): bias-corrected intervals, ``uncertainty["bootstrap"]``;
    with ``run_dir`` each replicate is kept in its ``bootstrap.json`` and reused on a resume,
    and the one under way checkpoints in ``run_dir/bootstrap/`` (a signal stops it there).
    ``recentre`` ≥ 1: after the fit, that many refits with the fitted fields' background prior
    moved to the last result's fields (``fit.recentre_background``; ``run_dir/recentre-<i>``)."""
    cfg = optimizer_config(optimizer, steps, **options)
    _check_counts(shooting, bootstrap, uncertainty, recentre, setup)
    if starts > 1:
        setup, _ = multistart.choose(
            [setup, *(multistart.perturbed(setup, 0.5, 1.5, i) for i in range(1, starts))],
            cfg, multistart.probe_length(cfg, None), log=log.info)
    problem = setup.problem
    check = _discretization_options(discretization_check, problem)
    curvature = curvature_for(problem) if cfg.name == LEVENBERG_MARQUARDT else None
    out = None if run_dir is None else Path(run_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    identity = _identity(setup, cfg)
    theta0 = setup.theta0
    if shooting > 1:
        theta0 = _shot(setup, cfg, multiple_shooting.Shooting(int(shooting), float(continuity)),
                       identity, out, progress)
    trained, state, history = _trained(setup, cfg, theta0, identity, out, progress, curvature,
                                       int(recentre))
    theta = history.best_theta
    fitted, fields = _fitted_values(problem, theta)
    intervals, report, residual = _assessment(trained, theta, check, uncertainty)
    intervals = _bootstrapped(setup, cfg, curvature, theta, intervals, int(bootstrap),
                              None if out is None else out / "bootstrap.json", int(recentre))
    return FitResult(fitted, fields, dict(setup.start_values), setup.reference,
                     list(history.losses), float(history.best_loss), int(state.step), theta,
                     history, report, stop_reason=history.stop_reason,
                     uncertainty=intervals, residual=residual)


def _identity(setup: FitSetup, cfg: OptimConfig) -> dict[str, Any]:
    """What a resume of :func:`fit` from its run_dir must agree on (the stopping keys of
    optim may change)."""
    problem = setup.problem
    return {"optim": dataclasses.asdict(cfg), "fitted": list(problem.layout.fitted),
            "fields": list(problem.fitted_fields),
            "start": {k: float(v) for k, v in setup.start_values.items()},
            "n_steps": problem.n_steps, "dt": float(problem.dt),
            "integrator": problem.integrator}


def _trained(setup: FitSetup, cfg: OptimConfig, theta0: Any, identity: dict[str, Any],
             out: Path | None, progress: bool, curvature: Any, recentre: int,
             ) -> tuple[FitSetup, Any, FitHistory]:
    """The fit from ``theta0`` (checkpointed in ``out``), then ``recentre`` refits, each from
    the last best θ with the fields' prior centred there (in ``out/recentre-<i>``); the
    setup of the last one with its state and history."""
    problem, steps = setup.problem, {}  # the refits share their compiled step
    for index in range(recentre + 1):
        within = out if out is None or index == 0 else out / f"recentre-{index}"
        state, history = run_fit(
            problem.loss, theta0, setup.batch, cfg, describe=problem.scalar_values,
            progress=progress, log=log.info, curvature=curvature,
            config={**identity, "recentre": index} if index else identity,
            metrics_path=None if within is None else within / "metrics.jsonl",
            checkpoint=None if within is None else CheckpointOptions(within / CHECKPOINT_DIR),
            layout=problem.layout, field_bounds=problem.field_bounds, steps=steps)
        theta0 = history.best_theta
        if index < recentre:
            setup = setup._replace(batch=background.recentred(setup.batch, theta0))
    return setup, state, history


def _check_counts(shooting: Any, bootstrap: Any, uncertainty: bool, recentre: Any,
                  setup: FitSetup) -> None:
    """:func:`fit`'s counts, refused before any work."""
    if int(shooting) != shooting or shooting < 1:
        raise ValueError(f"shooting must be a segment count >= 1, got {shooting!r}")
    if int(recentre) != recentre or recentre < 0 or (
            recentre and not background.available(setup.problem, setup.batch)):
        raise ValueError(f"recentre must be a count >= 0 of refits that move the background "
                         f"prior of fitted initial fields (regularization field_background > 0),"
                         f" got {recentre!r}")
    if bootstrap and (int(bootstrap) != bootstrap or bootstrap < 2 or not uncertainty):
        raise ValueError(f"bootstrap must be 0 or a replicate count >= 2 with uncertainty=True "
                         f"(the replicates' noise is the fit's), got {bootstrap!r}")


def _bootstrapped(setup: FitSetup, cfg: OptimConfig, curvature: Any, theta: Any,
                  intervals: dict[str, Any] | None, count: int,
                  store: Path | None, recentre: int) -> dict[str, Any] | None:
    """``intervals`` with :func:`fit`'s ``bootstrap`` block (unchanged without a count or
    intervals): ``count`` replicates at the noise level the intervals used, each fitted
    from the setup's start as the data were, ``recentre`` refits included (kept in
    ``store`` for a resume; the one under way checkpoints beside it, in ``bootstrap/``)."""
    if not count or intervals is None or not intervals.get("available"):
        return intervals
    problem = setup.problem
    observed = problem.observation.fields
    sigma = intervals.get("sigma_per_field") or {f: intervals["sigma"] for f in observed}
    steps: dict = {}  # the replicates' refits share their compiled step

    def once(batch: Any, theta0: Any, where: Path | None) -> Any:
        return run_fit(problem.loss, theta0, batch, cfg, progress=False, log=log.debug,
                       curvature=curvature, layout=problem.layout,
                       field_bounds=problem.field_bounds,
                       checkpoint=None if where is None else CheckpointOptions(
                           where / CHECKPOINT_DIR),
                       config={"optim": dataclasses.asdict(cfg)}, steps=steps)[1].best_theta

    fitted = fit_bootstrap.replicates(
        problem, setup.batch, setup.theta0, theta, sigma, count,
        background.with_recentring(once, once, recentre), log=log.info, store=store,
        scratch=None if store is None else store.parent / "bootstrap")
    return {**intervals, "bootstrap": fit_bootstrap.summary(problem, theta, fitted)}


def _shot(setup: FitSetup, cfg: OptimConfig, shooting: multiple_shooting.Shooting,
          identity: dict[str, Any], out: Path | None, progress: bool) -> Any:
    """The multiple-shooting stage of :func:`fit` (checkpointed in ``out/shooting``): its best
    θ without the segments, where the fit of one trajectory starts."""
    problem = dataclasses.replace(setup.problem, shooting=shooting)
    within = None if out is None else out / "shooting"
    _, history = run_fit(
        problem.loss, multiple_shooting.with_segments(problem, setup.theta0, setup.batch),
        setup.batch, cfg, describe=problem.scalar_values, progress=progress, log=log.info,
        curvature=curvature_for(problem) if cfg.name == LEVENBERG_MARQUARDT else None,
        config={**identity, "shooting": [shooting.segments, shooting.continuity]},
        metrics_path=None if within is None else within / "metrics.jsonl",
        checkpoint=None if within is None else CheckpointOptions(within / CHECKPOINT_DIR),
        layout=problem.layout, field_bounds=problem.field_bounds)
    return multiple_shooting.with_segments(setup.problem, history.best_theta, setup.batch)


def _discretization_options(requested: bool | Mapping[str, Any], problem: Any,
                            ) -> DiscretizationCheckConfig | None:
    """``fit(discretization_check=...)`` as typed options, checked before the fit (None:
    skipped)."""
    if requested is False:
        return None
    values = {} if requested is True else dict(requested)
    check = typed_options(DiscretizationCheckConfig, values, "discretization_check")
    validate_discretization_check(check, "discretization_check", problem)
    return check


def _fitted_values(problem: Any, theta: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The fitted parameters in physical units (floats for scalars) and initial fields."""
    physical = problem.physical_params(theta)
    fitted = {}
    for name in problem.layout.fitted:
        value = host_array(physical[name])
        fitted[name] = float(value) if np.ndim(value) == 0 else value
    fields = {k: host_array(v) for k, v in theta.get("fields", {}).items()}
    return fitted, fields


def _assessment(setup: FitSetup, theta: Any, check: DiscretizationCheckConfig | None,
                uncertainty: bool) -> tuple[dict | None, dict | None, dict | None]:
    """(intervals, discretization check, residual verdict) of the fitted ``theta``, made
    as the command line makes them for summary.json (each None where skipped)."""
    problem = setup.problem
    intervals, curvature = None, None
    if uncertainty:
        intervals, curvature = outcome.intervals(problem, theta, setup.batch,
                                                 _recorded_noise(setup), log=log.info)
    report = None
    if check is not None and check.enabled:
        report = discretization.check(problem, theta, setup.batch, check, setup.meta,
                                      log=log.info, curvature=curvature)
        if report["verdict"] == discretization.WARNING:
            log.warning(report["message"])
    if intervals is None:
        return None, report, None
    if report is not None:
        intervals = discretization.mark_intervals(intervals, report)
    return intervals, report, outcome.residual_verdict(intervals)


def _recorded_noise(setup: FitSetup) -> Mapping[str, Any] | None:
    """The dataset's noise record, where its data come from the fitted system (another
    system's data carry that system's error too, which the noise level does not cover)."""
    meta = setup.meta
    if meta is None or not (meta.system == "" or made_by(meta.system, setup.problem.system)):
        return None
    return meta.noise
