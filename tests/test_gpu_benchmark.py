"""``benchmarks/gpu.py`` runs on the CPU backend too: its quick mode is the smoke test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "gpu.py"


def load_benchmark(path: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_quick(tmp_path, capsys, *sections: str) -> tuple[dict, str]:
    gpu = load_benchmark()
    output = tmp_path / "gpu.json"
    result = gpu.main(["--quick", "--only", *sections, "--output", str(output)])
    written = json.loads(output.read_text())  # the JSON file is the printed table's record
    assert written["rows"] and {r["section"].split()[0] for r in written["rows"]} <= set(sections)
    return result, capsys.readouterr().out


def test_quick_forward_prints_one_table_headed_with_the_device(tmp_path, capsys):
    result, out = run_quick(tmp_path, capsys, "bandwidth", "forward")
    device = jax.devices()[0].device_kind
    assert result["device_kind"] == device and result["backend"] == jax.default_backend()
    assert f"device: {device} (backend {jax.default_backend()}" in out
    rows = {(r["section"], r["quantity"]): r["value"] for r in result["rows"]}
    # On the CPU backend NumPy's copy is one of the bandwidths; the bound uses the best.
    kinds = [r["case"] for r in result["rows"] if r["section"] == "bandwidth"]
    assert set(kinds) == {"xla_copy", "xla_stream", "numpy_copy"}
    assert all(r["value"] > 0 for r in result["rows"])
    assert rows[("forward", "steps/s")] > 0 and 0 < rows[("forward", "of copy bound")] < 100
    assert "BOCF 64²" in out and "of copy bound" in out


@pytest.mark.long
def test_quick_runs_every_section(tmp_path, capsys):
    result, out = run_quick(tmp_path, capsys, "adjoint", "fit", "small")
    quantities = {r["quantity"] for r in result["rows"]}
    assert {"revolve_branch_free /model", "revolve_segments/nested", "lbfgs evaluations/step",
            "lbfgs step/evaluations", "forward per step",
            "value and gradient, revolve", "step: launches", "step vjp: fft"} <= quantities
    assert all(r["value"] is not None for r in result["rows"]), out


def test_hlo_op_counts_weight_loop_bodies_by_their_trip_count():
    """The launch count behind the small-system rows: an FFT in a loop of 3 iterations counts
    3 times, one outside once, the dot fused with its operands still counts, and the loop
    itself once."""
    small = load_benchmark(BENCHMARKS / "small_systems.py")
    jnp = jax.numpy

    def f(x, m):
        y = jax.lax.fori_loop(0, 3, lambda i, y: jnp.fft.irfft(jnp.fft.rfft(y) * 0.5), x)
        return jnp.fft.rfft(y).real, (2.0 * m) @ m

    x, m = jnp.ones((4, 16)), jnp.ones((8, 8))
    ops = small.op_columns(jax.jit(f).lower(x, m).compile().as_text())
    assert ops["fft"] == 3 * 2 + 1 and ops["dot"] == 1 and ops["while"] == 1
    assert ops["launches"] >= ops["fft"] + ops["while"]
