"""Tests for pdefit.data: schema round trip, layout, parallel-style writes, validation, noise."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from pdefit.data import (
    FORMAT_VERSION,
    Dataset,
    DatasetError,
    DatasetMeta,
    ShardRange,
    add_noise,
    add_noise_block,
    create_dataset,
    make_provenance,
    open_dataset,
    plan_shards,
    shard_ranges,
    validate_dataset,
    write_block,
    write_dataset,
)

N_EXP, N_FRAMES, NY, NX = 2, 5, 8, 12


def make_meta(**overrides: Any) -> DatasetMeta:
    base: dict[str, Any] = {
        "system": "gray_scott",
        "fields": ("u", "v"),
        "grid_shape": (NY, NX),
        "grid_spacing": (0.5, 0.25),
        "boundaries": ("neumann", "periodic"),
        "dt": 0.01,
        "steps_per_frame": 10,
        "t0": 1.0,
        "n_frames": N_FRAMES,
        "n_experiments": N_EXP,
        "true_params": {"Du": 0.16, "F": 0.035},
        "noise": {"kind": "additive", "sigma": 0.01, "seed": 1},
        "provenance": make_provenance({"solver": "rk4", "n": 3}),
    }
    base.update(overrides)
    return DatasetMeta(**base)


def make_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (N_EXP, N_FRAMES, NY, NX)
    return {name: rng.standard_normal(shape).astype(np.float32) for name in ("u", "v")}


def make_mask(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((N_EXP, N_FRAMES, NY, NX)) > 0.3


VALID_CONFIG: dict[str, Any] = {
    "system": "gray_scott",
    "fields": ("u", "v"),
    "grid_shape": (NY, NX),
    "grid_spacing": (0.5, 0.25),
    "boundaries": ("neumann", "periodic"),
    "dt": 0.01,
}


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, DatasetMeta, dict[str, np.ndarray], np.ndarray]:
    """Dataset with a partial last shard (5 frames, 2 per shard) and a sub-frame tile."""
    path = tmp_path / "ds.zarr"
    meta, values, mask = make_meta(), make_values(), make_mask()
    write_dataset(path, meta, values, {"u": mask}, frames_per_shard=2, tile=(4, 6))
    return path, meta, values, mask


# ----------------------------------------------------------------------------- round trip


def test_round_trip_values_masks_attrs_and_times(written: tuple) -> None:
    path, meta, values, mask = written
    ds = open_dataset(path)
    assert ds.meta == meta
    np.testing.assert_array_equal(ds.read("u"), values["u"])
    np.testing.assert_array_equal(ds.read("v"), values["v"])
    assert ds.read("u").dtype == np.float32
    np.testing.assert_array_equal(ds.read_mask("u"), mask)
    assert ds.has_mask("u")
    assert not ds.has_mask("v")
    assert ds.read_mask("v") is None
    np.testing.assert_allclose(ds.meta.times, 1.0 + 0.1 * np.arange(N_FRAMES), rtol=1e-12)
    np.testing.assert_array_equal(zarr.open_array(path / "time", mode="r")[:], meta.times)

    attrs = zarr.open_group(path, mode="r").attrs.asdict()
    assert attrs["format"] == "pdefit-dataset"
    assert attrs["format_version"] == FORMAT_VERSION
    assert attrs["grid"] == {
        "shape": [NY, NX],
        "spacing": [0.5, 0.25],
        "boundaries": ["neumann", "periodic"],
    }
    assert attrs["fields"] == ["u", "v"]
    assert attrs["n_experiments"] == N_EXP
    assert attrs["provenance"]["config"] == {"solver": "rk4", "n": 3}
    assert attrs["provenance"]["created"].endswith("+00:00")


def test_on_disk_layout(written: tuple) -> None:
    path = written[0]
    group = zarr.open_group(path, mode="r", zarr_format=3)
    for name in ("u", "v", "mask_u"):
        array = group[name]
        assert array.metadata.zarr_format == 3
        assert array.chunks == (1, 1, 4, 6)
        assert array.shards == (1, 2, NY, NX)
        assert array.metadata.dimension_names == ("experiment", "time", "y", "x")
    assert group["u"].dtype == np.float32
    assert group["mask_u"].dtype == np.bool_
    assert group["time"].metadata.dimension_names == ("time",)
    np.testing.assert_array_equal(group["y"][...], (np.arange(NY) + 0.5) * 0.5)  # centres
    np.testing.assert_array_equal(group["x"][...], (np.arange(NX) + 0.5) * 0.25)
    assert "mask_v" not in group


def test_layout_defaults_and_tile_rounding(tmp_path: Path) -> None:
    meta = make_meta(n_frames=3)
    create_dataset(tmp_path / "a", meta)  # default: whole-frame tile, shard clipped to n_frames
    array = zarr.open_array(tmp_path / "a" / "u", mode="r")
    assert array.chunks == (1, 1, NY, NX)
    assert array.shards == (1, 3, NY, NX)
    create_dataset(tmp_path / "b", meta, tile=(5, 5))  # 5 divides neither 8 nor 12
    assert zarr.open_array(tmp_path / "b" / "u", mode="r").chunks == (1, 1, 4, 4)


def test_read_selections(written: tuple) -> None:
    path, _, values, mask = written
    ds = open_dataset(path)
    u = values["u"]
    np.testing.assert_array_equal(ds.read("u", experiments=1), u[1])
    np.testing.assert_array_equal(
        ds.read("u", experiments=[1, 0], frames=[4, 0]), u[[1, 0]][:, [4, 0]]
    )
    np.testing.assert_array_equal(ds.read("u", frames=slice(1, None), stride=2), u[:, 1::2])
    np.testing.assert_array_equal(ds.read("u", frames=slice(None, None, -1)), u[:, ::-1])
    np.testing.assert_array_equal(ds.read("u", 0, -1), u[0, -1])
    np.testing.assert_array_equal(ds.read_mask("u", frames=[2]), mask[:, [2]])
    with pytest.raises(DatasetError, match=r"frame .*out of range"):
        ds.read("u", frames=[5])
    with pytest.raises(DatasetError, match=r"has no field 'w'.*'u', 'v'"):
        ds.read("w")


def test_xarray_opens_dataset(written: tuple) -> None:
    xr = pytest.importorskip("xarray")
    path, meta, values, mask = written
    # zarr v3 has no standard consolidated metadata, so consolidated=False is required.
    xds = xr.open_zarr(path, consolidated=False)
    assert xds["u"].dims == ("experiment", "time", "y", "x")
    assert set(xds.indexes) == {"experiment", "time", "y", "x"}
    np.testing.assert_array_equal(xds["u"].values, values["u"])
    np.testing.assert_array_equal(xds["mask_u"].values, mask)
    np.testing.assert_array_equal(xds["time"].values, meta.times)
    np.testing.assert_array_equal(xds["u"].sel(time=meta.times[3]).values, values["u"][:, 3])
    assert xds.attrs["system"] == "gray_scott"


def test_format_version_1_still_read(written: tuple) -> None:
    """A dataset of format version 1 (times in ``t``, no coordinates, no labels) reads as
    before, with cell-centre axes y, x."""
    path, meta, values, _ = written
    group = zarr.open_group(path, mode="r+", zarr_format=3)
    group.create_array("t", shape=(N_FRAMES,), dtype="float64", chunks=(N_FRAMES,),
                       dimension_names=("time",))[...] = meta.times
    for name in ("time", "experiment", "y", "x"):
        del group[name]
    for key in ("axes", "time_unit", "field_attrs", "param_attrs"):
        del group.attrs[key]
    group.attrs["format_version"] = 1
    ds = open_dataset(path)
    assert ds.meta == meta
    np.testing.assert_array_equal(ds.read("v", 1, [0, 4]), values["v"][1, [0, 4]])


def test_format_version_2_still_read(written: tuple) -> None:
    """A dataset of format version 2 (a simulation's dt and steps_per_frame, always there)
    reads as before: times from t0 + k·steps_per_frame·dt, checked against its array."""
    path, meta, values, _ = written
    group = zarr.open_group(path, mode="r+", zarr_format=3)
    group.attrs["format_version"] = 2
    ds = open_dataset(path)
    assert ds.meta == meta and ds.meta.frame_times is None
    assert ds.meta.dt == 0.01 and ds.meta.frame_interval == pytest.approx(0.1)
    np.testing.assert_array_equal(ds.read("u"), values["u"])


def recording_meta(times: tuple[float, ...], **overrides: Any) -> DatasetMeta:
    """The metadata of a recording: no dt or steps_per_frame, its own times."""
    return make_meta(**{"system": "", "dt": None, "steps_per_frame": None, "t0": times[0],
                        "n_frames": len(times), "frame_times": times, "true_params": None,
                        "noise": {"kind": "none"}, **overrides})


def test_a_recording_has_times_and_no_model_step(tmp_path: Path) -> None:
    times = (0.5, 1.0, 2.0, 2.25, 3.0)  # uneven
    meta = recording_meta(times)
    write_dataset(tmp_path / "rec", meta, make_values())
    ds = open_dataset(tmp_path / "rec")
    assert ds.meta == meta and ds.meta.dt is None and ds.meta.system == ""
    np.testing.assert_array_equal(ds.meta.times, times)
    attrs = zarr.open_group(tmp_path / "rec", mode="r").attrs.asdict()
    assert attrs["dt"] is None and attrs["steps_per_frame"] is None
    assert not ds.meta.uniform_times
    with pytest.raises(DatasetError, match="not evenly spaced"):
        _ = ds.meta.frame_interval
    even = recording_meta((1.0, 1.5, 2.0, 2.5, 3.0))
    assert even.uniform_times and even.frame_interval == 0.5
    # No system: the name is not checked, the fields and grid are.
    validate_dataset(ds, **{**VALID_CONFIG, "system": "anything", "dt": 0.3})
    with pytest.raises(DatasetError, match="grid shape mismatch"):
        validate_dataset(ds, **{**VALID_CONFIG, "system": "anything", "grid_shape": (8, 8)})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"frame_times": None}, "frame_times .* required"),
    ({"frame_times": (0.0, 1.0, 1.0, 2.0, 3.0)}, "must increase"),
    ({"frame_times": (0.0, 1.0)}, "2 times for n_frames=5"),
    ({"t0": 7.0}, "t0=7.0 differs"),
    ({"dt": 0.5, "steps_per_frame": 3}, "disagree with t0"),
])
def test_recording_times_are_checked(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        recording_meta((0.0, 1.0, 2.0, 3.0, 4.0), **overrides)
    # Times that agree with a simulation's stepping are accepted with it.
    assert recording_meta((0.0, 1.0, 2.0, 3.0, 4.0), dt=0.5, steps_per_frame=2).frame_interval == 1


SYSTEM_DATASETS = {  # tiny simulated datasets of each system: overrides, axes
    "aliev_panfilov": (["system.grid.shape=[6,8]", "+system.options.initial=blobs"],
                       ("y", "x")),
    "bocf": (["system=bocf", "system.grid.shape=[6,8]", "+system.options.initial=rest"],
             ("y", "x")),
    "rayleigh_benard": (["system=rayleigh_benard", "system.grid.shape=[4,8]",
                         "system.grid.spacing=[0.25,0.125]", "system.options.init_spinup=0"],
                        ("z", "x")),
    "sphere_ns": (["experiment=sphere_force_recovery", "system.grid.shape=[8,16]",
                   "+system.options.init_lmax=2", "system.options.force_nodes=[2,3,4]",
                   "simulate.n_experiments=2", "simulate.steps_per_frame=1"],
                  ("lat", "lon")),
}


@pytest.mark.parametrize("system", sorted(SYSTEM_DATASETS))
def test_xarray_reads_every_systems_dataset(tmp_path: Path, system: str) -> None:
    """A simulated dataset of each system opens in xarray indexed by time, with the system's
    spatial coordinates and CF units/long names on the coordinates, fields and truths."""
    xr = pytest.importorskip("xarray")
    import jax.numpy as jnp
    from hydra import compose, initialize_config_dir

    from pdefit.app import cli  # noqa: F401  (registers the config schema with Hydra)
    from pdefit.fitting import assemble
    from pdefit.model.system import image_origin

    overrides, axes = SYSTEM_DATASETS[system]
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="fit", overrides=[
            *overrides, "simulate.n_frames=3", "simulate.noise.kind=none"])
    path = assemble.simulate_dataset(cfg, tmp_path / "ds.zarr", jnp.float64, log=lambda _: None)
    meta, made_by = open_dataset(path).meta, assemble.make_system(cfg.system)
    ds = xr.open_zarr(path, consolidated=False)

    field = meta.fields[0]
    assert ds[field].dims == ("experiment", "time", *axes)
    np.testing.assert_array_equal(ds[field].sel(time=meta.times[1]).values,
                                  ds[field].isel(time=1).values)
    assert ds["time"].attrs["units"] == made_by.time_unit
    for name in meta.fields:
        assert ds[name].attrs == dict(zip(("units", "long_name"),
                                          made_by.field_info[name], strict=True))
    ny, nx = meta.grid_shape
    if system == "sphere_ns":
        lat, lon = ds["lat"].values, ds["lon"].values
        assert ds["lat"].attrs["units"] == "degrees_north" and np.all(np.diff(lat) < 0)
        assert -90 < lat.min() < lat.max() < 90
        np.testing.assert_allclose(lon, 360.0 * np.arange(nx) / nx)
        force = ds["true_force"]
        assert force.dims == made_by.param_dims["force"]
        assert force.shape == (2, 2, 3, 4) and np.isfinite(force.values).all()
        assert force.attrs["units"] == made_by.params["force"].unit
    else:
        (hy, hx), space = meta.grid_spacing, made_by.space_unit
        np.testing.assert_allclose(ds[axes[0]].values, (np.arange(ny) + 0.5) * hy)
        np.testing.assert_allclose(ds[axes[1]].values, (np.arange(nx) + 0.5) * hx)
        assert ds[axes[0]].attrs["units"] == ds[axes[1]].attrs["units"] == space
    assert ds.attrs["param_attrs"][next(iter(meta.true_params))]["long_name"]
    # Plots draw the first axis increasing upwards: the sphere's latitudes north up.
    assert image_origin(made_by, assemble.make_grid(cfg.system)) == (
        "upper" if system == "sphere_ns" else "lower")


def test_create_refuses_existing_and_foreign_paths(tmp_path: Path, written: tuple) -> None:
    path = written[0]
    with pytest.raises(DatasetError, match=r"already exists.*overwrite=True"):
        create_dataset(path, make_meta())
    create_dataset(path, make_meta(system="other"), overwrite=True)
    assert open_dataset(path).meta.system == "other"

    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DatasetError, match=r"refusing to overwrite.*not a pdefit dataset"):
        create_dataset(foreign, make_meta(), overwrite=True)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_invalid_meta_rejected() -> None:
    with pytest.raises(DatasetError, match="steps_per_frame"):
        make_meta(steps_per_frame=0)
    with pytest.raises(DatasetError, match="reserved"):
        make_meta(fields=("u", "mask_u"))
    with pytest.raises(DatasetError, match="noise"):
        make_meta(noise={"kind": "additive", "sigma": 0.1, "seed": -1})
    # Without a seed: a measured level (a recording's), recorded but never drawn again.
    assert make_meta(noise={"kind": "additive", "sigma": 0.1}).noise["sigma"] == 0.1
    z_axis = ("z", tuple(np.arange(NY) + 0.5), "m", "height")
    with pytest.raises(DatasetError, match="axis 'x' has 3 coordinates"):
        make_meta(axes=(z_axis, ("x", (0.0, 1.0, 2.0))))
    with pytest.raises(DatasetError, match="reserved"):
        make_meta(fields=("u", "z"), axes=(z_axis, ("x", tuple(range(NX)))))
    with pytest.raises(DatasetError, match="field_attrs names unknown fields"):
        make_meta(field_attrs={"w": {"units": "1"}})
    with pytest.raises(DatasetError, match="true_array_dims"):
        make_meta(true_arrays={"f": [2, 3]}, true_array_dims={"f": ["time", "k"]})


# -------------------------------------------------------------------- parallel-style writes


def test_shard_ranges_cover_every_frame_once(tmp_path: Path) -> None:
    assert plan_shards(2, 5, 2) == [
        ShardRange(0, 0, 2),
        ShardRange(0, 2, 4),
        ShardRange(0, 4, 5),
        ShardRange(1, 0, 2),
        ShardRange(1, 2, 4),
        ShardRange(1, 4, 5),
    ]
    create_dataset(tmp_path / "d", make_meta(), frames_per_shard=2)
    assert shard_ranges(tmp_path / "d") == plan_shards(N_EXP, N_FRAMES, 2)


def test_parallel_shard_writers_reassemble_whole_array(tmp_path: Path) -> None:
    path = tmp_path / "par.zarr"
    meta, values, mask = make_meta(), make_values(), make_mask()
    create_dataset(path, meta, masks=["u"], frames_per_shard=2, tile=(4, 4))

    def writer(r: ShardRange) -> None:
        e, a, b = r
        write_block(path, "u", values["u"][e, a:b], experiment=e, frame_start=a, mask=mask[e, a:b])
        write_block(path, "v", values["v"][e, a:b], experiment=e, frame_start=a)

    # Reverse order so completion order differs from layout order.
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(writer, reversed(shard_ranges(path))))

    ds = open_dataset(path)
    np.testing.assert_array_equal(ds.read("u"), values["u"])
    np.testing.assert_array_equal(ds.read("v"), values["v"])
    np.testing.assert_array_equal(ds.read_mask("u"), mask)
    validate_dataset(ds, **VALID_CONFIG)


def test_write_block_rejects_misaligned_and_bad_blocks(tmp_path: Path) -> None:
    path = tmp_path / "mis.zarr"
    values = make_values()["v"]
    create_dataset(path, make_meta(), masks=["u"], frames_per_shard=2)
    with pytest.raises(DatasetError, match=r"whole shards.*read-modify-write"):
        write_block(path, "v", values[0, 1:3], experiment=0, frame_start=1)
    with pytest.raises(DatasetError, match="whole shards"):
        write_block(path, "v", values[0, 0:3], experiment=0, frame_start=0)
    with pytest.raises(DatasetError, match="outside"):
        write_block(path, "v", values[0, 0:4], experiment=0, frame_start=2)
    with pytest.raises(DatasetError, match="experiment 2 out of range"):
        write_block(path, "v", values[0, 0:2], experiment=2, frame_start=0)
    with pytest.raises(DatasetError, match="block must have shape"):
        write_block(path, "v", values[0, 0:2, :4], experiment=0, frame_start=0)
    with pytest.raises(DatasetError, match="pass mask="):
        write_block(path, "u", values[0, 0:2], experiment=0, frame_start=0)
    with pytest.raises(DatasetError, match="no mask"):
        write_block(path, "v", values[0, 0:2], experiment=0, frame_start=0, mask=values[0, :2] > 0)
    # The final partial shard is a legal block on its own.
    write_block(path, "v", values[1, 4:5], experiment=1, frame_start=4)
    np.testing.assert_array_equal(open_dataset(path).read("v", 1, [4]), values[1, [4]])


def test_write_dataset_checks_shapes_before_writing(tmp_path: Path) -> None:
    values = make_values()
    values["v"] = values["v"][:, :3]
    with pytest.raises(DatasetError, match="field 'v': expected shape"):
        write_dataset(tmp_path / "x", make_meta(), values)
    assert not (tmp_path / "x").exists()
    with pytest.raises(DatasetError, match="values given for fields"):
        write_dataset(tmp_path / "x", make_meta(), {"u": make_values()["u"]})


# ------------------------------------------------------------------------------ validation


def test_valid_dataset_passes(written: tuple) -> None:
    validate_dataset(open_dataset(written[0]), **VALID_CONFIG)
    validate_dataset(open_dataset(written[0]), **{**VALID_CONFIG, "fields": ["v"], "dt": None})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"system": "brusselator"},
            "made by system 'gray_scott' but the config asks for 'brusselator'",
        ),
        ({"fields": ("u", "w")}, r"no observed field\(s\) \['w'\]; it has \['u', 'v'\]"),
        (
            {"grid_shape": (8, 8)},
            r"grid shape mismatch: config expects \(8, 8\), dataset has \(8, 12\)",
        ),
        ({"grid_spacing": (0.5, 0.5)}, "grid spacing mismatch"),
        ({"boundaries": ("periodic", "periodic")}, "boundary mismatch"),
        ({"dt": 0.02}, "dt mismatch: config expects 0.02, dataset has 0.01"),
    ],
)
def test_validation_mismatches(written: tuple, override: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        validate_dataset(open_dataset(written[0]), **{**VALID_CONFIG, **override})


def test_dt_within_tolerance_accepted(written: tuple) -> None:
    validate_dataset(open_dataset(written[0]), **{**VALID_CONFIG, "dt": 0.01 * (1 + 1e-12)})


def test_nan_outside_mask_rejected_inside_mask_accepted(tmp_path: Path) -> None:
    values, mask = make_values(), make_mask()
    values["u"][1, 3, 2, 5] = np.nan
    mask[1, 3, 2, 5] = False  # unobserved: NaN is fine there
    write_dataset(tmp_path / "ok", make_meta(), values, {"u": mask}, frames_per_shard=2)
    validate_dataset(open_dataset(tmp_path / "ok"), **VALID_CONFIG)

    mask[1, 3, 2, 5] = True
    write_dataset(tmp_path / "bad", make_meta(), values, {"u": mask}, frames_per_shard=2)
    with pytest.raises(DatasetError, match=r"'u' has 1 NaN and 0 Inf.*\(1, 3, 2, 5\)"):
        validate_dataset(open_dataset(tmp_path / "bad"), **VALID_CONFIG)
    # The finite check can be skipped, e.g. when the caller handles NaNs itself.
    validate_dataset(open_dataset(tmp_path / "bad"), **VALID_CONFIG, check_finite=False)


def test_inf_without_mask_rejected_and_counted(tmp_path: Path) -> None:
    values = make_values()
    values["v"][0, 1, 0, 0] = np.inf
    values["v"][1, 4, 7, 11] = -np.inf
    values["v"][1, 0, 0, 0] = np.nan
    write_dataset(tmp_path / "inf", make_meta(), values, frames_per_shard=2)
    ds = open_dataset(tmp_path / "inf")
    with pytest.raises(DatasetError, match=r"'v' has 1 NaN and 2 Inf.*no mask.*\(0, 1, 0, 0\)"):
        validate_dataset(ds, **VALID_CONFIG)
    validate_dataset(ds, **{**VALID_CONFIG, "fields": ["u"]})  # only requested fields scanned


def test_unwritten_frames_fail_finite_check(tmp_path: Path) -> None:
    """A shard writer that never ran leaves NaN fill, which validation must catch."""
    path = tmp_path / "partial"
    create_dataset(path, make_meta(), frames_per_shard=2)
    values = make_values()
    for e, a, b in shard_ranges(path)[:-1]:
        for name in ("u", "v"):
            write_block(path, name, values[name][e, a:b], experiment=e, frame_start=a)
    with pytest.raises(DatasetError, match=r"first at .* = \(1, 4, 0, 0\)"):
        validate_dataset(open_dataset(path), **VALID_CONFIG)


def test_empty_dataset_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="empty"):
        create_dataset(tmp_path / "e", make_meta(n_frames=0))
    assert not (tmp_path / "e").exists()
    # An empty dataset made by other means is refused on open.
    create_dataset(tmp_path / "e2", make_meta())
    group = zarr.open_group(tmp_path / "e2", mode="r+", zarr_format=3)
    group.attrs["n_experiments"] = 0
    for name in ("u", "v"):
        group[name].resize((0, N_FRAMES, NY, NX))
    with pytest.raises(DatasetError, match="is empty: n_experiments=0"):
        open_dataset(tmp_path / "e2")


def test_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        open_dataset(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="not a Zarr v3 group"):
        open_dataset(tmp_path / "plain")
    zarr.open_group(tmp_path / "other", mode="w", zarr_format=3, attributes={"format": "x"})
    with pytest.raises(DatasetError, match=r"not a pdefit dataset.*'x'"):
        open_dataset(tmp_path / "other")


def test_structural_problems_on_open(written: tuple) -> None:
    path = written[0]
    group = zarr.open_group(path, mode="r+", zarr_format=3)
    group.attrs["format_version"] = 99
    with pytest.raises(DatasetError, match="format_version 99"):
        open_dataset(path)
    group.attrs["format_version"] = FORMAT_VERSION
    group.attrs["fields"] = ["u", "v", "w"]
    with pytest.raises(DatasetError, match="array 'w' is missing"):
        open_dataset(path)
    group.attrs["fields"] = ["u", "v"]
    group.attrs["n_experiments"] = 3
    with pytest.raises(DatasetError, match=r"field 'u': array shape \(2, 5, 8, 12\) disagrees"):
        open_dataset(path)
    group.attrs["n_experiments"] = 2
    group.attrs["dt"] = 0.02
    with pytest.raises(DatasetError, match="array 'time' disagrees"):
        open_dataset(path)
    del group.attrs["dt"]
    # Format 3: no dt is a recording, timed by its times array alone; format 2 required it.
    assert open_dataset(path).meta.dt is None
    group.attrs["format_version"] = 2
    with pytest.raises(DatasetError, match="attribute 'dt' is missing"):
        open_dataset(path)


def test_dataset_is_frozen(written: tuple) -> None:
    ds = open_dataset(written[0])
    assert isinstance(ds, Dataset)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.meta = make_meta()  # type: ignore[misc]
    assert isinstance(hash(ds.meta), int)  # dict fields are excluded from hashing


# ----------------------------------------------------------------------------------- noise


def test_noise_is_seeded() -> None:
    x = np.linspace(-1.0, 1.0, 1000)
    noise = {"kind": "additive", "sigma": 0.1, "seed": 7}
    a, b = add_noise(x, noise), add_noise(x, noise)
    c = add_noise(x, {**noise, "seed": 8})
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(add_noise(x, {"kind": "none"}), x.astype(np.float32))


def test_additive_noise_statistics() -> None:
    x = np.full(100_000, 3.0)
    residual = add_noise(x, {"kind": "additive", "sigma": 0.05, "seed": 0}) - x
    assert abs(residual.std() - 0.05) < 0.005
    assert abs(residual.mean()) < 0.005


def test_relative_noise_scales_with_magnitude() -> None:
    x = np.concatenate([np.full(50_000, 0.5), np.full(50_000, -20.0)])
    noisy = add_noise(x, {"kind": "relative", "sigma": 0.02, "seed": 3})
    small, large = (noisy - x)[:50_000], (noisy - x)[50_000:]
    assert abs(small.std() - 0.02 * 0.5) < 0.1 * 0.02 * 0.5
    assert abs(large.std() - 0.02 * 20.0) < 0.1 * 0.02 * 20.0
    assert np.all(add_noise(np.zeros(10), {"kind": "relative", "sigma": 0.5, "seed": 1}) == 0)


@pytest.mark.parametrize(
    ("noise", "message"),
    [
        ({"kind": "gaussian", "sigma": 0.1, "seed": 1}, "unknown noise kind 'gaussian'"),
        ({"kind": "additive", "sigma": -0.1, "seed": 1}, "sigma must be"),
        ({"kind": "additive", "sigam": 0.1, "seed": 1}, "unexpected.*sigam"),
        ({"kind": "relative", "sigma": 0.1}, "needs an int seed"),
        ({"sigma": 0.1}, "'kind'"),
    ],
)
def test_bad_noise_rejected(noise: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        add_noise(np.zeros(3), noise)


def test_block_noise_independent_of_blocking() -> None:
    """Parallel writers adding noise per shard must reproduce a single-pass write."""
    frames = make_values()["u"][1]
    noise = {"kind": "additive", "sigma": 0.1, "seed": 5}
    whole = add_noise_block(frames, noise, experiment=1, frame_start=0)
    parts = [
        add_noise_block(frames[a:b], noise, experiment=1, frame_start=a)
        for a, b in [(0, 2), (2, 4), (4, 5)]
    ]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    other = add_noise_block(frames, noise, experiment=0, frame_start=0)
    assert not np.array_equal(whole, other)  # experiments get distinct streams
