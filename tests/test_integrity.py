"""Damaged datasets are reported by dataset, field and frames (issue 16, item 5): a truncated
shard is not only Zarr's "checksum" complaint, a deleted shard is missing data rather than
NaN, and with ``observe.nan=mask`` the masked share is stated and a window without any data
of an observed field is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pdefit import data as zd
from pdefit.app import cli, rundir  # noqa: F401  (cli registers the config schema)
from pdefit.fitting import assemble

CONF = str(Path(__file__).resolve().parents[1] / "conf")
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=5",
        "simulate.steps_per_frame=10", "simulate.frames_per_shard=2", "adjoint=store_all",
        "precision=float32", "fit.params=[k,a]"]


def config(tmp: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[f"run.dir={tmp}", *TINY, *overrides])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("integrity")
    cfg = config(tmp)
    dtype = assemble.set_precision(cfg.precision)
    return rundir.simulated_dataset(
        cfg, tmp / "data.zarr",
        lambda p: assemble.simulate_dataset(cfg, p, dtype, log=lambda _: None))


def damaged(pristine: Path, tmp: Path) -> Path:
    path = tmp / "data.zarr"
    shutil.copytree(pristine, path)
    return path


def build(path: Path, *overrides: str):
    cfg = config(path.parent, *overrides)
    return assemble.build_fit(cfg, path, assemble.set_precision(cfg.precision))


def test_truncated_shard_names_dataset_field_frames_and_file(pristine, tmp_path):
    path = damaged(pristine, tmp_path)
    shard = path / "u" / "c" / "0" / "1" / "0" / "0"  # frames 2-3 of experiment 0
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(zd.DatasetError) as err:
        build(path)
    message = str(err.value)
    assert f"dataset {path} field 'u'" in message and "frame(s) 0-4" in message
    assert "the shard file(s) u/c/0/1/0/0 of this dataset are damaged or truncated" in message


def test_deleted_shard_is_missing_data_not_nan(pristine, tmp_path):
    path = damaged(pristine, tmp_path)
    shutil.rmtree(path / "v" / "c" / "0" / "2")  # frame 4
    with pytest.raises(zd.DatasetError, match=r"field 'v': missing data — 1 frame\(s\).*"
                       r"experiment 0: frame\(s\) 4.*observe.nan=mask"):
        build(path)


def test_masked_frames_are_counted_and_an_empty_window_refused(pristine, tmp_path, caplog):
    path = damaged(pristine, tmp_path)
    shutil.rmtree(path / "v" / "c" / "0" / "2")  # frame 4 of v
    with caplog.at_level("WARNING", logger="pdefit"):
        setup = build(path, "observe.nan=mask")
    messages = " ".join(r.message for r in caplog.records)
    assert "field 'v': 1 frame(s) are missing on disk" in messages
    assert "field 'v': 256 of 1280 points masked (1 of 5 frames have no data)" in messages
    assert setup.problem.n_steps == 40

    shutil.rmtree(path / "v" / "c" / "0" / "1")  # frames 2-3 of v: no v left in [2, 4]
    with pytest.raises(zd.DatasetError, match=r"field 'v': no observed .* value in the "
                       "training window"):
        build(path, "observe.nan=mask", "data.frames=[2,3,4]", "+fit.initial_fields.v=fit")
