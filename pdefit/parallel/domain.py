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

    # -- global operations: rows (a spectral transform over latitude sums over every row) --
    # The tile holds the band of rows [row_offset, row_offset + shape[0]) of the whole grid.

    @property
    def global_shape(self) -> tuple[int, int]:
        """The shape of the whole grid."""
        return self.grid.shape

    def row_offset(self) -> Any:
        """The index in the whole grid of this tile's first row (traced: the device's index
        along ``y`` times the rows per tile)."""
        if self.devices[0] == 1:
            return 0
        return jax.lax.axis_index("y") * self.shape[0]

    def sum_over_rows(self, a: jnp.ndarray) -> jnp.ndarray:
        """The sum of every tile's partial sum ``a`` over the tiles along ``y`` (the tiles of
        one column hold all rows)."""
        return a if self.devices[0] == 1 else jax.lax.psum(a, "y")

    # -- global operations: reductions and pencil transposes (a spectral solve on the grid) --
    # A pencil whole along x splits each tile's rows over the devices of its mesh row (an
    # all-to-all over "x"); one whole along y splits its columns over its mesh column;
    # swap_whole turns one into the other over all devices (an all-to-all over both axes).

    def global_max(self, a: jnp.ndarray) -> jnp.ndarray:
        """The largest of every tile's ``a`` (a per-tile maximum), elementwise."""
        return jax.lax.pmax(a, ("y", "x"))

    def global_sum(self, a: jnp.ndarray) -> jnp.ndarray:
        """The sum of every tile's ``a`` (a per-tile partial sum), elementwise."""
        return jax.lax.psum(a, ("y", "x"))

    def to_whole(self, a: jnp.ndarray, axis: int) -> jnp.ndarray:
        """This tile rearranged so that grid axis ``axis`` (−2 or −1) is whole: the other
        axis of the tiles along ``axis`` split over them (one all-to-all). A ValueError
        where it does not split evenly (raised while tracing, before any work)."""
        name, n_dev, other = self._pencil(axis)
        if n_dev == 1:
            return a
        return jax.lax.all_to_all(a, name, a.ndim + other, a.ndim + axis, tiled=True)

    def from_whole(self, a: jnp.ndarray, axis: int) -> jnp.ndarray:
        """The inverse of :meth:`to_whole`: a pencil whole along ``axis`` back to tiles."""
        name, n_dev, other = self._pencil(axis)
        if n_dev == 1:
            return a
        return jax.lax.all_to_all(a, name, a.ndim + axis, a.ndim + other, tiled=True)

    def swap_whole(self, a: jnp.ndarray, axis: int, back: bool = False) -> jnp.ndarray:
        """A pencil whole along ``axis`` (from :meth:`to_whole`) rearranged to be whole along
        the other axis, ``axis`` split over every device (one all-to-all over both mesh
        axes); ``back``: the inverse. The pencil's blocks of the other axis are numbered
        like the devices over both mesh axes, the mesh axis along ``axis`` last, so the
        blocks arrive in order."""
        names, n_dev = self._swap(axis)
        if n_dev == 1:
            return a
        split, concat = a.ndim + axis, a.ndim - 3 - axis
        if back:
            split, concat = concat, split
        return jax.lax.all_to_all(a, names, split, concat, tiled=True)

    def swapped_part(self, table: jnp.ndarray, axis: int) -> jnp.ndarray:
        """The part of ``table`` (of the whole grid's shape) where this device's
        :meth:`swap_whole` pencil lies: all of the other axis, its block of ``axis``."""
        names, n_dev = self._swap(axis)
        table = jnp.asarray(table)
        if n_dev == 1:
            return table
        size = self.grid.shape[axis] // n_dev
        return jax.lax.dynamic_slice_in_dim(table, jax.lax.axis_index(names) * size, size,
                                            axis=table.ndim + axis)

    def _swap(self, axis: int) -> tuple[tuple[str, str], int]:
        """(both mesh axes, that along ``axis`` last; their devices), checked to split."""
        name, _, _ = self._pencil(axis)
        names = ("x", "y") if name == "y" else ("y", "x")
        n_dev = self.devices[0] * self.devices[1]
        if self.grid.shape[axis] % n_dev:
            raise ValueError(
                f"grid axis {'yx'[axis + 2]} of {self.grid.shape[axis]} cells cannot be split "
                f"over all {n_dev} devices of the mesh for a transform along the other axis; "
                "choose a mesh whose tiles split so (e.g. powers of two on a power-of-two grid)")
        return names, n_dev

    def _pencil(self, axis: int) -> tuple[str, int, int]:
        """(mesh axis along ``axis``, its devices, the other grid axis), checked to split."""
        if axis not in (-2, -1):
            raise ValueError(f"a pencil is whole along grid axis -2 or -1, not {axis}")
        name, other = ("y", -1) if axis == -2 else ("x", -2)
        n_dev = self.devices[axis + 2]
        if self.shape[other] % n_dev:
            raise ValueError(
                f"tiles of {list(self.shape)} cells cannot be transposed whole along grid "
                f"axis {'yx'[axis + 2]}: their {self.shape[other]} cells along {'yx'[other + 2]}"
                f" do not split over the {n_dev} devices of mesh axis {name!r}; choose a mesh "
                "whose tiles split so (e.g. powers of two on a power-of-two grid)")
        return name, n_dev, other


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
