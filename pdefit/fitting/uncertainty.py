"""Standard errors and 95 % intervals of fitted shared scalar parameters at the optimum.

The data loss of a fit (:mod:`pdefit.fitting.observe`, :mod:`pdefit.fitting.problem`) is a weighted
sum of squared residuals r_i = model_i(θ) − y_i over every observed value i (all fields, frames,
points and experiments), plus the penalty R(θ):

    L(θ) = Σ_i a_i r_i² + R(θ),   a_i = w_f · s_{e,f} / E,

with w_f the field weight (``observe.field_weights``), s_{e,f} = 1 / (number of observed values
of field f in experiment e) for ``mse`` or 1 / Σ y² of them for ``relative_mse``, and E the
number of experiments. Assume y_i = model_i(θ*) + ε_i with independent ε_i ~ N(0, σ_f²) (one σ
per observed field, the same for all where none is known; no model error, a known initial
state or one read from the first frame, see below). With levels per field (``observe.noise_sigma``
or the dataset's record; the loss then weighs field f by 1/σ_f² relative to their mean,
:func:`pdefit.fitting.observe.noise_weights`), σ_f² = σ² v_f with the reference level
σ² = 1 / mean_f(1/σ_f²) and v_f the relative variances; the middle factor below is then
Jᵀ A V A J and the residual sum of squares is whitened, RSS = Σ_i r_i² / v_f (the plain sum
where every field has one σ), so that RSS / (dof σ²) is the reduced χ². Linearising the optimality
condition ∇L(θ̂) = 0 at the optimum gives the sandwich covariance in the unconstrained
coordinates θ (J = ∂r/∂θ, A = diag(a_i)):

    Cov(θ̂) = σ² B⁻¹ (Jᵀ A² J) B⁻¹,   B = Jᵀ A J + ½ ∇²R.

Every matrix here is a Gauss–Newton matrix of a reweighted loss, computed by
:func:`pdefit.fitting.gauss_newton.gauss_newton` (forward tangents, no stored trajectory): the loss
Σ_i a_i^q r_i² has Gauss–Newton matrix 2 Jᵀ A^q J. With uniform weights (a_i = a, the usual
case: ``mse`` and fields observed alike) all three are multiples of JᵀJ and one sweep with
q = 0 suffices; then, without a penalty, Cov = σ² (JᵀJ)⁻¹ with JᵀJ = (N/2)·H_GN of the MSE
over N values. σ² is the dataset's additive noise level when it records one, else estimated
from the residual: σ̂² = RSS / (N − p), with p the number of fitted parameters, and the
interval then uses Student's t with N − p degrees of freedom.

A known initial field read from the first frame of noisy data copies that frame's noise: those
values have zero residual and sample no noise, so they are not counted in N, and the noise
(variance σ² on every initial value) moves the whole trajectory. Linearised, it adds
(JᵀA J_x)(JᵀA J_x)ᵀ to the middle factor, J_x the residuals' response to the initial state;
its k × k value comes from the same sweep with the initial state's unit vectors (states of at
most 512 values: exact) or 32 seeded random directions (larger ones: an estimate of that term
with about 25 % error) as extra tangents.

Intervals are formed in θ-space (θ̂ ± q·σ_θ) and mapped through the transforms, so they stay
inside the parameters' bounds (for a ``log`` parameter they are [p·e^{−qσ_θ}, p·e^{qσ_θ}]); the
standard error in physical units is the delta method's |dp/dθ|·σ_θ (p·σ_θ for ``log``).

Directions the data do not determine are found from the eigen-decomposition of B scaled to
unit diagonal: an eigenvalue below ``rcond`` × the largest marks a near-singular direction, and
the parameters with a large share in it (squared component ≥ 0.1) get no interval and are
flagged; below −10⁻³ × the largest it is a curvature computed wrong (a Gauss–Newton matrix is
positive semi-definite), and its parameters are flagged as unknown, with a note. A relative
standard error above 100 % is flagged as poorly determined. The intervals are centred on the
optimum; where the Gauss–Newton step from the fitted θ, −(2B)⁺∇L, still moves a parameter by
more than half its standard error, the fit has not converged that far (flagged, ``to_optimum``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from scipy import stats

from pdefit.fitting import marginal
from pdefit.fitting.directions import (
    NOT_DETERMINED,
    SHARE,
    default_rcond,
    pseudo_inverse,
    unresolved_flags,
)
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.krylov import predictions
from pdefit.fitting.problem import Batch, FitProblem, Regularization

LEVEL = 0.95
OPEN_NOTE = ("the std errors of {} are lower bounds: the fields' block solves stopped at their "
             "cap, and std_error_bounds says how far above them the true ones may lie")
POORLY_DETERMINED = "poorly determined (std error > 100 %)"
# A fit whose Gauss–Newton step to the optimum exceeds this many std errors has not converged
# as far as its intervals assume (they are centred on the optimum).
STEP_LIMIT = 0.5
# A residual this many float32 rounding steps of the data's RMS or less is rounding, not noise
# (datasets store float32): the fit reproduces its data to their precision, the intervals only
# measure that rounding, and "how far from the optimum" is not meaningful.
ROUNDOFF_STEPS = 100
ROUNDOFF_NOTE = ("the residual is at the data's rounding level (noise-free data fitted to "
                 "their float32 precision): the intervals reflect rounding only")
NOT_CONVERGED = "optimum not reached"
# The response of the residuals to a noisy initial state: exact (one tangent per value) up to
# this many values, else estimated from this many random directions (about 25 % error).
EXACT_LIMIT = 512
SAMPLES = 32


def unavailable_reason(problem: FitProblem, batch: Batch | None = None) -> str | None:
    """Why no intervals can be computed for ``problem`` (None: they can). With fitted initial
    fields they can, on ``batch``'s data, as a Schur complement (:mod:`pdefit.fitting.marginal`);
    without ``batch`` (the discretization check's parameter shift) they cannot."""
    if problem.shooting is not None:
        return ("multiple shooting: intervals come from the fit of one trajectory that "
                "follows it")
    if problem.fitted_fields and batch is not None:
        return marginal.fields_reason(problem, misfit_weights(problem, batch))
    if problem.fitted_fields:
        return (f"fitted initial fields {list(problem.fitted_fields)}: intervals cover fits of "
                "shared scalar parameters only")
    others = [n for n in problem.layout.fitted if n not in problem.layout.scalars]
    if others:
        return (f"array or per-experiment parameter(s) {others}: intervals cover fits of "
                "shared scalar parameters only")
    if not problem.layout.fitted:
        return "no fitted parameter"
    if problem.domain is not None:
        return "the Gauss–Newton curvature runs on one device (mesh=single)"
    return None


def misfit_weights(problem: FitProblem, batch: Batch) -> dict[str, np.ndarray]:
    """a_{e,f} per observed field: the weight of a squared residual of field f in experiment e
    in the data loss, shape (n_exp,)."""
    field_weights = dict(problem.observation.field_weights)
    scale = batch.observed.scale
    n_exp = next(iter(scale.values())).shape[0]
    return {f: field_weights.get(f, 1.0) * np.asarray(s, np.float64) / n_exp
            for f, s in scale.items()}


def copied_values(problem: FitProblem, theta: Any, batch: Batch,
                  skip: Sequence[str] = ()) -> int:
    """How many observed values of the frame at step 0 the initial state reproduces exactly
    (in the observed fields but ``skip``): a known initial field read from that frame copies
    its noise, so its residual is zero and no sample of the noise; they are left out of N."""
    slot = int(batch.observed.slot_of_step[0])
    if slot < 0:
        return 0
    projected = jax.vmap(problem.observation.project)(problem.initial_state(theta, batch))
    return int(sum(jnp.sum((batch.observed.weights[f][:, slot] > 0)
                           & (projected[f] == batch.observed.values[f][:, slot]))
                   for f in projected if f not in skip))


def fitted_initial_values(problem: FitProblem, batch: Batch) -> int:
    """How many observed values of the frame at step 0 belong to fitted initial fields: each
    is fitted to its own noisy datum, so N leaves them out (the fields' other freedom is
    :mod:`pdefit.fitting.signal`'s, subtracted from the degrees of freedom)."""
    observed = batch.observed
    slot = int(observed.slot_of_step[0])
    if slot < 0:
        return 0
    return int(sum(float(jnp.sum(observed.weights[f][:, slot] > 0))
                   for f in problem.fitted_fields if f in observed.weights))


def relative_variances(problem: FitProblem) -> dict[str, float]:
    """v_f = σ_f² / σ² per observed field from the levels the loss is weighted by
    (σ² = 1 / mean_f(1/σ_f²)); 1 for every field where none are known."""
    sigma = dict(problem.observation.noise_sigma)
    fields = problem.observation.fields
    if not sigma or any(sigma.get(f, 0.0) <= 0 for f in fields):
        return dict.fromkeys(fields, 1.0)
    reference = reference_variance(sigma)
    return {f: sigma[f] ** 2 / reference for f in fields}


def reference_variance(sigma: Mapping[str, float]) -> float:
    """σ² = 1 / mean_f(1/σ_f²) of levels per field (σ_f² where they are all equal)."""
    levels = [float(s) for s in sigma.values()]
    if len(set(levels)) == 1:
        return levels[0] ** 2
    if min(levels) <= 0:
        return 0.0  # noise-free values among them: no common reference level
    return len(levels) / sum(1.0 / s**2 for s in levels)


def _reweighted(problem: FitProblem, batch: Batch, factors: Mapping[str, Any],
                ) -> tuple[FitProblem, Batch]:
    """The problem (no field weights, no penalty) and batch whose data loss is
    Σ_i factor_{e,f} r_i² (``factors``: per field, a number or one per experiment):
    gauss_newton averages over experiments, hence the factor E."""
    weights = misfit_weights(problem, batch)
    n_exp = next(iter(weights.values())).shape[0]
    dtype = next(iter(batch.observed.scale.values())).dtype
    scale = {f: jnp.asarray(np.broadcast_to(factors[f], w.shape) * n_exp, dtype)
             for f, w in weights.items()}
    plain = dataclasses.replace(
        problem, regularization=Regularization(),
        observation=dataclasses.replace(problem.observation, field_weights=()))
    return plain, batch._replace(observed=batch.observed._replace(scale=scale))


def _gauss_newton_matrix(problem: FitProblem, theta: Any, batch: Batch,
                         factors: Mapping[str, Any], directions: Any = None,
                         ) -> tuple[float, np.ndarray, np.ndarray]:
    """(Σ c r², its gradient 2 Jᵀ C r, half its Gauss–Newton matrix) at ``theta`` for the
    factors c per field (C = diag(c)): Jᵀ C J, bordered by Jᵀ C J_x d for initial-state
    ``directions`` d; one forward-tangent sweep."""
    plain, reweighted = _reweighted(problem, batch, factors)
    value, gradient, matrix = jax.jit(gauss_newton(plain))(theta, reweighted, directions)
    return (float(value), np.asarray(ravel_pytree(gradient["params"])[0], np.float64),
            0.5 * np.asarray(matrix, np.float64))


def initial_directions(x0: Any, limit: int = EXACT_LIMIT, samples: int = SAMPLES,
                       seed: int = 0) -> tuple[Any, float, str]:
    """Directions d of the initial state (each leaf with a leading axis) and the weight w with
    E[Σ_d w·(Xd)(Xd)ᵀ] = XXᵀ for any linear X: every unit vector (w = 1) for a state of at most
    ``limit`` values, else ``samples`` seeded standard-normal vectors (w = 1/samples)."""
    leaves, treedef = jax.tree.flatten(x0)
    size = sum(leaf.size for leaf in leaves)
    if size <= limit:
        basis, weight, kind = np.eye(size), 1.0, "exact"
    else:
        basis = np.random.default_rng(seed).standard_normal((samples, size))
        weight, kind = 1.0 / samples, f"estimated from {samples} random directions"
    offsets = np.cumsum([leaf.size for leaf in leaves])[:-1]
    parts = [jnp.asarray(block.reshape(-1, *leaf.shape), leaf.dtype) for block, leaf in
             zip(np.split(basis, offsets, axis=1), leaves, strict=True)]
    return jax.tree.unflatten(treedef, parts), weight, kind


class CurvatureParts(NamedTuple):
    """What the covariance is made of, at one θ (vectors and matrices flattened in
    ``ravel_pytree`` order of ``theta["params"]``): Cov = σ² B⁻¹ M B⁻¹."""

    rss: float  # Σ r² / v_f (Σ r², unweighted, where every field has one σ)
    n_values: int  # observed values that sample the noise (see copied_values)
    bread: np.ndarray  # B
    meat: np.ndarray  # M
    gradient: np.ndarray  # of the fit's loss, penalty included
    initial_noise: str | None  # how the noise of a copied initial state is included
    unresolved: tuple[int, ...] = ()  # positions whose curvature was not resolved (marginal)
    # (B⁻, M⁻) whose covariance bounds the true one from above, where B is itself a bound from
    # truncated solves whose covariance is one from below (marginal: S⁺ and S⁻); else None.
    lower: tuple[np.ndarray, np.ndarray] | None = None


def curvature_parts(problem: FitProblem, theta: Any, batch: Batch,
                    iterations: int = marginal.ITERATIONS) -> CurvatureParts:
    """:class:`CurvatureParts` at ``theta``. M = JᵀAVAJ (V: the relative variances of the
    fields, :func:`relative_variances`), plus (JᵀAJ_x)(JᵀAJ_x)ᵀ where the initial state is a
    noisy copy of the first frame (J_x: the residuals' response to it, from
    :func:`initial_directions`). One sweep when the weights are proportional to 1/v_f (uniform
    ones where every field has one σ), three otherwise. With fitted initial fields: the
    marginal curvature of :mod:`pdefit.fitting.marginal`, its field solves of at most
    ``iterations`` conjugate-gradient iterations each."""
    if problem.fitted_fields:
        return _marginal_curvature_parts(problem, theta, batch, iterations)
    weights = misfit_weights(problem, batch)
    copied = copied_values(problem, theta, batch)
    n_values = int(sum(float(jnp.sum(w)) for w in batch.observed.weights.values())) - copied
    directions, weight, kind = (initial_directions(problem.initial_state(theta, batch))
                                if copied else (None, 0.0, None))
    flat, unravel = ravel_pytree(theta["params"])
    k = flat.shape[0]
    variances = relative_variances(problem)
    whitening = {f: 1.0 / variances[f] for f in weights}
    rss, plain_gradient, plain = _gauss_newton_matrix(problem, theta, batch, whitening,
                                                      directions)
    levels = np.concatenate([np.ravel(w * variances[f]) for f, w in weights.items()])
    if np.allclose(levels, levels[0], rtol=1e-12, atol=0.0):
        a = float(levels[0])  # A = a V⁻¹: the data term and AVA are multiples of JᵀV⁻¹J
        gradient, data, squared = a * plain_gradient, a * plain, a * a * plain[:k, :k]
    else:
        _, gradient, data = _gauss_newton_matrix(problem, theta, batch, weights, directions)
        squared = _gauss_newton_matrix(problem, theta, batch, {
            f: w**2 * variances[f] for f, w in weights.items()})[2]
    cross = data[:k, k:]

    def penalty(f):
        return problem.penalty({**theta, "params": unravel(f)})

    bread = data[:k, :k] + 0.5 * np.asarray(jax.hessian(penalty)(flat), np.float64)
    gradient = gradient + np.asarray(jax.grad(penalty)(flat), np.float64)
    return CurvatureParts(rss, n_values, bread, squared + weight * cross @ cross.T, gradient,
                          kind)


def _marginal_curvature_parts(problem: FitProblem, theta: Any, batch: Batch,
                              iterations: int = marginal.ITERATIONS) -> CurvatureParts:
    """:class:`CurvatureParts` with fitted initial fields: bread S (the Schur complement),
    meat a·S (the Laplace covariance a σ² S⁻¹), the reduced gradient; N less the fitted
    initial values that are observed (each fitted to its own noisy datum)."""
    a = float(np.ravel(next(iter(misfit_weights(problem, batch).values())))[0])
    schur, schur_lower, gradient, unresolved = marginal.marginal_parts(problem, theta, batch,
                                                                       iterations)
    observed = batch.observed
    n_values = (int(sum(float(jnp.sum(w)) for w in observed.weights.values()))
                - fitted_initial_values(problem, batch))
    # By field name: the predictions come back in sorted order, the data in the observed one.
    predicted = jax.jit(lambda t, b: predictions(problem, t, b))(theta, batch)
    rss = float(sum(jnp.sum(observed.weights[f] * (predicted[f] - observed.values[f]) ** 2)
                    for f in observed.values))
    return CurvatureParts(rss, n_values, schur, a * schur, gradient,
                          "fitted with the parameters (a Schur complement)", unresolved,
                          None if schur_lower is None else (schur_lower, a * schur_lower))


def residual_statistics(problem: FitProblem, theta: Any, batch: Batch,
                        sigma: float | Mapping[str, float] | None, source: str,
                        fields_dof: float = 0.0) -> dict[str, Any] | None:
    """What the residual verdict reads of a fit without intervals because it fits initial
    fields only (no parameter): RSS (whitened by the fields' relative levels), N (less the
    observed initial values fitted, or copied from the first frame into a known initial
    state), dof = N − ``fields_dof`` (the fitted fields' freedom beyond their observed initial
    values, :mod:`pdefit.fitting.signal`) and σ (known, or estimated from the residual); None
    for fits it does not cover (several devices, multiple shooting, or a fitted parameter)."""
    if (problem.layout.fitted or not problem.fitted_fields or problem.domain is not None
            or problem.shooting is not None):
        return None
    observed = batch.observed
    variances = relative_variances(problem)
    predicted = jax.jit(lambda t, b: predictions(problem, t, b))(theta, batch)
    rss = float(sum(jnp.sum(observed.weights[f] * (predicted[f] - observed.values[f]) ** 2)
                    / variances[f] for f in predicted))
    n_values = (int(sum(float(jnp.sum(w)) for w in observed.weights.values()))
                - fitted_initial_values(problem, batch))
    # Known initial fields copied from the noisy first frame fit it exactly, too.
    copied = copied_values(problem, theta, batch, skip=problem.fitted_fields)
    n_values -= copied
    dof = n_values - fields_dof
    if sigma is None:
        sigma2, source = rss / max(dof, 1.0), "residual"
    else:
        sigma2 = (reference_variance(sigma) if isinstance(sigma, Mapping)
                  else float(sigma) ** 2)
    roundoff = source == "residual" and at_roundoff(math.sqrt(sigma2), batch)
    return {"rss": rss, "n_values": n_values, "dof": dof, "sigma": math.sqrt(sigma2),
            "sigma_source": source, "sigma_per_field": _levels(problem, sigma, sigma2),
            "residual_at_roundoff": roundoff, "copied_initial_values": copied,
            "degrees_of_freedom_note": _dof_note(fields_dof)}


def _dof_note(fields_dof: float) -> str:
    what = "N less the observed initial values fitted or copied from the first frame"
    if fields_dof:
        return (f"{what}, less {fields_dof:.4g}: the fitted fields' other degrees of freedom "
                "for signal (pdefit.fitting.signal)")
    return f"{what}; the fitted fields' other freedom is not subtracted"


def parameter_intervals(problem: FitProblem, theta: Any, cov: np.ndarray, quantile: float,
                        undetermined: Mapping[str, str], step: np.ndarray | None = None,
                        cov_upper: np.ndarray | None = None) -> dict[str, dict[str, Any]]:
    """Per fitted scalar, in physical units: value, std error (delta method), the interval
    mapped from θ-space (spanning the value and the optimum the Gauss–Newton ``step`` points
    to: :func:`mapped`), the relative std error, that step in std errors, the optimum, and a
    flag (``undetermined``: name → the flag of a parameter without an interval). Where
    ``cov`` is a lower bound of the covariance and ``cov_upper`` an upper one (fitted
    initial fields, truncated solves), every scalar, with an interval or not, also gets
    ``std_error_bounds`` [from ``cov``, from ``cov_upper`` (None: unbounded)], except one
    not determined by the data (no finite std error bounds it from below)."""
    flat, unravel = ravel_pytree(theta["params"])
    index = unravel(jnp.arange(flat.shape[0]))
    out = {}
    for name in problem.layout.scalars:
        spec = problem.layout.specs[name]
        with jax.enable_x64(True):  # a float32 fit's interval may be narrower than its eps
            value, slope, ends = mapped(spec, float(theta["params"][name]))
        row: dict[str, Any] = {"value": value, "std_error": None, "ci95_low": None,
                               "ci95_high": None, "rel_std_error": None, "to_optimum": None,
                               "optimum": None, "flag": ""}
        position = int(index[name])
        if cov_upper is not None and undetermined.get(name) != NOT_DETERMINED:
            high = float(cov_upper[position, position])
            row["std_error_bounds"] = [
                abs(slope) * math.sqrt(max(float(cov[position, position]), 0.0)),
                abs(slope) * math.sqrt(max(high, 0.0)) if math.isfinite(high) else None]
        if name in undetermined:
            row["flag"] = undetermined[name]
            out[name] = row
            continue
        sigma_z = math.sqrt(max(float(cov[position, position]), 0.0))
        # A step that is not finite (a curvature computed wrong) points nowhere: no span.
        shift = None if step is None or not np.isfinite(step[position]) else float(step[position])
        z = float(theta["params"][name])
        with jax.enable_x64(True):
            ends = mapped(spec, z, quantile * sigma_z, shift or 0.0)[2]
            optimum = None if shift is None else mapped(spec, z + shift)[0]
        std = abs(slope) * sigma_z
        rel = std / abs(value) if value else None
        remaining = None if shift is None or sigma_z == 0 else abs(shift) / sigma_z
        flag = POORLY_DETERMINED if rel is not None and rel > 1.0 else ""
        if not flag and remaining is not None and remaining > STEP_LIMIT:
            flag = f"{NOT_CONVERGED} ({remaining:.2g} std errors)"
        row.update(std_error=std, ci95_low=ends[0], ci95_high=ends[1], rel_std_error=rel,
                   to_optimum=remaining, optimum=optimum, flag=flag)
        out[name] = row
    return out


def mapped(spec: Any, z: float, half_width: float = 0.0, shift: float = 0.0,
           ) -> tuple[float, float, list[float]]:
    """(p(z), p'(z), sorted [p(lo), p(hi)]) through ``spec``'s (monotone) transform, in
    float64 (call under ``jax.enable_x64``); [lo, hi] reaches h beyond z and z + ``shift``
    (an interval belongs to the optimum: docs/design-decisions.md, "Parameter uncertainty")."""
    z64 = jnp.asarray(z, jnp.float64)
    value, slope = jax.jvp(spec.to_physical, (z64,), (jnp.ones_like(z64),))
    reach = (min(0.0, shift) - half_width, max(0.0, shift) + half_width)
    ends = sorted(float(spec.to_physical(z64 + r)) for r in reach)
    return float(value), float(slope), ends


def data_rms(batch: Batch) -> float:
    """Root mean square of the observed values (every observed field, missing points out)."""
    observed = batch.observed
    total = sum(float(jnp.sum(observed.weights[f] * v**2)) for f, v in observed.values.items())
    count = sum(float(jnp.sum(w)) for w in batch.observed.weights.values())
    return math.sqrt(total / count) if count else 0.0


def at_roundoff(sigma: float, batch: Batch) -> bool:
    """Whether a residual-estimated noise level ``sigma`` is only the data's float32 rounding."""
    return sigma <= ROUNDOFF_STEPS * float(np.finfo(np.float32).eps) * data_rms(batch)


def known_sigma(noise: Mapping[str, Any] | None,
                fields: Sequence[str] | None = None) -> float | dict[str, float] | None:
    """The noise level a dataset records, where it is the additive noise the covariance
    assumes (relative noise is not: its variance changes from value to value): one number,
    or per field (of ``fields``, all of which it must name) where it records one per field."""
    if not noise or noise.get("kind") != "additive":
        return None
    sigma = noise["sigma"]
    if not isinstance(sigma, Mapping):
        return float(sigma)
    if fields is None or any(f not in sigma for f in fields):
        return None
    return {f: float(sigma[f]) for f in fields}


def estimate(problem: FitProblem, theta: Any, batch: Batch,
             sigma: float | Mapping[str, float] | None = None, rcond: float | None = None,
             parts: CurvatureParts | None = None, source: str = "dataset",
             fields_dof: float = 0.0) -> dict[str, Any]:
    """The ``uncertainty`` block of summary.json at the optimum ``theta``: noise level and its
    source, degrees of freedom, condition number, near-singular directions and per fitted
    scalar its std error and 95 % interval (physical units). ``sigma``: the known noise level
    (None: estimated from the residual; per field: their reference level
    :func:`reference_variance`, the relative levels being the loss's); ``source`` says where a
    known level comes from; ``parts``: :func:`curvature_parts` at ``theta`` where already
    computed; ``fields_dof``: the fitted fields' freedom beyond their observed initial values,
    subtracted from the degrees of freedom (:mod:`pdefit.fitting.signal`)."""
    reason = unavailable_reason(problem, batch)
    if reason is not None:
        return {"available": False, "reason": reason}
    flat, unravel = ravel_pytree(theta["params"])
    rcond = default_rcond(flat.dtype) if rcond is None else rcond
    parts = curvature_parts(problem, theta, batch) if parts is None else parts
    p, n_values = int(flat.shape[0]), parts.n_values
    dof = n_values - p - fields_dof
    if sigma is None:
        if dof <= 0:
            return {"available": False, "reason": f"{n_values} observed values for {p} "
                    f"parameters and {fields_dof:.4g} more degrees of freedom of fitted fields"}
        sigma2, source = parts.rss / dof, "residual"
        quantile = float(stats.t.ppf(0.5 + LEVEL / 2, dof))
    else:
        sigma2 = (reference_variance(sigma) if isinstance(sigma, Mapping)
                  else float(sigma)**2)
        quantile = float(stats.norm.ppf(0.5 + LEVEL / 2))
    inverse, directions, condition, ratios = pseudo_inverse(parts.bread, rcond)
    cov = sigma2 * inverse @ parts.meat @ inverse
    # The Gauss–Newton step to the optimum: an unconverged fit is that far from the centre.
    step = -0.5 * inverse @ parts.gradient
    roundoff = source == "residual" and at_roundoff(math.sqrt(sigma2), batch)
    names = {int(i): name for name, i in unravel(jnp.arange(p)).items()}  # position → name
    named = [{"relative_eigenvalue": float(r),
              "parameters": {names[j]: float(v[j]) for j in np.flatnonzero(v**2 >= SHARE)}}
             for v, r in zip(directions, ratios, strict=True)]
    flags, note = unresolved_flags(named, [names[i] for i in parts.unresolved])
    intervals = parameter_intervals(problem, theta, cov, quantile, flags,
                                    None if roundoff else step,
                                    None if parts.lower is None else
                                    sigma2 * marginal.upper_covariance(*parts.lower))
    open_brackets, note = _open_brackets(intervals, ROUNDOFF_NOTE if roundoff else note)
    return {
        "available": True, "level": LEVEL, "sigma": math.sqrt(sigma2), "sigma_source": source,
        "sigma_per_field": _levels(problem, sigma, sigma2),
        "residual_at_roundoff": roundoff, "note": note,
        "n_values": n_values, "n_parameters": p, "dof": dof, "rss": parts.rss,
        "quantile": quantile, "condition_number": condition if math.isfinite(condition)
        else None, "rcond": rcond, "near_singular_directions": named,
        "flagged": [n for n, r in intervals.items() if r["flag"]],
        "open_brackets": open_brackets,
        "parameters": intervals,
        "covers": "fitted shared scalar parameters only (fitted initial fields are "
                  "marginalised over; array and per-experiment parameters are not covered)",
        "copied_initial_values": copied_values(problem, theta, batch),
        "initial_state_noise": parts.initial_noise,
    }


def _open_brackets(intervals: Mapping[str, Mapping[str, Any]], note: str | None,
                   ) -> tuple[list[str], str | None]:
    """(the parameters with a std error whose bracket is wider than :data:`marginal.SPREAD`,
    the estimate's note saying so)."""
    def closed(low, high):
        return high is not None and high <= (1.0 + marginal.SPREAD) * low

    names = [n for n, r in intervals.items() if r["std_error"] is not None
             and r.get("std_error_bounds") is not None and not closed(*r["std_error_bounds"])]
    if names:
        note = "; ".join(filter(None, [note, OPEN_NOTE.format(names)]))
    return names, note


def _levels(problem: FitProblem, sigma: Any, sigma2: float) -> dict[str, float] | None:
    """σ_f per observed field where the fields' levels differ (None where one σ holds for
    all): the known levels, or the reference level scaled by the loss's relative levels."""
    variances = relative_variances(problem)
    if isinstance(sigma, Mapping) and len(set(sigma.values())) > 1:
        return {f: float(v) for f, v in sigma.items()}
    if isinstance(sigma, Mapping) or all(v == 1.0 for v in variances.values()):
        return None
    return {f: math.sqrt(sigma2 * v) for f, v in variances.items()}
