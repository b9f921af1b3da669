"""User systems with the mistakes of issue 25, for benchmarks/bad_inputs.py: each is loaded by
import path (``system.name=bad_user_system:<Class>``) from a run with this directory on
PYTHONPATH. ``Good`` is right; each other class breaks one hook."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from pdefit import ParamSpec
from pdefit.numerics.stencils import laplacian, laplacian_spectral_radius


@dataclass(frozen=True)
class Good:
    """Barkley's excitable medium: du/dt = ∇²u + u(1−u)(u − (v+b)/a)/ε, dv/dt = u − v."""

    name: ClassVar[str] = "barkley"
    fields: ClassVar[tuple[str, ...]] = ("u", "v")
    stencil_radius: ClassVar[int] = 1
    params: ClassVar[dict] = {"a": ParamSpec(0.75, "log"), "b": ParamSpec(0.02, "log"),
                              "eps": ParamSpec(0.05, "log")}

    def diffusion(self, u, grid):
        return laplacian(u, grid)

    def rhs(self, state, p, t, grid):
        u, v = state["u"], state["v"]
        return {"u": self.diffusion(u, grid) + u * (1 - u) * (u - (v + p["b"]) / p["a"])
                / p["eps"], "v": u - v}

    def max_stable_dt(self, p, grid):
        return 0.9 * 2.0 / (laplacian_spectral_radius("5pt", grid.spacing) + 1.0 / p["eps"])

    def initial_state(self, grid, p, seed):
        ny, nx = grid.shape
        u = np.zeros(grid.shape)
        u[: ny // 2, : nx // 3] = 1.0
        v = np.zeros(grid.shape)
        v[ny // 2:, :] = 0.5
        return {"u": jnp.asarray(u), "v": jnp.asarray(v)}


@dataclass(frozen=True)
class MissingField(Good):
    """rhs forgets v."""

    def rhs(self, state, p, t, grid):
        return {"u": Good.rhs(self, state, p, t, grid)["u"]}


@dataclass(frozen=True)
class FloatParameter(Good):
    """A parameter given as a bare float instead of a ParamSpec."""

    params: ClassVar[dict] = {**Good.params, "eps": 0.05}


@dataclass(frozen=True)
class WrongShape(Good):
    """initial_state ignores the grid: always 8 × 8."""

    def initial_state(self, grid, p, seed):
        return {"u": jnp.zeros((8, 8)), "v": jnp.zeros((8, 8))}


@dataclass(frozen=True)
class RolledLaplacian(Good):
    """A Laplacian with jnp.roll: periodic whatever the config says, and blind to the halo of
    a tiled grid."""

    def diffusion(self, u, grid):
        hy, hx = grid.spacing
        return ((jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) - 2 * u) / hy**2
                + (jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 2 * u) / hx**2)
