"""The Bueno-Orovio–Cherry–Fenton (BOCF) minimal model of human ventricular action potentials
(Bueno-Orovio, Cherry & Fenton, J. Theor. Biol. 253:544, 2008), four fields u, v, w, s:

    du/dt = ∇·(D ∇u) − (J_fi + J_so + J_si) + J_stim(t)
    dv/dt = (1 − H(u − θv)) (v∞ − v)/τv⁻ − H(u − θv) v/τv⁺
    dw/dt = (1 − H(u − θw)) (w∞ − w)/τw⁻ − H(u − θw) w/τw⁺
    ds/dt = ((1 + tanh(k_s (u − u_s)))/2 − s)/τs

    J_fi = −v H(u − θv) (u − θv)(u_u − u)/τfi
    J_so = (u − u_o)(1 − H(u − θw))/τo + H(u − θw)/τso
    J_si = −H(u − θw) w s/τsi

with τv⁻, τw⁻, τso, τs, τo, v∞, w∞ switched or blended by u as in the paper (see ``_currents``).

Conventions:
- Units: time in ms; u is dimensionless (V[mV] = 85.7 u − 84); space in mm, so the default
  D = 0.1171 mm²/ms is the paper's tissue value (1.171 cm²/s). The seed paper's lattice
  (dx = 1 "grid unit", D = 0.1 grid²/ms) is the same model with ``spacing=1, D=0.1``;
  conf/system/bocf.yaml uses that.
- Heaviside: H(x) = 1 for x > 0, else 0 (so H(0) = 0); v∞ = 1 − H(u − θv⁻). Codes differ only
  on the measure-zero set u = θ exactly.
- Rest state (u, v, w, s) = (0, 1, 1, 0); the tissue is meant to have no-flux boundaries.
- Parameter names spell the paper's symbols in ASCII: ``tau_v1_minus`` is τv1⁻,
  ``theta_v`` is θv, ``w_inf_star`` is w∞*, ``tau_w_inf`` is the (dimensionless) τw∞.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.model.params import ParamSpec
from pdefit.model.system import check_option, stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.numerics.stencils import (
    LAPLACIAN_RADIUS,
    LAPLACIANS,
    laplacian,
    laplacian_spectral_radius,
)

# The 28 published parameters, in the paper's table order: name -> (EPI, ENDO, M, PB, TNNP).
PARAMETER_SETS_ORDER = ("EPI", "ENDO", "M", "PB", "TNNP")
_TABLE: dict[str, tuple[float, float, float, float, float]] = {
    "u_o": (0.0, 0.0, 0.0, 0.0, 0.0),
    "u_u": (1.55, 1.56, 1.61, 1.45, 1.58),
    "theta_v": (0.3, 0.3, 0.3, 0.35, 0.3),
    "theta_w": (0.13, 0.13, 0.13, 0.13, 0.015),
    "theta_v_minus": (0.006, 0.2, 0.1, 0.175, 0.015),
    "theta_o": (0.006, 0.006, 0.005, 0.006, 0.006),
    "tau_v1_minus": (60.0, 75.0, 80.0, 10.0, 60.0),
    "tau_v2_minus": (1150.0, 10.0, 1.4506, 1150.0, 1150.0),
    "tau_v_plus": (1.4506, 1.4506, 1.4506, 1.4506, 1.4506),
    "tau_w1_minus": (60.0, 6.0, 70.0, 140.0, 70.0),
    "tau_w2_minus": (15.0, 140.0, 8.0, 6.25, 20.0),
    "k_w_minus": (65.0, 200.0, 200.0, 65.0, 65.0),
    "u_w_minus": (0.03, 0.016, 0.016, 0.015, 0.03),
    "tau_w_plus": (200.0, 280.0, 280.0, 326.0, 280.0),
    "tau_fi": (0.11, 0.1, 0.078, 0.105, 0.11),
    "tau_o1": (400.0, 470.0, 410.0, 400.0, 6.0),
    "tau_o2": (6.0, 6.0, 7.0, 6.0, 6.0),
    "tau_so1": (30.0181, 40.0, 91.0, 30.0181, 43.0),
    "tau_so2": (0.9957, 1.2, 0.8, 0.9957, 0.2),
    "k_so": (2.0458, 2.0, 2.1, 2.0458, 2.0),
    "u_so": (0.65, 0.65, 0.6, 0.65, 0.65),
    "tau_s1": (2.7342, 2.7342, 2.7342, 2.7342, 2.7342),
    "tau_s2": (16.0, 2.0, 4.0, 16.0, 3.0),
    "k_s": (2.0994, 2.0994, 2.0994, 2.0994, 2.0994),
    "u_s": (0.9087, 0.9087, 0.9087, 0.9087, 0.9087),
    "tau_si": (1.8875, 2.9013, 3.3849, 1.8875, 2.8723),
    "tau_w_inf": (0.07, 0.0273, 0.01, 0.175, 0.07),
    "w_inf_star": (0.94, 0.78, 0.5, 0.9, 0.94),
}
# name -> (unit, doc). All are positive in every set except u_o, so all but u_o are fitted in
# log space (relative changes, positivity kept); u_o = 0 is fitted as is, on a scale of 0.1.
_DOCS: dict[str, tuple[str, str]] = {
    "D": ("mm²/ms", "diffusion coefficient (0.1 grid²/ms on the seed paper's dx = 1 lattice)"),
    "u_o": ("1", "reversal level of the slow outward current below θw"),
    "u_u": ("1", "upper zero of the fast inward current (the upstroke's target)"),
    "theta_v": ("1", "θv: threshold of the fast inward current and of v's inactivation"),
    "theta_w": ("1", "θw: threshold of the slow currents and of w's inactivation"),
    "theta_v_minus": ("1", "θv⁻: switches τv⁻ between τv1⁻ and τv2⁻, and v∞"),
    "theta_o": ("1", "θo: switches τo between τo1 and τo2, and w∞"),
    "tau_v1_minus": ("ms", "τv1⁻: v recovery time for u ≤ θv⁻"),
    "tau_v2_minus": ("ms", "τv2⁻: v recovery time for θv⁻ < u ≤ θv"),
    "tau_v_plus": ("ms", "τv⁺: v inactivation time above θv"),
    "tau_w1_minus": ("ms", "τw1⁻: w recovery time at low u"),
    "tau_w2_minus": ("ms", "τw2⁻: w recovery time at higher u (below θw)"),
    "k_w_minus": ("1", "kw⁻: steepness of the τw⁻ blend"),
    "u_w_minus": ("1", "uw⁻: midpoint of the τw⁻ blend"),
    "tau_w_plus": ("ms", "τw⁺: w inactivation time above θw"),
    "tau_fi": ("ms", "τfi: time constant of the fast inward (sodium-like) current"),
    "tau_o1": ("ms", "τo1: time constant of the outward current for u ≤ θo"),
    "tau_o2": ("ms", "τo2: time constant of the outward current for θo < u ≤ θw"),
    "tau_so1": ("ms", "τso1: slow outward time constant at low u (sets the plateau length)"),
    "tau_so2": ("ms", "τso2: slow outward time constant at high u"),
    "k_so": ("1", "k_so: steepness of the τso blend"),
    "u_so": ("1", "u_so: midpoint of the τso blend"),
    "tau_s1": ("ms", "τs1: s time constant for u ≤ θw"),
    "tau_s2": ("ms", "τs2: s time constant for u > θw"),
    "k_s": ("1", "k_s: steepness of s∞"),
    "u_s": ("1", "u_s: midpoint of s∞"),
    "tau_si": ("ms", "τsi: time constant of the slow inward (calcium-like) current"),
    "tau_w_inf": ("1", "τw∞: slope scale of w∞ = 1 − u/τw∞ below θo (dimensionless)"),
    "w_inf_star": ("1", "w∞*: w target for u > θo"),
}
D_TISSUE = 0.1171  # mm²/ms, the paper's isotropic human ventricular value


def parameter_values(parameter_set: str) -> dict[str, float]:
    """The published values of one set (plus the tissue D) as plain floats."""
    if parameter_set not in PARAMETER_SETS_ORDER:
        raise ValueError(f"unknown BOCF parameter set {parameter_set!r}; choose one of "
                         f"{list(PARAMETER_SETS_ORDER)}")
    column = PARAMETER_SETS_ORDER.index(parameter_set)
    return {"D": D_TISSUE, **{name: row[column] for name, row in _TABLE.items()}}


# Physical bounds (lower, upper), wide around all five published sets and their starts at
# × U(0.5, 1.5), so that a fit's steps stay in the model's meaningful range (the step
# control projects onto them; a start outside is refused). u is dimensionless (1 ≈ 86 mV,
# the upstroke's target u_u ≈ 1.6): thresholds and levels in (0, 3]; steepnesses (1/u) in
# [0.1, 1000]; time constants in [0.01, 10⁴] ms; gate targets (≤ 1) below 2; D in
# [1e-4, 10] mm²/ms.
_LEVELS = ("u_u", "theta_v", "theta_w", "theta_v_minus", "theta_o", "u_w_minus", "u_so", "u_s")
_STEEPNESSES = ("k_w_minus", "k_so", "k_s")


def _bounds(name: str) -> tuple[float, float]:
    if name in _LEVELS:
        return 0.0, 3.0
    if name in _STEEPNESSES:
        return 0.1, 1000.0
    if name.startswith("tau_") and name != "tau_w_inf":
        return 0.01, 1e4
    return {"D": (1e-4, 10.0), "tau_w_inf": (1e-3, 10.0), "w_inf_star": (0.0, 2.0),
            "u_o": (-1.0, 1.0)}[name]


def _specs(parameter_set: str) -> dict[str, ParamSpec]:
    out = {}
    for name, value in parameter_values(parameter_set).items():
        unit, doc = _DOCS[name]
        lower, upper = _bounds(name)
        if name == "u_o":
            out[name] = ParamSpec(value, "identity", lower, upper, scale=0.1, unit=unit,
                                  doc=doc)
        else:
            out[name] = ParamSpec(value, "log", lower, upper, unit=unit, doc=doc)
    return out


# Built once: the system hands out copies (a property per instance, because the defaults
# depend on the static option `parameter_set`).
_SPECS = {name: _specs(name) for name in PARAMETER_SETS_ORDER}


def _heaviside(x, width: float = 0.0):
    """H(x) = 1 for x > 0, else 0, in the dtype of x; with ``width`` > 0 the logistic ramp
    1 / (1 + exp(−x / width)) instead."""
    if width:
        return jax.nn.sigmoid(x / width)
    return (x > 0).astype(x.dtype)


@functools.cache
def _sharp_with_smooth_derivative(width: float):
    """H(x) = 1 for x > 0, else 0, whose derivative is that of the logistic ramp of
    ``width``: the sharp model forward, a surrogate derivative for Gauss–Newton steps."""

    @jax.custom_jvp
    def step(x):
        return (x > 0).astype(x.dtype)

    @step.defjvp
    def _derivative(primals, tangents):
        (x,), (dx,) = primals, tangents
        ramp = jax.nn.sigmoid(x / width)
        return step(x), ramp * (1.0 - ramp) / width * dx

    return step


def _switched_relaxation(h, target_below, tau_below, tau_above):
    """dy/dt = (1 − h)(target_below − y)/tau_below − h y/tau_above, which is linear in y, as a
    (target, time constant) pair; for h = 0 or 1 exactly one of the two branches."""
    rate = (1.0 - h) / tau_below + h / tau_above
    return (1.0 - h) * target_below / tau_below / rate, 1.0 / rate


@dataclass(frozen=True)
class BOCF:
    """Four-variable minimal ventricular model.

    Options (all static):
    - ``parameter_set``: ``"EPI"`` (default), ``"ENDO"``, ``"M"``, ``"PB"`` or ``"TNNP"``: the
      defaults of ``params`` (the seed paper's tissue runs use TNNP).
    - ``laplacian``: ``"5pt"`` or ``"9pt"``.
    - ``stimulus_amplitude`` (1/ms; 0 = no stimulus), ``stimulus_period``,
      ``stimulus_duration``, ``stimulus_start`` (ms): a periodic square current added to du/dt
      in every cell, for single-cell pacing (the published protocol is 0.5/ms for 1 ms).
    - ``initial``: ``"stimuli"`` (from rest, ``init_stimuli`` random squares of u += 1 spread
      over ``init_duration`` ms: broken fronts and spirals; the default is the seed paper's
      protocol, 30 stimuli each followed by 150 ms)
      or ``"rest"``; ``init_square`` is the side of a square in cells (0: a tenth of the
      smaller grid side, at least 2). ``"s1s2"``: a cross-field S1–S2 spiral (``_s1s2_state``;
      ``s2_at``, ``s2_delay``, ``init_settle``), which lasts at the seed paper's settings
      where the random stimuli die out (128², D = 0.1 and 512², D = 0.2).
    - ``heaviside_width`` (0 = the published, sharp model): H(x) becomes the logistic ramp
      1/(1 + e^(−x/width)). In discrete time a cell whose crossing of a threshold moves by one
      step changes its gates by a finite jump, so the sharp model's loss is a staircase at
      small scales (≈ 1e-6 on the tests' 32² window), where gradient methods stall a few per
      cent from the truth; the ramp makes it continuous.
    - ``heaviside_gradient_width`` (0 = exact derivatives; only with ``heaviside_width`` 0):
      the sharp model forward, but H's derivative taken as the logistic ramp's of this width
      (a surrogate derivative). Exact AD of the sharp model sees no threshold crossing move:
      on a long noisy window its Gauss–Newton steps are all rejected, where the surrogate's
      descend (docs/benchmarks.md, issue 24). Gradients are then no longer the loss's own.
    """

    parameter_set: str = "EPI"
    laplacian: str = "5pt"
    stimulus_amplitude: float = 0.0
    stimulus_period: float = 1000.0
    stimulus_duration: float = 1.0
    stimulus_start: float = 0.0
    initial: str = "stimuli"
    init_stimuli: int = 30
    init_duration: float = 4500.0
    init_square: int = 0
    s2_at: float = 0.5
    s2_delay: float = 0.0
    init_settle: float = 200.0
    heaviside_width: float = 0.0
    heaviside_gradient_width: float = 0.0

    name: ClassVar[str] = "bocf"
    fields: ClassVar[tuple[str, ...]] = ("u", "v", "w", "s")
    stencil_radius: ClassVar[int] = LAPLACIAN_RADIUS
    rest: ClassVar[dict[str, float]] = {"u": 0.0, "v": 1.0, "w": 1.0, "s": 0.0}
    # The gates relax towards targets in [0, 1] (v∞ ∈ {0, 1}, w∞ ∈ [w∞*, 1] for u ≥ 0,
    # s∞ = (1 + tanh)/2), so no state the model reaches from tissue has a gate outside it; a
    # fit of their initial values is kept there (pdefit.model.system, field_bounds). Unbounded,
    # the fitted gates of voltage-only fits ran to −2.7 … 3.2 (docs/benchmarks.md).
    field_bounds: ClassVar[dict[str, tuple[float, float]]] = {
        "v": (0.0, 1.0), "w": (0.0, 1.0), "s": (0.0, 1.0)}
    # Excited tissue, for the evaluator's active fraction (pdefit/analysis/activity.py).
    activity: ClassVar[tuple[str, float]] = ("u", 0.5)
    # Cell-centred fields, nothing tied to the cell count: data may be simulated on a refined
    # grid (simulate.refine.grid_factor) and a fit checked on one
    # (pdefit/fitting/discretization.py).
    refinable_grid: ClassVar[bool] = True
    time_unit: ClassVar[str] = "ms"
    space_unit: ClassVar[str] = "mm"
    field_info: ClassVar[dict[str, tuple[str, str]]] = {
        "u": ("1", "transmembrane potential, scaled (V = 85.7 u − 84 mV)"),
        "v": ("1", "fast inward current gate v"),
        "w": ("1", "slow inward current gate w"),
        "s": ("1", "slow gate s"),
    }

    def __post_init__(self) -> None:
        check_option("parameter set", self.parameter_set, list(PARAMETER_SETS_ORDER))
        check_option("Laplacian", self.laplacian, sorted(LAPLACIANS))
        check_option("initial-state generator (initial)", self.initial, ("stimuli", "s1s2", "rest"))
        if self.stimulus_amplitude and not (
                self.stimulus_period > 0 and 0 < self.stimulus_duration <= self.stimulus_period):
            raise ValueError("the stimulus needs period > 0 and 0 < duration <= period")
        if self.init_stimuli < 0 or self.init_duration < 0 or self.init_square < 0:
            raise ValueError("init_stimuli, init_duration and init_square must be >= 0")
        if not 0 < self.s2_at < 1:
            raise ValueError(f"s2_at must lie strictly between 0 and 1, got {self.s2_at}")
        for name in ("s2_delay", "init_settle"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("heaviside_width", "heaviside_gradient_width"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.heaviside_width and self.heaviside_gradient_width:
            raise ValueError("heaviside_gradient_width is a derivative for the sharp model "
                             "(heaviside_width 0); with a smoothed model set only one of them")

    @property
    def params(self) -> dict[str, ParamSpec]:
        return dict(_SPECS[self.parameter_set])

    # -- the model ------------------------------------------------------------------------------

    def _currents(self, state, p):
        """Total ionic current J_fi + J_so + J_si and the gate targets/time constants."""
        u, v, w, s = state["u"], state["v"], state["w"], state["s"]
        width = self.heaviside_width
        if self.heaviside_gradient_width:  # only with width 0 (__post_init__)
            heaviside = _sharp_with_smooth_derivative(self.heaviside_gradient_width)
        else:
            heaviside = functools.partial(_heaviside, width=width)
        h_v = heaviside(u - p["theta_v"])
        h_w = heaviside(u - p["theta_w"])
        h_vm = heaviside(u - p["theta_v_minus"])
        h_o = heaviside(u - p["theta_o"])

        tau_o = (1.0 - h_o) * p["tau_o1"] + h_o * p["tau_o2"]
        tau_so = p["tau_so1"] + (p["tau_so2"] - p["tau_so1"]) * 0.5 * (
            1.0 + jnp.tanh(p["k_so"] * (u - p["u_so"])))
        j_fi = -v * h_v * (u - p["theta_v"]) * (p["u_u"] - u) / p["tau_fi"]
        j_so = (u - p["u_o"]) * (1.0 - h_w) / tau_o + h_w / tau_so
        j_si = -h_w * w * s / p["tau_si"]

        # Each gate relaxes linearly in itself, with a target and time constant that switch at
        # a threshold; above it the target is 0 (pure decay with the "+" time constant). This
        # pair form is the ODE exactly, and Rush–Larsen integrates it exactly for frozen u.
        v_inf = 1.0 - h_vm
        tau_v_minus = (1.0 - h_vm) * p["tau_v1_minus"] + h_vm * p["tau_v2_minus"]
        w_inf = (1.0 - h_o) * (1.0 - u / p["tau_w_inf"]) + h_o * p["w_inf_star"]
        tau_w_minus = p["tau_w1_minus"] + (p["tau_w2_minus"] - p["tau_w1_minus"]) * 0.5 * (
            1.0 + jnp.tanh(p["k_w_minus"] * (u - p["u_w_minus"])))
        s_inf = 0.5 * (1.0 + jnp.tanh(p["k_s"] * (u - p["u_s"])))
        tau_s = (1.0 - h_w) * p["tau_s1"] + h_w * p["tau_s2"]
        if width or self.heaviside_gradient_width:
            gates = {"v": _switched_relaxation(h_v, v_inf, tau_v_minus, p["tau_v_plus"]),
                     "w": _switched_relaxation(h_w, w_inf, tau_w_minus, p["tau_w_plus"]),
                     "s": (s_inf, tau_s)}
        else:
            gates = {
                "v": (jnp.where(h_v > 0, 0.0, v_inf), jnp.where(h_v > 0, p["tau_v_plus"],
                                                                  tau_v_minus)),
                "w": (jnp.where(h_w > 0, 0.0, w_inf), jnp.where(h_w > 0, p["tau_w_plus"],
                                                                  tau_w_minus)),
                "s": (s_inf, tau_s),
            }
        return j_fi + j_so + j_si, gates

    def stimulus(self, t: Any) -> Any:
        """J_stim(t): ``stimulus_amplitude`` during the first ``stimulus_duration`` ms of every
        period from ``stimulus_start`` on. The end is pulled in by a relative 1e-6 so that a
        step landing on it up to round-off (t = n·dt) is not counted: 1 ms at dt = 0.005 is
        exactly 200 stimulated steps."""
        if not self.stimulus_amplitude:
            return 0.0
        since = t - self.stimulus_start
        phase = since - self.stimulus_period * jnp.floor(since / self.stimulus_period)
        on = (since >= 0) & (phase < self.stimulus_duration * (1.0 - 1e-6))
        return jnp.where(on, self.stimulus_amplitude, 0.0)

    def rhs(self, state, params, t, grid: Grid):
        total, gates = self._currents(state, params)
        du = params["D"] * laplacian(state["u"], grid, self.laplacian) - total
        if self.stimulus_amplitude:
            du = du + self.stimulus(t)
        out = {"u": du}
        for name, (y_inf, tau) in gates.items():
            out[name] = (y_inf - state[name]) / tau
        return out

    def initial_guess(self, observed, params):
        """A first guess of the gates from an observed u: each at its quasi-steady value for
        that u (the target it relaxes to). Right in resting and in excited tissue, wrong in
        a refractory tail, where the gates still recover; a fit corrects it."""
        if "u" not in observed:
            return {}
        u = observed["u"]
        rest = {"v": jnp.ones_like(u), "w": jnp.ones_like(u), "s": jnp.zeros_like(u)}
        _, gates = self._currents({"u": u, **rest}, params)
        return {name: target for name, (target, _) in gates.items()}

    def gates(self, state, params, t, grid: Grid):
        """Targets and time constants of v, w, s for Rush–Larsen (u takes a Euler step)."""
        return self._currents(state, params)[1]

    def max_stable_dt(self, params, grid: Grid) -> float:
        """Largest stable forward-Euler step, with a safety factor of 0.95.

        The u-equation's Jacobian is D·L + diag(∂(du/dt)/∂u). The stiffest reaction rate is
        at the upstroke's target u = u_u, where the fast inward current relaxes u with rate
        v (u_u − θv)/τfi ≤ (u_u − θv)/τfi (≈ 11/ms, i.e. dt ≲ 0.17 ms alone); the other
        currents are slower by two orders. Their sum bounds the most negative eigenvalue
        (Weyl), so dt·(D·ρ(L) + (u_u − θv)/τfi) ≤ 2, ρ(L) = 8/dx² (5pt; dt ≤ dx²/(4D) for
        diffusion alone) or 16/(3dx²) (9pt; 3dx²/(8D)). The gates' own limits (dt ≤ 2τ for
        the smallest time constant) never bind for the published sets but are kept for
        parameters far from them. The bound is sufficient, not sharp: v inactivates within
        τv⁺ ≈ 1.5 ms of the upstroke, so a single cell survives dt = 0.25 ms with a larger
        overshoot, whereas tissue above the diffusion limit alone blows up. Accuracy is
        stricter than stability: conduction velocity is within ~2 % of its dt → 0 value only
        for dt ≤ 0.02 ms.
        """
        p = {k: float(v) for k, v in params.items()}
        fast = max(p["u_u"] - p["theta_v"], 0.0) / p["tau_fi"]
        diffusion = p["D"] * laplacian_spectral_radius(self.laplacian, grid.spacing)
        if grid.shape == (1, 1):  # a single cell: the no-flux Laplacian is zero
            diffusion = 0.0
        u_limit = 2.0 / (diffusion + fast) if diffusion + fast > 0 else math.inf
        taus = ("tau_v_plus", "tau_v1_minus", "tau_v2_minus", "tau_w1_minus", "tau_w2_minus",
                "tau_w_plus", "tau_s1", "tau_s2", "tau_o1", "tau_o2")
        gate_limit = 2.0 * min(p[k] for k in taus)
        return 0.95 * min(u_limit, gate_limit)

    # -- initial states -------------------------------------------------------------------------

    def resting_state(self, grid: Grid, dtype: Any = None) -> dict[str, jnp.ndarray]:
        return {f: jnp.full(grid.shape, value, dtype) for f, value in self.rest.items()}

    def initial_state(self, grid: Grid, params, seed: int, dt: float | None = None):
        """The state at t = 0 from the ``initial`` protocol: ``"rest"``, ``"stimuli"``
        (``_stimuli_state``) or ``"s1s2"`` (``_s1s2_state``, deterministic: ``seed`` unused)."""
        p = {k: jnp.asarray(v) for k, v in params.items()}
        dtype = jnp.result_type(*p.values())
        state = self.resting_state(grid, dtype)
        if self.initial == "rest" or (self.initial == "stimuli" and self.init_stimuli == 0):
            return state
        dt = dt or min(0.05, 0.5 * self.max_stable_dt(params, grid))
        step = stepper(dataclasses.replace(self, stimulus_amplitude=0.0), grid, "rush_larsen")
        if self.initial == "s1s2":
            return self._s1s2_state(grid, p, state, dt, step)
        return self._stimuli_state(grid, p, state, dt, step, seed)

    def _stimuli_state(self, grid: Grid, p, state, dt: float, step, seed: int):
        """From rest: ``init_stimuli`` squares of side ``init_square`` (u += 1) at seeded random
        places and evenly spaced times over ``init_duration`` ms, integrated by Rush–Larsen
        between them without the pacing stimulus. Later squares land on partly refractory
        tissue, so fronts break into spirals and chaotic patterns."""
        dtype = state["u"].dtype
        rng = np.random.default_rng(seed)
        ny, nx = grid.shape
        side = self.init_square or max(2, min(ny, nx) // 10)
        corners = np.stack([rng.integers(0, max(ny - side, 0) + 1, self.init_stimuli),
                            rng.integers(0, max(nx - side, 0) + 1, self.init_stimuli)], axis=1)
        steps = max(1, round(self.init_duration / self.init_stimuli / dt))

        def one_stimulus(state, corner):
            y0, x0 = corner[0], corner[1]
            rows = jnp.arange(ny)[:, None]
            cols = jnp.arange(nx)[None, :]
            square = (rows >= y0) & (rows < y0 + side) & (cols >= x0) & (cols < x0 + side)
            state = {**state, "u": state["u"] + square.astype(dtype)}
            frames = simulate(step, state, p, 0.0, dt, steps, steps)
            return jax.tree.map(lambda f: f[-1], frames), None

        run = jax.jit(lambda s, c: jax.lax.scan(one_stimulus, s, c)[0])
        return run(state, jnp.asarray(corners))

    def _s1s2_state(self, grid: Grid, p, state, dt: float, step):
        """Cross-field S1–S2 protocol, one spiral: S1 excites the ``max(2, nx // 32)`` leftmost
        columns (a plane wave travelling +x). S2 (u += 1) excites the lower half (rows ≥ ny/2)
        left of the column at ``s2_at`` × width, ``s2_delay`` ms after the S1 wave's back
        (u falling below 0.5) has passed that column in the middle row: the S2 wave can only
        spread into the recovered tissue behind S1, and its free end at the S1 refractory tail
        curls into a spiral. Timing from the measured wave back makes the protocol the same for
        any grid and D. The state ``init_settle`` ms after S2 is returned; a ValueError if
        the tissue is at rest by then (too small a grid for a spiral, e.g. 32² at D = 0.1)."""
        dtype = state["u"].dtype
        ny, nx = grid.shape
        rows = jnp.arange(ny)[:, None]
        cols = jnp.arange(nx)[None, :]
        probe = min(nx - 1, max(1, round(self.s2_at * (nx - 1))))
        s1 = jnp.broadcast_to(cols < max(2, nx // 32), grid.shape)
        s2 = (rows >= ny // 2) & (cols <= probe)
        per_ms = max(1, round(1.0 / dt))
        # An S1 wave crossing the tissue and recovering takes well under this at any sane D.
        limit_ms = 20.0 * (nx + 50)

        def advance(state, steps):
            return jax.lax.fori_loop(0, steps, lambda n, x: step(x, p, 0.0, dt), state)

        def waiting(carry):
            state, seen, elapsed = carry
            back_passed = seen & (state["u"][ny // 2, probe] < 0.5)
            return ~back_passed & (elapsed < limit_ms)

        def one_ms(carry):
            state, seen, elapsed = carry
            state = advance(state, per_ms)
            return state, seen | (state["u"][ny // 2, probe] > 0.5), elapsed + 1.0

        @jax.jit
        def run(state):
            state = {**state, "u": state["u"] + s1.astype(dtype)}
            state, _, elapsed = jax.lax.while_loop(
                waiting, one_ms, (state, jnp.asarray(False), jnp.asarray(0.0, dtype)))
            state = advance(state, round(self.s2_delay / dt))
            state = {**state, "u": state["u"] + s2.astype(dtype)}
            return advance(state, round(self.init_settle / dt)), elapsed

        state, elapsed = run(state)
        if float(elapsed) >= limit_ms:
            raise ValueError("initial='s1s2': the S1 wave never passed the S2 column "
                             f"(s2_at={self.s2_at}); the tissue does not conduct")
        if not bool(jnp.any(state["u"] > 0.5)):
            # The spiral needs room for its core and wavelength: at D = 0.1 grid²/ms 48² holds
            # one, 32² does not (the length scales like √D).
            raise ValueError(f"initial='s1s2': the tissue is at rest {self.init_settle:g} ms "
                             f"after S2 on this {ny}×{nx} grid; it is too small for a spiral "
                             "at this D (use a larger grid, a smaller D or initial='stimuli')")
        return state
