"""The global grid: shape, spacing and per-axis boundary kind, plus halo filling.

Fields live at cell centres. A stencil never indexes past the array it is given: it receives a
*block that carries halos* (the interior padded by ``width`` cells on each side of the last two
axes) and returns the interior. On one device the halo is filled here from the boundary
condition; the domain-decomposition code fills it by exchanging with neighbours instead and
calls the very same stencils.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

NEUMANN = "neumann"
PERIODIC = "periodic"
BOUNDARY_KINDS = (NEUMANN, PERIODIC)

# Cell-centred no-flux: the ghost cell mirrors the interior cell across the face, so the face
# gradient is zero and the discrete Laplacian conserves the field's sum exactly.
_PAD_MODE = {NEUMANN: "symmetric", PERIODIC: "wrap"}


@dataclass(frozen=True)
class Grid:
    """A uniform 2-D cell-centred grid. Arrays are indexed ``[..., y, x]``."""

    shape: tuple[int, int]
    spacing: tuple[float, float]
    boundaries: tuple[str, str] = (NEUMANN, NEUMANN)
    # Stencils declare their symmetric VJP (fast reverse mode); False gives plain stencils,
    # which forward mode (jvp) can also differentiate.
    self_adjoint_vjp: bool = True

    def __post_init__(self) -> None:
        shape = tuple(int(n) for n in self.shape)
        spacing = tuple(float(h) for h in self.spacing)
        boundaries = tuple(str(b) for b in self.boundaries)
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"grid shape must be two positive integers, got {self.shape!r}")
        if len(spacing) != 2 or min(spacing) <= 0:
            raise ValueError(f"grid spacing must be two positive numbers, got {self.spacing!r}")
        if len(boundaries) != 2 or any(b not in BOUNDARY_KINDS for b in boundaries):
            raise ValueError(
                f"grid boundaries must be two of {BOUNDARY_KINDS}, got {self.boundaries!r}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "spacing", spacing)
        object.__setattr__(self, "boundaries", boundaries)

    @property
    def extent(self) -> tuple[float, float]:
        """Physical size (Ly, Lx)."""
        return (self.shape[0] * self.spacing[0], self.shape[1] * self.spacing[1])

    def coordinates(self) -> tuple[jnp.ndarray, jnp.ndarray]:
        """Cell-centre coordinates (y, x) as 1-D arrays."""
        (ny, nx), (dy, dx) = self.shape, self.spacing
        return (jnp.arange(ny) + 0.5) * dy, (jnp.arange(nx) + 0.5) * dx

    def pad(self, u: jnp.ndarray, width: int) -> jnp.ndarray:
        """Return ``u`` with a halo of ``width`` cells on the last two axes, filled from the
        boundary conditions. Corners are filled consistently because the axes are padded one
        after the other."""
        if width == 0:
            return u
        lead = [(0, 0)] * (u.ndim - 2)
        u = jnp.pad(u, [*lead, (width, width), (0, 0)], mode=_PAD_MODE[self.boundaries[0]])
        return jnp.pad(u, [*lead, (0, 0), (width, width)], mode=_PAD_MODE[self.boundaries[1]])

    # -- global operations: rows (a spectral transform over latitude sums over every row) --
    # On one device the grid holds every row; a tile of a mesh split along y holds a band.

    @property
    def global_shape(self) -> tuple[int, int]:
        """The shape of the whole grid (this one; a tile's is larger than its own)."""
        return self.shape

    def row_offset(self) -> int:
        """The index in the whole grid of this block's first row."""
        return 0

    def sum_over_rows(self, a: jnp.ndarray) -> jnp.ndarray:
        """The sum over the blocks that hold the rows of per-block partial sums ``a``."""
        return a

    # -- global operations: reductions and pencil transposes (a spectral solve on the grid) --
    # One device holds the whole grid: every reduction is the block's own, every axis whole.

    def global_max(self, a: jnp.ndarray) -> jnp.ndarray:
        """The largest of every block's ``a`` (a per-block maximum), elementwise."""
        return a

    def global_sum(self, a: jnp.ndarray) -> jnp.ndarray:
        """The sum of every block's ``a`` (a per-block partial sum), elementwise."""
        return a

    def to_whole(self, a: jnp.ndarray, axis: int) -> jnp.ndarray:
        """``a`` (this block) rearranged so that grid axis ``axis`` (−2 or −1) is whole on
        every device and the other one split: a pencil for a transform along ``axis``."""
        return a

    def from_whole(self, a: jnp.ndarray, axis: int) -> jnp.ndarray:
        """The inverse of :meth:`to_whole`: a pencil whole along ``axis`` back to blocks."""
        return a

    def swap_whole(self, a: jnp.ndarray, axis: int, back: bool = False) -> jnp.ndarray:
        """A pencil whole along ``axis`` (from :meth:`to_whole`) rearranged to be whole along
        the other axis, ``axis`` split over every device; ``back``: the inverse."""
        return a

    def swapped_part(self, table: jnp.ndarray, axis: int) -> jnp.ndarray:
        """The part of ``table`` (an array of the whole grid's shape) that lies where this
        device's :meth:`swap_whole` pencil lies (for a diagonal operator on it)."""
        return table
