"""The commands' persistent compilation cache (pdefit.runtime.compile_cache): where it lives,
that a command fills it and a second identical command compiles nothing new, and that
``off`` keeps every command out of the user's home."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdefit.runtime.compile_cache import cache_directory, use_compilation_cache

BIN = Path(sys.executable).parent
TINY = ["system.grid.shape=[16,16]", "+system.options.initial=blobs", "simulate.n_frames=4",
        "simulate.steps_per_frame=5"]


def test_the_cache_directory_follows_the_environment(tmp_path):
    home = Path.home() / ".cache" / "pdefit" / "jax"
    assert cache_directory({}) == home
    assert cache_directory({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pdefit" / "jax"
    jax_own = {"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/x"}
    assert cache_directory(jax_own) == Path("/j")
    chosen = {"PDEFIT_COMPILATION_CACHE": str(tmp_path / "c"), "JAX_COMPILATION_CACHE_DIR": "/j"}
    assert cache_directory(chosen) == tmp_path / "c"
    for off in ("off", "OFF", "0", "false", "no", "", " none "):
        assert cache_directory({"PDEFIT_COMPILATION_CACHE": off,
                                "JAX_COMPILATION_CACHE_DIR": "/j"}) is None


def _simulate(tmp_path: Path, output: str, **env: str) -> None:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("XLA_FLAGS", "PDEFIT_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR",
                            "XDG_CACHE_HOME")}
    # Every compile is kept, however short (JAX keeps only those of a second or more).
    environ.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", HOME=str(tmp_path / "home"),
                   **env)
    done = subprocess.run([str(BIN / "pdefit-simulate"), *TINY, f"simulate.output={output}"],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def _entries(cache: Path) -> dict[str, int]:
    """The cache's compiled programs and when each was written."""
    return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.name.endswith("-cache")}


def test_a_command_fills_the_cache_and_a_repeat_compiles_nothing_new(tmp_path):
    cache = tmp_path / "cache"
    _simulate(tmp_path, "one.zarr", PDEFIT_COMPILATION_CACHE=str(cache))
    first = _entries(cache)
    assert first, "the command kept no compiled program"
    _simulate(tmp_path, "two.zarr", PDEFIT_COMPILATION_CACHE=str(cache))
    # A program compiled again would be written again (a new modification time).
    assert _entries(cache) == first
    # Off: nothing is written to the home directory's cache (nor anywhere else).
    _simulate(tmp_path, "three.zarr", PDEFIT_COMPILATION_CACHE="off")
    assert not (tmp_path / "home" / ".cache").exists()
    # By default: the user's cache directory.
    _simulate(tmp_path, "four.zarr")
    assert any((tmp_path / "home" / ".cache" / "pdefit" / "jax").iterdir())


def test_an_unwritable_cache_directory_leaves_the_cache_off_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level("WARNING", logger="pdefit"):
        assert use_compilation_cache({"PDEFIT_COMPILATION_CACHE": str(blocker / "jax")}) is None
    assert "PDEFIT_COMPILATION_CACHE" in caplog.text
