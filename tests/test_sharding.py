"""Domain decomposition on 8 virtual CPU devices: losses and gradients on every mesh equal the
single-device ones, a fit on a 2×4 mesh ends where the 1×1 fit ends, and the data of each
device is read from its own window of the dataset."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.adjoint import Revolve
from pdefit.app import cli
from pdefit.parallel.domain import Domain
from tests.helpers import ap_problem
from tests.test_fit import SMALL, config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

MESHES = [(1, 1), (1, 8), (2, 4), (8, 1), (2, 2, 2)]


def max_relative_difference(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize(("boundaries", "dtype", "tolerance"), [
    (("neumann", "neumann"), jnp.float64, 1e-12),
    (("periodic", "periodic"), jnp.float64, 1e-12),
    (("periodic", "neumann"), jnp.float32, 1e-5),
])
def test_loss_and_gradient_equal_single_device(boundaries, dtype, tolerance):
    if dtype == jnp.float32:
        jax.config.update("jax_enable_x64", False)
    problem, batch, _, theta = ap_problem(shape=(16, 16), boundaries=boundaries, n_steps=21,
                                          every=5, fit_fields=("v",), n_exp=2,
                                          schedule=Revolve(4), dtype=dtype)
    reference = jax.jit(problem.value_and_grad)(theta, batch)
    for mesh in MESHES:
        sharded = dataclasses.replace(problem, domain=Domain.build(mesh))
        value, grad = jax.jit(sharded.value_and_grad)(theta, batch)
        assert abs(float(value) - float(reference[0])) <= tolerance * abs(float(reference[0]))
        assert max_relative_difference(grad, reference[1]) <= tolerance, mesh
        # Field gradients stay split like the field itself.
        if mesh != (1, 1):
            assert not grad["fields"]["v"].sharding.is_fully_replicated


def test_branch_free_revolve_on_a_mesh_equals_single_device():
    """The executor accelerators use, inside ``shard_map`` (here on virtual CPU devices)."""
    problem, batch, _, theta = ap_problem(shape=(16, 16), n_steps=21, every=5,
                                          fit_fields=("v",), n_exp=2, schedule=Revolve(4))
    reference = jax.jit(problem.value_and_grad)(theta, batch)
    sharded = dataclasses.replace(problem, domain=Domain.build((2, 4)),
                                  schedule=Revolve(4, "branch_free"))
    value, grad = jax.jit(sharded.value_and_grad)(theta, batch)
    assert abs(float(value) - float(reference[0])) <= 1e-12 * abs(float(reference[0]))
    assert max_relative_difference(grad, reference[1]) <= 1e-12


def test_tile_halo_exchange_matches_global_padding():
    """Every tile's padded block equals the matching window of the globally padded field."""
    from jax.sharding import PartitionSpec as P

    from pdefit.numerics.grid import Grid
    from pdefit.parallel.domain import AXES

    for boundaries in [("neumann", "periodic"), ("periodic", "neumann")]:
        grid = Grid((8, 12), (1.0, 1.0), boundaries)
        u = jnp.arange(96.0).reshape(1, 8, 12) ** 1.5
        domain = Domain.build((2, 4))
        tiles = domain.tile_grid(grid)
        padded = jax.shard_map(lambda t, tiles=tiles: tiles.pad(t, 2)[None], mesh=domain.mesh,
                               in_specs=P(*AXES), out_specs=P(("e", "y", "x")))(u)
        expected = grid.pad(u, 2)[0]
        for k, block in enumerate(np.asarray(padded)):
            iy, ix = divmod(k, 4)
            window = expected[iy * 4: iy * 4 + 8, ix * 3: ix * 3 + 7]
            np.testing.assert_array_equal(block[0], window)


def test_mesh_must_divide_the_grid():
    with pytest.raises(ValueError, match="does not split over 3 devices"):
        Domain.build((1, 3)).check(dataclasses.replace(
            ap_problem(shape=(8, 8))[0].grid), n_experiments=1)


def test_fit_on_2x4_mesh_ends_where_single_device_fit_ends(tmp_path):
    common = [*SMALL, "optim=adam", "optim.steps=15", "fit.params=[k,a,eps0]",
              "precision=float64"]
    single = cli.fit(config(tmp_path / "single", *common))
    meshed = cli.fit(config(tmp_path / "mesh", *common, "mesh=2x4"))
    for a, b in zip(single["parameters"], meshed["parameters"], strict=True):
        assert a["recovered"] == pytest.approx(b["recovered"], rel=1e-9), (a, b)
    assert single["final_loss"] == pytest.approx(meshed["final_loss"], rel=1e-9)


def test_each_device_window_is_read_once(tmp_path):
    """On a 2×4 mesh the dataset is read in eight windows per array, one per device."""
    from pdefit.fitting import assemble
    data_dir = tmp_path / "data"
    cfg = config(data_dir, *SMALL, "mesh=2x4")
    dtype = assemble.set_precision("float64")
    path = assemble.simulate_dataset(cfg, data_dir / "ap.zarr", dtype, log=lambda _: None)
    setup = assemble.build_fit(config(tmp_path, *SMALL, "mesh=2x4", f"data.path={path}"),
                               path, dtype)
    u_windows = {(r[3], r[4]) for r in setup.reads if r[0] == "u" and len(r[2]) > 1}
    assert len(u_windows) == 8
    assert {w[0] for w in u_windows} == {(0, 10), (10, 20)}
    assert {w[1] for w in u_windows} == {(0, 5), (5, 10), (10, 15), (15, 20)}
