"""Rayleigh–Bénard on a device mesh split in space (8 virtual CPU devices): the loss and its
revolve gradient on meshes split along z, x and both equal store-all on one device to
round-off, the diagnostics' global maxima and sums equal the whole grid's, and a mesh whose
tiles cannot be transposed into pencils is refused before any state is made."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pdefit.adjoint import Revolve, StoreAll
from pdefit.fitting.components import check_tiled_step
from pdefit.fitting.observe import Observation, observed_data
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.model.params import ParameterLayout
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.numerics.pencil import dct_ii, dct_iii, irfft_packed, rfft_packed
from pdefit.options import ConfigError
from pdefit.parallel.domain import Domain
from pdefit.systems.rayleigh_benard import RayleighBenard, solve_poisson

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (virtual) devices")

SYSTEM = RayleighBenard(init_amplitude=0.5, init_modes=3)
GRID = Grid((16, 32), (1.0 / 16, 2.0 / 32), ("neumann", "periodic"))
TRUTH = {"Ra": 2e4, "Pr": 1.0}
DT, STEPS, EVERY = 5e-4, 8, 2
# Split along z, x and both (the diagnostics test also takes four tiles along each axis).
MESHES = [(1, 2), (2, 1), (2, 2)]


@functools.cache
def moving_state() -> dict[str, jnp.ndarray]:
    """A state with flow in both directions: the initial θ evolved for 40 steps."""
    params = {k: jnp.asarray(v) for k, v in TRUTH.items()}
    x0 = SYSTEM.initial_state(GRID, params, seed=2)
    return SYSTEM.evolve(x0, params, GRID, 40 * DT)


def problem_and_batch():
    """u and w observed every EVERY steps; Ra, Pr and θ(0) fitted from off-truth values."""
    x0 = moving_state()
    params = {k: jnp.asarray(v) for k, v in TRUTH.items()}
    frames = jax.jit(simulate, static_argnums=(0, 5, 6))(
        stepper(SYSTEM, GRID, "euler"), x0, params, 0.0, DT, STEPS, EVERY)
    observation = Observation(("u", "w"))
    values = {f: np.asarray(frames[f])[None] for f in observation.fields}
    observed = observed_data(observation, values, {f: None for f in observation.fields},
                             list(range(0, STEPS + 1, EVERY)), STEPS, jnp.float64)
    layout = ParameterLayout.build(SYSTEM.params, TRUTH, ["Ra", "Pr"])
    problem = FitProblem(system=SYSTEM, grid=GRID, dt=DT, integrator="euler", n_steps=STEPS,
                         layout=layout, observation=observation, schedule=StoreAll(),
                         fitted_fields=("theta",))
    batch = Batch(observed, {f: x0[f][None] for f in ("u", "w")})
    theta = {"params": layout.unconstrained({"Ra": 1.3 * TRUTH["Ra"], "Pr": 0.8}),
             "fields": {"theta": 0.7 * x0["theta"][None]}}
    return problem, batch, theta


def relative(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_loss_and_revolve_gradient_on_every_mesh_equal_one_device():
    problem, batch, theta = problem_and_batch()
    value, grad = jax.jit(problem.value_and_grad)(theta, batch)
    assert float(value) > 0 and all(float(jnp.max(jnp.abs(g))) > 0
                                    for g in jax.tree.leaves(grad))
    for mesh in MESHES:
        meshed = dataclasses.replace(problem, domain=Domain.build(mesh), schedule=Revolve(3))
        v, g = jax.jit(meshed.value_and_grad)(theta, batch)
        assert abs(float(v) - float(value)) <= 1e-12 * abs(float(value)), mesh
        assert relative(g, grad) <= 1e-12, mesh
        assert not g["fields"]["theta"].sharding.is_fully_replicated


def test_diagnostics_and_poisson_solve_on_tiles_equal_the_whole_grid():
    state = moving_state()
    dz, dx = GRID.spacing
    rhs = SYSTEM.divergence({"u": state["theta"], "w": state["u"]}, GRID)  # any field
    whole = (SYSTEM.cfl_dt(state, {}, GRID), SYSTEM.nusselt(state, GRID),
             *SYSTEM.wall_nusselt(state, GRID), SYSTEM.kinetic_energy(state, GRID))
    for mesh in [(2, 2), (4, 1), (1, 4), (2, 4)]:
        domain = Domain.build(mesh)
        tiles = domain.tile_grid(GRID)

        def on_tile(s, r, tiles=tiles):
            return ((SYSTEM.cfl_dt(s, {}, tiles), SYSTEM.nusselt(s, tiles),
                     *SYSTEM.wall_nusselt(s, tiles), SYSTEM.kinetic_energy(s, tiles)),
                    solve_poisson(r, dz, dx, tiles))

        scalars, phi = jax.jit(jax.shard_map(
            on_tile, mesh=domain.mesh, in_specs=(P("y", "x"), P("y", "x")),
            out_specs=((P(),) * 5, P("y", "x"))))(state, rhs)
        assert relative(scalars, whole) <= 1e-13, mesh
        assert relative(phi, solve_poisson(rhs, dz, dx)) <= 1e-13, mesh


def test_a_mesh_whose_tiles_do_not_transpose_is_refused_before_any_state():
    """Six rows over the four devices: no pencil whole along x; refused while tracing."""
    grid = Grid((6, 16), (1.0 / 6, 1.0 / 16), ("neumann", "periodic"))
    with pytest.raises(ConfigError, match=r"^mesh.shape=\[1, 4\]: grid axis y of 6 cells"):
        check_tiled_step(RayleighBenard(init_spinup=1e9), grid, TRUTH, (1, 4), DT, "euler")


@pytest.mark.parametrize("n", [7, 8])
def test_real_transforms_invert_and_the_dct_is_the_cosine_sum(n):
    a = np.random.default_rng(n).standard_normal((3, n, n + 1))
    j = np.arange(n)
    cosines = 2.0 * np.cos(np.pi * j[:, None] * (2 * j[None, :] + 1) / (2 * n))
    np.testing.assert_allclose(dct_ii(jnp.asarray(a), -2), np.einsum("kj,bji->bki", cosines, a),
                               atol=1e-12)
    for axis in (-2, -1):
        back = dct_iii(dct_ii(jnp.asarray(a), axis), axis)
        np.testing.assert_allclose(back, a, atol=1e-13)
        packed = rfft_packed(jnp.asarray(a), axis)
        assert packed.shape == a.shape and packed.dtype == a.dtype
        np.testing.assert_allclose(irfft_packed(packed, axis), a, atol=1e-13)
