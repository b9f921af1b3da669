"""Shared test setup: float64 by default (gradient checks need it); tests that want float32
say so explicitly, and whatever a test does to the precision switch is undone after it."""

import jax
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def _restore_precision():
    before = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", before)
