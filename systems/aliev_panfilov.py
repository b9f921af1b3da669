"""The Aliev–Panfilov model of cardiac excitation (Aliev & Panfilov, Chaos Solitons Fractals
7:293, 1996), dimensionless:

    du/dt = ∇·(D ∇u) − k u (u − a)(u − 1) − u v
    dv/dt = ε(u, v) (−v − k u (u − b − 1)),   ε(u, v) = ε0 + μ1 v / (u + μ2)

Defaults are the published set AP96 (k = 8, a = b = 0.15, ε0 = 0.002, μ1 = 0.2, μ2 = 0.3) with
D = 1. Common mapping to physical units: E[mV] = 100 u − 80, t[ms] = 12.9 t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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

AP96 = {"D": 1.0, "k": 8.0, "a": 0.15, "b": 0.15, "eps0": 0.002, "mu1": 0.2, "mu2": 0.3}


@dataclass(frozen=True)
class AlievPanfilov:
    """Two-variable excitable medium. ``laplacian`` is ``"5pt"`` or ``"9pt"``; ``initial`` picks
    the initial-state generator: ``"spiral"`` (S1–S2, needs tissue of about a wavelength) or
    ``"blobs"`` (random excited and refractory discs; active for a few time units on any
    grid, for small test problems)."""

    laplacian: str = "5pt"
    initial: str = "spiral"

    name: ClassVar[str] = "aliev_panfilov"
    fields: ClassVar[tuple[str, ...]] = ("u", "v")
    stencil_radius: ClassVar[int] = LAPLACIAN_RADIUS
    # The flow keeps v >= 0 (dv/dt = ε k u (1 + b − u) >= 0 at v = 0 for u in [0, 1]): a fit
    # of v's initial values is kept there (pdefit.model.system, field_bounds). v's upper end,
    # k (1 + b)² / 4 on the nullcline, moves with the parameters, so it is left open. u is
    # left unbounded although the flow keeps it in [0, 1]: it is the observed field, whose
    # first guess is a noisy frame (clipped at the rest state u = 0 it would bias the prior
    # upward there), and recordings scaled otherwise (BOCF's u reaches 1.5) are fitted too.
    field_bounds: ClassVar[dict[str, tuple[float, float]]] = {"v": (0.0, float("inf"))}
    # Excited tissue, for the evaluator's active fraction (pdefit/analysis/activity.py).
    activity: ClassVar[tuple[str, float]] = ("u", 0.5)
    # Cell-centred fields, nothing tied to the cell count: data may be simulated on a refined
    # grid (simulate.refine.grid_factor) and a fit checked on one
    # (pdefit/fitting/discretization.py).
    refinable_grid: ClassVar[bool] = True
    # Dimensionless model units (1 time unit ≈ 12.9 ms in the common mapping).
    time_unit: ClassVar[str] = "AP time units"
    space_unit: ClassVar[str] = "AP space units"
    field_info: ClassVar[dict[str, tuple[str, str]]] = {
        "u": ("1", "transmembrane potential, scaled (E = 100 u − 80 mV)"),
        "v": ("1", "recovery variable"),
    }
    params: ClassVar[dict[str, ParamSpec]] = {
        "D": ParamSpec(AP96["D"], "log", unit="space²/time", doc="diffusion coefficient"),
        "k": ParamSpec(AP96["k"], "log", unit="1",
                       doc="excitability (strength of the cubic source)"),
        "a": ParamSpec(AP96["a"], "log", unit="1", upper=1.0, doc="excitation threshold"),
        "b": ParamSpec(AP96["b"], "log", unit="1", upper=1.0,
                       doc="recovery threshold (b = a in AP96)"),
        "eps0": ParamSpec(AP96["eps0"], "log", unit="1", doc="baseline recovery rate"),
        "mu1": ParamSpec(AP96["mu1"], "log", unit="1", doc="recovery-rate gain"),
        "mu2": ParamSpec(AP96["mu2"], "log", unit="1", doc="recovery-rate offset"),
    }

    def __post_init__(self) -> None:
        check_option("Laplacian", self.laplacian, sorted(LAPLACIANS))
        check_option("initial-state generator", self.initial, ("spiral", "blobs"))

    def rhs(self, state, params, t, grid: Grid):
        u, v = state["u"], state["v"]
        lap = laplacian(u, grid, self.laplacian)
        k, a, b = params["k"], params["a"], params["b"]
        # The recovery rate sees v only where v ≥ 0, the region the dynamics never leave. Below
        # it the published rate has a finite-time blow-up (dv/dt ≈ −(μ1/μ2)v² at u = 0), which
        # an optimiser adjusting an unobserved initial v would otherwise run into. Values and
        # derivatives for v ≥ 0 are unchanged.
        v_recovery = jnp.where(v < 0, 0.0, v)
        eps = params["eps0"] + params["mu1"] * v_recovery / (u + params["mu2"])
        du = params["D"] * lap - k * u * (u - a) * (u - 1.0) - u * v
        dv = eps * (-v - k * u * (u - b - 1.0))
        return {"u": du, "v": dv}

    def initial_guess(self, observed, params):
        """A first guess of the recovery v from an observed u: on its nullcline
        v = −k u (u − b − 1) where u is above the excitation threshold a, and 0 below it (at
        rest; noise on a resting u would otherwise make v noise k(1 + b) times larger). Low
        in a refractory tail and far too high behind a wave front, where v has not risen
        yet: on ap_from_voltage (32², made with the true k and a) its rms error is 1.5 × the
        rms of the true v (zero would be 1 ×), so a background prior around it must be wide
        (pdefit.fitting.background says when it is not); a fit corrects it where the data
        determine v."""
        if "u" not in observed:
            return {}
        u = observed["u"]
        nullcline = -params["k"] * u * (u - params["b"] - 1.0)
        return {"v": jnp.where(u > params["a"], jnp.maximum(nullcline, 0.0), 0.0)}

    def max_stable_dt(self, params, grid: Grid) -> float:
        """Forward-Euler limit: diffusion plus the reaction Jacobian's largest rates, with
        r = k (b + 1)² / 4 bounding v in the recovered tissue (reference heuristic, safety 0.95)."""
        r = params["k"] * (params["b"] + 1.0) ** 2 / 4.0
        lam = laplacian_spectral_radius(self.laplacian, grid.spacing)
        diffusion_reaction = 2.0 / (params["D"] * lam + 2.0 * (params["k"] + r))
        recovery = 1.0 / (params["eps0"] + params["mu1"] / params["mu2"] * r)
        return 0.95 * min(diffusion_reaction, recovery)

    def initial_state(self, grid: Grid, params, seed: int, dt: float | None = None):
        if self.initial == "blobs":
            return self.blobs_state(grid, seed)
        return self.spiral_state(grid, params, seed, dt)

    def blobs_state(self, grid: Grid, seed: int, n_blobs: int = 3):
        """Excited discs (u = 1) beside refractory discs (v ≈ 1), at seeded random places:
        waves start at once and are partly blocked, so a short window is informative."""
        rng = np.random.default_rng(seed)
        y, x = grid.coordinates()
        radius = 0.15 * min(grid.extent)
        u = jnp.zeros(grid.shape)
        v = jnp.zeros(grid.shape)
        for _ in range(n_blobs):
            cy, cx = rng.uniform(0, grid.extent[0]), rng.uniform(0, grid.extent[1])
            r2 = ((y[:, None] - cy) ** 2 + (x[None, :] - cx) ** 2) / radius**2
            u = jnp.maximum(u, jnp.exp(-(r2**2)))
            cy, cx = rng.uniform(0, grid.extent[0]), rng.uniform(0, grid.extent[1])
            r2 = ((y[:, None] - cy) ** 2 + (x[None, :] - cx) ** 2) / (1.5 * radius) ** 2
            v = jnp.maximum(v, rng.uniform(0.5, 1.5) * jnp.exp(-r2))
        return {"u": u, "v": v}

    def spiral_state(self, grid: Grid, params, seed: int, dt: float | None = None):
        """A spiral wave by S1–S2 cross-field stimulation: a plane wave from the left edge (S1);
        when its back has passed a probe point, a stimulus over one half of the tissue (S2)
        excites only the recovered part, is blocked by the refractory tail, and its free end
        curls into a spiral. The seed jitters the probe position, the S2 extent and the
        orientation, so different seeds give different spirals. The tissue must be larger than
        about one wavelength (≈ 40 space units for AP96 with D = 1) to hold a spiral."""
        rng = np.random.default_rng(seed)
        dt = dt or 0.5 * self.max_stable_dt(params, grid)
        step = stepper(self, grid, "euler")
        p = {k: jnp.asarray(v) for k, v in params.items()}
        ny, nx = grid.shape
        probe = (ny // 2, int(rng.uniform(0.4, 0.6) * nx))
        _, x = grid.coordinates()
        s1 = jnp.where(x < 0.05 * grid.extent[1] + 2 * grid.spacing[1], 1.0, 0.0)
        state = {"u": jnp.broadcast_to(s1, grid.shape), "v": jnp.zeros(grid.shape)}

        def until_back_passed(carry):
            _, _, _excited, back_passed = carry
            return ~back_passed

        def one_step(carry):
            state, n, excited, _ = carry
            state = step(state, p, n * dt, dt)
            u_probe = state["u"][probe]
            excited = excited | (u_probe > 0.5)
            return state, n + 1, excited, excited & (u_probe < 0.1)

        carry = (state, jnp.asarray(0), jnp.asarray(False), jnp.asarray(False))
        state = jax.jit(lambda c: jax.lax.while_loop(until_back_passed, one_step, c))(carry)[0]
        rows = jnp.arange(ny)[:, None] < int(rng.uniform(0.4, 0.6) * ny)
        state = {"u": jnp.where(rows, 1.0, state["u"]), "v": state["v"]}
        settle = round(rng.uniform(40.0, 60.0) / dt)
        state = jax.tree.map(lambda f: f[-1], simulate(step, state, p, 0.0, dt, settle, settle))
        if rng.uniform() < 0.5:  # mirror for variety; the physics is symmetric
            state = jax.tree.map(lambda f: f[::-1, :], state)
        return state
