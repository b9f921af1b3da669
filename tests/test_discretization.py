"""The discretization check of a finished fit and data made by a finer discretization
(pdefit/fitting/discretization.py, ``fit.discretization_check``, ``simulate.refine``)."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from pdefit.api import build_problem
from pdefit.app import cli
from pdefit.app.validate import validate_discretization_check, validate_fit
from pdefit.data import open_dataset
from pdefit.fitting import assemble, discretization, uncertainty
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.options import DiscretizationCheckConfig
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov
from tests.test_fit import SMALL, config


@pytest.mark.parametrize("boundaries", [("neumann", "neumann"), ("periodic", "neumann")])
@pytest.mark.parametrize("factor", [2, 3])
def test_prolongation_keeps_cell_averages_and_lines(boundaries, factor):
    """Block-averaging a prolonged field gives the field back exactly, and a linear field is
    prolonged exactly away from the boundary (second order)."""
    rng = np.random.default_rng(0)
    u = jnp.asarray(rng.standard_normal((2, 6, 8)))
    fine = discretization.prolong(u, factor, boundaries)
    assert fine.shape == (2, 6 * factor, 8 * factor)
    np.testing.assert_allclose(discretization.restrict(fine, factor), u, atol=1e-14)
    grid = Grid((6, 8), (1.0, 0.5), boundaries)
    y, x = grid.coordinates()
    fy, fx = discretization.refined_grid(grid, factor).coordinates()
    line = 0.3 * y[:, None] - 2.0 * x[None, :]
    exact = 0.3 * fy[:, None] - 2.0 * fx[None, :]
    interior = (slice(factor, -factor), slice(factor, -factor))
    np.testing.assert_allclose(discretization.prolong(line, factor, boundaries)[interior],
                               exact[interior], atol=1e-12)


def test_refined_dataset_matches_a_direct_fine_simulation(tmp_path):
    """simulate.refine: frames of dt/3 on the grid ×2, block-averaged back, the first frame the
    coarse generator's state; the dataset records how it was made and keeps the frame times;
    a system without a refinable grid, an unstable refined step and a zero factor are refused
    with the key named."""
    dtype = assemble.set_precision("float64")
    plain = assemble.simulate_dataset(config(tmp_path, *SMALL), tmp_path / "plain.zarr", dtype,
                                      log=lambda _: None)
    cfg = config(tmp_path, *SMALL, "simulate.refine.dt_factor=3",
                 "simulate.refine.grid_factor=2")
    path = assemble.simulate_dataset(cfg, tmp_path / "refined.zarr", dtype, log=lambda _: None)
    meta = open_dataset(path).meta
    assert meta.dt == pytest.approx(0.05 / 3) and meta.steps_per_frame == 30
    assert meta.grid_shape == (20, 20)
    np.testing.assert_allclose(meta.times, open_dataset(plain).meta.times, rtol=1e-12)
    made = meta.provenance["discretization"]
    assert made["dt_factor"] == 3 and made["grid_factor"] == 2
    assert made["grid_shape"] == [40, 40] and "block average" in made["transfer"]

    system, grid = AlievPanfilov(initial="blobs"), Grid((20, 20), (1.0, 1.0))
    params = {k: jnp.asarray(v) for k, v in AP96.items()}
    x0 = system.initial_state(grid, params, 0)
    fine_grid = Grid((40, 40), (0.5, 0.5))
    fine0 = {k: discretization.prolong(jnp.asarray(v), 2, grid.boundaries) for k, v in x0.items()}
    frames = simulate(stepper(system, fine_grid, "euler"), fine0, params, 0.0, 0.05 / 3, 90, 30)
    for name in ("u", "v"):
        direct = np.asarray(frames[name]).reshape(4, 20, 2, 20, 2).mean(axis=(2, 4))
        stored = open_dataset(path).read(name)[0]
        np.testing.assert_allclose(stored, direct, atol=2e-6)  # stored as float32
        np.testing.assert_allclose(stored[0], x0[name], atol=2e-6)
        coarse = open_dataset(plain).read(name)[0]
        assert np.abs(coarse[-1] - stored[-1]).max() > 1e-3  # not the fit's discretization

    rb = config(tmp_path, "system=rayleigh_benard", "simulate.refine.grid_factor=2")
    with pytest.raises(assemble.ConfigError, match=r"simulate\.refine\.grid_factor=2: "
                                                   r"rayleigh_benard does not declare"):
        assemble.dataset_meta(rb)
    with pytest.raises(assemble.ConfigError, match=r"raise simulate\.refine\.dt_factor"):
        assemble.dataset_meta(config(tmp_path, *SMALL, "simulate.refine.grid_factor=4"))
    with pytest.raises(assemble.ConfigError, match=r"simulate\.refine\.dt_factor must be"):
        validate_fit(config(tmp_path, *SMALL, "simulate.refine.dt_factor=0"), log=print)
    with pytest.raises(assemble.ConfigError, match=r"fit\.discretization_check\.dt_factor must"):
        validate_fit(config(tmp_path, *SMALL, "fit.discretization_check.dt_factor=1"),
                     log=print)


@pytest.fixture(scope="module")
def refined_noisy_data(tmp_path_factory):
    """AP blobs on 20², data made at dt = 0.0025 (dt/20) with additive noise σ = 0.003."""
    tmp = tmp_path_factory.mktemp("refined")
    cfg = config(tmp, *SMALL, "simulate.n_frames=6", "simulate.refine.dt_factor=20",
                 "simulate.noise.kind=additive", "simulate.noise.sigma=0.003")
    dtype = assemble.set_precision("float64")
    path = assemble.simulate_dataset(cfg, tmp / "ap.zarr", dtype, log=lambda _: None)
    jax.config.update("jax_enable_x64", True)
    return path


def test_check_flags_a_coarse_time_step_and_passes_a_fine_one(refined_noisy_data):
    """On data from dt/20 with noise, the true parameters fitted at Euler dt = 0.05 (near its
    stability limit) leave a discretization error the check flags, naming system.dt; at
    dt = 0.005 the change is small against the noise and it passes. Also on two devices'
    tiles with the grid refined: the same numbers as on one device."""
    meta = open_dataset(refined_noisy_data).meta
    options = OmegaConf.structured(DiscretizationCheckConfig)
    results = {}
    for dt in (0.05, 0.005):
        setup = build_problem("aliev_panfilov", refined_noisy_data, fit=["k"], dt=dt)
        results[dt] = discretization.check(setup.problem, setup.theta0, setup.batch, options,
                                           meta, log=lambda _: None)
    coarse, fine = results[0.05], results[0.005]
    print(f"coarse: {coarse['message']}\nfine:   {fine['message']}")
    assert coarse["verdict"] == discretization.WARNING
    assert coarse["knobs"] == ["system.dt", "system.integrator"]
    assert "refine system.dt" in coarse["message"]
    assert fine["verdict"] == discretization.OK and fine["knobs"] == []
    assert coarse["change_vs_residual"] > 3 * options.tolerance
    assert fine["change_vs_residual"] < options.tolerance
    # At dt/2 the coarse fit's prediction moves towards the data made at dt/20.
    assert coarse["misfit_refined"] < coarse["misfit"]
    assert coarse["refined_dt"] == 0.025 and coarse["verdict"] != discretization.TWIN
    assert coarse["model_error_in_residual"] and not fine["model_error_in_residual"]


def test_unsupported_check_options_are_refused_before_the_fit(tmp_path):
    """parameters=true without a Gauss–Newton curvature (a fitted initial field) and
    grid_factor > 1 on a grid that cannot be refined raise ConfigError naming the key, from
    validation of the assembled problem (pdefit-fit: before any fit is compiled)."""
    dtype = assemble.set_precision("float64")
    data = assemble.simulate_dataset(config(tmp_path, *SMALL), tmp_path / "ap.zarr", dtype,
                                     log=lambda _: None)
    fields = assemble.build_fit(config(tmp_path, *SMALL, f"data.path={data}",
                                       "fit.params=[k]", "+fit.initial_fields.v=fit"),
                                data, dtype).problem
    parameters = OmegaConf.structured(DiscretizationCheckConfig(parameters=True))
    with pytest.raises(assemble.ConfigError, match=r"fit\.discretization_check\.parameters="
                                                   r"true .*fitted initial fields \['v'\]"):
        validate_discretization_check(parameters, problem=fields)
    validate_discretization_check(OmegaConf.structured(DiscretizationCheckConfig(
        parameters=True, enabled=False)), problem=fields)  # off: nothing to refuse

    @dataclasses.dataclass(frozen=True)
    class Staggered(AlievPanfilov):
        refinable_grid: ClassVar[bool] = False

    staggered = dataclasses.replace(fields, system=Staggered(initial="blobs"), fitted_fields=(),
                                    field_bounds=())
    grid = OmegaConf.structured(DiscretizationCheckConfig(grid_factor=2))
    with pytest.raises(assemble.ConfigError, match=r"discretization_check\.grid_factor=2: "
                                                   r".*does not declare a refinable"):
        validate_discretization_check(grid, "discretization_check", staggered)

    run = tmp_path / "run"
    with pytest.raises(assemble.ConfigError, match=r"fit\.discretization_check\.parameters"):
        cli.fit(config(run, *SMALL, f"data.path={data}", "fit.params=[k]",
                       "+fit.initial_fields.v=fit", "fit.discretization_check.parameters=true"))
    assert not list(run.glob("**/checkpoints/*"))


def test_parameter_shift_estimates_the_bias_of_a_coarse_fit(refined_noisy_data):
    """With parameters=true the check estimates how far k's optimum moves at dt/2 (a
    Gauss–Newton step, on the curvature the intervals computed): for first-order Euler about
    half the bias, so it shrinks about in proportion to dt; the verdict then follows
    parameter_tolerance. The intervals are marked unreliable where the residual is partly
    discretization error (dt = 0.05), not where it is noise (dt = 0.005)."""
    options = OmegaConf.structured(DiscretizationCheckConfig(parameters=True,
                                                             parameter_tolerance=2e-4))
    found, marked = {}, {}
    for dt in (0.05, 0.005):
        setup = build_problem("aliev_panfilov", refined_noisy_data, fit=["k"], dt=dt)
        parts = uncertainty.curvature_parts(setup.problem, setup.theta0, setup.batch)
        found[dt] = discretization.check(setup.problem, setup.theta0, setup.batch, options,
                                         log=lambda _: None, curvature=parts)
        intervals = uncertainty.estimate(setup.problem, setup.theta0, setup.batch, parts=parts)
        marked[dt] = discretization.mark_intervals(intervals, found[dt])
        assert marked[dt]["parameters"] == intervals["parameters"]
    assert marked[0.05]["model_error_dominated"] and "not reliable" in marked[0.05]["note"]
    assert not marked[0.005]["model_error_dominated"] and marked[0.005]["note"] is None
    assert "model_error_dominated" not in discretization.mark_intervals(
        {"available": False, "reason": "fit.uncertainty=false"}, found[0.05])
    coarse, fine = (found[dt]["parameter_shift"]["parameters"]["k"]["relative"]
                    for dt in (0.05, 0.005))
    print(f"k moves by {coarse:.3%} at dt = 0.05 → 0.025, {fine:.3%} at 0.005 → 0.0025")
    assert 5 < coarse / fine < 20  # first order: ∝ dt
    assert found[0.05]["verdict"] == discretization.WARNING
    assert found[0.05]["criterion"] == "parameter_shift"
    assert "the fitted values move by more than 0.02 %" in found[0.05]["message"]
    assert found[0.005]["verdict"] == discretization.OK


def test_check_on_a_mesh_and_a_refined_grid_equals_one_device(tmp_path):
    """Two experiments over a 2 × 2 mesh of tiles with ×2 grid refinement: the check's
    numbers equal the single-device ones; a system without a refinable grid is refused, the
    key named."""
    dtype = assemble.set_precision("float64")
    data = assemble.simulate_dataset(config(tmp_path, *SMALL, "simulate.n_experiments=2"),
                                     tmp_path / "two.zarr", dtype, log=lambda _: None)
    options = OmegaConf.structured(DiscretizationCheckConfig(grid_factor=2))
    found = []
    for mesh in ([], ["mesh.shape=[1,2]", "mesh.experiments=2"]):
        cfg = config(tmp_path, *SMALL, f"data.path={data}", "fit.params=[k,a]", *mesh)
        setup = assemble.build_fit(cfg, data, dtype)
        found.append(discretization.check(setup.problem, setup.theta0, setup.batch, options,
                                          open_dataset(data).meta, log=lambda _: None))
    single, meshed = found
    assert meshed["grid_check"]["grid"] == [40, 40]
    for key in ("misfit", "misfit_refined", "change"):
        assert meshed[key] == pytest.approx(single[key], rel=1e-9)
    for key in ("misfit_refined", "change"):
        assert meshed["grid_check"][key] == pytest.approx(single["grid_check"][key], rel=1e-9)
    assert single["grid_check"]["change"] > single["change"] > 0
    assert single["verdict"] == discretization.TWIN  # the fit's own dt, integrator and grid

    @dataclasses.dataclass(frozen=True)
    class Staggered(AlievPanfilov):
        refinable_grid: ClassVar[bool] = False

    plain = dataclasses.replace(setup.problem, system=Staggered(initial="blobs"), domain=None)
    single_setup = assemble.build_fit(config(tmp_path, *SMALL, f"data.path={data}",
                                             "fit.params=[k,a]"), data, dtype)
    with pytest.raises(ValueError, match=r"fit\.discretization_check\.grid_factor=2: .*does "
                                         r"not declare a refinable"):
        discretization.check(plain, single_setup.theta0, single_setup.batch, options,
                             log=lambda _: None)


def test_fit_reports_the_check_in_summary_and_table(tmp_path, capsys):
    """pdefit-fit writes the check to summary.json and prints it after the table."""
    assemble.set_precision("float32")
    run = tmp_path / "run"
    summary = cli.fit(config(run, *SMALL, "fit.params=[k]", "optim=adam", "optim.steps=2"))
    check = summary["discretization_check"]
    for key in ("misfit", "misfit_refined", "change", "change_vs_residual", "change_vs_data",
                "verdict", "knobs", "refined_dt", "message"):
        assert key in check
    assert check["verdict"] == discretization.TWIN and check["refined_dt"] == 0.025
    assert json.loads((run / "summary.json").read_text())["discretization_check"] == check
    assert summary["uncertainty"]["model_error_dominated"] is False  # a twin: noise only
    assert "discretization check (dt/2): predictions change by" in capsys.readouterr().out


def test_api_fit_runs_the_check(refined_noisy_data):
    """pdefit.fit runs the check after the fit (its keys as a mapping) and refuses a bad key
    or value before fitting."""
    import pdefit

    setup = build_problem("aliev_panfilov", refined_noisy_data, fit=["k"], dt=0.05)
    with pytest.raises(ValueError, match=r"discretization_check: .*dt_fator"):
        pdefit.fit(setup, steps=1, discretization_check={"dt_fator": 4})
    with pytest.raises(assemble.ConfigError, match=r"discretization_check\.dt_factor must"):
        pdefit.fit(setup, steps=1, discretization_check={"dt_factor": 1})
    with pytest.raises(ValueError, match=r"discretization_check\.parameters: .*'maybe'"):
        pdefit.fit(setup, steps=1, discretization_check={"parameters": "maybe"})
    result = pdefit.fit(setup, optimizer="adam", steps=1, discretization_check={"dt_factor": 4})
    assert result.discretization["refined_dt"] == 0.0125
    assert result.discretization["verdict"] == discretization.WARNING
    assert pdefit.fit(setup, optimizer="adam", steps=1,
                      discretization_check=False).discretization is None
