"""``benchmarks/gpu.py`` runs on the CPU backend too: its quick mode is the smoke test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
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
            "value and gradient, revolve"} <= quantities
    assert all(r["value"] is not None for r in result["rows"]), out
