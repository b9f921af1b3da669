"""The parameters' curvature with fitted initial fields as nuisance unknowns (a Schur complement).

Where initial fields are fitted with the parameters, the parameters' uncertainty must let
the fields move too: with B the half Gauss–Newton matrix of the loss over θ = (p, x₀) (data
and priors), the marginal curvature of p is the Schur complement

    S = B_pp − B_px B_xx⁻¹ B_xp,

and the Laplace (Gaussian posterior) covariance of p is a σ² S⁻¹ for misfit weights a that
are one number (the loss a Σ r² + priors, with noise σ). B_xx has 10⁴–10⁶ rows, so it is
never formed: the k columns B_xp e_i come from k matrix-free products
(:func:`pdefit.fitting.krylov.gauss_newton_product`) and each B_xx⁻¹ B_xp e_i from
conjugate gradients on the field block, preconditioned like the fit's steps, all k of them
batched under ``vmap`` (:func:`batched`). The same solve reduces the gradient
(g_p − B_px B_xx⁻¹ g_x), whose Gauss–Newton step tells how far a fit stopped from its optimum.

The field solves are preconditioned by B_xx's diagonal cell by cell (:func:`cell_diagonal`),
not by one number per field as the fit's steps scale them: a hidden field's cells differ in
how much the data see them by decades (BOCF's gates at 64² on 10 ms of voltage: 2e-8 to 1e-3,
the prior's floor to a cell about to fire), and after 100 iterations one number per field
left these solves at relative residuals (2-norm) of 1e-3–1e-2, the cells' diagonal at
2e-9–2e-8 (docs/benchmarks.md, "The field solves preconditioned cell by cell").

A solve stopped at its cap leaves S bracketed, not lost: the variational estimate S⁺
(:func:`solved_columns`) is positive semi-definite and never below S, and the solves'
residuals with the fields' prior curvature give S⁻ ⪯ S (:func:`marginal_parts`), so every
std error lies between those of S⁺ and S⁻ however far the solves got.

What the result is, is :class:`pdefit.fitting.uncertainty.CurvatureParts` with bread S⁺,
meat a·S⁺ and the pair for S⁻, so the intervals, flags and residual verdict of
:func:`pdefit.fitting.uncertainty.estimate` apply unchanged, with each std error's bracket.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.fitting import krylov
from pdefit.fitting.directions import SHARE
from pdefit.fitting.problem import Batch, FitProblem

# Conjugate-gradient iterations per field-block solve, and their relative tolerance.
ITERATIONS = 60
RTOL = 1e-4
# A solve stopped at its cap leaves S bracketed (:func:`marginal_parts`); a parameter's std error
# counts as resolved where its bracket's upper end is at most SPREAD above its lower one.
SPREAD = 0.1
# Where the bracket stays open (on BOCF's 10 ms of voltage the residuals' bound is 10⁵–10⁶ × S,
# the prior's floor μ being that small), a capped solve's S_ii below RESOLVED × (B_pp)_ii is
# lost in its error, not measured (a BOCF 64² fit of all four fields, first-order estimate:
# |S_ii| 1e-7–2e-5 of (B_pp)_ii, three of ten negative); above it, the std error is the
# bracket's lower end, with the bracket beside it.
RESOLVED = 1e-3
# Relative eigenvalue of S below which a direction counts as undetermined (as the estimate's
# default for float64, :func:`pdefit.fitting.directions.default_rcond`).
SINGULAR = 1e-10
# The squared share of a direction's unit vector from which a parameter takes part in it: in
# one S⁺ leaves undetermined, as the estimate names them; in one S⁻ does not bound, any share
# above rounding (S could be singular there, and then every such parameter's std unbounded).
UNBOUNDED_SHARE = 1e-8
# Solves batched together each hold the model's tangent at every observed frame (as much
# memory as the data); a batch holds at most this many bytes of them.
BATCH_BYTES = 2**31
# The lattice of cells probed together for the field block's diagonal (:func:`cell_diagonal`):
# every PROBE_SPACING-th cell along each axis, PROBE_SPACING² probes per field. At a fitted
# state of 10 ms of voltage (BOCF 64²) a cell's column reaches cells 4 apart, and with every
# 4th cell the crosstalk left the field solves at relative residuals 4e-2–1.5e-1 after 100
# iterations; with every 8th and the floor of field_floors, 1.3e-4–1.9e-3 (docs/benchmarks.md,
# "The probed diagonal at a fitted state"), for 4 × the probes (256 products for four fields
# against the solves' 1000).
PROBE_SPACING = 8
# A probed diagonal entry is floored at this share of its field's mean: the probe's crosstalk
# can leave a cell the data hardly see at zero or below, which no preconditioner may divide by.
PROBE_FLOOR = 1e-6


def fields_reason(problem: FitProblem, weights: dict[str, Any]) -> str | None:
    """Why no marginal curvature can be formed for ``problem`` with misfit ``weights`` (per
    observed field, one per experiment; None: it can)."""
    if problem.domain is not None:
        return "the Gauss–Newton curvature runs on one device (mesh=single)"
    others = [n for n in problem.layout.fitted if n not in problem.layout.scalars]
    if others or not problem.layout.fitted:
        return ("intervals with fitted initial fields cover shared scalar parameters only"
                if others else "no fitted parameter")
    if common_weight(weights) is None:
        return ("intervals with fitted initial fields need one misfit weight for every "
                "observed value (one field, or fields of equal noise and count)")
    return None


def common_weight(weights: dict[str, Any]) -> float | None:
    """The one misfit weight of every observed value (``weights``: per observed field, one
    per experiment), or None where they differ."""
    levels = np.concatenate([np.ravel(w) for w in weights.values()])
    return float(levels[0]) if np.allclose(levels, levels[0], rtol=1e-12, atol=0.0) else None


class MarginalParts(NamedTuple):
    """The parameters' marginal curvature at one θ, over ``theta["params"]`` flattened in
    ``ravel_pytree`` order: half the Gauss–Newton matrix's Schur complement, bracketed."""

    schur: np.ndarray  # S⁺ ⪰ S: the variational estimate (an upper bound, positive semi-definite)
    schur_lower: np.ndarray | None  # S⁻ ⪯ S (None where the fields have no curvature floor)
    reduced_gradient: np.ndarray  # of the loss, g_p − G_px G_xx⁻¹ g_x
    unresolved: tuple[int, ...]  # positions whose curvature is lost (RESOLVED, SPREAD)


def marginal_parts(problem: FitProblem, theta: Any, batch: Batch,
                   iterations: int = ITERATIONS, batch_size: int | None = None,
                   ) -> MarginalParts:
    """:class:`MarginalParts` at ``theta`` (see the module docstring); ``batch_size``: see
    :func:`batched`. The bracket: with R the column solves' residuals and μ ≤ λ_min(G_xx)
    (:func:`curvature_floor`), G_px G_xx⁻¹ G_xp = coupled + RᵀG_xx⁻¹R ⪯ coupled + RᵀR/μ
    (:func:`solved_columns`), so S⁻ = S⁺ − ½RᵀR/μ ⪯ S ⪯ S⁺, and the std errors from S⁺⁻¹
    and S⁻⁻¹ bracket the true ones. A position is unresolved where its solve stopped at its
    cap, its S_ii is below :data:`RESOLVED` of its held curvature and its bracket is wider
    than :data:`SPREAD`."""
    every = np.arange(ravel_pytree(theta["params"])[0].shape[0])
    parts = jax.jit(lambda th, b: solved_columns(problem, th, b, every, iterations, batch_size)
                    ._replace(solutions=None))(theta, batch)
    schur = symmetric(0.5 * (np.asarray(parts.block, np.float64)
                             - np.asarray(parts.coupled, np.float64)))
    floor = curvature_floor(problem, theta, batch)
    lower = (symmetric(schur - 0.5 * np.asarray(parts.residual_gram, np.float64) / floor)
             if floor > 0 else None)
    held = 0.5 * np.diag(np.asarray(parts.block, np.float64))  # 0: never seen, not lost
    capped = np.asarray(parts.steps[:every.shape[0]]) >= iterations
    lost = np.flatnonzero(capped & (held > 0) & (np.diag(schur) < RESOLVED * held)
                          & ~(std_spread(schur, lower) <= SPREAD))
    return MarginalParts(schur, lower, np.asarray(parts.reduced_gradient, np.float64),
                         tuple(int(i) for i in lost))


def symmetric(matrix: np.ndarray) -> np.ndarray:
    return 0.5 * (matrix + matrix.T)


def std_spread(upper: np.ndarray, lower: np.ndarray | None,
               rcond: float = SINGULAR) -> np.ndarray:
    """Per position, √((S⁻⁻¹)_ii / (S⁺⁻¹)_ii) − 1: how much wider the std error may be than
    its bound from ``upper`` S⁺ (inf where ``lower`` S⁻ is None or not positive definite in a
    direction the position takes part in; nan where it takes part in a direction S⁺ itself
    leaves undetermined, below ``rcond`` of its largest eigenvalue: not determined, which the
    estimate says, rather than unresolved)."""
    k = upper.shape[0]
    values, vectors = np.linalg.eigh(upper)
    top = max(float(np.max(np.abs(values), initial=0.0)), np.finfo(np.float64).tiny)
    null = values <= rcond * top
    undetermined = np.any((vectors[:, null] ** 2) >= SHARE, axis=1)
    kept = vectors[:, ~null]
    narrow = np.einsum("ij,j,ij->i", kept, 1.0 / values[~null], kept)
    wide = np.full(k, np.inf)
    if lower is not None:
        inverse, unbounded = bounded_inverse(lower, rcond * top)
        wide = np.where(unbounded, np.inf, np.diag(inverse))
    with np.errstate(invalid="ignore", divide="ignore"):
        spread = np.sqrt(wide / narrow) - 1.0
    return np.where(undetermined, np.nan, spread)


class SolvedColumns(NamedTuple):
    """The field solves behind a Schur complement, over the ``free`` positions of the
    flattened parameters (k of them), for G the full Gauss–Newton matrix of the loss and X the
    solves' approximations of G_xx⁻¹ G_xp (columns x_i) and of G_xx⁻¹ g_x (x_g)."""

    block: jax.Array  # G_pp (k × k)
    coupled: jax.Array  # G_px G_xx⁻¹ G_xp, its variational estimate G_pxX + XᵀG_xp − XᵀG_xxX
    reduced_gradient: jax.Array  # g_p − G_px G_xx⁻¹ g_x, its variational estimate (k)
    solutions: Any  # x_i for each free i, then x_g: stacked like θ's fields
    steps: jax.Array  # the iterations of each of the k + 1 solves
    residual_gram: jax.Array  # RᵀR of the k column solves' residuals G_xp e_i − G_xx x_i


def solved_columns(problem: FitProblem, theta: Any, batch: Batch, free: np.ndarray,
                   iterations: int, batch_size: int | None = None) -> SolvedColumns:
    """:class:`SolvedColumns` at ``theta`` (traceable: the caller jits it): k products for
    the parameters' columns, then their k field parts and the gradient's as k + 1 solves of
    at most ``iterations`` conjugate-gradient iterations, ``batch_size`` at a time
    (:func:`batched`), each followed by one product G_xx x.

    Why the variational estimates: where a solve stops early, x_i = G_xx⁻¹ b_i + e_i, and
    G_px X is off by G_px E, first order in the errors, of either sign: a truncated solve can
    leave that S indefinite. The estimate Xᵀb + bᵀX − XᵀG_xxX is off by −EᵀG_xxE only:
    second order, and never above the true G_px G_xx⁻¹ G_xp (for any combination a of the
    columns, 2 aᵀbᵀXa − aᵀXᵀG_xxXa is the quadratic model's value at Xa, at most its
    maximum), so S = G_pp − coupled is positive semi-definite and an upper bound of the true
    Schur complement, however far the solves got; the residuals R bound its gap from above
    (:func:`marginal_parts`). The reduced gradient's estimate is off by −E_colsᵀG_xxE_g,
    second order too, and with the same pair the reduced model's step is exactly the full
    quadratic model's along the step taken (fields moved by −(x_g + Xδ))."""
    flat, unravel = ravel_pytree(theta["params"])
    zero = jax.tree.map(jnp.zeros_like, theta)
    fields_only, scale = field_block(problem, theta, batch)

    def column(unit):  # G·e_i: its parameter rows (G_pp) and its field rows (G_xp e_i)
        response = krylov.gauss_newton_product(problem, theta, batch,
                                               {**zero, "params": unravel(unit)})
        return ravel_pytree(response["params"])[0][free], response["fields"]

    def solved(rhs):  # x ≈ G_xx⁻¹ rhs, G_xx x and the solve's iterations
        solution = field_solution(fields_only, rhs, scale, iterations)
        return solution.value, fields_only(solution.value), solution.stats["num_steps"]

    gradient = jax.grad(problem.loss)(theta, batch)
    units = jnp.eye(flat.shape[0], dtype=flat.dtype)[free]
    block, field_rows = batched(column, units, batch_size, batch)
    # The gradient's field part is one more right-hand side of the same solves.
    rhs = jax.tree.map(lambda c, g: jnp.concatenate([c, g[None]]), field_rows,
                       gradient["fields"])
    solutions, responses, steps = batched(solved, rhs, batch_size, batch)
    along = stacked_gram(rhs, solutions)  # [i, j] = b_iᵀ x_j
    coupled = along + along.T - stacked_gram(solutions, responses)
    k = free.shape[0]
    residuals = jax.tree.map(lambda b, r: (b - r)[:k], rhs, responses)
    reduced = ravel_pytree(gradient["params"])[0][free] - coupled[:k, k]
    return SolvedColumns(block.T, coupled[:k, :k], reduced, solutions, steps,
                         stacked_gram(residuals, residuals))


def stacked_gram(left: Any, right: Any) -> jax.Array:
    """[i, j] = ⟨left_i, right_j⟩ over every leaf, for pytrees stacked on a leading axis."""
    return sum(jnp.tensordot(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1),
                             axes=(1, 1)) for a, b in zip(jax.tree.leaves(left),
                                                          jax.tree.leaves(right), strict=True))


def curvature_floor(problem: FitProblem, theta: Any, batch: Batch) -> float:
    """A lower bound of G_xx's least eigenvalue: the least of :func:`field_floors`. 0 where
    some fitted field has no prior of its own."""
    return float(min(field_floors(problem, theta, batch).values(), default=0.0))


def field_floors(problem: FitProblem, theta: Any, batch: Batch) -> dict[str, float]:
    """Per fitted field, a lower bound of G_xx's diagonal on its cells: its own prior terms,
    mean squares (``field_background``, and ``Regularization.fields``) whose Hessian is 2w/n
    on each of its n values; the data and the roughness terms only add positive
    semi-definite parts, whose diagonal is ≥ 0."""
    reg = problem.regularization
    return {name: 2.0 * (reg.field_background * (name in batch.background) + reg.fields)
            / field.size for name, field in theta["fields"].items()}


def batched(function: Any, stacked: Any, batch_size: int | None, batch: Batch) -> Any:
    """``function`` over the leading axis of ``stacked``, ``batch_size`` at a time under
    ``vmap`` (1: one after another; None: as many as :data:`BATCH_BYTES` of ``batch``'s
    observed frames allow). A batch shares the model's primal sweep between its members'
    tangents and adjoints, and a GPU runs them side by side."""
    count = jax.tree.leaves(stacked)[0].shape[0]
    size = batch_size_for(batch, batch_size, count)
    return jax.jit(lambda xs: jax.lax.map(function, xs, batch_size=size))(stacked)


def batch_size_for(batch: Batch, batch_size: int | None, count: int) -> int:
    """How many of ``count`` products :func:`batched` runs together (``batch_size``, or as
    many as :data:`BATCH_BYTES` of ``batch``'s observed frames allow)."""
    if batch_size is None:
        frames = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch.observed.values))
        batch_size = BATCH_BYTES // max(frames, 1)
    return max(1, min(int(batch_size), count))


def field_block(problem: FitProblem, theta: Any, batch: Batch, key: jax.Array | None = None,
                spacing: int = PROBE_SPACING, floored: bool = True) -> tuple[Any, Any]:
    """(v ↦ G_xx v, the Gauss–Newton matrix's block over the fitted fields applied to
    fields v; its diagonal cell by cell, which preconditions the solves: :func:`cell_diagonal`
    on the ``spacing`` lattice with ``key``'s signs, floored at :func:`field_floors` unless
    not ``floored``, its probes as many at a time as :data:`BATCH_BYTES` allow, whatever the
    solves' batch size, so that their results do not depend on it), at ``theta``."""
    zero = jax.tree.map(jnp.zeros_like, theta)

    def fields_only(fields):
        return krylov.gauss_newton_product(problem, theta, batch, {**zero, "fields": fields})[
            "fields"]

    key = jax.random.key(0) if key is None else key
    size = batch_size_for(batch, None, probe_count(theta["fields"], spacing))
    floors = field_floors(problem, theta, batch) if floored else None
    return fields_only, cell_diagonal(fields_only, theta["fields"], key, size, spacing, floors)


def probe_count(fields: dict[str, Any], spacing: int = PROBE_SPACING) -> int:
    """The products :func:`cell_diagonal` takes for ``fields``."""
    return len(fields) * spacing**2


def cell_diagonal(product: Any, fields: dict[str, Any], key: jax.Array, batch_size: int = 1,
                  spacing: int = PROBE_SPACING, floors: dict[str, float] | None = None,
                  ) -> dict[str, jax.Array]:
    """The diagonal of the symmetric operator ``product`` (fields ↦ fields) at every cell, by
    probing (Tang & Saad's colouring, with random signs): for each field and each of the
    ``spacing``² offsets of a lattice of every ``spacing``-th cell along the grid's two axes,
    one product with a probe z that is ±1 on that field's lattice cells and 0 elsewhere; a
    cell's entry is z ⊙ (product z) there. Exact where a cell's column reaches no other cell
    of its lattice; the rest is crosstalk of random sign, and an entry is floored at
    :data:`PROBE_FLOOR` of its field's mean and at its field's entry of ``floors`` (a lower
    bound every true entry keeps, :func:`field_floors`). ``batch_size`` probes run together
    under ``vmap``; the sum is kept, not the probes' products."""
    names = sorted(fields)
    per_field = spacing**2
    count = len(names) * per_field
    signs = {f: jax.random.rademacher(jax.random.fold_in(key, i), fields[f].shape,
                                      fields[f].dtype) for i, f in enumerate(names)}
    rows, cols = (jnp.arange(n) % spacing for n in fields[names[0]].shape[-2:])

    def probe(index):  # index ≥ count: the padding of the last batch, a zero probe
        offset = index % per_field
        on = (rows[:, None] == offset // spacing) & (cols[None, :] == offset % spacing)
        return {f: jnp.where(on & (index // per_field == i), signs[f], 0.0).astype(
            fields[f].dtype) for i, f in enumerate(names)}

    def one(index):
        z = probe(index)
        response = product(z)
        return {f: z[f] * response[f] for f in names}

    size = max(1, min(batch_size, count))
    chunks = jnp.arange(-(-count // size) * size).reshape(-1, size)

    def accumulate(total, indices):
        parts = jax.vmap(one)(indices)
        return jax.tree.map(lambda t, p: t + jnp.sum(p, axis=0), total, parts), None

    total, _ = jax.lax.scan(accumulate, {f: jnp.zeros_like(fields[f]) for f in names}, chunks)
    floors = floors or {}
    return {f: jnp.maximum(d, jnp.maximum(PROBE_FLOOR * jnp.mean(jnp.abs(d)), jnp.maximum(
        floors.get(f, 0.0), jnp.finfo(d.dtype).tiny)).astype(d.dtype))
        for f, d in total.items()}


def field_solution(fields_only: Any, rhs: Any, scale: Any, iterations: int) -> lx.Solution:
    """G_xx⁻¹ rhs by conjugate gradients preconditioned by ``scale`` (G_xx's diagonal,
    :func:`field_block`): lineax's solution (``.value``; ``stats["num_steps"]``: the iterations)."""
    return krylov.conjugate_gradients(fields_only,
                                      lambda v: jax.tree.map(jnp.divide, v, scale), rhs,
                                      iterations, RTOL)


def upper_covariance(bread: np.ndarray, meat: np.ndarray) -> np.ndarray:
    """B⁻¹ M B⁻¹ for a lower bound B of the curvature (:attr:`CurvatureParts.lower`), inf on
    the diagonal where B is not positive definite in a direction the position takes part in
    (:func:`bounded_inverse`, below :data:`SINGULAR` of B's largest eigenvalue)."""
    top = max(float(np.max(np.abs(np.linalg.eigvalsh(symmetric(bread))), initial=0.0)),
              np.finfo(np.float64).tiny)
    inverse, unbounded = bounded_inverse(bread, SINGULAR * top)
    cov = inverse @ meat @ inverse
    cov[np.diag_indices_from(cov)] = np.where(unbounded, np.inf, np.diag(cov))
    return cov


def bounded_inverse(lower: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(the inverse of ``lower`` on its eigenvalues above ``threshold``, per position whether
    it takes part, by a squared share of at least :data:`UNBOUNDED_SHARE`, in a direction at
    or below it: there the lower bound of the curvature bounds no std error)."""
    values, vectors = np.linalg.eigh(symmetric(lower))
    positive = values > threshold
    kept = vectors[:, positive]
    unbounded = np.any(vectors[:, ~positive] ** 2 >= UNBOUNDED_SHARE, axis=1)
    return kept @ np.diag(1.0 / values[positive]) @ kept.T, unbounded
