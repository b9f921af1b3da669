"""Spherical-harmonic transforms on a Gaussian grid, in JAX.

Grid: ``nlat`` Gauss–Legendre nodes in μ = cos θ, ordered from north to south (θ increasing, as
the grid's row index), and ``nlon`` equispaced longitudes φ_j = 2πj/nlon. Fields are arrays
``[..., nlat, nlon]``; spectral coefficients are complex arrays ``[..., M, L + 1]`` indexed
``[m, l]`` with M = L + 1 and zeros where l < m (triangular truncation at degree L):

    f(μ, φ) = Σ_{m=-L..L} Σ_{l=|m|..L} a_lm P̄_l^m(μ) e^{imφ},   a_{l,-m} = conj(a_lm),

so only m ≥ 0 is stored. P̄_l^m are the associated Legendre functions normalised so that
∫_{-1}^{1} P̄_l^m P̄_k^m dμ = δ_lk (no Condon–Shortley phase); the harmonics orthonormal on the
unit sphere are P̄_l^m e^{imφ}/√(2π).

Analysis is a real FFT in φ followed by Gauss quadrature in μ; synthesis is the reverse. Both
are exact for band-limited fields when the quadrature is exact, nlat ≥ L + 1 and nlon ≥ 2L + 2
(linear grid). Products of two fields of degree L are projected back without aliasing when
nlat ≥ (3L + 1)/2 and nlon ≥ 3L + 1 (the quadratic grid, equivalent to the 2/3 rule).

The Legendre tables are built once per size in numpy (float64, by the standard stable
three-term recurrence) and cached, so jitted code closes over constants.

Split over latitude: a transform given a ``block`` (a tile of a device mesh split along the
rows, or any grid with ``shape``, ``global_shape``, ``row_offset()`` and ``sum_over_rows(a)``)
works on fields holding only that block's band of rows. Synthesis evaluates the band's rows;
analysis forms the band's partial quadrature sum and adds the other bands' with
``block.sum_over_rows`` (a collective sum on a mesh). The Fourier transform along longitude is
local, so longitude must not be split. Without a block (or with the whole grid) every row is
held and nothing is summed across blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Tables(NamedTuple):
    """Constant numpy tables of one transform (float64)."""

    mu: np.ndarray         # (nlat,) Gauss nodes, descending (θ ascending)
    weights: np.ndarray    # (nlat,) Gauss weights
    theta: np.ndarray      # (nlat,) colatitudes
    phi: np.ndarray        # (nlon,) longitudes
    legendre: np.ndarray   # (M, L + 1, nlat) P̄_l^m(μ_i), zero for l < m
    dlegendre: np.ndarray  # (M, L + 1, nlat) (1 − μ²) dP̄_l^m/dμ at μ_i


def quadratic_truncation(nlat: int, nlon: int) -> int:
    """The largest degree L whose quadratic products the grid resolves without aliasing."""
    return max(min((2 * nlat - 1) // 3, (nlon - 1) // 3), 0)


def legendre_table(lmax: int, mu: np.ndarray) -> np.ndarray:
    """P̄_l^m(μ) for 0 ≤ m ≤ l ≤ lmax as an array (lmax + 1, lmax + 1, len(mu)) indexed
    [m, l, i]. The diagonal P̄_m^m ∝ sin^m θ is built by a product (no factorials, so no
    overflow), then each column m by μP̄_l^m = ε_{l+1}^m P̄_{l+1}^m + ε_l^m P̄_{l-1}^m, which is
    stable upwards in l."""
    mu = np.asarray(mu, np.float64)
    sin = np.sqrt(np.clip(1.0 - mu**2, 0.0, None))
    table = np.zeros((lmax + 1, lmax + 1, mu.size))
    diagonal = np.full(mu.shape, np.sqrt(0.5))
    for m in range(lmax + 1):
        if m > 0:
            diagonal = np.sqrt((2 * m + 1) / (2 * m)) * sin * diagonal
        table[m, m] = diagonal
        if m + 1 <= lmax:
            table[m, m + 1] = np.sqrt(2 * m + 3) * mu * diagonal
        for l in range(m + 2, lmax + 1):
            table[m, l] = (mu * table[m, l - 1] - epsilon(l - 1, m) * table[m, l - 2]) / epsilon(
                l, m)
    return table


def epsilon(l: Any, m: Any) -> Any:
    """ε_l^m = √((l² − m²)/(4l² − 1)), the coupling of the μ recurrence (0 for l ≤ |m|)."""
    l, m = np.asarray(l, np.float64), np.asarray(m, np.float64)
    return np.sqrt(np.clip(l**2 - m**2, 0.0, None) / np.maximum(4 * l**2 - 1, 1.0))


def legendre_tables(lmax: int, mu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P̄_l^m(μ) and (1 − μ²) dP̄_l^m/dμ for 0 ≤ m ≤ l ≤ lmax, each (lmax + 1, lmax + 1,
    len(mu)) indexed [m, l, i] and zero for l < m."""
    full = legendre_table(lmax + 1, mu)  # one degree more, for the derivative recurrence
    l = np.arange(lmax + 1)[None, :, None]
    m = np.arange(lmax + 1)[:, None, None]
    legendre = full[: lmax + 1, : lmax + 1]
    # (1 − μ²) dP̄_l^m/dμ = −l ε_{l+1}^m P̄_{l+1}^m + (l + 1) ε_l^m P̄_{l−1}^m
    lower = np.concatenate([np.zeros_like(legendre[:, :1]), legendre[:, :-1]], axis=1)
    dlegendre = (-l * epsilon(l + 1, m) * full[: lmax + 1, 1: lmax + 2]
                 + (l + 1) * epsilon(l, m) * lower)
    return legendre, np.where(l >= m, dlegendre, 0.0)


@lru_cache(maxsize=32)
def gaussian_grid(nlat: int, nlon: int) -> tuple[np.ndarray, np.ndarray]:
    """Colatitudes θ_i (ascending, the Gauss nodes μ_i = cos θ_i) and longitudes φ_j."""
    mu = np.polynomial.legendre.leggauss(nlat)[0][::-1]
    return np.arccos(mu), 2 * np.pi * np.arange(nlon) / nlon


@lru_cache(maxsize=32)
def tables(nlat: int, nlon: int, lmax: int) -> Tables:
    """The cached constant tables of a transform."""
    x, w = np.polynomial.legendre.leggauss(nlat)
    mu, weights = x[::-1].copy(), w[::-1].copy()
    legendre, dlegendre = legendre_tables(lmax, mu)
    theta, phi = gaussian_grid(nlat, nlon)
    return Tables(mu=mu, weights=weights, theta=theta, phi=phi, legendre=legendre,
                  dlegendre=dlegendre)


def held_rows(values: np.ndarray, block: Any, dtype: Any, axis: int = -1) -> jnp.ndarray:
    """A per-latitude constant (one entry per row of the whole grid along ``axis``) as a
    ``dtype`` array, cut to the band of rows ``block`` holds (all of it for None or the whole
    grid; see the module docstring)."""
    const = jnp.asarray(values, dtype)
    if block is None or block.shape[0] == const.shape[axis]:
        return const
    return jax.lax.dynamic_slice_in_dim(const, block.row_offset(), block.shape[0], axis)


def _real(dtype: Any) -> Any:
    return jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


def real_table_einsum(spec: str, c: Any, table: jnp.ndarray) -> jnp.ndarray:
    """``einsum(spec, c, table)`` for complex ``c`` and a real table, as one real contraction
    of the stacked real and imaginary parts: einsum would promote the table to complex and
    spend four real products per element instead of two."""
    if not jnp.iscomplexobj(c):
        return jnp.einsum(spec, c, table)
    parts = jnp.einsum(spec, jnp.stack([c.real, c.imag]), table)
    return jax.lax.complex(parts[0], parts[1])


@dataclass(frozen=True)
class SphericalTransform:
    """Analysis and synthesis between a Gaussian grid (nlat, nlon) and triangular truncation
    ``lmax`` (0: the quadratic-grid truncation, alias-free for products)."""

    nlat: int
    nlon: int
    lmax: int = 0
    # The block of rows the fields hold (see the module docstring); None: every row.
    block: Any = None

    def __post_init__(self) -> None:
        if self.lmax == 0:
            object.__setattr__(self, "lmax", quadratic_truncation(self.nlat, self.nlon))
        if self.block is not None:
            if tuple(self.block.global_shape) != (self.nlat, self.nlon):
                raise ValueError(f"a block of the grid {list(self.block.global_shape)} does not "
                                 f"belong to a {self.nlat}×{self.nlon} transform")
            if self.block.shape[1] != self.nlon:
                raise ValueError("spherical transforms split latitude only: a block must hold "
                                 f"all {self.nlon} longitudes, not {self.block.shape[1]}")
            if tuple(self.block.shape) == (self.nlat, self.nlon):
                object.__setattr__(self, "block", None)  # the whole grid: nothing to split
        if self.lmax < 1:
            raise ValueError(f"a {self.nlat}×{self.nlon} Gaussian grid resolves no degree ≥ 1; "
                             "use nlat ≥ 2 and nlon ≥ 4")
        if self.nlat < self.lmax + 1 or self.nlon < 2 * self.lmax + 2:
            raise ValueError(
                f"truncation L={self.lmax} needs nlat ≥ L + 1 = {self.lmax + 1} and nlon ≥ "
                f"2L + 2 = {2 * self.lmax + 2}; the grid is {self.nlat}×{self.nlon}")

    @property
    def tables(self) -> Tables:
        return tables(self.nlat, self.nlon, self.lmax)

    @property
    def dealiased(self) -> bool:
        """Whether products of two degree-L fields are projected back without aliasing."""
        return self.lmax <= quadratic_truncation(self.nlat, self.nlon)

    @property
    def degrees(self) -> np.ndarray:
        """l as a (1, L + 1) array, to broadcast against coefficients [m, l]."""
        return np.arange(self.lmax + 1)[None, :].astype(np.float64)

    @property
    def orders(self) -> np.ndarray:
        """m as a (M, 1) array."""
        return np.arange(self.lmax + 1)[:, None].astype(np.float64)

    @property
    def mask(self) -> np.ndarray:
        """True where l ≥ m (the coefficients that exist)."""
        return self.degrees >= self.orders

    def _const(self, table: np.ndarray, like: Any) -> jnp.ndarray:
        return jnp.asarray(table, _real(jnp.result_type(like)))

    # -- the rows held ---------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        """How many rows (latitudes) the fields hold: nlat, or the block's band."""
        return self.nlat if self.block is None else self.block.shape[0]

    def held_rows(self, table: np.ndarray, like: Any, axis: int = -1) -> jnp.ndarray:
        """A per-latitude constant (nlat long along ``axis``) in the real dtype of ``like``,
        cut to the rows the fields hold."""
        return held_rows(table, self.block, _real(jnp.result_type(like)), axis)

    def sum_over_rows(self, partial: Any) -> Any:
        """A quadrature sum over the rows held, completed with the other blocks' sums."""
        return partial if self.block is None else self.block.sum_over_rows(partial)

    def sin_theta(self, like: Any) -> jnp.ndarray:
        """sin θ of the rows held, as a column (rows, 1)."""
        return self.held_rows(np.sin(self.tables.theta)[:, None], like, axis=0)

    # -- transforms ------------------------------------------------------------------------------

    def fourier(self, f: Any) -> jnp.ndarray:
        """c_m(μ_i) with f = Σ_m c_m e^{imφ}, m = 0..L: (..., nlat, M)."""
        return jnp.fft.rfft(f, axis=-1)[..., : self.lmax + 1] / self.nlon

    def legendre_partial(self, c: Any, table: np.ndarray | None = None) -> jnp.ndarray:
        """Σ_i w_i c_m(μ_i) T_l^m(μ_i) over the rows held, for Fourier coefficients c
        (..., rows, M): the analysis before the other blocks' sums are added."""
        t = self.tables
        table = t.legendre if table is None else table
        return real_table_einsum("...im,mli->...ml", c, self.held_rows(table * t.weights, c))

    def legendre_analysis(self, c: Any, table: np.ndarray | None = None) -> jnp.ndarray:
        """a_lm = Σ_i w_i c_m(μ_i) T_l^m(μ_i) for Fourier coefficients c (..., nlat, M)."""
        return self.sum_over_rows(self.legendre_partial(c, table))

    def analysis(self, f: Any) -> jnp.ndarray:
        """Grid (..., nlat, nlon) → coefficients (..., M, L + 1)."""
        return self.legendre_analysis(self.fourier(f))

    def _synthesise(self, a: Any, table: np.ndarray) -> jnp.ndarray:
        c = real_table_einsum("...ml,mli->...im", a, self.held_rows(table, a))
        pad = self.nlon // 2 + 1 - c.shape[-1]
        c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, pad)])
        return jnp.fft.irfft(c * self.nlon, n=self.nlon, axis=-1)

    def synthesis(self, a: Any) -> jnp.ndarray:
        """Coefficients (..., M, L + 1) → grid (..., nlat, nlon)."""
        return self._synthesise(a, self.tables.legendre)

    def synthesis_dmu(self, a: Any) -> jnp.ndarray:
        """(1 − μ²) ∂f/∂μ = −sin θ ∂f/∂θ on the grid."""
        return self._synthesise(a, self.tables.dlegendre)

    def synthesis_dtheta(self, a: Any) -> jnp.ndarray:
        """∂f/∂θ on the grid (the Gauss nodes avoid the poles, so sin θ > 0)."""
        return -self.synthesis_dmu(a) / self.sin_theta(a)

    def synthesis_dphi(self, a: Any) -> jnp.ndarray:
        """∂f/∂φ on the grid."""
        return self.synthesis(self.dphi(a))

    # -- spectral operators ----------------------------------------------------------------------

    def dphi(self, a: Any) -> jnp.ndarray:
        """Coefficients of ∂f/∂φ: i m a_lm."""
        return a * (1j * self._const(self.orders, a))

    def laplacian_eigenvalues(self, radius: float = 1.0) -> np.ndarray:
        """−l(l + 1)/R² as a (1, L + 1) array."""
        return -self.degrees * (self.degrees + 1) / radius**2

    def laplacian(self, a: Any, radius: Any = 1.0) -> jnp.ndarray:
        l = self._const(self.degrees, a)
        return a * (-l * (l + 1)) / radius**2

    def inverse_laplacian(self, a: Any, radius: Any = 1.0) -> jnp.ndarray:
        """The ψ with ∇²ψ = f and zero mean: the l = 0 mode is set to zero."""
        l = self._const(self.degrees, a)
        inverse = jnp.where(l > 0, -1.0 / jnp.maximum(l * (l + 1), 1.0), 0.0)
        return a * inverse * radius**2

    def truncate(self, f: Any) -> jnp.ndarray:
        """The band-limited projection of a grid field."""
        return self.synthesis(self.analysis(f))

    # -- vector fields ---------------------------------------------------------------------------

    def rotated_gradient(self, a: Any, radius: Any = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
        """r̂ × ∇ψ for ψ with coefficients a: (u_θ, u_φ) = (−∂φψ/(R sin θ), ∂θψ/R)."""
        sin = self.sin_theta(a)
        return -self.synthesis_dphi(a) / (radius * sin), self.synthesis_dtheta(a) / radius

    def gradient(self, a: Any, radius: Any = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
        """∇f = (∂θf/R, ∂φf/(R sin θ))."""
        sin = self.sin_theta(a)
        return self.synthesis_dtheta(a) / radius, self.synthesis_dphi(a) / (radius * sin)

    def curl_analysis(self, f_theta: Any, f_phi: Any, radius: Any = 1.0) -> jnp.ndarray:
        """Coefficients of r̂·curl F = (∂θ(sin θ F_φ) − ∂φF_θ)/(R sin θ) from the grid components.

        With A = sin θ F_φ, B = sin θ F_θ the curl is −[∂μA + ∂φB/(1 − μ²)]/R; integrating the
        ∂μ term by parts against P̄_l^m (A vanishes at the poles) moves the derivative onto the
        known table, so no derivative of the (possibly non-band-limited) force is taken:

            curl_lm = −(1/R) Σ_i w_i [i m B_m P̄_l^m − A_m (1 − μ²) dP̄_l^m/dμ] / (1 − μ_i²).

        Exact when F is band-limited (e.g. F = r̂ × ∇χ + ∇ξ with χ, ξ of degree ≤ L)."""
        real = _real(jnp.result_type(f_theta, f_phi))
        # B/(1 − μ²) = F_θ/sin θ, A/(1 − μ²) = F_φ/sin θ
        over = self.held_rows(1.0 / np.sin(self.tables.theta)[:, None], real, axis=0)
        b, a = self.fourier(jnp.stack([f_theta * over, f_phi * over]))  # one FFT for both
        m = jnp.asarray(np.arange(self.lmax + 1), real)
        # Both partial sums first: one sum across blocks.
        curl = self.sum_over_rows(self.legendre_partial(1j * m * b)
                                  - self.legendre_partial(a, self.tables.dlegendre))
        return -curl / radius

    def divergence_analysis(self, f_theta: Any, f_phi: Any, radius: Any = 1.0) -> jnp.ndarray:
        """Coefficients of ∇·F = (∂θ(sin θ F_θ) + ∂φF_φ)/(R sin θ), by the same integration by
        parts as :meth:`curl_analysis` (the divergence of (F_θ, F_φ) is the curl of
        (−F_φ, F_θ))."""
        return self.curl_analysis(-f_phi, f_theta, radius)
