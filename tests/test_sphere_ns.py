"""Navier–Stokes on a sphere: the spectral transform (round trip, Laplacian, derivatives against
scipy's Legendre functions, curl of a force), viscous decay of single-degree modes at the
physical rate ν(l(l + 1) − 2)/R², steady rigid rotation, the Rossby–Haurwitz phase speed, and
gradients with respect to a space–time force through a rollout (Taylor order 2, revolve equals
store-all)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import factorial, lpmv

from pdefit.adjoint import LossChain, Revolve, StoreAll
from pdefit.adjoint.taylor import taylor_test
from pdefit.model.system import check_time_step, stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.numerics.spherical import SphericalTransform
from pdefit.parallel.domain import TileGrid
from pdefit.systems import get_system
from pdefit.systems.sphere_force import (
    area_mean,
    cubic_interpolation_matrix,
    force_at_times,
    force_node_coordinates,
    force_on_grid,
    gradient_part,
    solenoidal_part,
    true_force,
)
from pdefit.systems.sphere_ns import SphereNS
from tests.helpers import configured_system


def sphere_grid(nlat: int, nlon: int) -> Grid:
    """A Gaussian grid for the engine (the spacing is nominal: the system ignores it)."""
    return Grid((nlat, nlon), (math.pi / nlat, 2 * math.pi / nlon), ("neumann", "periodic"))


def harmonic(transform: SphericalTransform, l: int, m: int, phase: float = 0.0,
             ) -> np.ndarray:
    """P̄_l^m(cos θ) cos(mφ − phase) on the grid, from scipy (independent of our tables):
    lpmv carries the Condon–Shortley phase (−1)^m, which our normalisation omits."""
    t = transform.tables
    norm = np.sqrt((2 * l + 1) / 2 * factorial(l - m) / factorial(l + m))
    legendre = (-1) ** m * norm * lpmv(m, l, t.mu)
    return legendre[:, None] * np.cos(m * t.phi[None, :] - phase)


def band_limited(transform: SphericalTransform, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (transform.lmax + 1, transform.lmax + 1)
    coeffs = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * transform.mask
    coeffs[0] = coeffs[0].real
    return coeffs


# ---------------------------------------------------------------------------------------------
# The transform.


def test_round_trip_and_truncation():
    transform = SphericalTransform(16, 32)
    assert transform.lmax == 10 and transform.dealiased
    coeffs = band_limited(transform)
    field = transform.synthesis(coeffs)
    assert np.abs(transform.analysis(field) - coeffs).max() < 1e-13
    assert np.abs(transform.truncate(field) - field).max() < 1e-13
    # A field of degree 2L (a product) is projected: its degree ≤ L part survives exactly.
    product = field * field
    again = transform.analysis(transform.synthesis(transform.analysis(product)))
    assert np.abs(again - transform.analysis(product)).max() < 1e-12


@pytest.mark.parametrize("l,m", [(1, 0), (3, 2), (6, 6), (10, 4)])
def test_laplacian_and_derivatives_of_harmonics(l, m):
    transform, radius = SphericalTransform(16, 32), 1.7
    t = transform.tables
    y = harmonic(transform, l, m, phase=0.3)
    coeffs = transform.analysis(y)
    expected = np.zeros_like(coeffs)
    expected[m, l] = 0.5 * np.exp(-0.3j) if m else np.cos(0.3)  # cos(mφ − 0.3), m ≥ 0
    assert np.abs(coeffs - expected).max() < 1e-14
    laplacian = transform.synthesis(transform.laplacian(coeffs, radius))
    assert np.abs(laplacian + l * (l + 1) / radius**2 * y).max() < 1e-12
    back = transform.synthesis(transform.inverse_laplacian(transform.laplacian(coeffs, radius),
                                                           radius))
    assert np.abs(back - (y if l else 0)).max() < 1e-13
    # ∂θ against scipy's functions: dP_l^m(cos θ)/dθ = [P_l^(m+1) − (l+m)(l−m+1) P_l^(m−1)]/2
    # (Condon–Shortley convention, scipy handles m − 1 = −1); ∂φ exactly.
    norm = np.sqrt((2 * l + 1) / 2 * factorial(l - m) / factorial(l + m))
    dlegendre = 0.5 * (lpmv(m + 1, l, t.mu) - (l + m) * (l - m + 1) * lpmv(m - 1, l, t.mu))
    dtheta = ((-1) ** m * norm * dlegendre)[:, None] * np.cos(m * t.phi[None, :] - 0.3)
    assert np.abs(transform.synthesis_dtheta(coeffs) - dtheta).max() < 1e-12
    legendre = (-1) ** m * norm * lpmv(m, l, t.mu)
    dphi = -m * legendre[:, None] * np.sin(m * t.phi[None, :] - 0.3)
    assert np.abs(transform.synthesis_dphi(coeffs) - dphi).max() < 1e-12


def test_curl_of_a_force_from_a_stream_function():
    """F = r̂ × ∇χ + ∇ξ has r̂·curl F = ∇²χ (the gradient part is curl-free) and div F = ∇²ξ."""
    transform, radius = SphericalTransform(12, 24), 2.5
    chi, xi = band_limited(transform, 1), band_limited(transform, 2)
    rot_theta, rot_phi = transform.rotated_gradient(chi, radius)
    grad_theta, grad_phi = transform.gradient(xi, radius)
    f_theta, f_phi = rot_theta + grad_theta, rot_phi + grad_phi
    lap_chi, lap_xi = transform.laplacian(chi, radius), transform.laplacian(xi, radius)
    scale = np.abs(lap_chi).max()
    assert np.abs(transform.curl_analysis(f_theta, f_phi, radius) - lap_chi).max() < 1e-13 * scale
    assert np.abs(transform.divergence_analysis(f_theta, f_phi, radius)
                  - lap_xi).max() < 1e-13 * scale
    # The velocity of the system is the same rotated gradient of ψ = ∇⁻²ζ.
    system = SphereNS(radius=radius)
    zeta = transform.synthesis(lap_chi)
    u_theta, u_phi = system.velocity(zeta)
    ref_theta, ref_phi = transform.rotated_gradient(chi, radius)  # the mean of χ has no flow
    assert np.abs(u_theta - ref_theta).max() < 1e-12 and np.abs(u_phi - ref_phi).max() < 1e-12


def test_helmholtz_parts_and_area_mean():
    """F = r̂ × ∇χ + ∇ξ splits back into its two parts to round-off, and the quadrature mean
    of a product of band-limited fields is exact: ⟨|F|²⟩ = ⟨|r̂ × ∇χ|²⟩ + ⟨|∇ξ|²⟩ (the parts
    are L²-orthogonal), and ⟨Y²⟩ = 1/(4π) for a unit-normalised Y_2^1 written with our
    (∫P̄² dμ = 1) tables as P̄ cos φ/√π."""
    transform, radius = SphericalTransform(12, 24), 2.5
    chi, xi = band_limited(transform, 3), band_limited(transform, 4)
    rot = transform.rotated_gradient(chi, radius)
    grad = transform.gradient(xi, radius)
    f_theta, f_phi = rot[0] + grad[0], rot[1] + grad[1]
    scale = float(np.abs(jnp.stack(rot)).max())
    for got, want in ((solenoidal_part(transform, f_theta, f_phi, radius), rot),
                      (gradient_part(transform, f_theta, f_phi, radius), grad)):
        for g, w in zip(got, want, strict=True):
            assert np.abs(g - w).max() < 1e-12 * scale
    total = area_mean(transform, f_theta**2 + f_phi**2)
    parts = (area_mean(transform, rot[0]**2 + rot[1]**2)
             + area_mean(transform, grad[0]**2 + grad[1]**2))
    assert abs(total - parts) < 1e-12 * total
    y = harmonic(transform, 2, 1) / np.sqrt(np.pi)
    assert abs(area_mean(transform, jnp.asarray(y**2)) - 1 / (4 * np.pi)) < 1e-14


def test_force_gradient_penalty():
    """The system's ``force_gradient`` penalty: the mean square of the force's curl-free part
    at its node times. A divergence-free truth has almost none (only what interpolating nodes
    adds), a force made of a gradient is almost all of it; without force nodes there is no
    penalty."""
    system, grid = SphereNS(force_nodes=(4, 11, 15), force_start=0.0, force_end=3.0), \
        sphere_grid(16, 32)
    penalty = system.penalties(grid)["force_gradient"]
    transform = system.transform(grid)
    times = system.force_times(4)

    def mean_square(nodes):
        f = force_at_times(nodes, times, times, grid)
        return float(area_mean(transform, f[:, 0]**2 + f[:, 1]**2))

    solenoidal = jnp.asarray(true_force(4, 11, 15, seed=3))
    assert float(penalty({"force": solenoidal})) < 1e-4 * mean_square(solenoidal)
    # F = ∇ξ for ξ = P̄_2^1(cos θ) cos φ: F_θ = ∂θξ, F_φ = −m P̄ sin φ / sin θ.
    theta, phi = force_node_coordinates(11, 15)
    inner = np.clip(theta, 1e-6, np.pi - 1e-6)
    mu, sin = np.cos(inner), np.sin(inner)
    p21 = -np.sqrt(15 / 4) * mu * sin  # P̄_2^1 without Condon–Shortley phase, up to sign
    dp21 = -np.sqrt(15 / 4) * np.cos(2 * inner)
    f_theta = dp21[:, None] * np.cos(phi)[None, :]
    f_phi = -(p21 / sin)[:, None] * np.sin(phi)[None, :]
    gradient = jnp.asarray(np.broadcast_to(np.stack([f_theta, f_phi]), (4, 2, 11, 15)))
    assert float(penalty({"force": gradient})) > 0.95 * mean_square(gradient)
    assert SphereNS().penalties(grid) == {}


def test_force_interpolation():
    """Linear in time (held outside), nodes reproduced where they sit, smooth in between."""
    grid = sphere_grid(8, 16)
    rng = np.random.default_rng(0)
    nodes = rng.standard_normal((3, 2, 5, 8))
    times = np.array([0.0, 1.0, 3.0])
    mid = force_on_grid(nodes, 2.0, times, grid)
    ends = [force_on_grid(nodes[k:k + 1], 0.0, times[k:k + 1], grid) for k in (1, 2)]
    for got, a, b in zip(mid, *ends, strict=True):
        assert np.allclose(got, 0.5 * (a + b), atol=1e-14)
    late = force_on_grid(nodes, 9.0, times, grid)
    assert np.allclose(late[0], ends[1][0], atol=1e-14)
    # Constant nodes give a constant field, linear-in-θ nodes a linear field.
    theta_nodes, _ = force_node_coordinates(5, 8)
    theta, _ = SphereNS().coordinates(grid)
    linear = np.broadcast_to(theta_nodes[:, None], (5, 8))
    f_theta, f_phi = force_on_grid(np.stack([linear, np.ones((5, 8))])[None], 0.0, [0.0], grid)
    assert np.allclose(f_theta, theta[:, None], atol=1e-13)
    assert np.allclose(f_phi, 1.0, atol=1e-14)
    # Interpolating: at node coordinates the matrix is the identity (periodic and not).
    for periodic in (True, False):
        w = cubic_interpolation_matrix(jnp.arange(6.0), 6, periodic)
        assert np.allclose(w, np.eye(6), atol=1e-14)
    # Rotating by one node spacing shifts the node pattern by one node.
    shifted = force_on_grid(nodes[:1], 0.0, [0.0], grid, azimuth=2 * np.pi / 8)
    rolled = force_on_grid(np.roll(nodes[:1], 1, axis=-1), 0.0, [0.0], grid)
    assert np.allclose(shifted[0], rolled[0], atol=1e-13)


# ---------------------------------------------------------------------------------------------
# Dynamics.


def run(system: SphereNS, grid: Grid, zeta0, params, dt: float, n_steps: int):
    """The final state of an rk4 rollout (``simulate``: a scan, never a Python loop)."""
    step = stepper(system, grid, "rk4")
    params = {k: jnp.asarray(v) for k, v in params.items()}
    frames = jax.jit(simulate, static_argnums=(0, 5, 6))(
        step, {"zeta": jnp.asarray(zeta0)}, params, 0.0, dt, n_steps, n_steps)
    return frames["zeta"][-1]


MODES = [(1, 1), (2, 0), (3, 1), (5, 3), (6, 6)]


def test_single_degree_modes_decay_at_the_physical_rate():
    """ψ ∝ Y_l^m is an exact solution (the nonlinear term vanishes) decaying at
    ν(l(l + 1) − 2)/R²: rigid rotation (l = 1) is steady."""
    radius, nu, dt, n_steps = 1.5, 0.02, 0.01, 100
    system, grid = SphereNS(radius=radius), sphere_grid(12, 24)
    transform = system.transform(grid)
    zeta0 = np.stack([harmonic(transform, l, m, 0.4) for l, m in MODES])
    final = jax.vmap(lambda z: run(system, grid, z, {"nu": nu, "Omega": 0.0}, dt, n_steps))(
        jnp.asarray(zeta0))
    errors = {}
    for k, (l, m) in enumerate(MODES):
        a0, a1 = transform.analysis(zeta0[k])[m, l], transform.analysis(final[k])[m, l]
        rate = -math.log(abs(a1 / a0)) / (n_steps * dt)
        expected = nu * (l * (l + 1) - 2) / radius**2
        if l == 1:
            assert abs(rate) < 1e-12 and np.abs(final[k] - zeta0[k]).max() < 1e-12
        else:
            errors[l, m] = abs(rate / expected - 1)
        # No other mode is excited, and the phase does not drift (Ω = 0).
        assert abs(np.angle(a1 / a0)) < 1e-12
    assert max(errors.values()) <= 1e-6, errors
    print("relative decay-rate errors", errors)


def test_rigid_rotation_about_the_axis_is_steady_in_a_rotating_frame():
    system, grid = SphereNS(), sphere_grid(8, 16)
    zeta0 = 2.0 * harmonic(system.transform(grid), 1, 0)
    final = run(system, grid, zeta0, {"nu": 0.05, "Omega": 1.3}, 0.05, 40)
    assert np.abs(final - zeta0).max() < 1e-12


@pytest.mark.parametrize("nu", [0.0, 2e-3])
def test_rossby_haurwitz_wave_phase_speed(nu):
    """ψ = −R²ωμ + R²K(1 − μ²)^(m/2) μ cos(m(φ − ct)), c = [m(m+3)ω − 2Ω]/((m+1)(m+2)):
    the phase of the m-th Fourier mode at one latitude after T gives c; with physical
    viscosity c is unchanged and the wave decays at ν((m+1)(m+2) − 2)/R²."""
    radius, omega_frame, omega, amplitude, m = 2.0, 1.0, 0.2, 0.2, 4
    dt, n_steps = 0.05, 100
    system, grid = SphereNS(radius=radius), sphere_grid(12, 24)
    t = system.transform(grid).tables
    mu = t.mu[:, None]
    # ζ = ∇²ψ: the l = 1 part gives 2ωμ, the wave (degree m + 1) −(m+1)(m+2)K(...).
    wave = (1 - mu**2) ** (m / 2) * mu * np.cos(m * t.phi[None, :])
    zeta0 = 2 * omega * mu - (m + 1) * (m + 2) * amplitude * wave
    final = run(system, grid, zeta0, {"nu": nu, "Omega": omega_frame}, dt, n_steps)
    row = int(np.argmin(np.abs(t.theta - np.pi / 4)))
    c0 = np.fft.rfft(zeta0[row])[m]
    c1 = np.fft.rfft(np.asarray(final)[row])[m]
    duration = dt * n_steps
    speed = -np.angle(c1 / c0) / (m * duration)
    expected = (m * (m + 3) * omega - 2 * omega_frame) / ((m + 1) * (m + 2))
    error = abs(speed / expected - 1)
    print(f"RH phase speed {speed:.10f} expected {expected:.10f} relative error {error:.2e}")
    assert error <= 1e-3
    decay = -math.log(abs(c1 / c0)) / duration
    assert abs(decay - nu * ((m + 1) * (m + 2) - 2) / radius**2) < 1e-6


def test_inviscid_flow_conserves_energy_and_enstrophy():
    """The dealiased Galerkin projection conserves energy and enstrophy exactly in continuous
    time (rotation included); what changes is rk4's O(dt⁵) damping of the fastest modes."""
    system, grid = SphereNS(radius=1.3), sphere_grid(12, 24)
    state = system.initial_state(grid, {"nu": 1.0, "Omega": 0.0}, seed=5)
    final = run(system, grid, state["zeta"], {"nu": 0.0, "Omega": 0.7}, 0.01, 200)
    weights = system.transform(grid).tables.weights[:, None]

    def integrals(zeta):
        u_theta, u_phi = system.velocity(zeta)
        return (float(jnp.sum(weights * (u_theta**2 + u_phi**2))),
                float(jnp.sum(weights * zeta**2)))

    for before, after in zip(integrals(state["zeta"]), integrals(final), strict=True):
        assert abs(after / before - 1) < 1e-8, (before, after)


def test_random_initial_state_and_time_step_limits():
    system, grid = get_system("sphere_ns", radius=1.0), sphere_grid(16, 32)
    params = {"nu": 1e-3, "Omega": 0.5}
    state = system.initial_state(grid, params, seed=3)
    zeta = np.asarray(state["zeta"])
    assert zeta.shape == (16, 32) and zeta.dtype == np.float64
    transform = system.transform(grid)
    coeffs = transform.analysis(zeta)
    assert abs(coeffs[0, 0]) < 1e-14, "zero mean"
    assert np.allclose(np.sqrt(np.mean(zeta**2)), 1.0)
    assert np.abs(transform.truncate(zeta) - zeta).max() < 1e-12, "band-limited"
    assert not np.allclose(zeta, system.initial_state(grid, params, seed=4)["zeta"])
    limit = system.max_stable_dt(params, grid)
    lmax = transform.lmax
    assert math.isclose(limit, 0.95 * 2 / (1e-3 * (lmax * (lmax + 1) - 2) + 0.5))
    assert check_time_step(system, params, grid, 0.1, "rk4") > limit
    cfl = system.cfl_dt(state, params, grid)
    assert 0 < cfl < 1


def test_grid_validation():
    system = SphereNS()
    with pytest.raises(ValueError, match="nlon ≥ 2·nlat"):
        system.transform(Grid((16, 20), (1.0, 1.0), ("neumann", "periodic")))
    with pytest.raises(ValueError, match="periodic longitude"):
        system.transform(Grid((16, 32), (1.0, 1.0), ("neumann", "neumann")))
    with pytest.raises(ValueError, match="nlat ≥"):
        SphereNS(truncation=12).transform(sphere_grid(16, 64))
    assert SphereNS(truncation=12, dealias=False).transform(sphere_grid(16, 64)).lmax == 12
    with pytest.raises(ValueError, match="radius"):
        SphereNS(radius=0.0)
    # A mesh may split latitude (each tile a band of rows), never longitude.
    with pytest.raises(ValueError, match=r"can split only latitude \(mesh.shape=\[k, 1\]\)"):
        system.transform(TileGrid(sphere_grid(16, 32), (1, 2)))
    assert system.transform(TileGrid(sphere_grid(16, 32), (2, 1))).rows == 8


def test_config_builds():
    cfg, system, grid, params = configured_system("sphere_ns")
    check_time_step(system, params, grid, cfg["dt"], cfg["integrator"])
    state = system.initial_state(grid, params, 0)
    assert cfg["dt"] < 2 * system.cfl_dt(state, params, grid)


# ---------------------------------------------------------------------------------------------
# Gradients with respect to the force through a rollout.


def force_chain(system: SphereNS, grid: Grid, params, dt: float, every: int) -> LossChain:
    one_step = stepper(system, grid, "rk4")

    def step(x, theta, n):
        return one_step(x, {**params, "force": theta["force"]}, n * dt, dt)

    def cost(x, theta, n, data):
        u_theta, u_phi = system.velocity(x["zeta"])
        k = jnp.minimum(n // every, data.shape[0] - 1)
        misfit = jnp.sum((u_theta - data[k, 0]) ** 2 + (u_phi - data[k, 1]) ** 2)
        return jnp.where(n % every == 0, misfit, 0.0)

    return LossChain(step, cost, lambda n, data: n % every == 0)


def test_force_gradient_through_rollout():
    n_steps, every, dt = 12, 4, 0.05
    system = SphereNS(force_start=0.0, force_end=n_steps * dt)
    grid = sphere_grid(8, 16)
    params = {"nu": jnp.asarray(0.01), "Omega": jnp.asarray(0.5)}
    x0 = system.initial_state(grid, params, seed=0)
    rng = np.random.default_rng(1)
    true_force = jnp.asarray(rng.standard_normal((3, 2, 5, 6)))
    chain = force_chain(system, grid, params, dt, every)
    frames = simulate(stepper(system, grid, "rk4"), x0, {**params, "force": true_force}, 0.0,
                      dt, n_steps, every)
    data = jnp.stack(system.velocity(frames["zeta"]), axis=1)  # (n_frames, 2, nlat, nlon)
    theta = {"force": 0.5 * true_force + 0.2}

    # One compiled value-and-gradient serves both the loss and the gradient (compiling is the
    # cost of this test).
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda t: StoreAll().loss(chain, x0, t, data, n_steps)))

    def store_all(t):
        return value_and_grad(t)[0]

    def grad_store(t):
        return value_and_grad(t)[1]

    grad_revolve = jax.jit(jax.grad(lambda t: Revolve(3).loss(chain, x0, t, data, n_steps)))
    g_ref, g_rev = grad_store(theta), grad_revolve(theta)
    assert np.abs(np.asarray(g_ref["force"])).max() > 0
    rel = np.abs(g_rev["force"] - g_ref["force"]).max() / np.abs(g_ref["force"]).max()
    assert rel < 1e-12, rel
    assert float(store_all(theta)) > 0 and float(store_all({"force": true_force})) < 1e-20

    rows = taylor_test(store_all, grad_store, theta, eps0=1e-2, n=4)
    orders = [r["order"] for r in rows[1:]]
    print("Taylor orders", orders)
    assert all(1.8 < o < 2.2 for o in orders), rows
    assert rows[-1]["first_order"] > 10 * rows[-1]["remainder"]
