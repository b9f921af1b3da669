"""Two processes × two CPU devices (jax.distributed with an explicit coordinator on
127.0.0.1) reproduce the single-process loss, gradient and fit, and each process reads only
the dataset windows of its own devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from pdefit.app import cli
from pdefit.fitting import assemble
from tests.test_fit import MULTIPROCESS_FIT, config

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    data_cfg = config(tmp_path / "data", *MULTIPROCESS_FIT)
    dtype = assemble.set_precision("float64")
    dataset = assemble.simulate_dataset(data_cfg, tmp_path / "ap.zarr", dtype,
                                        log=lambda _: None)

    # The reference: one process, one device.
    cfg = config(tmp_path / "single", *MULTIPROCESS_FIT, f"data.path={dataset}")
    setup = assemble.build_fit(cfg, dataset, dtype)
    value, grad = jax.jit(setup.problem.value_and_grad)(setup.theta0, setup.batch)
    single = cli.fit(cfg)

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent)}
    env.pop("XLA_FLAGS", None)
    # Output to files, not pipes: an undrained pipe would block one process inside a
    # collective and hang the other.
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [subprocess.Popen([sys.executable, str(WORKER), str(i), "2", str(port),
                                 str(dataset), str(tmp_path)], env=env,
                                stdout=logs[i].open("w"), stderr=subprocess.STDOUT)
               for i in range(2)]
    try:
        for w, log in zip(workers, logs, strict=True):
            w.wait(timeout=320)
            assert w.returncode == 0, log.read_text()[-4000:]
    finally:
        for w in workers:
            w.kill()
    results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]

    for r in results:
        assert r["loss"] == pytest.approx(float(value), rel=1e-12)
        for name, g in r["grad"].items():
            assert g == pytest.approx(float(grad["params"][name]), rel=1e-10, abs=1e-14), name
        for row in single["parameters"]:
            assert r["recovered"][row["name"]] == pytest.approx(row["recovered"], rel=1e-9)
        assert r["final_loss"] == pytest.approx(single["final_loss"], rel=1e-9)

    # Mesh [2, 2] over (y, x) of a 20×20 grid: process 0 holds devices 0–1 (y rows 0–9),
    # process 1 devices 2–3 (rows 10–19). Each reads only its own rows, together all.
    for r in results:
        rows = {tuple(read[3]) for read in r["reads"]}
        cols = {tuple(read[4]) for read in r["reads"]}
        assert rows == {(0, 10)} if r["process"] == 0 else {(10, 20)}, rows
        assert cols == {(0, 10), (10, 20)}, cols
