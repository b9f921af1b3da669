"""The sphere's tangential body force F = (F_θ, F_φ), the fittable forcing of
:mod:`pdefit.systems.sphere_ns`: its values on a coarse space–time node grid and their
interpolation onto the Gaussian grid (linear in time, cubic in space, optionally rotated in
longitude), a smooth random divergence-free truth for synthetic data, and the Helmholtz–Hodge
parts of a tangential field (only the divergence-free part acts on an incompressible flow; the
gradient part is balanced by pressure).

Pure functions of arrays and grids: the system (:mod:`pdefit.systems.sphere_ns`) and the
evaluation of a force fit (:mod:`pdefit.systems.sphere_eval`) both build on them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.numerics.grid import Grid
from pdefit.numerics.spherical import (
    SphericalTransform,
    gaussian_grid,
    held_rows,
    legendre_tables,
)

FORCE_COMPONENTS = 2  # (F_θ, F_φ)


# ---------------------------------------------------------------------------------------------
# The force: nodes on a coarse space–time grid, interpolated onto the Gaussian grid.


def force_node_coordinates(n_theta: int, n_phi: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the force nodes sit: θ_k = kπ/(n_theta − 1) (both poles included, so the nodes
    cover the sphere without extrapolation) and φ_k = 2πk/n_phi (periodic)."""
    return np.linspace(0.0, np.pi, n_theta), 2 * np.pi * np.arange(n_phi) / n_phi


def _keys_weights(t: Any) -> tuple[Any, Any, Any, Any]:
    """Catmull–Rom (Keys, a = −1/2) cubic weights of nodes −1, 0, 1, 2 at fraction t ∈ [0, 1]:
    interpolating, C¹, and exact for quadratics."""
    t2, t3 = t * t, t * t * t
    return ((-t3 + 2 * t2 - t) / 2, (3 * t3 - 5 * t2 + 2) / 2, (-3 * t3 + 4 * t2 + t) / 2,
            (t3 - t2) / 2)


def cubic_interpolation_matrix(x: Any, n: int, periodic: bool) -> Any:
    """W (len(x), n) with W @ values = the cubic interpolant of ``values`` at node coordinates
    ``x`` (in units of the node spacing, node k at x = k). Periodic: indices wrap. Otherwise
    x is clipped to [0, n − 1] and the ghost nodes −1 and n are linear extrapolations
    (2f₀ − f₁), which keeps linear functions exact up to the ends.

    A numpy ``x`` gives a numpy matrix (a constant of the traced program, built once per
    trace); a JAX ``x`` may be traced, e.g. to differentiate an azimuthal shift."""
    xp = np if isinstance(x, np.ndarray) else jnp
    x = xp.asarray(x)
    if n == 1:
        return xp.ones((x.shape[0], 1), x.dtype)
    eye = xp.eye(n, dtype=x.dtype)
    if periodic:
        base = xp.floor(x)
    else:
        x = xp.clip(x, 0, n - 1)
        base = xp.clip(xp.floor(x), 0, n - 2)
    t = x - base
    base = base.astype(np.int32)
    # ghost −1 = 2f₀ − f₁ and ghost n = 2f_{n−1} − f_{n−2}
    low, high = 2 * eye[0] - eye[1], 2 * eye[n - 1] - eye[n - 2]
    matrix = xp.zeros((x.shape[0], n), x.dtype)
    for offset, w in zip((-1, 0, 1, 2), _keys_weights(t), strict=True):
        index = base + offset
        if periodic:
            row = eye[index % n]
        else:
            row = xp.where((index < 0)[:, None], low,
                           xp.where((index > n - 1)[:, None], high,
                                    eye[xp.clip(index, 0, n - 1)]))
        matrix = matrix + w[:, None] * row
    return matrix


def interpolate_in_time(nodes: Any, t: Any, t_nodes: Any) -> jnp.ndarray:
    """Piecewise-linear interpolation of ``nodes`` (n_times, ...) at time t, held constant
    before the first and after the last node."""
    t_nodes = jnp.asarray(t_nodes, jnp.result_type(nodes))
    if nodes.shape[0] == 1:
        return nodes[0]
    # compare_all: one comparison with every node, where the default bisection is a loop
    # (on an accelerator a few launches per iteration, three loops per rk4 step).
    k = jnp.clip(jnp.searchsorted(t_nodes, t, side="right", method="compare_all") - 1, 0,
                 nodes.shape[0] - 2)
    t0, t1 = t_nodes[k], t_nodes[k + 1]
    w = jnp.clip((t - t0) / (t1 - t0), 0.0, 1.0)
    return (1 - w) * nodes[k] + w * nodes[k + 1]


def force_on_grid(nodes: Any, t: Any, t_nodes: Any, grid: Grid, azimuth: Any = 0.0,
                  ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(F_θ, F_φ) on the Gaussian grid of ``grid.shape`` = (nlat, nlon) at time ``t`` (on a
    tile of a mesh split along latitude: on the tile's rows of the whole grid).

    ``nodes`` has shape (n_times, 2, n_theta, n_phi): the components (F_θ, F_φ) at times
    ``t_nodes`` (n_times, increasing) and at the node positions of
    :func:`force_node_coordinates`. Linear in time (constant outside [t_0, t_last]), cubic
    Catmull–Rom in θ and periodic cubic in φ (C¹ in space). ``azimuth`` rotates the pattern
    eastwards: the force at φ is the node pattern's at φ − azimuth. Linear in ``nodes``."""
    nodes = jnp.asarray(nodes)
    if nodes.ndim != 4 or nodes.shape[1] != FORCE_COMPONENTS:
        raise ValueError(f"force nodes must have shape (n_times, 2, n_theta, n_phi), got "
                         f"{nodes.shape}")
    if np.shape(t_nodes) != (nodes.shape[0],):
        raise ValueError(f"{nodes.shape[0]} force time nodes need {nodes.shape[0]} times, got "
                         f"shape {np.shape(t_nodes)}")
    _, _, n_theta, n_phi = nodes.shape
    if n_theta < 2:
        raise ValueError("the force needs at least 2 nodes in θ (the two poles)")
    theta, phi = gaussian_grid(*getattr(grid, "global_shape", grid.shape))
    w_theta = cubic_interpolation_matrix(theta * ((n_theta - 1) / np.pi), n_theta,
                                         periodic=False)
    # A concrete zero azimuth keeps the φ weights a numpy constant too.
    shifted = phi if isinstance(azimuth, (int, float)) and azimuth == 0 else (
        jnp.asarray(phi, nodes.dtype) - azimuth)
    w_phi = cubic_interpolation_matrix(shifted * (n_phi / (2 * np.pi)), n_phi, periodic=True)
    now = interpolate_in_time(nodes, t, t_nodes)
    real = jnp.finfo(nodes.dtype).dtype
    out = jnp.einsum("ia,cab,jb->cij", held_rows(w_theta, grid, real, axis=0), now,
                     jnp.asarray(w_phi, real))
    return out[0], out[1]


def force_at_times(nodes: Any, times: Any, t_nodes: Any, grid: Grid) -> jnp.ndarray:
    """(F_θ, F_φ) of :func:`force_on_grid` at each of ``times``: (len(times), 2, nlat, nlon)."""
    nodes = jnp.asarray(nodes)
    return jax.vmap(lambda t: jnp.stack(force_on_grid(nodes, t, t_nodes, grid)))(
        jnp.asarray(times, nodes.dtype))


def true_force(n_times: int, n_theta: int, n_phi: int, seed: int = 0, amplitude: float = 1.0,
               lmin: int = 2, lmax: int = 3, time_modes: int = 3) -> np.ndarray:
    """A smooth random force on the nodes of :func:`force_node_coordinates`, shape
    (n_times, 2, n_theta, n_phi), RMS ``amplitude``: F = r̂ × ∇χ for a stream function χ of
    degrees lmin ≤ l ≤ lmax (divergence-free, so all of it acts on the flow; lmin ≥ 2 leaves
    out the rigid-rotation part l = 1, which viscosity never damps) whose coefficients vary
    in time as Legendre polynomials of degree < ``time_modes`` over the node times (so a
    time shift is visible). Seeded and pure numpy."""
    rng = np.random.default_rng(seed)
    theta, phi = force_node_coordinates(n_theta, n_phi)
    # Nodes sit on the poles, where ∂φχ/sin θ has a finite limit; a tiny offset evaluates it.
    theta = np.clip(theta, 1e-6, np.pi - 1e-6)
    mu, sin = np.cos(theta), np.sin(theta)
    legendre, dmu = legendre_tables(lmax, mu)  # [m, l, i]
    l_idx = np.arange(lmax + 1)[None, :, None]
    m_idx = np.arange(lmax + 1)[:, None, None]
    # ∂θ = −(1 − μ²)∂μ / sin θ
    dtheta = np.where(l_idx >= m_idx, -dmu / sin, 0.0)
    s = np.linspace(-1.0, 1.0, n_times)
    time_basis = np.stack([np.polynomial.legendre.Legendre.basis(k)(s)
                           for k in range(time_modes)])  # (K, T)
    keep = (l_idx >= m_idx) & (l_idx >= lmin)
    shape = (time_modes, lmax + 1, lmax + 1)
    coeffs = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * keep[..., 0]
    coeffs = coeffs / (1.0 + np.arange(time_modes))[:, None, None]  # slower modes dominate
    c_t = np.einsum("kt,kml->tml", time_basis, coeffs)
    wave = np.exp(1j * np.arange(lmax + 1)[:, None] * phi[None, :])  # (m, φ)
    # χ = Re Σ c_lm P̄ e^{imφ}; F_θ = −∂φχ/sin θ, F_φ = ∂θχ
    f_theta = -np.real(np.einsum("tml,mli,mj->tij", c_t * 1j * m_idx[None, :, :, 0], legendre,
                                 wave)) / sin[None, :, None]
    f_phi = np.real(np.einsum("tml,mli,mj->tij", c_t, dtheta, wave))
    force = np.stack([f_theta, f_phi], axis=1)
    rms = np.sqrt(np.mean(force**2))
    return force * (amplitude / rms if rms > 0 else 0.0)


def gradient_part(transform: SphericalTransform, f_theta: Any, f_phi: Any, radius: float = 1.0,
                  ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The curl-free part ∇ξ of a tangential field F = ∇ξ + r̂ × ∇χ (Helmholtz–Hodge on the
    sphere: ∇²ξ = ∇·F), band-limited at the transform's truncation."""
    xi = transform.inverse_laplacian(transform.divergence_analysis(f_theta, f_phi, radius), radius)
    return transform.gradient(xi, radius)


def solenoidal_part(transform: SphericalTransform, f_theta: Any, f_phi: Any,
                    radius: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The divergence-free part r̂ × ∇χ of F (∇²χ = r̂·curl F): all an incompressible flow
    responds to, band-limited at the transform's truncation."""
    chi = transform.inverse_laplacian(transform.curl_analysis(f_theta, f_phi, radius), radius)
    return transform.rotated_gradient(chi, radius)


def area_mean(transform: SphericalTransform, f: Any) -> jnp.ndarray:
    """The mean of f over the sphere and any leading axes, by Gauss–Legendre quadrature in
    latitude (exact for products of two degree-L fields on a quadratic grid)."""
    weights = jnp.asarray(transform.tables.weights[:, None] / 2.0, jnp.result_type(f))
    return jnp.mean(jnp.sum(jnp.mean(f, axis=-1, keepdims=True) * weights, axis=(-2, -1)))
