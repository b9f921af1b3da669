"""Two-dimensional Rayleigh–Bénard convection in the Oberbeck–Boussinesq approximation,
thermal-diffusion scaling (length d, time d²/κ, temperature ΔT), T = 1 − z + θ:

    ∂u/∂t + (u·∇)u = −∇p + Pr ∇²u + Pr Ra θ e_z,    ∇·u = 0
    ∂θ/∂t + (u·∇)θ = ∇²θ + w

Ra = gαΔT d³/(νκ), Pr = ν/κ. Periodic in x (the grid's x axis, last array axis), walls at
z = 0 and z = 1 (the grid's first axis, so its spacing must be exactly 1/nz) with θ = 0 and
either no-slip (u = w = 0) or free-slip (∂u/∂z = 0, w = 0) velocity.

Staggered (MAC) layout. Every field is an array of the grid's shape (nz, nx), indexed [j, i],
so datasets, observations and checkpoints treat it like any cell-centred field:

- ``theta[j, i]`` at the cell centre  (z, x) = ((j + ½) dz, (i + ½) dx);
- ``u[j, i]``     on the cell's left x-face, (z, x) = ((j + ½) dz, i dx) (periodic: nx faces);
- ``w[j, i]``     on the cell's bottom z-face, (z, x) = (j dz, (i + ½) dx). ``w[0]`` is the
  bottom wall and stays exactly 0; the top wall face (j = nz) is not stored (it is 0).

The pressure lives at cell centres but is not part of the state: each stage is projected.

Scheme: second-order centred differences in flux (divergence) form, whose advection terms
conserve kinetic energy and ∫θ² for a discretely divergence-free velocity (up to time-stepping
error), and the three-stage SSP Runge–Kutta method of Shu & Osher with a pressure projection
after every stage. The projection solves the discrete Neumann Poisson problem exactly by a real
FFT in x and a DCT-II in z (taken as an FFT of the mirrored field), with eigenvalues
λx = −(2 − 2 cos(k dx))/dx² and λz = −(2 − 2 cos(π m/nz))/dz², so the projected velocity is
divergence-free to round-off; it is linear and differentiable, with no matrices and no
iterations. Because the face average of the linear base temperature is
exact, the discrete equations conserve total heat flux level by level, and the volume-averaged
Nusselt number 1 + ⟨wθ⟩ equals the wall one (1 − ∂z⟨θ⟩ at z = 0) in a discrete steady state.

The global pressure solve needs the whole grid on one device: the system works with a mesh over
experiments, not with a spatial decomposition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.model.params import ParamSpec
from pdefit.model.system import check_option
from pdefit.numerics.grid import NEUMANN, PERIODIC, Grid

WALLS = ("no_slip", "free_slip")

# Linear onset of stationary rolls (Chandrasekhar): (Ra_c, k_c).
ONSET = {"no_slip": (1707.762, 3.117), "free_slip": (27.0 * math.pi**4 / 4.0,
                                                       math.pi / math.sqrt(2.0))}

# Shu–Osher weights of the old state in the three stages of SSP-RK3.
SSP_RK3_WEIGHTS = (0.0, 0.75, 1.0 / 3.0)
# Extents of SSP-RK3's stability region along the negative real and the imaginary axis.
RK3_REAL_EXTENT = 2.5127
RK3_IMAG_EXTENT = math.sqrt(3.0)


def check_grid(grid: Any) -> None:
    """Raise a ValueError unless ``grid`` spans the layer 0 ≤ z ≤ 1 in its first axis and is
    periodic in x, on one device."""
    if tuple(getattr(grid, "devices", (1, 1))) != (1, 1):
        raise ValueError("rayleigh_benard solves for the pressure on the whole grid (FFT/DCT); "
                         "it cannot run on a spatially decomposed mesh, use experiments only")
    nz = grid.shape[0]
    dz = grid.spacing[0]
    if abs(nz * dz - 1.0) > 1e-9:
        raise ValueError(f"rayleigh_benard needs the z spacing (first axis) to be 1/nz = "
                         f"{1.0 / nz:.6g} so the walls sit at z = 0 and 1, got {dz} "
                         f"(nz = {nz}, height {nz * dz:.6g})")
    if tuple(grid.boundaries) != (NEUMANN, PERIODIC):
        raise ValueError(f"rayleigh_benard needs grid boundaries [{NEUMANN}, {PERIODIC}] "
                         f"(walls in z, periodic in x), got {list(grid.boundaries)}")
    if nz < 2:
        raise ValueError("rayleigh_benard needs at least 2 cells between the walls")


# -- shifts and ghost rows (axis −1 is x, axis −2 is z) ------------------------------------------


def _east(a: jnp.ndarray) -> jnp.ndarray:
    """a[..., i + 1] (periodic)."""
    return jnp.roll(a, -1, axis=-1)


def _west(a: jnp.ndarray) -> jnp.ndarray:
    """a[..., i − 1] (periodic)."""
    return jnp.roll(a, 1, axis=-1)


def _with_ghosts(a: jnp.ndarray, sign: float) -> jnp.ndarray:
    """A cell-centred (in z) field with one ghost row at each wall: ``sign`` = −1 puts the
    wall value at 0 (Dirichlet at the face), +1 makes the wall gradient 0."""
    return jnp.concatenate([sign * a[..., :1, :], a, sign * a[..., -1:, :]], axis=-2)


def _all_faces(w: jnp.ndarray) -> jnp.ndarray:
    """w on all nz + 1 z-faces: the stored ones with the bottom forced to 0, plus the top."""
    zero = jnp.zeros_like(w[..., :1, :])
    return jnp.concatenate([zero, w[..., 1:, :], zero], axis=-2)


def _second_x(a: jnp.ndarray, dx: float) -> jnp.ndarray:
    return (_east(a) - 2.0 * a + _west(a)) / dx**2


# -- the pressure projection ---------------------------------------------------------------------


def divergence_of(u: jnp.ndarray, w: jnp.ndarray, dz: float, dx: float) -> jnp.ndarray:
    """Discrete divergence at cell centres (walls carry no flux)."""
    wf = _all_faces(w)
    return (_east(u) - u) / dx + (wf[..., 1:, :] - wf[..., :-1, :]) / dz


def _inverse_eigenvalues(nz: int, nx: int, dz: float, dx: float, dtype: Any) -> np.ndarray:
    """1/λ of the Neumann(z)–periodic(x) five-point Laplacian on the z-mirrored grid (2nz
    rows) in the rFFT basis, λ = −(2 − 2 cos(π m/nz))/dz² − (2 − 2 cos(2π k/nx))/dx², with the
    constant mode (λ = 0, the pressure's free constant) mapped to 0."""
    lam_z = -(2.0 - 2.0 * np.cos(np.pi * np.arange(2 * nz) / nz)) / dz**2
    lam_x = -(2.0 - 2.0 * np.cos(2.0 * np.pi * np.arange(nx // 2 + 1) / nx)) / dx**2
    lam = lam_z[:, None] + lam_x[None, :]
    lam[0, 0] = 1.0
    inv = 1.0 / lam
    inv[0, 0] = 0.0
    return inv.astype(dtype)


def solve_poisson(rhs: jnp.ndarray, dz: float, dx: float) -> jnp.ndarray:
    """φ with L φ = rhs for the discrete Laplacian L (zero flux through the walls, periodic in
    x); the mean of ``rhs`` (the null space) is dropped and φ has zero mean.

    The DCT-II in z is taken as the FFT of the even (half-sample) mirror image about the
    walls: mirroring is exactly the zero-flux ghost rule, so the mirrored field obeys the
    periodic Laplacian on 2nz rows and one rFFT2 diagonalises it, with the DCT-II eigenvalues
    (the same numbers as ``jax.scipy.fft.dct``, at a fifth of its compile time)."""
    nz, nx = rhs.shape[-2:]
    inv = _inverse_eigenvalues(nz, nx, dz, dx, np.dtype(rhs.dtype))
    mirrored = jnp.concatenate([rhs, rhs[..., ::-1, :]], axis=-2)
    phi = jnp.fft.irfft2(jnp.fft.rfft2(mirrored) * inv, s=(2 * nz, nx))
    return phi[..., :nz, :]


def project(u: jnp.ndarray, w: jnp.ndarray, dz: float, dx: float,
            ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The discretely divergence-free part of (u, w): subtract ∇φ with ∇²φ = ∇·u."""
    phi = solve_poisson(divergence_of(u, w, dz, dx), dz, dx)
    u = u - (phi - _west(phi)) / dx
    w_interior = w[..., 1:, :] - (phi[..., 1:, :] - phi[..., :-1, :]) / dz
    return u, jnp.concatenate([jnp.zeros_like(w[..., :1, :]), w_interior], axis=-2)


# -- the system ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayleighBenard:
    """Boussinesq convection between two walls, periodic in x (see the module docstring).

    Options (all static):
    - ``walls``: ``"no_slip"`` (rigid, default) or ``"free_slip"`` (stress-free).
    - ``init_amplitude``: RMS of the random initial temperature perturbation.
    - ``init_modes``: how many Fourier modes in x and sine modes in z it is made of.
    - ``init_spinup``: time (d²/κ) the perturbation is evolved for, with adaptive steps, before
      it is returned; 0 returns the perturbation itself (velocity at rest).
    """

    walls: str = "no_slip"
    init_amplitude: float = 0.1
    init_modes: int = 4
    init_spinup: float = 0.0

    name: ClassVar[str] = "rayleigh_benard"
    fields: ClassVar[tuple[str, ...]] = ("u", "w", "theta")
    stencil_radius: ClassVar[int] = 1
    spatial_mesh: ClassVar[bool] = False  # the pressure solve needs the whole grid
    params: ClassVar[dict[str, ParamSpec]] = {
        "Ra": ParamSpec(1.0e4, "log", unit="1", doc="Rayleigh number gαΔT d³/(νκ)"),
        "Pr": ParamSpec(0.71, "log", unit="1", doc="Prandtl number ν/κ"),
    }
    # Dimensionless: lengths in d, times in d²/κ, velocities in κ/d, temperatures in ΔT.
    time_unit: ClassVar[str] = "1"
    space_unit: ClassVar[str] = "1"
    axis_names: ClassVar[tuple[str, str]] = ("z", "x")
    field_info: ClassVar[dict[str, tuple[str, str]]] = {
        "u": ("1", "horizontal velocity (κ/d), on the cell's left face"),
        "w": ("1", "vertical velocity (κ/d), on the cell's bottom face"),
        "theta": ("1", "temperature deviation from the conduction profile (ΔT)"),
    }

    def __post_init__(self) -> None:
        check_option("wall condition", self.walls, WALLS)
        if not self.init_amplitude >= 0 or self.init_modes < 1 or not self.init_spinup >= 0:
            raise ValueError("init_amplitude and init_spinup must be >= 0, init_modes >= 1")

    # -- the model ------------------------------------------------------------------------------

    def tendencies(self, state, params, grid: Grid) -> dict[str, jnp.ndarray]:
        """d/dt of (u, w, θ) without the pressure gradient (the projection adds it)."""
        dz, dx = grid.spacing
        u, w, th = state["u"], state["w"], state["theta"]
        ra, pr = params["Ra"], params["Pr"]
        wf = _all_faces(w)
        # Ghost rows of u mirror (free-slip) or negate (no-slip) the first row off each wall.
        ug = _with_ghosts(u, -1.0 if self.walls == "no_slip" else 1.0)
        thg = _with_ghosts(th, -1.0)

        # The u·w flux lives on cell corners (z = j dz, x = i dx), levels j = 0 … nz; it is
        # zero on the walls (w = 0 there) whatever the ghost u is.
        corner = 0.5 * (ug[..., :-1, :] + ug[..., 1:, :]) * 0.5 * (wf + _west(wf))

        u_centre = 0.5 * (u + _east(u))
        du = (-(u_centre**2 - _west(u_centre) ** 2) / dx
              - (corner[..., 1:, :] - corner[..., :-1, :]) / dz
              + pr * (_second_x(u, dx)
                      + (ug[..., 2:, :] - 2.0 * u + ug[..., :-2, :]) / dz**2))

        # w on the interior faces j = 1 … nz − 1; the wall faces keep w = 0.
        w_centre = 0.5 * (wf[..., :-1, :] + wf[..., 1:, :])
        w_in = w[..., 1:, :]
        dw_in = (-(_east(corner) - corner)[..., 1:-1, :] / dx
                 - (w_centre[..., 1:, :] ** 2 - w_centre[..., :-1, :] ** 2) / dz
                 + pr * (_second_x(w_in, dx)
                         + (wf[..., 2:, :] - 2.0 * w_in + wf[..., :-2, :]) / dz**2)
                 + pr * ra * 0.5 * (th[..., :-1, :] + th[..., 1:, :]))
        dw = jnp.concatenate([jnp.zeros_like(w[..., :1, :]), dw_in], axis=-2)

        flux_x = u * 0.5 * (th + _west(th))
        flux_z = wf * 0.5 * (thg[..., :-1, :] + thg[..., 1:, :])
        # + w: advection of the base profile 1 − z (exact: its face average is exact).
        dth = (-(_east(flux_x) - flux_x) / dx
               - (flux_z[..., 1:, :] - flux_z[..., :-1, :]) / dz
               + _second_x(th, dx) + (thg[..., 2:, :] - 2.0 * th + thg[..., :-2, :]) / dz**2
               + w_centre)
        return {"u": du, "w": dw, "theta": dth}

    def step(self, state, params, t, dt, grid: Grid) -> dict[str, jnp.ndarray]:
        """One SSP-RK3 (Shu–Osher) step, each stage projected onto divergence-free velocity.
        Stage k maps s to a_k·x + (1 − a_k)·(s + dt·F(s)) with a = (0, ¾, ⅓): it combines
        divergence-free fields convexly, so projecting each stage keeps the method's order
        and the velocity divergence-free to round-off. The stages run as a ``lax.scan`` so
        the stage is traced (and compiled, and differentiated) once, not three times."""
        check_grid(grid)
        dz, dx = grid.spacing

        def stage(s, a):
            ds = self.tendencies(s, params, grid)
            new = {k: a * state[k] + (1.0 - a) * (s[k] + dt * ds[k]) for k in self.fields}
            new["u"], new["w"] = project(new["u"], new["w"], dz, dx)
            return new, None

        dtype = jnp.result_type(*jax.tree.leaves(state))
        return jax.lax.scan(stage, state, jnp.asarray(SSP_RK3_WEIGHTS, dtype))[0]

    def max_stable_dt(self, params, grid: Grid) -> float:
        """The diffusive limit 2/(max(Pr, 1)·(4/dx² + 4/dz²)) = dx²/(4 max(Pr, 1)) for
        dx = dz: forward Euler's, so SSP-RK3 (real extent ≈ 2.51) keeps a 25 % margin for
        advection. Advection needs :meth:`cfl_dt` as well, which depends on the state."""
        check_grid(grid)
        dz, dx = grid.spacing
        nu = max(float(params["Pr"]), 1.0)
        return 2.0 / (nu * (4.0 / dx**2 + 4.0 / dz**2))

    def cfl_dt(self, state, params, grid: Grid, courant: float = 1.0) -> jnp.ndarray:
        """courant / max(|u|/dx + |w|/dz): the advective limit of centred differences with
        SSP-RK3 is courant = √3 (its imaginary-axis extent); 1 leaves room for diffusion.
        Infinite for a fluid at rest. Jittable (``float()`` it outside jit). ``params`` is
        unused; it keeps the signature of the other systems' ``cfl_dt``."""
        dz, dx = grid.spacing
        rate = jnp.max(jnp.abs(state["u"]) / dx + jnp.abs(state["w"]) / dz)
        return jnp.where(rate > 0, courant / jnp.where(rate > 0, rate, 1.0), jnp.inf)

    def stable_dt(self, state, params, grid: Grid, courant: float = 1.0) -> jnp.ndarray:
        """The smaller of the diffusive and the advective limits for this state."""
        return jnp.minimum(self.max_stable_dt(params, grid),
                           self.cfl_dt(state, params, grid, courant))

    # -- diagnostics -----------------------------------------------------------------------------

    def divergence(self, state, grid: Grid) -> jnp.ndarray:
        """∇·u at cell centres (zero to round-off after every step)."""
        dz, dx = grid.spacing
        return divergence_of(state["u"], state["w"], dz, dx)

    def nusselt(self, state, grid: Grid) -> jnp.ndarray:
        """Nu = 1 + ⟨wθ⟩ over the layer (trapezoid over the z-faces, θ averaged to them)."""
        dz = grid.spacing[0]
        th = state["theta"]
        flux = state["w"][..., 1:, :] * 0.5 * (th[..., :-1, :] + th[..., 1:, :])
        return 1.0 + dz * jnp.sum(jnp.mean(flux, axis=-1), axis=-1)

    def wall_nusselt(self, state, grid: Grid) -> tuple[jnp.ndarray, jnp.ndarray]:
        """Nu = 1 − ∂z⟨θ⟩ at the bottom and the top wall, from the first cell off each wall
        (θ = 0 on the wall half a cell away). Equal to :meth:`nusselt` in a steady state."""
        dz = grid.spacing[0]
        th = state["theta"]
        bottom = 1.0 - 2.0 * jnp.mean(th[..., 0, :], axis=-1) / dz
        top = 1.0 + 2.0 * jnp.mean(th[..., -1, :], axis=-1) / dz
        return bottom, top

    def kinetic_energy(self, state, grid: Grid) -> jnp.ndarray:
        """½⟨u² + w²⟩ over the layer (every stored face stands for one cell's area)."""
        return 0.5 * jnp.mean(state["u"] ** 2 + state["w"] ** 2, axis=(-2, -1))

    # -- initial states ---------------------------------------------------------------------------

    def perturbation(self, grid: Grid, seed: int, dtype: Any = None) -> dict[str, jnp.ndarray]:
        """Fluid at rest with a seeded smooth θ: random amplitudes of sin(mπz)·cos(k x + φ)
        for m, k/(2π/Lx) = 1 … ``init_modes``, falling off as 1/(m k), RMS ``init_amplitude``.
        It vanishes on the walls, and its horizontal mean is zero: a mean profile θ(z) drives
        no flow and would be invisible to velocity observations."""
        check_grid(grid)
        rng = np.random.default_rng(seed)
        z, x = (np.asarray(c, np.float64) for c in grid.coordinates())
        length = grid.extent[1]
        theta = np.zeros(grid.shape)
        for m in range(1, self.init_modes + 1):
            for k in range(1, self.init_modes + 1):
                amp = rng.standard_normal() / (m * k)
                phase = rng.uniform(0.0, 2.0 * np.pi)
                theta += amp * np.outer(np.sin(m * np.pi * z),
                                        np.cos(2.0 * np.pi * k * x / length + phase))
        rms = np.sqrt(np.mean(theta**2))
        theta *= self.init_amplitude / rms if rms > 0 else 0.0
        zeros = jnp.zeros(grid.shape, dtype)
        return {"u": zeros, "w": zeros, "theta": jnp.asarray(theta, dtype)}

    def initial_state(self, grid: Grid, params, seed: int) -> dict[str, jnp.ndarray]:
        """:meth:`perturbation`, evolved for ``init_spinup`` by :meth:`evolve`."""
        p = {k: jnp.asarray(v) for k, v in params.items()}
        state = self.perturbation(grid, seed, jnp.result_type(*p.values()))
        if self.init_spinup > 0:
            state = self.evolve(state, p, grid, self.init_spinup)
        return state

    def evolve(self, state, params, grid: Grid, duration: float, safety: float = 0.5):
        """Advance by ``duration`` with adaptive steps, ``safety`` × :meth:`stable_dt` each
        (the last one shortened to land on ``duration``). One ``lax.while_loop``, jitted."""
        def not_done(carry):
            return carry[1] < duration

        def one_step(carry):
            s, t = carry
            dt = jnp.minimum(safety * self.stable_dt(s, params, grid), duration - t)
            return self.step(s, params, t, dt, grid), t + dt

        t0 = jnp.zeros((), jax.tree.leaves(state)[0].dtype)
        run = jax.jit(lambda s: jax.lax.while_loop(not_done, one_step, (s, t0))[0])
        return run(state)
