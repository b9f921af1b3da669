"""The Taylor test: for a random direction v, the remainder |L(θ+εv) − L(θ) − ε ∇L·v| of an
exact gradient shrinks as ε², while the first-order difference shrinks only as ε."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def random_direction(theta: Any, seed: int = 0) -> Any:
    """A unit-RMS random direction with the structure of ``theta``."""
    leaves, treedef = jax.tree.flatten(theta)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    return jax.tree.unflatten(treedef, [
        jax.random.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves,
                                                                                 strict=True)])


def taylor_test(loss: Callable[[Any], Any], grad: Callable[[Any], Any], theta: Any, *,
                seed: int = 0, eps0: float = 1e-1, n: int = 6, factor: float = 0.5,
                ) -> list[dict[str, float | None]]:
    """Rows of (ε, first-order difference, remainder, observed order of the remainder)."""
    v = random_direction(theta, seed)
    l0 = float(loss(theta))
    slope = float(sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grad(theta)),
                                                    jax.tree.leaves(v), strict=True)))
    rows: list[dict[str, float | None]] = []
    eps = eps0
    for _ in range(n):
        shifted = jax.tree.map(lambda t, d, e=eps: t + e * d, theta, v)
        diff = float(loss(shifted)) - l0
        remainder = abs(diff - eps * slope)
        order = None
        if rows and rows[-1]["remainder"] and remainder > 0:
            order = math.log(rows[-1]["remainder"] / remainder) / math.log(1 / factor)
        rows.append({"eps": eps, "first_order": abs(diff), "remainder": remainder,
                     "order": order})
        eps *= factor
    return rows


