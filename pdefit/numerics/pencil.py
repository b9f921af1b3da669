"""Separable spectral operators on a grid that may be split over devices: real-to-real
transforms along one axis, and a diagonal operator applied in their joint basis by pencils.

A transform along an axis needs that axis whole. The grid says how to get it: ``to_whole``
rearranges the blocks so that the axis is whole on every device (on one device: nothing; on a
tile of a device mesh: an all-to-all over the mesh axis along it), ``from_whole`` undoes it,
``swap_whole`` turns such a pencil into one whole along the other axis (an all-to-all over both
mesh axes), and ``swapped_part`` picks the part of a table that lies on that pencil. The transforms
here keep arrays real and of the block's size, so every transpose moves exactly one field.

- :func:`dct_ii` / :func:`dct_iii`: the cosine transform of a cell-centred field with mirror
  (zero-flux) walls and its inverse, as an FFT of the mirrored field.
- :func:`rfft_packed` / :func:`irfft_packed`: the periodic real FFT with its n real numbers
  packed into n slots (real parts of 0 … n//2, then imaginary parts of 1 … (n−1)//2).
- :func:`apply_diagonal`: transform along the axis that is whole on this block first, swap the
  pencil, transform along the other, multiply, and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

Transform = Callable[[jnp.ndarray, int], jnp.ndarray]


def _phase(n: int, axis: int, ndim: int, sign: float) -> jnp.ndarray:
    """exp(sign · iπk/(2n)), k = 0 … n−1, shaped to broadcast along ``axis``."""
    shape = [1] * ndim
    shape[axis] = n
    return jnp.asarray(np.exp(sign * 1j * np.pi * np.arange(n) / (2 * n)).reshape(shape))


def dct_ii(a: jnp.ndarray, axis: int) -> jnp.ndarray:
    """C_k = 2 Σ_j a_j cos(πk(2j + 1)/(2n)) along ``axis``: the real FFT of ``a`` followed by
    its mirror image is exp(iπk/(2n)) C_k, because the mirror is the zero-flux ghost rule."""
    n = a.shape[axis]
    mirrored = jnp.concatenate([a, jnp.flip(a, axis)], axis=axis)
    spectrum = jnp.fft.rfft(mirrored, axis=axis)
    index = [slice(None)] * a.ndim
    index[axis] = slice(0, n)
    phase = _phase(n, axis, a.ndim, -1.0).astype(spectrum.dtype)
    return jnp.real(spectrum[tuple(index)] * phase).astype(a.dtype)


def dct_iii(c: jnp.ndarray, axis: int) -> jnp.ndarray:
    """The inverse of :func:`dct_ii`: the mirrored field from its spectrum exp(iπk/(2n)) C_k
    (zero at k = n), its first half kept."""
    n = c.shape[axis]
    complex_dtype = jnp.result_type(c.dtype, jnp.complex64)  # complex64 for float32
    spectrum = c * _phase(n, axis, c.ndim, 1.0).astype(complex_dtype)
    pad = [(0, 0)] * c.ndim
    pad[axis] = (0, 1)
    mirrored = jnp.fft.irfft(jnp.pad(spectrum, pad), n=2 * n, axis=axis)
    index = [slice(None)] * c.ndim
    index[axis] = slice(0, n)
    return mirrored[tuple(index)].astype(c.dtype)


def rfft_packed(a: jnp.ndarray, axis: int) -> jnp.ndarray:
    """The real FFT along ``axis`` as n real numbers: Re F_0 … Re F_{n//2}, then
    Im F_1 … Im F_{(n−1)//2} (the imaginary parts that are not zero for real data)."""
    n = a.shape[axis]
    spectrum = jnp.moveaxis(jnp.fft.rfft(a, axis=axis), axis, -1)
    packed = jnp.concatenate([jnp.real(spectrum), jnp.imag(spectrum[..., 1:(n + 1) // 2])],
                             axis=-1)
    return jnp.moveaxis(packed, -1, axis).astype(a.dtype)


def irfft_packed(p: jnp.ndarray, axis: int) -> jnp.ndarray:
    """The inverse of :func:`rfft_packed`."""
    n = p.shape[axis]
    p = jnp.moveaxis(p, axis, -1)
    real = p[..., : n // 2 + 1]
    zero = jnp.zeros_like(p[..., :1])
    imag = jnp.concatenate([zero, p[..., n // 2 + 1:]] + ([zero] if n % 2 == 0 else []),
                           axis=-1)
    return jnp.moveaxis(jnp.fft.irfft(real + 1j * imag, n=n, axis=-1), -1, axis).astype(p.dtype)


def packed_wavenumbers(n: int) -> np.ndarray:
    """The wavenumber k of each slot of :func:`rfft_packed` (each k ≥ 1 below n/2 twice)."""
    slots = np.arange(n)
    return np.where(slots <= n // 2, slots, slots - n // 2)


def apply_diagonal(a: jnp.ndarray, grid: Any, transforms: dict[int, tuple[Transform, Transform]],
                   diagonal: Any) -> jnp.ndarray:
    """``diagonal`` (an array of the whole grid's shape, indexed by the transformed
    coordinates) applied to ``a`` in the basis of ``transforms`` = {axis: (forward,
    inverse)} for axes −2 and −1. The axis that is whole on this block (if one is) is
    transformed first; then the pencil is swapped to be whole along the other axis. A mesh
    split along one axis needs two all-to-alls, one split along both four."""
    whole_shape = tuple(grid.global_shape)
    first = -2 if grid.shape[-2] == whole_shape[-2] else -1
    second = -1 - (first + 2)
    b = transforms[first][0](grid.to_whole(a, first), first)
    b = transforms[second][0](grid.swap_whole(b, first), second)
    b = transforms[second][1](b * grid.swapped_part(diagonal, first), second)
    b = transforms[first][1](grid.swap_whole(b, first, back=True), first)
    return grid.from_whole(b, first)
