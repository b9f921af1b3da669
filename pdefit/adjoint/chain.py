"""The loss chain, and J evaluated along it by plain or nested scans.

A fit differentiates a *loss chain*: states x_0 … x_N with

    x_{n+1} = step(x_n, θ, n),      J = Σ_{n=0..N} cost(x_n, θ, n, data)

where ``cost`` is zero except at observation steps. Owns :class:`LossChain` and the scans the
store-all and nested schedules (:mod:`pdefit.adjoint.schedules`) and the revolve executors'
primal (:mod:`pdefit.adjoint.revolve`) evaluate J with.

``data`` travels as an argument, never as a closure: the chain's functions must not close over
traced values (they are static to ``custom_vjp``), and large observed arrays would otherwise be
baked into the program as constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

State = Any
Theta = Any
Data = Any


class LossChain(NamedTuple):
    """The functions that define a loss along a trajectory (see the module docstring).

    ``observed(n, data)``, when given, says whether ``cost`` can be nonzero at step ``n``;
    revolve then linearises the cost only at those steps (differentiating through a cost
    that branches on the step costs about one more forward step at every step).

    ``observed_cost(x, θ, n, data)``, when given with ``observed``, is ``cost`` at the steps
    ``observed`` selects, computed without branching on ``n`` (finite anywhere else): the
    branch-free revolve executor masks it instead of branching."""

    step: Callable[[State, Theta, Any], State]
    cost: Callable[[State, Theta, Any, Data], Any]
    observed: Callable[[Any, Data], Any] | None = None
    observed_cost: Callable[[State, Theta, Any, Data], Any] | None = None


def store_all_loss(chain: LossChain, x0: State, theta: Theta, data: Data, n_steps: int):
    """J by one plain scan: reverse-mode differentiation of it keeps every state."""
    x, total = scan_steps(chain, x0, theta, data, 0, n_steps)
    return total + chain.cost(x, theta, n_steps, data)


def scan_steps(chain: LossChain, x0: State, theta: Theta, data: Data, start: Any, length: int):
    """Advance ``length`` steps from step index ``start``; return (x, Σ cost before each step)."""

    def body(carry, n):
        x, total = carry
        total = total + chain.cost(x, theta, n, data)
        return (chain.step(x, theta, n), total), None

    (x, total), _ = jax.lax.scan(body, (x0, zero_cost(chain, x0, theta, data)),
                                 start + jnp.arange(length))
    return x, total


def nested_steps(chain: LossChain, x0: State, theta: Theta, data: Data, start: Any,
                 length: int, levels: int):
    """:func:`scan_steps` as ``levels`` nested scans, each inner block in ``jax.checkpoint``."""
    if levels == 1 or length <= 1:
        return scan_steps(chain, x0, theta, data, start, length)
    block = math.ceil(length ** ((levels - 1) / levels))
    n_blocks, remainder = divmod(length, block)

    @jax.checkpoint
    def one_block(x, first):
        return nested_steps(chain, x, theta, data, first, block, levels - 1)

    def body(carry, first):
        x, total = carry
        x, part = one_block(x, first)
        return (x, total + part), None

    firsts = start + block * jnp.arange(n_blocks)
    (x, total), _ = jax.lax.scan(body, (x0, zero_cost(chain, x0, theta, data)), firsts)
    if remainder:
        x, part = nested_steps(chain, x, theta, data, start + n_blocks * block, remainder,
                               levels - 1)
        total = total + part
    return x, total


def zero_cost(chain: LossChain, x0: State, theta: Theta, data: Data):
    """A zero to start summing costs from, of the cost's dtype and typed like a reduction of
    the state (inside ``shard_map`` a loop carry must keep one "varying" type throughout)."""
    dtype = jax.eval_shape(lambda: chain.cost(x0, theta, jnp.asarray(0), data)).dtype
    return jnp.sum(jax.tree.leaves(x0)[0][..., :0]).astype(dtype)
