"""A user's recording in: ``pdefit.write_dataset`` and the ``pdefit-import`` command (NumPy,
netCDF and Zarr through xarray) write datasets with observation times and no model time step;
the fit chooses its dt and refuses one the frame times do not allow; nothing that is not a
pdefit dataset is ever replaced."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pdefit
from pdefit.data import DatasetError, open_dataset
from pdefit.options import ConfigError
from pdefit.systems.aliev_panfilov import AlievPanfilov

BIN = Path(sys.executable).parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def pdefit_import(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "pdefit-import"), *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=120)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The refusal: exit 2, one line on stderr, no traceback."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def frames(n_frames: int = 4, ny: int = 6, nx: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n_frames, ny, nx)).astype(np.float32)


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_npy_import_round_trips_values_times_and_units(tmp_path):
    u = frames()
    np.save(tmp_path / "u.npy", u)
    done = pdefit_import("u.npy", "u.zarr", "--field", "u", "--time-step", "0.5",
                         "--spacing", "0.25", "0.25", "--units", "u=mV", "--time-unit", "ms",
                         cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ds = open_dataset(tmp_path / "u.zarr")
    meta = ds.meta
    assert meta.dt is None and meta.steps_per_frame is None and meta.system == ""
    np.testing.assert_array_equal(ds.read("u", 0), u)
    np.testing.assert_array_equal(meta.times, [0.0, 0.5, 1.0, 1.5])
    assert meta.frame_interval == 0.5 and meta.grid_spacing == (0.25, 0.25)
    assert meta.time_unit == "ms" and meta.field_attrs["u"]["units"] == "mV"
    assert not ds.masked_fields
    refused = one_line_error(pdefit_import("u.npy", "v.zarr", "--time-step", "0.5",
                                           cwd=tmp_path))
    assert "--field" in refused and not (tmp_path / "v.zarr").exists()


def test_npz_with_nan_gets_masks_and_its_own_times(tmp_path):
    u, v = frames(seed=1), frames(seed=2)
    v[2, 1:3, 4] = np.nan
    times = np.array([0.0, 0.1, 0.3, 0.4])  # not evenly spaced
    np.savez(tmp_path / "rec.npz", u=u, v=v, time=times, mask_u=np.ones(u.shape, bool))
    refused = one_line_error(pdefit_import("rec.npz", "rec.zarr", cwd=tmp_path))
    assert "field 'v' has 2 NaN" in refused and "--mask-nan" in refused
    done = pdefit_import("rec.npz", "rec.zarr", "--mask-nan", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ds = open_dataset(tmp_path / "rec.zarr")
    np.testing.assert_array_equal(ds.meta.times, times)
    assert ds.masked_fields == {"u", "v"}
    mask = ds.read_mask("v", 0)
    np.testing.assert_array_equal(mask, ~np.isnan(v))
    np.testing.assert_array_equal(ds.read("v", 0)[mask], v[mask])
    assert ds.read_mask("u", 0).all()
    with pytest.raises(DatasetError, match="not evenly spaced"):
        _ = ds.meta.frame_interval


@pytest.mark.parametrize("kind", ["netcdf", "zarr"])
def test_xarray_files_give_fields_times_grid_and_units(tmp_path, kind):
    xr = pytest.importorskip("xarray")
    u = frames(n_frames=3, seed=3)
    source = xr.Dataset(
        {"voltage": (("time", "row", "col"), u, {"units": "mV"})},
        coords={"time": ("time", [2.0, 4.0, 6.0], {"units": "ms"}),
                "row": ("row", 0.1 * np.arange(6), {"units": "mm"}),
                "col": ("col", 0.2 * np.arange(8), {"units": "mm"})})
    if kind == "netcdf":
        name = "rec.nc"
        source.to_netcdf(tmp_path / name, engine="scipy")  # netCDF3: scipy only
    else:
        name = "rec_in.zarr"
        source.to_zarr(tmp_path / name, consolidated=False)
    done = pdefit_import(name, "rec.zarr", "--variable", "voltage=u", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ds = open_dataset(tmp_path / "rec.zarr")
    meta = ds.meta
    assert meta.fields == ("u",) and meta.field_attrs["u"]["units"] == "mV"
    np.testing.assert_array_equal(ds.read("u", 0), u)
    np.testing.assert_array_equal(meta.times, [2.0, 4.0, 6.0])
    assert meta.t0 == 2.0 and meta.time_unit == "ms"
    np.testing.assert_allclose(meta.grid_spacing, (0.1, 0.2))
    assert [(a.name, a.units) for a in meta.axes] == [("row", "mm"), ("col", "mm")]
    np.testing.assert_allclose(meta.axes[1].values, 0.2 * np.arange(8))
    missing = one_line_error(pdefit_import(name, "x.zarr", "--variable", "w=u", cwd=tmp_path))
    assert "['w'] not in the input" in missing


def test_without_xarray_one_line_says_what_to_install(tmp_path, monkeypatch, capsys):
    from pdefit.app import importer

    (tmp_path / "rec.nc").write_bytes(b"CDF\x01")
    monkeypatch.setitem(sys.modules, "xarray", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        importer.main([str(tmp_path / "rec.nc"), str(tmp_path / "rec.zarr")])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "pip install xarray" in line and not (tmp_path / "rec.zarr").exists()


def test_a_directory_that_is_not_a_dataset_is_never_replaced(tmp_path):
    """Regression: overwrite replaced whatever directory it was pointed at."""
    mine = tmp_path / "my_results"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("three weeks of work")
    (mine / "sub" / "data.bin").write_bytes(os.urandom(256))
    before = checksums(mine)
    np.save(tmp_path / "u.npy", frames())
    refused = one_line_error(pdefit_import("u.npy", mine, "--field", "u", "--time-step", "1",
                                           "--overwrite", cwd=tmp_path))
    assert "not a pdefit dataset" in refused
    with pytest.raises(DatasetError, match="not a pdefit dataset"):
        pdefit.write_dataset(mine, {"u": frames()}, np.arange(4.0), overwrite=True)
    (tmp_path / "a_file").write_text("keep")
    with pytest.raises(DatasetError, match="not a pdefit dataset"):
        pdefit.write_dataset(tmp_path / "a_file", {"u": frames()}, np.arange(4.0),
                             overwrite=True)
    assert checksums(mine) == before and (tmp_path / "a_file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "my_results", "u.npy"]

    # A pdefit dataset is replaced only with overwrite, and then completely.
    path = pdefit.write_dataset(tmp_path / "ds.zarr", {"u": frames()}, np.arange(4.0))
    with pytest.raises(DatasetError, match="already a pdefit dataset"):
        pdefit.write_dataset(path, {"u": frames(seed=5)}, np.arange(4.0))
    pdefit.write_dataset(path, {"w": frames(n_frames=2)}, [0.0, 1.0], overwrite=True)
    assert open_dataset(path).meta.fields == ("w",) and not (path / "u").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ds.zarr", "my_results",
                                                           "u.npy"]  # no temporary left


def test_mismatched_shapes_and_times_are_refused_naming_the_field(tmp_path):
    with pytest.raises(DatasetError, match=r"field 'v' has shape \(1, 4, 6, 9\).*field 'u'"):
        pdefit.write_dataset(tmp_path / "a.zarr", {"u": frames(), "v": frames(nx=9)},
                             np.arange(4.0))
    with pytest.raises(DatasetError, match="times has shape"):
        pdefit.write_dataset(tmp_path / "a.zarr", {"u": frames()}, np.arange(3.0))
    with pytest.raises(DatasetError, match="increasing"):
        pdefit.write_dataset(tmp_path / "a.zarr", {"u": frames()}, [0.0, 2.0, 1.0, 3.0])
    np.savez(tmp_path / "bad.npz", u=frames(), v=frames(ny=5), t=np.arange(4.0))
    refused = one_line_error(pdefit_import("bad.npz", "b.zarr", cwd=tmp_path))
    assert "field 'v' has shape" in refused
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


def simulated_recording(n_frames: int, steps_per_frame: int, dt: float) -> dict[str, np.ndarray]:
    """A tiny Aliev–Panfilov run (12², float64) at the default parameters (k = 8)."""
    from pdefit.fitting.synthetic import simulate_frames

    system = pdefit.get_system("aliev_panfilov", initial="blobs")
    grid = pdefit.Grid((12, 12), (1.0, 1.0), ("neumann", "neumann"))
    params = {name: spec.default for name, spec in system.params.items()}
    return simulate_frames(system, grid, params, dt, "euler", n_frames, steps_per_frame,
                           seed=0, dtype=jnp.float64)


class UndeclaredStep(AlievPanfilov):
    """Aliev–Panfilov under a name with no config of its own: no default time step."""

    name = "ap_without_a_default_step"


def test_an_imported_recording_is_fitted_at_the_fits_own_dt(tmp_path):
    """Frames of a tiny simulation, imported from NumPy without any dt, one frame dropped
    (uneven times): the fit steps at dt=0.05 to each frame's time, refuses a dt that does not
    reach them, and its loss falls."""
    run = simulated_recording(n_frames=5, steps_per_frame=4, dt=0.05)  # frames 0.2 apart
    keep = [0, 1, 3, 4]
    np.savez(tmp_path / "ap.npz", t=0.2 * np.array(keep), **{k: v[keep] for k, v in run.items()})
    assert pdefit_import("ap.npz", "ap.zarr", cwd=tmp_path).returncode == 0
    path = tmp_path / "ap.zarr"
    assert open_dataset(path).meta.dt is None
    setup = pdefit.build_problem("aliev_panfilov", path, fit=["k"], start={"k": 6.0},
                                 dt=0.05, precision="float64")
    assert setup.problem.dt == 0.05 and setup.problem.n_steps == 16
    with pytest.raises(ConfigError, match=r"system\.dt=0\.03.*0\.2"):
        pdefit.build_problem("aliev_panfilov", path, fit=["k"], dt=0.03, precision="float64")
    # No dt given and none recorded: the system's default step (conf/system: 0.05).
    assert pdefit.build_problem("aliev_panfilov", path, fit=["k"],
                                precision="float64").problem.dt == 0.05
    with pytest.raises(ValueError, match="dt=… is required: the dataset records no model"):
        pdefit.build_problem(UndeclaredStep(initial="blobs"), path, fit=["k"])
    result = pdefit.fit(setup, optimizer="adam", steps=6, lr=0.2,
                        discretization_check=False, uncertainty=False)
    assert result.losses[-1] < 0.5 * result.losses[0], result.losses
    assert abs(result.params["k"] - 8.0) < abs(6.0 - 8.0)
