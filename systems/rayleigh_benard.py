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

On a device mesh every operator works on the block it is given: the differences on a halo of
one cell from ``grid.pad`` (rows on a wall given their own rule where the block holds it), the
projection's transforms on pencils (:func:`pdefit.numerics.pencil.apply_diagonal`: an all-to-all
makes the transformed axis whole; a block holding the whole layer takes one rFFT2 instead),
maxima and means with ``grid.global_max``/``global_sum``. So the same code runs on a
:class:`~pdefit.numerics.grid.Grid` and on a tile of a mesh split along z, x or both, and gives
the one-device results to round-off (tests/test_rb_sharding.py).
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
from pdefit.numerics.pencil import (
    apply_diagonal,
    dct_ii,
    dct_iii,
    irfft_packed,
    packed_wavenumbers,
    rfft_packed,
)

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
    periodic in x (a tile of a device mesh is checked by the whole grid's shape)."""
    nz = getattr(grid, "global_shape", grid.shape)[0]
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


# -- blocks with a halo of one cell (axis −1 is x, axis −2 is z) ---------------------------------
# ``grid.pad`` fills the halo: periodic in x, from the neighbouring tiles on a mesh, and by
# mirroring at the walls; ``_wall_rows`` then gives the rows at a wall their own rule.
# Slices of a padded block B: B[..., 1:-1, 1:-1] is the block, B[..., 1:-1, 2:] its east
# neighbour, B[..., :-2, 1:-1] the row below.


def _at_walls(grid: Any) -> tuple[Any, Any]:
    """Whether this block holds the bottom and the top row of the layer (traced on a tile)."""
    offset = grid.row_offset()
    return offset == 0, offset + grid.shape[0] == grid.global_shape[0]


def _wall_rows(grid: Any, dtype: Any, ghost: float, first: float = 1.0) -> jnp.ndarray:
    """Row factors (rows + 2, 1) for a padded block: its ghost rows beyond a wall times
    ``ghost`` (−1: the value vanishes on the wall; 1: zero gradient; 0: a face value that is
    zero), and its first row, on the bottom wall, times ``first`` (0 for w: the wall face)."""
    bottom, top = _at_walls(grid)
    one = jnp.ones((), dtype)
    factors = jnp.ones(grid.shape[0] + 2, dtype)
    factors = factors.at[0].set(jnp.where(bottom, jnp.asarray(ghost, dtype), one))
    factors = factors.at[1].set(jnp.where(bottom, jnp.asarray(first, dtype), one))
    factors = factors.at[-1].set(jnp.where(top, jnp.asarray(ghost, dtype), one))
    return factors[:, None]


def _faces(w: jnp.ndarray, grid: Any) -> jnp.ndarray:
    """w padded, on the z-faces −1 … rows: the wall faces (and beyond) zero."""
    return grid.pad(w, 1) * _wall_rows(grid, w.dtype, 0.0, 0.0)


# -- the pressure projection ---------------------------------------------------------------------


def divergence_of(u: jnp.ndarray, w: jnp.ndarray, grid: Any) -> jnp.ndarray:
    """Discrete divergence at cell centres (walls carry no flux)."""
    dz, dx = grid.spacing
    east = grid.pad(u, 1)[..., 1:-1, 2:]
    wf = _faces(w, grid)
    return (east - u) / dx + (wf[..., 2:, 1:-1] - wf[..., 1:-1, 1:-1]) / dz


def _inverse_eigenvalues(nz: int, nx: int, dz: float, dx: float, dtype: Any) -> np.ndarray:
    """1/λ of the Neumann(z)–periodic(x) five-point Laplacian in the DCT-II (z) and packed
    real FFT (x) basis, λ = −(2 − 2 cos(π m/nz))/dz² − (2 − 2 cos(2π k/nx))/dx², with the
    constant mode (λ = 0, the pressure's free constant) mapped to 0."""
    return _inverse(np.arange(nz), nz, packed_wavenumbers(nx), nx, dz, dx, dtype)


def _inverse_eigenvalues_mirrored(nz: int, nx: int, dz: float, dx: float, dtype: Any,
                                  ) -> np.ndarray:
    """The same on the z-mirrored grid (2nz rows) in the rFFT2 basis."""
    return _inverse(np.arange(2 * nz), nz, np.arange(nx // 2 + 1), nx, dz, dx, dtype)


def _inverse(modes_z: np.ndarray, nz: int, modes_x: np.ndarray, nx: int, dz: float, dx: float,
             dtype: Any) -> np.ndarray:
    lam_z = -(2.0 - 2.0 * np.cos(np.pi * modes_z / nz)) / dz**2
    lam_x = -(2.0 - 2.0 * np.cos(2.0 * np.pi * modes_x / nx)) / dx**2
    lam = lam_z[:, None] + lam_x[None, :]
    lam[0, 0] = 1.0
    inv = 1.0 / lam
    inv[0, 0] = 0.0
    return inv.astype(dtype)


def _whole_layer(shape: tuple[int, ...], dz: float, dx: float) -> Grid:
    return Grid(tuple(shape[-2:]), (dz, dx), (NEUMANN, PERIODIC))


def solve_poisson(rhs: jnp.ndarray, dz: float, dx: float, grid: Any = None) -> jnp.ndarray:
    """φ with L φ = rhs for the discrete Laplacian L (zero flux through the walls, periodic in
    x); the mean of ``rhs`` (the null space) is dropped and φ has zero mean. ``grid`` is the
    block's grid (a tile of a device mesh, or by default the whole layer of ``rhs``).

    A DCT-II in z (the FFT of the even mirror image about the walls: mirroring is exactly the
    zero-flux ghost rule) and a real FFT in x diagonalise L, with the DCT-II eigenvalues. On a
    mesh each transform runs on a pencil whole along its axis (:mod:`pdefit.numerics.pencil`)."""
    grid = _whole_layer(rhs.shape, dz, dx) if grid is None else grid
    nz, nx = grid.global_shape
    if tuple(grid.shape) == (nz, nx):
        # The whole layer here: one rFFT2 of the mirrored field does both transforms at once
        # (about a fifth faster on one device than the two real transforms below).
        inv = _inverse_eigenvalues_mirrored(nz, nx, dz, dx, np.dtype(rhs.dtype))
        mirrored = jnp.concatenate([rhs, rhs[..., ::-1, :]], axis=-2)
        return jnp.fft.irfft2(jnp.fft.rfft2(mirrored) * inv, s=(2 * nz, nx))[..., :nz, :]
    inv = _inverse_eigenvalues(nz, nx, dz, dx, np.dtype(rhs.dtype))
    transforms = {-2: (dct_ii, dct_iii), -1: (rfft_packed, irfft_packed)}
    return apply_diagonal(rhs, grid, transforms, inv)


def project(u: jnp.ndarray, w: jnp.ndarray, dz: float, dx: float, grid: Any = None,
            ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The discretely divergence-free part of (u, w): subtract ∇φ with ∇²φ = ∇·u."""
    grid = _whole_layer(u.shape, dz, dx) if grid is None else grid
    phi = solve_poisson(divergence_of(u, w, grid), dz, dx, grid)
    padded = grid.pad(phi, 1)
    u = u - (phi - padded[..., 1:-1, :-2]) / dx
    w = w - (phi - padded[..., :-2, 1:-1]) / dz
    return u, w * _wall_rows(grid, w.dtype, 0.0, 0.0)[1:-1]


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
    spatial_mesh: ClassVar[bool] = True  # the pressure solve runs by pencils on a mesh
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
        """d/dt of (u, w, θ) without the pressure gradient (the projection adds it), from
        blocks with a halo of one cell (see the slices above ``_at_walls``)."""
        dz, dx = grid.spacing
        u, th = state["u"], state["theta"]
        ra, pr = params["Ra"], params["Pr"]
        # Ghost rows of u mirror (free-slip) or negate (no-slip) the first row off each wall.
        ub = grid.pad(u, 1) * _wall_rows(grid, u.dtype, -1.0 if self.walls == "no_slip" else 1.0)
        wb = _faces(state["w"], grid)
        tb = grid.pad(th, 1) * _wall_rows(grid, th.dtype, -1.0)
        w = wb[..., 1:-1, 1:-1]  # the stored faces, the bottom wall's forced to 0
        u_rows, w_rows, t_rows = ub[..., 1:-1, :], wb[..., 1:-1, :], tb[..., 1:-1, :]
        w_cols = wb[..., :, 1:-1]

        # The u·w flux lives on cell corners (z = j dz, x = i dx), z-faces 0 … rows, x-faces
        # 0 … columns; it is zero on the walls (w = 0 there) whatever the ghost u is.
        corner = 0.5 * (ub[..., :-1, 1:] + ub[..., 1:, 1:]) * 0.5 * (wb[..., 1:, 1:]
                                                                     + wb[..., 1:, :-1])
        here, east = corner[..., :-1], corner[..., 1:]

        u_centre = 0.5 * (u + u_rows[..., 2:])
        u_centre_west = 0.5 * (u_rows[..., :-2] + u)
        du = (-(u_centre**2 - u_centre_west**2) / dx
              - (here[..., 1:, :] - here[..., :-1, :]) / dz
              + pr * ((u_rows[..., 2:] - 2.0 * u + u_rows[..., :-2]) / dx**2
                      + (ub[..., 2:, 1:-1] - 2.0 * u + ub[..., :-2, 1:-1]) / dz**2))

        # w on the block's faces; the bottom wall's face keeps w = 0. Cell centres −1 … rows.
        w_centre = 0.5 * (w_cols[..., :-1, :] + w_cols[..., 1:, :])
        dw = (-(east - here)[..., :-1, :] / dx
              - (w_centre[..., 1:, :] ** 2 - w_centre[..., :-1, :] ** 2) / dz
              + pr * ((w_rows[..., 2:] - 2.0 * w + w_rows[..., :-2]) / dx**2
                      + (w_cols[..., 2:, :] - 2.0 * w + w_cols[..., :-2, :]) / dz**2)
              + pr * ra * 0.5 * (tb[..., :-2, 1:-1] + tb[..., 1:-1, 1:-1]))
        dw = dw * _wall_rows(grid, dw.dtype, 0.0, 0.0)[1:-1]

        flux_x = u * 0.5 * (th + t_rows[..., :-2])
        flux_x_east = u_rows[..., 2:] * 0.5 * (t_rows[..., 2:] + th)
        flux_z = wb[..., 1:, 1:-1] * 0.5 * (tb[..., :-1, 1:-1] + tb[..., 1:, 1:-1])
        # + w: advection of the base profile 1 − z (exact: its face average is exact).
        dth = (-(flux_x_east - flux_x) / dx
               - (flux_z[..., 1:, :] - flux_z[..., :-1, :]) / dz
               + (t_rows[..., 2:] - 2.0 * th + t_rows[..., :-2]) / dx**2
               + (tb[..., 2:, 1:-1] - 2.0 * th + tb[..., :-2, 1:-1]) / dz**2
               + w_centre[..., 1:, :])
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
            new["u"], new["w"] = project(new["u"], new["w"], dz, dx, grid)
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
        rate = grid.global_max(jnp.max(jnp.abs(state["u"]) / dx + jnp.abs(state["w"]) / dz))
        return jnp.where(rate > 0, courant / jnp.where(rate > 0, rate, 1.0), jnp.inf)

    def stable_dt(self, state, params, grid: Grid, courant: float = 1.0) -> jnp.ndarray:
        """The smaller of the diffusive and the advective limits for this state."""
        return jnp.minimum(self.max_stable_dt(params, grid),
                           self.cfl_dt(state, params, grid, courant))

    # -- diagnostics -----------------------------------------------------------------------------

    def divergence(self, state, grid: Grid) -> jnp.ndarray:
        """∇·u at cell centres (zero to round-off after every step)."""
        return divergence_of(state["u"], state["w"], grid)

    def nusselt(self, state, grid: Grid) -> jnp.ndarray:
        """Nu = 1 + ⟨wθ⟩ over the layer (trapezoid over the z-faces, θ averaged to them)."""
        dz = grid.spacing[0]
        tb = grid.pad(state["theta"], 1)
        flux = _faces(state["w"], grid)[..., 1:-1, 1:-1] * 0.5 * (tb[..., :-2, 1:-1]
                                                                  + tb[..., 1:-1, 1:-1])
        total = grid.global_sum(jnp.sum(flux, axis=(-2, -1)))
        return 1.0 + dz * total / grid.global_shape[1]

    def wall_nusselt(self, state, grid: Grid) -> tuple[jnp.ndarray, jnp.ndarray]:
        """Nu = 1 − ∂z⟨θ⟩ at the bottom and the top wall, from the first cell off each wall
        (θ = 0 on the wall half a cell away). Equal to :meth:`nusselt` in a steady state."""
        dz = grid.spacing[0]
        th = state["theta"]
        bottom, top = _at_walls(grid)
        nx = grid.global_shape[1]
        low = grid.global_sum(jnp.where(bottom, jnp.sum(th[..., 0, :], axis=-1), 0.0)) / nx
        high = grid.global_sum(jnp.where(top, jnp.sum(th[..., -1, :], axis=-1), 0.0)) / nx
        return 1.0 - 2.0 * low / dz, 1.0 + 2.0 * high / dz

    def kinetic_energy(self, state, grid: Grid) -> jnp.ndarray:
        """½⟨u² + w²⟩ over the layer (every stored face stands for one cell's area)."""
        total = grid.global_sum(jnp.sum(state["u"] ** 2 + state["w"] ** 2, axis=(-2, -1)))
        return 0.5 * total / math.prod(grid.global_shape)

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
