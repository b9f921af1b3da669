"""The sphere split over latitude on virtual CPU devices (issue 26): each tile holds a band of
rows, the Legendre sums are completed across tiles, and the loss and its revolve gradient on
meshes [2, 1], [4, 1] (and experiments × latitude) equal store-all on one device in float64;
a split of longitude, or of latitude into unequal bands, is refused before anything is
simulated, naming ``mesh.shape``."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pdefit.adjoint import Revolve, StoreAll
from pdefit.app import cli
from pdefit.fitting.observe import Observation, observed_data
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.model.params import ParameterLayout
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.options import ConfigError
from pdefit.parallel.domain import Domain
from pdefit.systems.sphere_force import true_force
from pdefit.systems.sphere_ns import SphereNS
from tests.test_fit import config
from tests.test_sphere_fit import TINY

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (virtual) devices")

N_EXP, N_STEPS, EVERY, DT = 2, 8, 4, 0.05
FITTED = ("nu", "Omega", "force")


def sphere_grid(nlat: int, nlon: int) -> Grid:
    return Grid((nlat, nlon), (math.pi / nlat, 2 * math.pi / nlon), ("neumann", "periodic"))


def sphere_problem(grid: Grid) -> tuple[FitProblem, Batch, dict]:
    """Two experiments of a forced flow observed through its velocity (a derived observable,
    so observing goes through the transforms too); fitted: the initial vorticity, ν, Ω and
    the force nodes (read on each tile's rows), θ away from the truth. Euler steps: the
    operators are those of rk4, the program is smaller to compile."""
    jax.config.update("jax_enable_x64", True)
    system = SphereNS(force_nodes=(2, 5, 6), force_start=0.0, force_end=N_STEPS * DT,
                      init_amplitude=0.5)
    force = true_force(2, 5, 6, seed=1, amplitude=0.5, lmax=2)
    truth = {"nu": 0.01, "Omega": 0.5, "force": force, "force_azimuth": 0.0,
             "force_time_shift": 0.0}
    step = stepper(system, grid, "euler")
    x0 = {"zeta": jnp.stack([system.initial_state(grid, {"nu": jnp.asarray(0.01)}, seed)["zeta"]
                             for seed in range(N_EXP)])}
    params = {k: jnp.asarray(v) for k, v in truth.items()}
    frames = jax.jit(jax.vmap(lambda x: system.observables(
        simulate(step, x, params, 0.0, DT, N_STEPS, EVERY))))(x0)
    observation = Observation(("u_theta", "u_phi"), derive=system.observables)
    frame_steps = list(range(0, N_STEPS + 1, EVERY))
    observed = observed_data(observation, {k: np.asarray(v) for k, v in frames.items()},
                             {k: None for k in frames}, frame_steps, N_STEPS, jnp.float64)
    layout = ParameterLayout.build(system.params, truth, list(FITTED), system_name=system.name)
    problem = FitProblem(system=system, grid=grid, dt=DT, integrator="euler", n_steps=N_STEPS,
                         layout=layout, observation=observation, schedule=StoreAll(),
                         fitted_fields=("zeta",))
    start = {**truth, "nu": 0.013, "Omega": 0.4, "force": 0.7 * force + 0.05}
    theta = {"params": layout.unconstrained(start),
             "fields": {"zeta": 0.9 * x0["zeta"] + 0.01}}
    return problem, Batch(observed, {}), theta


@pytest.fixture(scope="module")
def problem_on_one_device() -> tuple[FitProblem, Batch, dict]:
    return sphere_problem(sphere_grid(8, 16))


def relative_difference(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_transforms_on_latitude_bands_equal_whole_grid():
    """Analysis (partial sums + collective sum), synthesis and the velocity on each band of
    a [4, 1] mesh equal the whole-grid transforms."""
    jax.config.update("jax_enable_x64", True)
    grid, system = sphere_grid(8, 16), SphereNS()
    zeta = system.initial_state(grid, {"nu": jnp.asarray(0.01)}, 3)["zeta"]
    domain = Domain.build((4, 1))
    transform = system.transform(grid)

    def on_band(tile, z):
        band = system.transform(tile)
        a = band.analysis(z)
        return {"back": band.synthesis(a), "a": a[None], **system.observables({"zeta": z}, tile)}

    out = jax.jit(jax.shard_map(
        lambda z: on_band(domain.tile_grid(grid), z), mesh=domain.mesh, in_specs=P("y", "x"),
        out_specs={"back": P("y", "x"), "a": P(("y", "x")), "u_theta": P("y", "x"),
                   "u_phi": P("y", "x")}))(zeta)
    whole = jax.jit(system.observables)({"zeta": zeta})
    a = jax.jit(transform.analysis)(zeta)
    for band_a in out["a"]:  # every band holds the same (completed) coefficients
        np.testing.assert_allclose(band_a, a, rtol=0, atol=1e-14 * float(jnp.max(jnp.abs(a))))
    np.testing.assert_allclose(out["back"], jax.jit(transform.synthesis)(a), rtol=0, atol=1e-13)
    for name in ("u_theta", "u_phi"):
        np.testing.assert_allclose(out[name], whole[name], rtol=0, atol=1e-13)


def test_loss_and_revolve_gradient_on_latitude_meshes_equal_one_device(problem_on_one_device):
    problem, batch, theta = problem_on_one_device
    reference = jax.jit(problem.value_and_grad)(theta, batch)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(reference[1]))
    for mesh in [(1, 2, 1), (1, 4, 1)]:
        sharded = dataclasses.replace(problem, domain=Domain.build(mesh), schedule=Revolve(3))
        value, grad = jax.jit(sharded.value_and_grad)(theta, batch)
        error = abs(float(value) - float(reference[0])) / abs(float(reference[0]))
        assert error <= 1e-12, (mesh, error)
        assert relative_difference(grad, reference[1]) <= 1e-12, mesh
        # The initial vorticity's gradient stays split over latitude like the field itself.
        assert not grad["fields"]["zeta"].sharding.is_fully_replicated, mesh


@pytest.mark.parametrize(("mesh", "start"), [
    ("mesh.shape=[1,2]", "mesh.shape=[1, 2]: sphere_ns can split only grid axis y "
                         "(mesh.shape=[k, 1])"),
    ("mesh.shape=[3,1]", "mesh.shape=[3, 1]: grid axis y of 8 cells (system.grid.shape=[8, 16])"
                         " does not split over 3 devices"),
])
def test_a_mesh_the_sphere_cannot_use_is_refused_before_work(tmp_path, no_training, mesh,
                                                              start):
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        cli.fit(config(run_dir, *TINY, mesh))
    message = str(err.value)
    assert message.startswith(start), message
    assert "\n" not in message
    assert not run_dir.exists()  # nothing simulated or written
    assert time.perf_counter() - started < 20


def test_discretization_check_on_a_latitude_mesh_equals_one_device(problem_on_one_device):
    """The dt/2 check after a fit runs the fit's model beside a refined one on the tiles;
    its velocities are derived on each tile's band too."""
    from pdefit.fitting.discretization import _measure

    problem, batch, theta = problem_on_one_device
    reference = _measure(problem, theta, batch, 2, 1)
    sharded = _measure(dataclasses.replace(problem, domain=Domain.build((2, 1))), theta, batch,
                       2, 1)
    for key in ("misfit", "misfit_refined", "change"):
        assert sharded[key] == pytest.approx(reference[key], rel=1e-12), key
