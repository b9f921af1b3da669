"""One process of a multi-process pdefit run, started by tests/test_multiprocess.py:

    python tests/multiprocess_worker.py PROCESS_ID N_PROCESSES PORT DATASET OUT_DIR

Each process has two virtual CPU devices; together they form a 2×2 mesh. The process writes
its loss, gradient, fitted parameters and the dataset windows it read to OUT_DIR/pN.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax

from pdefit import parallel
from pdefit.app import cli
from pdefit.fitting import assemble

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_fit import MULTIPROCESS_FIT, config


def main() -> None:
    import faulthandler
    # A hang in a collective would otherwise be silent: dump stacks and exit instead.
    faulthandler.dump_traceback_later(280, exit=True)
    pid, n_processes, port = (int(a) for a in sys.argv[1:4])
    dataset, out = Path(sys.argv[4]), Path(sys.argv[5])
    info = parallel.initialize(f"127.0.0.1:{port}", n_processes, pid)
    assert info.global_devices == 2 * n_processes, info
    run_dir = out / "run"  # one directory: Orbax saves are collective across processes
    cfg = config(run_dir, *MULTIPROCESS_FIT, f"data.path={dataset}", "mesh.shape=[2,2]")
    dtype = assemble.set_precision(cfg.precision)
    setup = assemble.build_fit(cfg, dataset, dtype)
    print("built", flush=True)
    value, grad = jax.jit(setup.problem.value_and_grad)(setup.theta0, setup.batch)
    jax.block_until_ready(grad)
    print("gradient", parallel.host_scalar(value), flush=True)
    summary = cli.fit(cfg)
    print("fitted", flush=True)
    result = {
        "process": pid,
        "loss": parallel.host_scalar(value),
        "grad": {k: parallel.host_scalar(v) for k, v in grad["params"].items()},
        "recovered": {r["name"]: r["recovered"] for r in summary["parameters"]},
        "final_loss": summary["final_loss"],
        "reads": setup.reads,
    }
    (out / f"p{pid}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
