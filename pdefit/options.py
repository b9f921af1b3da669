"""The typed options of every pdefit run: frozen dataclasses, one per config group, and the
error a bad option raises. They are the vocabulary all layers share: the command lines turn
their Hydra config into a :class:`FitConfig` once (:mod:`pdefit.app.config`), the Python API
(:func:`pdefit.build_problem`) builds one directly, and everything below takes these typed
options or plain values. No Hydra or OmegaConf here.

Keys that name system parameters or fields (``system.params``, ``fit.start``, ...) are free
dicts here and checked against the chosen system when the fit is assembled, which names the
offending key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# OmegaConf's marker of a value that must be given (its MISSING), spelt out so that this
# module needs no OmegaConf: Hydra reports such a key as missing before anything runs.
MISSING: Any = "???"


class ConfigError(ValueError):
    """A configuration that cannot describe a valid run; the message names the key."""


@dataclass(frozen=True)
class GridConfig:
    shape: list[int] = field(default_factory=lambda: [64, 64])
    spacing: list[float] = field(default_factory=lambda: [1.0, 1.0])
    boundaries: list[str] = field(default_factory=lambda: ["neumann", "neumann"])


@dataclass(frozen=True)
class SystemConfig:
    # A built-in name, an import path "package.module:Class" or a pdefit.systems entry point
    # (pdefit.model.system.system_class); conf/system/<name>.yaml sets it.
    name: str = MISSING  # a value Hydra and the API must set
    options: dict[str, Any] = field(default_factory=dict)
    params: dict[str, float] = field(default_factory=dict)  # overrides of the system defaults
    grid: GridConfig = field(default_factory=GridConfig)
    dt: float = 0.05
    integrator: str = "euler"


@dataclass(frozen=True)
class NoiseConfig:
    kind: str = "none"  # none | additive | relative
    sigma: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class RefineConfig:
    """A dataset the fit's own discretization did not make (no "inverse crime"): simulate
    with time step ``system.dt / dt_factor`` (``steps_per_frame × dt_factor`` steps per frame,
    the same frame times) on the grid refined ``grid_factor`` times per axis, the initial
    state interpolated to it and every frame block-averaged back to ``system.grid``
    (pdefit.fitting.discretization). Refining the grid needs a system that declares it can."""

    dt_factor: int = 1
    grid_factor: int = 1


@dataclass(frozen=True)
class SimulateConfig:
    """How a synthetic dataset is made (``pdefit-simulate``, or ``pdefit-fit`` without data)."""

    seed: int = 0
    n_experiments: int = 1
    n_frames: int = 21
    steps_per_frame: int = 20
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    output: str = "data.zarr"
    frames_per_shard: int = 16
    # The system that makes the data, when it is not the fitted one (a surrogate fit, e.g.
    # a cheap model fitted to a detailed model's data); None: the fitted ``system``.
    system: SystemConfig | None = None
    # A job array (slurm/simulate.sbatch): this is task `task` of `tasks`, each writing a
    # contiguous block of the experiments; tasks=1 writes everything.
    task: int = 0
    tasks: int = 1
    # The names written to the dataset: state fields and/or the system's observables (e.g.
    # velocity components of a vorticity model); None: the state fields.
    fields: list[str] | None = None
    # Per-experiment truths: parameter -> {low, high}, each experiment's value drawn
    # uniformly (seeded by `seed`); with center_per_experiment the draws are shifted to mean
    # zero, the frame a fit with a small L2 prior on them recovers (only differences between
    # experiments are observable when a shared field can absorb a common offset).
    per_experiment: dict[str, Any] = field(default_factory=dict)
    center_per_experiment: bool = True
    # Array-valued truths: parameter -> options of the system's synthetic_param(name, ...)
    # (e.g. a smooth random force field), stored in the dataset as true_<name>.
    arrays: dict[str, Any] = field(default_factory=dict)
    # Observation masks: options of the system's observation_mask(grid, times, ...) (e.g.
    # a polar cap growing in time); empty: every point observed.
    mask: dict[str, Any] = field(default_factory=dict)
    refine: RefineConfig = field(default_factory=RefineConfig)


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None  # None: simulate first (the embedded default)
    frames: list[int] | None = None  # frame indices used for training; None: all
    experiments: list[int] | None = None  # None: all
    # A dataset of another system (a surrogate fit): its name, which must match the dataset's.
    # Only the observed fields are then taken from it; the model's other initial fields are
    # fitted. None: the dataset must come from the fitted system.
    system: str | None = None
    time_scale: float = 1.0  # dataset time units per model time unit (e.g. ms → model units)


@dataclass(frozen=True)
class ObserveConfig:
    fields: list[str] = field(default_factory=lambda: ["u", "v"])
    stride: int = 1
    loss: str = "mse"  # mse | relative_mse
    field_weights: dict[str, float] = field(default_factory=dict)
    nan: str = "error"  # error: NaN/Inf outside the mask is rejected; mask: NaN means missing
    # The data's additive noise level σ: one number, or field -> number for every observed
    # field (null: the level the dataset records, if any, else estimated from the residual).
    # Each field's misfit is weighted by 1/σ_f² (relative to their mean, so one field, or
    # equal levels, leave the loss as it is), and the intervals and the residual verdict
    # (reduced χ²) take σ as known. For a recording whose file records none.
    noise_sigma: Any = None


@dataclass(frozen=True)
class PerturbConfig:
    low: float = 0.5
    high: float = 1.5
    seed: int = 0


@dataclass(frozen=True)
class ShootingConfig:
    """Multiple shooting (pdefit.fitting.shooting): with ``segments`` > 1 every stage but the
    last cuts its window into that many segments, each from a fitted state of its own, joined
    by ``continuity`` × the mean squared gap per field (in the misfit's units); the last stage
    (added when there is one stage) fits one trajectory from the result."""

    segments: int = 1
    continuity: float = 0.03


@dataclass(frozen=True)
class DiscretizationCheckConfig:
    """After the fit, the fitted model is run again over the training window at
    ``system.dt / dt_factor`` (and, with ``grid_factor`` > 1, on the grid refined that many
    times where the system allows it) and the change in the predicted observations is
    compared with the residual (pdefit.fitting.discretization): a warning names the knob to turn
    when RMS change / RMS residual exceeds ``tolerance`` and RMS change / RMS of the data exceeds
    ``negligible``. With ``parameters``, also how far the optimum of the fitted shared
    scalars moves at the finer time step (a Gauss–Newton step: one more gradient, on the
    intervals' curvature; refused before the fit where there is none); it then decides for
    the time step, warning when a parameter moves by more than ``parameter_tolerance``
    (relative). ``grid_factor`` > 1 on a grid that cannot be refined is refused too."""

    enabled: bool = True
    dt_factor: int = 2
    grid_factor: int = 1
    tolerance: float = 0.1
    negligible: float = 0.0
    parameters: bool = False
    parameter_tolerance: float = 0.001


@dataclass(frozen=True)
class FitSpecConfig:
    params: list[str] = field(default_factory=list)  # names of fitted parameters
    start: dict[str, float] = field(default_factory=dict)  # explicit starting values
    # A finished run's directory (or its fitted.npz): fitted parameters start from its
    # values (shapes must match), fitted fields too where their shapes match (another grid:
    # they start as usual; their prior's background stays the system's first guess).
    # fit.start still wins.
    start_from: str | None = None
    # start = reference × U(low, high), the reference being the dataset truth when known
    perturb: PerturbConfig | None = field(default_factory=PerturbConfig)
    transforms: dict[str, str] = field(default_factory=dict)  # per-parameter override
    # field -> fit (fitted with the parameters) | data (a known initial state: the dataset's
    # first frame, e.g. in a twin experiment). A field that is not observed must be named here
    # unless the system derives it from the observed fields (state_from_observables); it never
    # starts from the dataset's first frame silently (that is a truth no recording has).
    initial_fields: dict[str, str] = field(default_factory=dict)
    # Keep fitted initial fields in the ranges their system declares (its field_bounds, e.g.
    # BOCF's gates in [0, 1]): every step projects them there. false: unbounded.
    bound_fields: bool = True
    # Fitted parameters with one value per experiment (e.g. an alignment); the others are
    # shared by all experiments.
    per_experiment: list[str] = field(default_factory=list)
    # Per-experiment parameters constrained to zero mean over the experiments (the physical
    # value is the fitted row minus the mean row), e.g. alignments only defined relative to
    # each other.
    centered: list[str] = field(default_factory=list)
    # Growing training windows: frame counts of successive stages (the last stage sees all
    # frames), each starting from the previous one's result. None: one stage.
    stages: list[int] | None = None
    # Parameters held at their current values during the first N stages of a staged fit
    # ({name: N}), fitted from stage N + 1 on: e.g. `+fit.hold.NAME=1` keeps NAME at its
    # start in the first, shortest window, whose data barely see it; N = 0: not held.
    # null (`fit.hold=null`) drops an experiment's whole hold, which `fit.hold={}` cannot:
    # Hydra merges a mapping into the one it overrides.
    hold: dict[str, int] | None = field(default_factory=dict)
    # Multiple shooting over the training window (segments: 1 = one trajectory).
    shooting: ShootingConfig = field(default_factory=ShootingConfig)
    # After the last stage, this many more fits of the whole window, each with the fitted
    # fields' background prior (regularization.field_background) moved to the previous fit's
    # fields: proximal iterations that take the prior's pull towards a wrong first guess
    # out of the estimate (0: the prior stays at the first guess).
    recentre_background: int = 0
    # Standard errors and 95 % intervals of the fitted shared scalars after the fit
    # (pdefit.fitting.uncertainty): one forward-tangent sweep over the training window.
    uncertainty: bool = True
    # Re-run the fitted model with a finer time step (and grid) and compare (one or two
    # forward runs after the fit).
    discretization_check: DiscretizationCheckConfig = field(
        default_factory=DiscretizationCheckConfig)
    # Multi-start (pdefit.fitting.multistart): `starts` start points — the configured one and
    # starts − 1 more drawn as fit.perturb draws its start, with seeds perturb.seed + i — each
    # run for start_probe_steps optimiser steps (null: 10 % of optim.steps, at least 1) on the
    # first training window; the fit continues from the best point of the lowest probe loss.
    starts: int = 1
    start_probe_steps: int | None = None
    # Parametric bootstrap (pdefit.fitting.bootstrap): after the fit, `bootstrap` (0: none,
    # else ≥ 2) refits of the last stage on replicates of the data made by the fitted model
    # with fresh noise; summary.json's uncertainty.bootstrap: bias, corrected estimate, interval.
    bootstrap: int = 0


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adam"  # adam | adamw | sgd | lbfgs
    lr: float = 0.05
    steps: int = 300
    schedule: str = "cosine"  # constant | cosine | exponential
    final_lr_fraction: float = 0.01
    warmup_steps: int = 0
    clip: float | None = 1.0  # global-norm gradient clipping; null disables
    nan_lr_factor: float = 0.5  # on a non-finite loss/gradient the step is skipped, lr scaled
    max_nan_failures: int = 5
    grad_tol: float = 0.0  # stop once |grad| <= grad_tol * |initial grad|
    patience: int | None = None  # stop once the loss has not improved in this many steps
    # Step control against run-off (pdefit.fitting.optimisers.StepLimits): no log-transformed
    # parameter changes by more than a factor exp(max_log_step) per step (2.302585 = ln 10: a
    # factor of 10; its step is clipped); null: no limit. Each step is then projected onto
    # the parameters' bounds (ParamSpec lower/upper).
    max_log_step: float | None = 2.302585
    # Run-off detection: the fit stops as `diverged` (keeping its best point) once its loss
    # exceeds divergence_factor × its best loss, or once a parameter has sat on one of its
    # bounds for max_steps_at_bound steps in a row; null disables either rule.
    divergence_factor: float | None = 1000.0
    max_steps_at_bound: int | None = 10
    # Levenberg–Marquardt with fitted initial fields (pdefit.fitting.krylov): at most this
    # many conjugate-gradient iterations per step, each one forward-tangent and one adjoint
    # run, stopping early at this relative residual.
    krylov_iterations: int = 20
    krylov_rtol: float = 0.01
    # Their preconditioner: "diagonal" scales each parameter by its Gauss–Newton diagonal and
    # each field by one number; "parameter_block" inverts the parameters' whole damped block.
    krylov_preconditioner: str = "diagonal"
    # "reduced": each step fits the fields alone first (reduced_field_steps matrix-free
    # steps), then steps the parameters on the Schur complement of the fields (k + 1 field
    # solves of at most reduced_solve_iterations iterations), refitting the fields after it,
    # at most reduced_tries trust radii a step (pdefit.fitting.reduced_steps). "joint":
    # fields and parameters in one conjugate-gradient solve.
    parameter_step: str = "joint"
    # At most this many steps in a stage that takes reduced steps (each costs tens of joint
    # steps' sweeps; stages that fit the fields alone keep optim.steps); null: optim.steps.
    reduced_steps: int | None = None
    reduced_field_steps: int = 10
    reduced_solve_iterations: int = 100
    reduced_tries: int = 3
    # The trust radius of a stage's first reduced step: the Euclidean length of the
    # parameters' step in their unconstrained coordinates (0.1: about 10 % of a log one).
    reduced_radius: float = 0.1
    # Levenberg–Marquardt's damping λ at the start (relative to the scaling D): 1 takes a
    # first step half as long as Gauss–Newton's, safer from a poor first guess of fields.
    initial_damping: float = 1e-3


@dataclass(frozen=True)
class AdjointConfig:
    kind: str = "revolve"  # store_all | nested | revolve
    snapshots: int | None = 32  # revolve; null: derive from memory_budget_mb
    memory_budget_mb: float | None = None
    levels: int = 2  # nested


@dataclass(frozen=True)
class RegularizationConfig:
    params: float = 0.0  # L2 weight on every fitted parameter's distance from its default
    fields: float = 0.0
    param_l2: dict[str, float] = field(default_factory=dict)  # per-parameter L2 weight
    smoothness: dict[str, float] = field(default_factory=dict)  # array parameter -> weight
    system: dict[str, float] = field(default_factory=dict)  # system.penalties(grid) name -> weight
    # The prior of fitted initial fields (pdefit.fitting.problem.Regularization): the weight
    # of the mean square of a field's distance from its first guess, and of the mean squared
    # difference of neighbouring cells.
    field_background: float = 0.0
    field_smoothness: float = 0.0


@dataclass(frozen=True)
class RunConfig:
    dir: str | None = None  # None: Hydra's output directory (runs/fit/<name>, see conf/fit.yaml)
    name: str | None = None  # None: named after the command-line overrides ("default": none)
    resume: bool = True  # continue from the run directory's checkpoints; false: delete them
    checkpoint_every: int = 25  # optimiser steps between Orbax checkpoints (one more at the end)
    checkpoint_keep: int = 3  # how many checkpoints to keep
    log_every: int = 25
    progress: bool = True
    plots: bool = True


@dataclass(frozen=True)
class MeshConfig:
    """Devices: ``shape`` = [py, px] tiles of the grid, ``experiments`` devices along the
    experiment axis; ``all_devices`` lays every device of the run along x instead ([1, n])."""

    shape: list[int] = field(default_factory=lambda: [1, 1])
    experiments: int = 1
    all_devices: bool = False


@dataclass(frozen=True)
class DistributedConfig:
    """Explicit multi-process settings; left empty, Slurm (srun) or MPI (mpiexec) is detected
    from the environment, and a single process needs nothing."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclass(frozen=True)
class RankConfig:
    """``pdefit-rank``: multiply each parameter by ``factor`` and rank by trajectory MAE over
    the simulated window (``simulate.*``)."""

    factor: float = 1.5
    params: list[str] | None = None  # None: all parameters of the system
    top: int = 10  # how many to print as a ready ``fit.params`` list


@dataclass(frozen=True)
class EvaluateConfig:
    """``pdefit-evaluate``: forecast the fitted model past its training window against the
    truth (the data-generating simulation). Times are in the dataset's units."""

    horizon: float | None = None  # forecast end; None: 4 × the training window
    frame_interval: float | None = None  # None: the dataset's frame interval
    threshold: float = 0.05  # forecast valid while MAE / range of the truth stays below this
    field: str | None = None  # the field of the maps and traces; None: the first observed
    # Upstroke level of that field for activation (peak) times; None: no activation metric.
    activation_level: float | None = 0.5
    maps_at: list[float] | None = None  # times of difference maps; None: 4 spread over horizon
    lyapunov_perturbation: float = 1e-6  # size of the nearby trajectories' initial offset
    lyapunov_directions: int = 4  # seeded random perturbation directions (twins) of the truth
    # The truth is at rest once fewer than this share of its points is active (the system's
    # `activity`, else still changing; pdefit/analysis/activity.py) to the horizon.
    min_active_fraction: float = 0.05
    # Finished fits of the same truth (run directories) whose forecasts are plotted with this
    # one's, e.g. a BOCF refit next to its Aliev–Panfilov surrogate (the seed paper's Fig. 2c).
    # (dataclasses.field: `field` is one of this class's keys)
    compare: list[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class FitConfig:
    system: SystemConfig = field(default_factory=SystemConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    fit: FitSpecConfig = field(default_factory=FitSpecConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    adjoint: AdjointConfig = field(default_factory=AdjointConfig)
    regularization: RegularizationConfig = field(default_factory=RegularizationConfig)
    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    rank: RankConfig = field(default_factory=RankConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    precision: str = "float32"  # float32 | float64


@dataclass(frozen=True)
class SimulateCommandConfig(SimulateConfig):
    """``pdefit-simulate``'s ``simulate``: also whether an existing ``output`` may be
    replaced."""

    overwrite: bool = False


@dataclass(frozen=True)
class SimulateMainConfig:
    system: SystemConfig = field(default_factory=SystemConfig)
    simulate: SimulateCommandConfig = field(default_factory=SimulateCommandConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    precision: str = "float32"
