"""Domain decomposition: a device mesh over experiments and the two grid axes, tiles with halos
exchanged by ``lax.ppermute``, and a map that runs a loss on every tile inside one
``shard_map``.

Mesh axes are always ``("e", "y", "x")``: experiments (batch parallelism) and the grid's two
axes (spatial decomposition); any of them may have size one. Field arrays ``(n_exp, ny, nx)``
are split as ``P("e", "y", "x")``; each device owns a tile ``(n_exp/pe, ny/py, nx/px)``.

The physics sees a :class:`TileGrid` instead of a :class:`~pdefit.numerics.grid.Grid`: the same
``pad(u, width)`` / ``spacing`` interface, but ``pad`` takes halo cells from the neighbouring
tiles (a wrap-around neighbour on periodic axes) and fills the boundary condition only on
tiles that touch a physical edge. The stencils are the same functions in both cases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdefit.numerics.grid import NEUMANN, PERIODIC, Grid

AXES = ("e", "y", "x")


@dataclass(frozen=True)
class TileGrid:
    """One device's tile of a global grid, valid only inside ``shard_map`` over ``AXES``."""

    grid: Grid
    devices: tuple[int, int]  # (py, px)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.grid.shape[0] // self.devices[0], self.grid.shape[1] // self.devices[1])

    @property
    def spacing(self) -> tuple[float, float]:
        return self.grid.spacing

    @property
    def boundaries(self) -> tuple[str, str]:
        return self.grid.boundaries

    def pad(self, u: jnp.ndarray, width: int) -> jnp.ndarray:
        """Halo of ``width`` cells on the last two axes: x first, then y on the x-padded block,
        so corner cells come from the diagonal neighbour."""
        if width == 0:
            return u
        u = _pad_axis(u, -1, width, "x", self.devices[1], self.grid.boundaries[1])
        return _pad_axis(u, -2, width, "y", self.devices[0], self.grid.boundaries[0])


def _take(u: jnp.ndarray, axis: int, start: int, stop: int | None) -> jnp.ndarray:
    index = [slice(None)] * u.ndim
    index[axis] = slice(start, stop)
    return u[tuple(index)]


def _pad_axis(u: jnp.ndarray, axis: int, width: int, name: str, n_dev: int, kind: str,
              ) -> jnp.ndarray:
    low = _take(u, axis, 0, width)       # my first `width` cells
    high = _take(u, axis, -width, None)  # my last `width` cells
    if n_dev == 1:
        if kind == PERIODIC:
            return jnp.concatenate([high, u, low], axis=axis)
        return jnp.concatenate([jnp.flip(low, axis), u, jnp.flip(high, axis)], axis=axis)
    wrap = kind == PERIODIC
    to_next = [(i, i + 1) for i in range(n_dev - 1)] + ([(n_dev - 1, 0)] if wrap else [])
    to_previous = [(i + 1, i) for i in range(n_dev - 1)] + ([(0, n_dev - 1)] if wrap else [])
    low_halo = jax.lax.ppermute(high, name, to_next)      # the previous tile's last cells
    high_halo = jax.lax.ppermute(low, name, to_previous)  # the next tile's first cells
    if kind == NEUMANN:
        # Tiles on a physical edge received nothing there: mirror their own cells instead.
        index = jax.lax.axis_index(name)
        low_halo = jnp.where(index == 0, jnp.flip(low, axis), low_halo)
        high_halo = jnp.where(index == n_dev - 1, jnp.flip(high, axis), high_halo)
    return jnp.concatenate([low_halo, u, high_halo], axis=axis)


@dataclass(frozen=True)
class Domain:
    """A device mesh of shape ``(pe, py, px)`` for the grid axes and experiments."""

    mesh: Mesh

    @classmethod
    def build(cls, shape: Sequence[int], devices: Sequence[Any] | None = None) -> Domain:
        """``shape`` is ``[py, px]`` or ``[pe, py, px]``; ``devices`` defaults to all devices
        (in every process)."""
        shape = tuple(int(n) for n in shape)
        if len(shape) == 2:
            shape = (1, *shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"mesh shape must be [py, px] or [pe, py, px], got {list(shape)}")
        devices = list(jax.devices() if devices is None else devices)
        need = int(np.prod(shape))
        if need > len(devices):
            raise ValueError(f"mesh {list(shape)} needs {need} devices; {len(devices)} available")
        grid_of_devices = np.asarray(devices[:need], dtype=object).reshape(shape)
        return cls(Mesh(grid_of_devices, AXES))

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.mesh.shape[a] for a in AXES)  # type: ignore[return-value]

    @property
    def n_devices(self) -> int:
        return int(np.prod(self.shape))

    def check(self, grid: Grid, n_experiments: int, stride: int = 1, halo: int = 1) -> None:
        """Raise unless the grid and the experiments split evenly over the mesh."""
        pe, py, px = self.shape
        (ny, nx) = grid.shape
        if n_experiments % pe:
            raise ValueError(f"{n_experiments} experiments do not split over {pe} devices")
        for n, p, axis in ((ny, py, "y"), (nx, px, "x")):
            if n % p:
                raise ValueError(f"grid axis {axis} of {n} cells does not split over {p} devices")
            if n // p < halo:
                raise ValueError(f"tiles of {n // p} cells along {axis} are thinner than the "
                                 f"halo ({halo})")
            if (n // p) % stride:
                raise ValueError(f"tiles of {n // p} cells along {axis} are not a multiple of "
                                 f"the observation stride {stride}")

    def tile_grid(self, grid: Grid) -> TileGrid:
        return TileGrid(grid, self.shape[1:])

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def sum_over_tiles(self, local_sum: Callable[..., jnp.ndarray], args: tuple,
                       in_specs: tuple) -> jnp.ndarray:
        """Σ over devices of ``local_sum(*tile_args)``, computed in one ``shard_map``. Inputs
        with a replicated spec (scalar parameters) receive the sum of all tiles' cotangents
        when differentiated; sharded inputs keep sharded cotangents."""

        def per_device(*tile_args):
            return jax.lax.psum(local_sum(*tile_args), AXES)

        mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs, out_specs=P())
        return mapped(*args)

    def map_tiles(self, grid: Grid, local: Callable[[TileGrid, Any, Any], Any], fields: Any,
                  replicated: Any) -> Any:
        """``local(tile_grid, tile_fields, replicated)`` on every tile of ``fields`` (arrays
        ``(ny, nx)`` on ``grid``, one experiment, the same on every row of the experiment
        axis) in one ``shard_map``, and the tiles it returns put together again: the tiled
        twin of ``local(grid, fields, replicated)``, for checking a system's operators."""
        tile_grid = self.tile_grid(grid)

        def per_device(tile_fields, values):
            return local(tile_grid, tile_fields, values)

        mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=(TILE, REPLICATED),
                               out_specs=TILE)
        return mapped(fields, replicated)


FIELD = P("e", "y", "x")  # (n_exp, ny, nx)
FRAMES = P("e", None, "y", "x")  # (n_exp, n_frames, ny, nx)
PER_EXPERIMENT = P("e")
REPLICATED = P()
TILE = P("y", "x")  # (ny, nx): one experiment's field
