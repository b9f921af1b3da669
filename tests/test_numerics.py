"""Numerical correctness: stencil and integrator orders against analytic solutions, halo filling,
spectral radii, the Aliev–Panfilov plane-front speed and stable time step, and the seeded spiral
generator. Everything runs in float64 on small grids; time loops are jitted ``lax.scan``s."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.model.system import UnstableTimeStepError, check_time_step, stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import make_stepper, simulate
from pdefit.numerics.stencils import laplacian_5pt, laplacian_9pt, laplacian_spectral_radius
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov

LAPLACIAN_FUNCS = {"5pt": laplacian_5pt, "9pt": laplacian_9pt}


@pytest.fixture(autouse=True)
def _float64():
    """Every test here runs in float64, without leaving the switch changed for other modules."""
    with jax.enable_x64(True):
        yield


def observed_order(hs, errors) -> float:
    """Slope of log(error) against log(h): the observed order of convergence."""
    return float(np.polyfit(np.log(hs), np.log(errors), 1)[0])


def mesh(grid: Grid) -> tuple[jnp.ndarray, jnp.ndarray]:
    y, x = grid.coordinates()
    return jnp.meshgrid(y, x, indexing="ij")


# --------------------------------------------------------------------------------------------
# Stencils
# --------------------------------------------------------------------------------------------


def periodic_case(grid: Grid):
    """u = sin(2πx/Lx)·cos(4πy/Ly) and its exact Laplacian."""
    ly, lx = grid.extent
    y, x = mesh(grid)
    u = jnp.sin(2 * np.pi * x / lx) * jnp.cos(4 * np.pi * y / ly)
    return u, -((2 * np.pi / lx) ** 2 + (4 * np.pi / ly) ** 2) * u


def neumann_case(grid: Grid):
    """u = cos(πx/Lx)·cos(2πy/Ly): zero normal derivative on the cell faces of the boundary."""
    ly, lx = grid.extent
    y, x = mesh(grid)
    u = jnp.cos(np.pi * x / lx) * jnp.cos(2 * np.pi * y / ly)
    return u, -((np.pi / lx) ** 2 + (2 * np.pi / ly) ** 2) * u


@pytest.mark.parametrize("kind", ["5pt", "9pt"])
@pytest.mark.parametrize("boundary", ["periodic", "neumann"])
def test_laplacian_converges_at_second_order(kind, boundary):
    lap = LAPLACIAN_FUNCS[kind]
    case = periodic_case if boundary == "periodic" else neumann_case
    # The 9-point stencil needs dx == dy; the 5-point one is checked on a rectangular,
    # anisotropic grid (Ly = 2, Lx = 3).
    extent = (3.0, 3.0) if kind == "9pt" else (2.0, 3.0)
    ns = (32, 64, 128)
    errors = []
    for n in ns:
        grid = Grid((n, n), (extent[0] / n, extent[1] / n), (boundary, boundary))
        u, exact = case(grid)
        approx = lap(grid.pad(u, 1), grid.spacing)
        assert approx.shape == u.shape
        errors.append(float(jnp.max(jnp.abs(approx - exact))))
    hs = [1.0 / n for n in ns]
    order = observed_order(hs, errors)
    assert 1.8 < order < 2.2, (kind, boundary, errors, order)
    # and the error is small in absolute terms on the finest grid (relative to |Δu| ≲ 50)
    assert errors[-1] < 0.05 * float(jnp.max(jnp.abs(exact)))


def test_laplacian_9pt_error_is_isotropic():
    """For plane waves of equal |k| along an axis, (5, 0), and off-axis, (3, 4), the 5-point
    stencil's relative error differs by the factor (kx⁴ + ky⁴)/|k|⁴ = 337/625, while the
    9-point stencil's leading error term is rotation invariant."""
    n, h = 64, 0.25
    grid = Grid((n, n), (h, h), ("periodic", "periodic"))
    y, x = mesh(grid)
    length = n * h

    def relative_error(kind, my, mx):
        phase = 2 * np.pi * (mx * x + my * y) / length
        u = jnp.cos(phase)
        exact = -((2 * np.pi / length) ** 2) * (mx * mx + my * my) * u
        approx = LAPLACIAN_FUNCS[kind](grid.pad(u, 1), grid.spacing)
        return float(jnp.max(jnp.abs(approx - exact)) / jnp.max(jnp.abs(exact)))

    ratio_5 = relative_error("5pt", 4, 3) / relative_error("5pt", 0, 5)
    ratio_9 = relative_error("9pt", 4, 3) / relative_error("9pt", 0, 5)
    assert ratio_5 == pytest.approx(337 / 625, rel=0.05)
    assert abs(ratio_9 - 1.0) < 0.05
    assert abs(ratio_9 - 1.0) < 0.2 * abs(ratio_5 - 1.0)


@pytest.mark.parametrize(
    ("kind", "spacing", "boundaries"),
    [
        ("5pt", (0.3, 0.7), ("neumann", "neumann")),
        ("5pt", (0.3, 0.7), ("neumann", "periodic")),
        ("9pt", (0.5, 0.5), ("neumann", "neumann")),
        ("9pt", (0.5, 0.5), ("periodic", "neumann")),
    ],
)
def test_no_flux_laplacian_conserves_the_sum(kind, spacing, boundaries):
    grid = Grid((12, 17), spacing, boundaries)
    u = jnp.asarray(np.random.default_rng(3).normal(size=(2, *grid.shape)))
    lap = LAPLACIAN_FUNCS[kind](grid.pad(u, 1), grid.spacing)
    totals = jnp.sum(lap, axis=(-2, -1))
    scale = jnp.sum(jnp.abs(lap), axis=(-2, -1))
    assert float(jnp.max(jnp.abs(totals) / scale)) < 1e-13
    # a constant field is in the kernel
    const = jnp.full(grid.shape, 2.5)
    assert float(jnp.max(jnp.abs(LAPLACIAN_FUNCS[kind](grid.pad(const, 1), spacing)))) < 1e-12


def halo_index(n: int, width: int, boundary: str) -> np.ndarray:
    """Which interior index each padded position holds: a cell-centred mirror for Neumann (the
    ghost across a face repeats the cell next to it), wrap-around for periodic."""
    i = np.arange(-width, n + width)
    if boundary == "periodic":
        return i % n
    return np.where(i < 0, -1 - i, np.where(i >= n, 2 * n - 1 - i, i))


@pytest.mark.parametrize("width", [0, 1, 2])
@pytest.mark.parametrize(
    "boundaries",
    [("neumann", "neumann"), ("periodic", "periodic"), ("neumann", "periodic"),
     ("periodic", "neumann")],
)
def test_pad_fills_halos_including_corners(width, boundaries):
    grid = Grid((4, 5), (1.0, 1.0), boundaries)
    u = jnp.arange(3 * 4 * 5, dtype=jnp.float64).reshape(3, 4, 5)  # a leading batch axis too
    padded = np.asarray(grid.pad(u, width))
    assert padded.shape == (3, 4 + 2 * width, 5 + 2 * width)
    iy = halo_index(4, width, boundaries[0])
    ix = halo_index(5, width, boundaries[1])
    expected = np.asarray(u)[:, iy[:, None], ix[None, :]]
    np.testing.assert_array_equal(padded, expected)
    if width:
        corner = padded[:, 0, 0]
        cy = 4 - width if boundaries[0] == "periodic" else width - 1
        cx = 5 - width if boundaries[1] == "periodic" else width - 1
        np.testing.assert_array_equal(corner, np.asarray(u)[:, cy, cx])


def laplacian_matrix(kind: str, grid: Grid) -> np.ndarray:
    """The discrete Laplacian as a dense matrix, by applying it to every unit vector."""
    n = grid.shape[0] * grid.shape[1]
    basis = jnp.eye(n).reshape(n, *grid.shape)
    columns = LAPLACIAN_FUNCS[kind](grid.pad(basis, 1), grid.spacing).reshape(n, n)
    return np.asarray(columns).T


@pytest.mark.parametrize(("kind", "spacing"), [("5pt", (0.5, 0.3)), ("9pt", (0.4, 0.4))])
def test_spectral_radius_matches_eigenvalues(kind, spacing):
    radius = laplacian_spectral_radius(kind, spacing)
    # Even periodic grid: the checkerboard is an eigenmode, so the bound is attained.
    grid = Grid((6, 8), spacing, ("periodic", "periodic"))
    matrix = laplacian_matrix(kind, grid)
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-12)
    eigenvalues = np.linalg.eigvalsh(matrix)
    assert eigenvalues.max() < 1e-10 * radius  # negative semi-definite
    assert np.abs(eigenvalues).max() == pytest.approx(radius, rel=1e-10)
    checkerboard = jnp.asarray((-1.0) ** np.add.outer(np.arange(6), np.arange(8)))
    lap_cb = LAPLACIAN_FUNCS[kind](grid.pad(checkerboard, 1), spacing)
    np.testing.assert_allclose(np.asarray(lap_cb), -radius * np.asarray(checkerboard), rtol=1e-12)
    # Odd periodic and Neumann grids never exceed it (it is a valid bound for stable-dt).
    for shape, boundaries in [((5, 7), ("periodic", "periodic")), ((6, 8), ("neumann", "neumann"))]:
        eig = np.linalg.eigvalsh(laplacian_matrix(kind, Grid(shape, spacing, boundaries)))
        assert np.abs(eig).max() <= radius * (1 + 1e-12)
        assert np.abs(eig).max() > 0.8 * radius


def test_stencil_argument_errors():
    block = jnp.zeros((6, 6))
    with pytest.raises(ValueError, match="equal spacing"):
        laplacian_9pt(block, (0.5, 0.25))
    with pytest.raises(ValueError, match="unknown Laplacian"):
        laplacian_spectral_radius("7pt", (1.0, 1.0))


# --------------------------------------------------------------------------------------------
# Integrators
# --------------------------------------------------------------------------------------------

LAM = -1.3


def forced_linear_exact(t, t0, y0, lam, alpha, beta):
    """Exact solution of y' = λy + α cos t + β sin t with y(t0) = y0."""
    a = -(lam * alpha + beta) / (1.0 + lam * lam)
    b = lam * a + alpha
    particular = lambda s: a * np.cos(s) + b * np.sin(s)  # noqa: E731
    return particular(t) + (y0 - particular(t0)) * np.exp(lam * (t - t0))


def run(step, y0, params, t0, dt, n_steps):
    frames = jax.jit(lambda s: simulate(step, s, params, t0, dt, n_steps, n_steps))(y0)
    return frames


@pytest.mark.parametrize(("method", "order"), [("euler", 1), ("heun", 2), ("rk4", 4)])
def test_explicit_integrators_reach_their_order(method, order):
    """y' = λy + cos t from t0 = 0.3 (the forcing checks that each stage sees the right time)."""

    def rhs(state, params, t):
        return {"y": params["lam"] * state["y"] + jnp.cos(t)}

    step = make_stepper(method, rhs)
    # (horizon 1: at 2 the leading error terms happen to nearly cancel for rk4, which makes
    # the observed order pre-asymptotic, ≈ 4.4, on these step sizes)
    t0, y0, horizon = 0.3, 1.0, 1.0
    exact = forced_linear_exact(t0 + horizon, t0, y0, LAM, 1.0, 0.0)
    params = {"lam": jnp.asarray(LAM)}
    dts, errors = [], []
    for n in (20, 40, 80, 160):
        dt = horizon / n
        frames = run(step, {"y": jnp.asarray(y0)}, params, t0, dt, n)
        assert frames["y"].shape == (2,)
        assert float(frames["y"][0]) == y0
        dts.append(dt)
        errors.append(abs(float(frames["y"][-1]) - exact))
    slope = observed_order(dts, errors)
    assert abs(slope - order) < 0.15, (method, errors, slope)


def test_simulate_frames_and_validation():
    step = make_stepper("euler", lambda s, p, t: {"y": -s["y"]})
    frames = run(step, {"y": jnp.ones(3)}, None, 0.0, 0.1, 12)
    assert frames["y"].shape == (2, 3)
    stacked = jax.jit(lambda s: simulate(step, s, None, 0.0, 0.1, 12, 4))({"y": jnp.ones(3)})
    assert stacked["y"].shape == (4, 3)
    np.testing.assert_allclose(np.asarray(stacked["y"][:, 0]), 0.9 ** np.array([0, 4, 8, 12]))
    with pytest.raises(ValueError, match="multiple"):
        simulate(step, {"y": jnp.ones(3)}, None, 0.0, 0.1, 10, 4)


def gating_system(y_inf, tau):
    """Gate y relaxing to y_inf(t) with time constant tau, plus a non-gated w' = -w."""

    def rhs(state, params, t):
        return {"y": (y_inf(t) - state["y"]) / tau, "w": -state["w"]}

    def gates(state, params, t):
        return {"y": (y_inf(t), tau)}

    return rhs, gates


def test_rush_larsen_is_exact_for_constant_gates_at_any_dt():
    y_inf, tau, y0 = 0.7, 0.01, -0.4
    rhs, gates = gating_system(lambda t: y_inf, tau)
    rush_larsen = make_stepper("rush_larsen", rhs, gates)
    euler = make_stepper("euler", rhs)
    state = {"y": jnp.asarray(y0), "w": jnp.asarray(1.0)}
    for dt, n in [(0.001, 40), (0.05, 8), (0.5, 4)]:  # dt up to 50 τ
        final = run(rush_larsen, state, None, 0.0, dt, n)
        exact = y_inf + (y0 - y_inf) * np.exp(-n * dt / tau)
        assert abs(float(final["y"][-1]) - exact) < 1e-14
        # the non-gated field takes forward-Euler steps
        assert float(final["w"][-1]) == pytest.approx((1.0 - dt) ** n, rel=1e-13)
    # forward Euler at dt = 50 τ amplifies the deviation by |1 - 50| per step
    blown = run(euler, state, None, 0.0, 0.5, 4)
    assert abs(float(blown["y"][-1]) - y_inf) > 1e6


def test_rush_larsen_is_first_order_for_time_dependent_target():
    # (horizon 1: at 2 the first-order term nearly cancels and the observed order is ≈ 1.3)
    tau, y0, t0, horizon = 0.5, 0.2, 0.0, 1.0
    rhs, gates = gating_system(jnp.sin, tau)
    step = make_stepper("rush_larsen", rhs, gates)
    # y' = -y/τ + sin(t)/τ
    exact = forced_linear_exact(t0 + horizon, t0, y0, -1.0 / tau, 0.0, 1.0 / tau)
    state = {"y": jnp.asarray(y0), "w": jnp.asarray(0.0)}
    dts, errors = [], []
    for n in (20, 40, 80, 160):
        dt = horizon / n
        dts.append(dt)
        errors.append(abs(float(run(step, state, None, t0, dt, n)["y"][-1]) - exact))
    slope = observed_order(dts, errors)
    assert abs(slope - 1.0) < 0.15, (errors, slope)


def test_make_stepper_rejects_bad_requests():
    rhs = lambda s, p, t: s  # noqa: E731
    with pytest.raises(ValueError, match="gates"):
        make_stepper("rush_larsen", rhs)
    with pytest.raises(ValueError, match="unknown integrator"):
        make_stepper("leapfrog", rhs)
    # Aliev–Panfilov has no gating variables
    with pytest.raises(ValueError, match="gates"):
        stepper(AlievPanfilov(), Grid((4, 4), (1.0, 1.0)), "rush_larsen")


# --------------------------------------------------------------------------------------------
# Aliev–Panfilov: plane-front speed
# --------------------------------------------------------------------------------------------

FRONT_SPEED = np.sqrt(AP96["k"] * AP96["D"] / 2.0) * (1.0 - 2.0 * AP96["a"])  # 1.4


def front_position(u: np.ndarray, x: np.ndarray) -> float:
    """Rightmost u = 0.5 crossing, linearly interpolated between cell centres."""
    i = int(np.nonzero(u >= 0.5)[0].max())
    assert i + 1 < u.size, "the front has reached the boundary"
    return float(x[i] + (u[i] - 0.5) / (u[i] - u[i + 1]) * (x[i + 1] - x[i]))


def plane_front_speed(params: dict[str, float], dx: float) -> float:
    """Speed of a plane front on a 3-row strip (periodic in y, no-flux in x) of length 40,
    started by exciting x < 3, measured between t ≈ 6, 12 and 18 with forward Euler at
    dt = 0.1 dx²."""
    length = 40.0
    grid = Grid((3, round(length / dx)), (dx, dx), ("periodic", "neumann"))
    dt = 0.1 * dx * dx
    n = round(6.0 / dt)
    _, x = grid.coordinates()
    u0 = jnp.broadcast_to(jnp.where(x < 3.0, 1.0, 0.0), grid.shape)
    state = {"u": u0, "v": jnp.zeros(grid.shape)}
    step = stepper(AlievPanfilov(), grid, "euler")
    p = {k: jnp.asarray(v) for k, v in params.items()}
    frames = jax.jit(lambda s: simulate(step, s, p, 0.0, dt, 3 * n, n))(state)
    u = np.asarray(frames["u"])
    assert np.isfinite(u).all()
    np.testing.assert_allclose(u, np.broadcast_to(u[:, :1, :], u.shape), atol=1e-12)  # planar
    xs = np.asarray(x)
    positions = [front_position(u[k, 0], xs) for k in (1, 2, 3)]
    assert positions[-1] < length - 5.0  # measured away from the boundaries
    early = (positions[1] - positions[0]) / (n * dt)
    late = (positions[2] - positions[1]) / (n * dt)
    assert abs(early - late) < 2e-3, (early, late)  # the front is established
    return (positions[2] - positions[0]) / (2 * n * dt)


def test_aliev_panfilov_front_speed_converges():
    assert abs(FRONT_SPEED - 1.4) < 1e-12
    dxs = (0.4, 0.2, 0.1)
    speeds = [plane_front_speed(AP96, dx) for dx in dxs]
    errors = [abs(c - FRONT_SPEED) for c in speeds]
    assert errors[0] > errors[1] > errors[2], speeds
    assert errors[-1] < 0.01 * FRONT_SPEED, speeds
    # second order in dx (with dt ∝ dx²): successive differences shrink by about 4
    order = np.log2((speeds[1] - speeds[0]) / (speeds[2] - speeds[1]))
    assert 1.7 < order < 2.3, (speeds, order)


def test_front_speed_without_recovery_extrapolates_to_theory():
    """With ε ≡ 0 (v stays 0) the u-equation is exactly the Nagumo equation whose front speed
    is sqrt(kD/2)(1 − 2a); Richardson extrapolation of two second-order runs hits it closely.
    (With AP96's ε0 = 0.002 the slowly rising v at the front lowers the limit by ~0.3 %.)"""
    nagumo = {**AP96, "eps0": 0.0, "mu1": 0.0}
    coarse, fine = (plane_front_speed(nagumo, dx) for dx in (0.2, 0.1))
    extrapolated = fine + (fine - coarse) / 3.0
    assert abs(extrapolated - FRONT_SPEED) < 5e-4 * FRONT_SPEED, (coarse, fine, extrapolated)


# --------------------------------------------------------------------------------------------
# Aliev–Panfilov: stable time step
# --------------------------------------------------------------------------------------------


def test_max_stable_dt_matches_reference_formula():
    dx = 0.25
    grid = Grid((8, 8), (dx, dx))
    p = AP96
    r = p["k"] * (p["b"] + 1.0) ** 2 / 4.0
    expected = 0.95 * min(dx * dx / (4 * p["D"] + dx * dx * (p["k"] + r)),
                          1.0 / (p["eps0"] + p["mu1"] / p["mu2"] * r))
    assert AlievPanfilov().max_stable_dt(p, grid) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("method", ["euler", "heun", "rk4"])
def test_check_time_step_accepts_below_and_rejects_above_the_limit(method):
    system = AlievPanfilov()
    grid = Grid((16, 16), (0.25, 0.25))
    euler_limit = system.max_stable_dt(AP96, grid)
    scale = {"euler": 1.0, "heun": 1.0, "rk4": 2.785 / 2.0}[method]
    limit = check_time_step(system, AP96, grid, 0.99 * euler_limit, method)
    assert limit == pytest.approx(scale * euler_limit, rel=1e-12)
    with pytest.raises(UnstableTimeStepError, match=re.escape(f"{limit:.4g}")):
        check_time_step(system, AP96, grid, 1.05 * limit, method)
    with pytest.raises(UnstableTimeStepError, match="positive"):
        check_time_step(system, AP96, grid, 0.0, method)


@pytest.mark.parametrize("laplacian", ["5pt", "9pt"])
def test_time_step_above_the_limit_is_really_unstable(laplacian):
    """At dx = 0.25, 0.9× the limit decays from small random data while 1.5× blows up.
    (On coarse grids such as dx = 0.5 the limit is conservative enough that 1.5× still
    decays near rest: the heuristic reserves 2(k + r) for reaction rates of excited tissue.)"""
    system = AlievPanfilov(laplacian)
    grid = Grid((16, 16), (0.25, 0.25))
    limit = system.max_stable_dt(AP96, grid)
    rng = np.random.default_rng(0)
    state = {"u": jnp.asarray(0.05 * rng.random(grid.shape)),
             "v": jnp.asarray(0.05 * rng.random(grid.shape))}
    step = stepper(system, grid, "euler")
    p = {k: jnp.asarray(v) for k, v in AP96.items()}

    def final_u(dt):
        frames = jax.jit(lambda s: simulate(step, s, p, 0.0, dt, 200, 200))(state)
        return np.asarray(frames["u"][-1])

    stable = final_u(0.9 * limit)
    assert np.isfinite(stable).all() and np.abs(stable).max() < 0.05
    unstable = final_u(1.5 * limit)
    assert not np.isfinite(unstable).all() or np.abs(unstable).max() > 1e3


# --------------------------------------------------------------------------------------------
# Aliev–Panfilov: spiral generator
# --------------------------------------------------------------------------------------------


def test_spiral_initial_state_is_seeded_and_active():
    system = AlievPanfilov()
    grid = Grid((64, 64), (1.0, 1.0))
    a = system.initial_state(grid, AP96, 0)
    b = system.initial_state(grid, AP96, 0)
    c = system.initial_state(grid, AP96, 1)
    for state in (a, c):
        assert set(state) == {"u", "v"}
        u, v = np.asarray(state["u"]), np.asarray(state["v"])
        assert u.shape == v.shape == grid.shape
        assert np.isfinite(u).all() and np.isfinite(v).all()
        assert u.max() > 0.5  # an active wave
        assert 0.02 < (u > 0.5).mean() < 0.8  # ... that does not fill the tissue
        # not a plane wave from the S1 stimulus: u varies along y as well as x
        assert np.ptp(u, axis=0).max() > 0.5
    for name in ("u", "v"):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    assert np.abs(np.asarray(a["u"]) - np.asarray(c["u"])).max() > 0.1


@pytest.mark.parametrize("kind", ["5pt", "9pt"])
@pytest.mark.parametrize("boundaries", [("neumann", "neumann"), ("periodic", "neumann"),
                                        ("periodic", "periodic")])
def test_laplacian_custom_vjp_equals_autodiff(kind, boundaries):
    """The hand-written VJP (the operator is symmetric) equals reverse-mode through pad and
    stencil, on a grid with dx != dy for the 5-point stencil."""
    from pdefit.numerics.stencils import LAPLACIANS, laplacian

    with jax.enable_x64(True):
        spacing = (0.7, 0.7) if kind == "9pt" else (0.7, 1.3)
        grid = Grid((6, 9), spacing, boundaries)
        rng = np.random.default_rng(4)
        u = jnp.asarray(rng.standard_normal((2, 6, 9)))
        cotangent = jnp.asarray(rng.standard_normal((2, 6, 9)))
        _, mine = jax.vjp(lambda a: laplacian(a, grid, kind), u)
        _, reference = jax.vjp(lambda a: LAPLACIANS[kind](grid.pad(a, 1), spacing), u)
        np.testing.assert_allclose(mine(cotangent)[0], reference(cotangent)[0],
                                   rtol=1e-12, atol=1e-12)
