"""Two-dimensional incompressible Navier–Stokes flow on a sphere of radius R, in vorticity form:

    dζ/dt + J(ψ, ζ + f) = ν (∇²ζ + 2ζ/R²) + r̂·curl F,      ∇²ψ = ζ,  f = 2Ω cos θ,

with colatitude θ, longitude φ, velocity u = r̂ × ∇ψ (u_θ = −∂φψ/(R sin θ), u_φ = ∂θψ/R),
J(a, b) = (∂θa ∂φb − ∂φa ∂θb)/(R² sin θ) = u·∇b for a = ψ, and a tangential body force F.

Conventions:
- Viscosity: the physical Navier–Stokes stress 2ν div(Def u) gives ν(∇²ζ + 2ζ/R²), so a
  vorticity mode of degree l decays at ν(l(l + 1) − 2)/R² and rigid rotation (l = 1) is
  steady (not the Hodge Laplacian ν∇²ζ of some codes, under which rigid rotation decays).
- Rotating frame: f = 2Ω cos θ (Ω = 0 for tissue); J(ψ, f) = 2Ω ∂φψ/R² is applied spectrally.
- The mean vorticity is zero on a closed sphere (Stokes' theorem) and is kept so: the l = 0
  tendency is zero.
- Discretisation: pseudo-spectral on a Gaussian grid (see :mod:`pdefit.numerics.spherical`);
  the state is ζ on the grid, shape (nlat, nlon) = the engine grid's shape, whose spacing is
  unused (θ are Gauss nodes, φ_j = 2πj/nlon). The nonlinear term is formed on the grid and
  projected back to triangular truncation L; by default L is the largest for which the grid
  is "quadratic" (nlat ≥ (3L + 1)/2, nlon ≥ 3L + 1), so products do not alias (the 3/2-grid
  form of the 2/3 rule). The tendency is band-limited, so a band-limited state stays
  band-limited; any part of the state beyond degree L is invisible to the dynamics and is not
  evolved.
- Forcing: ``params["force"]``, when present, is an array (n_times, 2, n_theta, n_phi) of the
  components (F_θ, F_φ) at space–time nodes; see :func:`force_on_grid`. Optional scalars
  ``params["force_azimuth"]`` (rotates the force pattern eastwards by that angle) and
  ``params["force_time_shift"]`` (the force is read at t + shift) carry per-experiment
  alignment. Without ``"force"`` there is no forcing. With the option ``force_nodes`` =
  (n_times, n_theta, n_phi) the system declares ``force`` (an array parameter of that node
  grid, default zero), ``force_azimuth`` and ``force_time_shift`` in its ``params``, so they
  can be fitted (the alignment typically per experiment); :func:`true_force` makes a smooth
  random divergence-free force for synthetic truths.
- Only the rotational part of a force acts on an incompressible flow (the gradient part is
  balanced by pressure), so only that part can be recovered from the flow.
- Device meshes: the grid may be split along latitude (``mesh.shape=[k, 1]``, ``spatial_mesh
  = ("y",)``). Each tile holds a band of rows: the grid → spectral Legendre sums are the band's
  partial sums completed by ``grid.sum_over_rows`` (a collective sum), the spectral → grid
  syntheses evaluate the band's rows only, and the FFT along longitude stays on the tile (so
  longitude is never split). The state of every tile is its band of ζ; spectral coefficients
  are the same on every tile of a column.

The force itself (its nodes, interpolation, synthetic truth and Helmholtz–Hodge parts) is
:mod:`pdefit.systems.sphere_force`; the evaluation of a force fit, which the system offers as
its ``evaluate_fit`` hook, is :mod:`pdefit.systems.sphere_eval`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from pdefit.model.params import ParamSpec
from pdefit.model.system import SystemEvaluation
from pdefit.numerics.grid import PERIODIC, Grid
from pdefit.numerics.spherical import SphericalTransform, gaussian_grid, quadratic_truncation

from . import sphere_eval
from .sphere_force import area_mean, force_at_times, force_on_grid, gradient_part, true_force

OBSERVABLES = ("u_theta", "u_phi")
BASE_PARAMS = {
    "nu": ParamSpec(1e-3, "log", unit="R²/time", doc="kinematic viscosity"),
    "Omega": ParamSpec(0.0, "identity", unit="1/time",
                       doc="angular velocity of the frame (Coriolis f = 2Ω cos θ)"),
}


# ---------------------------------------------------------------------------------------------
# The system.


@dataclass(frozen=True)
class SphereNS:
    """Incompressible flow on a sphere, vorticity–stream-function form (see module docstring).

    Options (all static):
    - ``radius`` R (length unit of the problem), default 1.
    - ``truncation``: the triangular truncation L (0: the largest the grid resolves without
      aliasing).
    - ``dealias``: require the grid to resolve quadratic products at L (default True); False
      only requires the linear grid (nlat ≥ L + 1, nlon ≥ 2L + 2) and lets products alias.
    - ``force_start``, ``force_end``: the times of the first and last force time node (nodes
      are equally spaced in between; one node: a steady force).
    - ``init_lmax`` (≤ L) and ``init_amplitude`` (RMS vorticity) of random initial states.
    - ``force_nodes``: (n_times, n_theta, n_phi) of a fittable force (declares the parameters
      ``force``, ``force_azimuth``, ``force_time_shift``); empty: none. ``force_scale`` is the
      force's unit in the optimiser's coordinates (force = force_scale · z).
    """

    radius: float = 1.0
    truncation: int = 0
    dealias: bool = True
    force_start: float = 0.0
    force_end: float = 1.0
    init_lmax: int = 8
    init_amplitude: float = 1.0
    force_nodes: tuple[int, ...] = ()
    force_scale: float = 1.0

    name: ClassVar[str] = "sphere_ns"
    fields: ClassVar[tuple[str, ...]] = ("zeta",)
    observable_names: ClassVar[tuple[str, ...]] = OBSERVABLES
    stencil_radius: ClassVar[int] = 0  # spectral: no halos
    # Latitude bands only: the Legendre sums are completed across tiles, the longitude FFT
    # needs whole rows.
    spatial_mesh: ClassVar[tuple[str, ...]] = ("y",)
    # Dimensionless: lengths in R, times in the unit of ν's and Ω's values.
    time_unit: ClassVar[str] = "1"
    field_info: ClassVar[dict[str, tuple[str, str]]] = {
        "zeta": ("1", "relative vorticity (1/time)"),
        "u_theta": ("1", "southward velocity u_θ (R/time)"),
        "u_phi": ("1", "eastward velocity u_φ (R/time)"),
    }
    param_dims: ClassVar[dict[str, tuple[str, ...]]] = {
        "force": ("force_time", "force_component", "force_colatitude", "force_longitude")}

    @property
    def params(self) -> dict[str, ParamSpec]:
        """ν and Ω, and with ``force_nodes`` the force and its alignment."""
        out = dict(BASE_PARAMS)
        if self.force_nodes:
            n_times, n_theta, n_phi = self.force_nodes
            out["force"] = ParamSpec(
                0.0, "identity", scale=self.force_scale, unit="R/time²",
                doc="(F_θ, F_φ) on space–time nodes", shape=(n_times, 2, n_theta, n_phi),
                smooth_axes=(0, 2, 3), periodic_axes=(3,))
            out["force_azimuth"] = ParamSpec(
                0.0, "identity", unit="rad", doc="eastward rotation of the force pattern")
            out["force_time_shift"] = ParamSpec(
                0.0, "identity", unit="time", doc="the force is read at t + shift")
        return out

    def __post_init__(self) -> None:
        # Options arrive as lists from configs; a tuple keeps the system hashable.
        object.__setattr__(self, "force_nodes", tuple(int(n) for n in self.force_nodes))
        if self.force_nodes and (len(self.force_nodes) != 3 or min(self.force_nodes) < 1
                                 or self.force_nodes[1] < 2):
            raise ValueError(f"force_nodes must be [n_times ≥ 1, n_theta ≥ 2, n_phi ≥ 1], got "
                             f"{list(self.force_nodes)}")
        if not self.force_scale > 0:
            raise ValueError(f"force_scale must be > 0, got {self.force_scale}")
        if not self.radius > 0:
            raise ValueError(f"sphere radius must be > 0, got {self.radius}")
        if self.truncation < 0 or self.init_lmax < 1 or self.init_amplitude < 0:
            raise ValueError("truncation must be >= 0, init_lmax >= 1 and init_amplitude >= 0")
        if not self.force_end >= self.force_start:
            raise ValueError("force_end must not precede force_start")

    # -- geometry --------------------------------------------------------------------------------

    def transform(self, grid: Any) -> SphericalTransform:
        """The spectral transform of this grid (a Grid, a tile of a mesh split along
        latitude, or a field's (nlat, nlon) shape); a clear ValueError if the grid does not
        suit the truncation."""
        block = None
        if hasattr(grid, "boundaries"):
            if grid.boundaries[1] != PERIODIC:
                raise ValueError(f"{self.name} needs a periodic longitude axis: grid boundaries "
                                 f"[neumann, periodic], got {list(grid.boundaries)}")
            shape = tuple(getattr(grid, "global_shape", grid.shape))
            if tuple(grid.shape) != shape:
                block = grid  # a tile: a band of rows
            if grid.shape[1] != shape[1]:
                raise ValueError(
                    f"{self.name} can split only latitude (mesh.shape=[k, 1]): its longitude "
                    f"FFT needs whole rows, and a tile holds {grid.shape[1]} of {shape[1]} "
                    "longitudes")
        else:
            shape = tuple(grid)
        nlat, nlon = shape
        # Both quadratic-grid conditions bind together at nlon = 2·nlat (T21: 32 × 64); a
        # narrower grid wastes latitudes on a truncation set by the longitudes.
        if nlon < 2 * nlat:
            raise ValueError(f"{self.name} needs a Gaussian grid with nlon ≥ 2·nlat (e.g. "
                             f"{nlat}×{2 * nlat}); the grid is {nlat}×{nlon}")
        lmax = self.truncation or quadratic_truncation(nlat, nlon)
        if lmax < 1:
            raise ValueError(f"a {nlat}×{nlon} Gaussian grid is too small for {self.name}; "
                             "use e.g. nlat ≥ 4, nlon = 2·nlat")
        if self.dealias and lmax > quadratic_truncation(nlat, nlon):
            raise ValueError(
                f"{self.name} with truncation L={lmax} and dealiasing needs nlat ≥ "
                f"{math.ceil((3 * lmax + 1) / 2)} and nlon ≥ {3 * lmax + 1}; the grid is "
                f"{nlat}×{nlon} (use truncation ≤ {quadratic_truncation(nlat, nlon)} or "
                "dealias: false)")
        return SphericalTransform(nlat, nlon, lmax, block)

    def coordinates(self, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
        """Colatitudes θ (Gauss nodes, north to south) and longitudes φ of the (whole) grid."""
        return gaussian_grid(*getattr(grid, "global_shape", grid.shape))

    def axes(self, grid: Grid) -> tuple[tuple[str, np.ndarray, str, str], ...]:
        """Latitude (Gauss nodes, north to south) and longitude of the grid, in degrees."""
        theta, phi = self.coordinates(grid)
        return (("lat", 90.0 - np.degrees(theta), "degrees_north", "latitude"),
                ("lon", np.degrees(phi), "degrees_east", "longitude"))

    def force_times(self, n_times: int) -> np.ndarray:
        """The times of ``n_times`` force nodes."""
        return np.linspace(self.force_start, self.force_end, n_times)

    # -- the model -------------------------------------------------------------------------------

    def stream_function(self, zeta_lm: Any, transform: SphericalTransform) -> jnp.ndarray:
        return transform.inverse_laplacian(zeta_lm, self.radius)

    def velocity(self, zeta: Any, grid: Any = None) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(u_θ, u_φ) of a vorticity field (..., nlat, nlon) on ``grid`` (default: the whole
        grid of the field's shape; a tile holds a band of rows): the observable of the flow."""
        transform = self.transform(zeta.shape[-2:] if grid is None else grid)
        psi = self.stream_function(transform.analysis(zeta), transform)
        return transform.rotated_gradient(psi, self.radius)

    def observables(self, state: dict[str, Any], grid: Any = None) -> dict[str, jnp.ndarray]:
        """Derived observed quantities: the velocity components (on ``grid``, a tile of a
        mesh or the whole grid; default: the whole grid of the state's shape)."""
        u_theta, u_phi = self.velocity(state["zeta"], grid)
        return {"u_theta": u_theta, "u_phi": u_phi}

    def state_from_observables(self, observed: dict[str, Any]) -> dict[str, jnp.ndarray]:
        """The vorticity of an observed velocity (..., nlat, nlon): the curl of (u_θ, u_φ),
        band-limited (a starting guess for a fitted initial state)."""
        u_theta, u_phi = jnp.asarray(observed["u_theta"]), jnp.asarray(observed["u_phi"])
        transform = self.transform(u_theta.shape[-2:])
        return {"zeta": transform.synthesis(transform.curl_analysis(u_theta, u_phi,
                                                                    self.radius))}

    def observation_mask(self, grid: Any, times: Any, cap_start: float = 90.0,
                         cap_end: float = 180.0) -> np.ndarray:
        """Observed points (n_frames, nlat, nlon): a polar cap θ ≤ θ_c(t) around the north
        pole whose colatitude θ_c grows linearly from ``cap_start`` to ``cap_end`` degrees
        over the frame times (like tissue spreading over a yolk)."""
        if not 0 < cap_start <= cap_end <= 180:
            raise ValueError(f"need 0 < cap_start <= cap_end <= 180 degrees, got {cap_start}, "
                             f"{cap_end}")
        times = np.asarray(times, np.float64)
        span = times[-1] - times[0]
        fraction = (times - times[0]) / span if span > 0 else np.zeros_like(times)
        cap = np.radians(cap_start + (cap_end - cap_start) * fraction)
        theta, _ = gaussian_grid(*grid.shape)
        observed = theta[None, :] <= cap[:, None]
        return np.broadcast_to(observed[:, :, None], (len(times), *grid.shape)).copy()

    def synthetic_param(self, name: str, seed: int = 0, **options: Any) -> np.ndarray:
        """A seeded synthetic truth for the array parameter ``name`` (``force``: see
        :func:`true_force`, options amplitude, lmin, lmax, time_modes)."""
        if name != "force" or not self.force_nodes:
            raise ValueError(f"{self.name} makes synthetic values only for 'force' (with "
                             f"force_nodes set), not {name!r}")
        return true_force(*self.force_nodes, seed=seed, **options)

    def penalties(self, grid: Grid) -> dict[str, Any]:
        """With a fittable force: ``force_gradient``, the mean over the force's node times of
        the area mean of |∇ξ|², ∇ξ the gradient (curl-free) part of the interpolated force
        (:func:`gradient_part`). That part is balanced by pressure, so the data say nothing
        about it; the penalty picks the force without one, as a gauge choice."""
        if not self.force_nodes:
            return {}
        transform = self.transform(grid)

        def force_gradient(params: dict[str, Any]) -> jnp.ndarray:
            times = self.force_times(jnp.shape(params["force"])[0])
            fields = force_at_times(params["force"], times, times, grid)
            g_theta, g_phi = gradient_part(transform, fields[:, 0], fields[:, 1], self.radius)
            return area_mean(transform, g_theta**2 + g_phi**2)

        return {"force_gradient": force_gradient}

    def evaluate_fit(self, problem: Any, theta: Any, dataset: Any, experiments: Any,
                     out: Any, plots: bool) -> SystemEvaluation | None:
        """pdefit's evaluation hook: the recovered force and alignments against the
        dataset's truths (:func:`pdefit.systems.sphere_eval.evaluate_fit`); None unless they
        were fitted."""
        return sphere_eval.evaluate_fit(problem, theta, dataset, experiments, out, plots)

    def force_curl(self, params: dict[str, Any], t: Any, grid: Grid,
                   transform: SphericalTransform) -> jnp.ndarray | None:
        """Coefficients of r̂·curl F at time t, or None without a force."""
        if "force" not in params:
            return None
        nodes = jnp.asarray(params["force"])
        shift = params.get("force_time_shift", 0.0)
        times = self.force_times(nodes.shape[0])
        f_theta, f_phi = force_on_grid(nodes, t + shift, times, grid,
                                       params.get("force_azimuth", 0.0))
        return transform.curl_analysis(f_theta, f_phi, self.radius)

    def tendency(self, zeta_lm: Any, params: dict[str, Any], t: Any, grid: Grid,
                 transform: SphericalTransform) -> jnp.ndarray:
        """dζ/dt in spectral coefficients."""
        r = self.radius
        psi = self.stream_function(zeta_lm, transform)
        # J(ψ, ζ) = (∂φψ (1 − μ²)∂μζ − (1 − μ²)∂μψ ∂φζ)/(R²(1 − μ²)) (= u·∇ζ), formed on the
        # quadratic grid and projected back: no aliasing. One synthesis per Legendre table
        # for ψ and ζ together keeps the traced program small.
        both = jnp.stack([psi, zeta_lm])
        dphi = transform.synthesis(transform.dphi(both))
        dmu = transform.synthesis_dmu(both)
        one_minus_mu2 = transform.held_rows(np.sin(transform.tables.theta)[:, None] ** 2, dphi,
                                            axis=0)
        jacobian = (dphi[0] * dmu[1] - dmu[0] * dphi[1]) / (r**2 * one_minus_mu2)
        advection = transform.analysis(jacobian)
        # J(ψ, 2Ω cos θ) = 2Ω ∂φψ/R², exact in spectral space.
        coriolis = (2.0 * params["Omega"] / r**2) * transform.dphi(psi)
        viscous = params["nu"] * (transform.laplacian(zeta_lm, r) + 2.0 * zeta_lm / r**2)
        out = viscous - advection - coriolis
        curl = self.force_curl(params, t, grid, transform)
        if curl is not None:
            out = out + curl
        # The mean vorticity stays zero (the l = 0 row of every term vanishes analytically).
        return out.at[..., 0, 0].set(0.0)

    def rhs(self, state, params, t, grid: Grid):
        transform = self.transform(grid)
        zeta_lm = transform.analysis(state["zeta"])
        return {"zeta": transform.synthesis(self.tendency(zeta_lm, params, t, grid, transform))}

    # -- time steps ------------------------------------------------------------------------------

    def max_stable_dt(self, params, grid: Grid) -> float:
        """Largest stable forward-Euler step of the linear terms, with a safety factor 0.95.

        The viscous eigenvalues are −ν(l(l + 1) − 2)/R², largest at l = L; the Coriolis term
        adds imaginary eigenvalues 2iΩm/(l(l + 1)), at most |Ω| (l = m = 1). The bound is
        2/(ν(L(L + 1) − 2)/R² + |Ω|). Forward Euler is unstable for purely imaginary
        eigenvalues whatever dt, so use rk4 (stable to ≈ 2.8 along both axes) for weakly damped
        flows. Advection needs a CFL limit that depends on the state, not checked here: see
        :meth:`cfl_dt`.
        """
        lmax = self.transform(grid).lmax
        nu, omega = float(params["nu"]), abs(float(params["Omega"]))
        rate = nu * (lmax * (lmax + 1) - 2) / self.radius**2 + omega
        return 0.95 * 2.0 / rate if rate > 0 else math.inf

    def cfl_dt(self, state, params, grid: Grid) -> float:
        """The advective step at Courant number 1: R/(max|u| √(L(L + 1))), √(L(L + 1))/R being
        the largest wavenumber of the truncation. rk4 is stable up to about 2.8 times this (the
        extent of its stability region along the imaginary axis); stay well below for
        accuracy."""
        lmax = self.transform(grid).lmax
        u_theta, u_phi = self.velocity(state["zeta"])
        speed = float(jnp.max(jnp.sqrt(u_theta**2 + u_phi**2)))
        return self.radius / (speed * math.sqrt(lmax * (lmax + 1))) if speed > 0 else math.inf

    # -- initial states --------------------------------------------------------------------------

    def initial_state(self, grid: Grid, params, seed: int) -> dict[str, jnp.ndarray]:
        """Smooth random vorticity with zero mean: independent Gaussian coefficients for
        1 ≤ l ≤ min(init_lmax, L) with an energy spectrum falling off as 1/l (vorticity
        amplitude ∝ l^(−1/2)), scaled to RMS ``init_amplitude``. Band-limited, so the dynamics
        sees all of it."""
        transform = self.transform(grid)
        lmax = min(self.init_lmax, transform.lmax)
        rng = np.random.default_rng(seed)
        shape = (transform.lmax + 1, transform.lmax + 1)
        coeffs = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        coeffs[0] = coeffs[0].real  # m = 0 coefficients of a real field are real
        degree = transform.degrees
        keep = transform.mask & (degree >= 1) & (degree <= lmax)
        coeffs = np.where(keep, coeffs / np.sqrt(np.maximum(degree, 1.0)), 0.0)
        zeta = np.asarray(transform.synthesis(jnp.asarray(coeffs)))
        rms = np.sqrt(np.mean(zeta**2))
        zeta = zeta * (self.init_amplitude / rms if rms > 0 else 0.0)
        dtype = jnp.result_type(*(v for k, v in params.items() if k in BASE_PARAMS))
        return {"zeta": jnp.asarray(zeta, dtype)}
