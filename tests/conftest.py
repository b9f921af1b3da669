"""Shared test setup: 8 virtual CPU devices, float64 by default (gradient checks need it);
tests that want float32 say so explicitly, and whatever a test does to the precision switch is
undone after it."""

import atexit
import os
import shutil
import tempfile

# Eight virtual CPU devices for the multi-device tests; set before JAX starts its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The commands the tests start keep their compiled programs in a cache of the test session's
# own (pdefit.runtime.compile_cache), never in the user's ~/.cache.
if "PDEFIT_COMPILATION_CACHE" not in os.environ:
    os.environ["PDEFIT_COMPILATION_CACHE"] = tempfile.mkdtemp(
        prefix="pdefit-test-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["PDEFIT_COMPILATION_CACHE"], ignore_errors=True)

import jax
import pytest

from pdefit.runtime.compile_cache import cache_directory

jax.config.update("jax_enable_x64", True)

# The tests in this process use that cache too, every compile kept however short: many build
# the same small problem again (a fit per noise seed, the same fixture in several files), and
# each new closure is compiled again without it (tests/test_krylov.py and test_signal.py
# together: 213 s → 160 s on the 2-core host; JAX's default keeps only compiles of 1 s or more,
# which saved nothing on test_uncertainty.py's coverage test where 0.2 s took it 55 → 33 s).
_cache = cache_directory()
if _cache is not None:
    jax.config.update("jax_compilation_cache_dir", str(_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture(autouse=True, scope="module")
def _restore_precision_after_module():
    """Module-scoped fixtures may switch the precision too (set up before any test's own
    restore): undo that once the module is done, so it cannot leak into later modules."""
    before = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(autouse=True)
def _restore_precision():
    before = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if the optimiser loop (where compilation happens) is ever reached."""
    from pdefit.app import cli

    def forbidden(*args, **kwargs):
        raise AssertionError("bad input reached the training loop")
    monkeypatch.setattr(cli, "run_fit", forbidden)
