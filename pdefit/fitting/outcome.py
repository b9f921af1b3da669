"""What a finished fit says about its own result, for the command line's ``summary.json``
(:mod:`pdefit.app.fit_report`) and the Python API's ``FitResult`` (:func:`pdefit.fit`) alike:
the fitted scalars' 95 % intervals with the curvature they come from
(:mod:`pdefit.fitting.uncertainty`), and the verdict on the residual — is what the model does
not explain the data's noise, their rounding, or more than that? — and ``FitResult``, all
of it together with the fitted values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdefit.fitting import background, marginal, signal
from pdefit.fitting.observe import NOISE_KEY
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.fitting.train import FitHistory
from pdefit.fitting.uncertainty import (
    CurvatureParts,
    curvature_parts,
    estimate,
    fitted_initial_values,
    known_sigma,
    misfit_weights,
    residual_statistics,
    unavailable_reason,
)

# Residual verdicts (``residual_verdict(...)["verdict"]``).
NOISE = "noise"  # the residual is the recorded noise level, as far as its spread allows
ABOVE_NOISE = "above_noise"  # more than the recorded noise: model error or not converged
BELOW_NOISE = "below_noise"  # less than the recorded noise: the recorded level overstates it
ROUNDOFF = "roundoff"  # noise-free data fitted to their storage precision
MODEL_ERROR = "model_error"  # partly discretization error (the discretization check says)
ESTIMATED = "estimated"  # no noise level recorded: σ is estimated from the residual
UNKNOWN = "unknown"  # no intervals, so no residual statistics
# Where a known noise level comes from: the dataset's record, or the fit's option.
KNOWN_SOURCES = ("dataset", NOISE_KEY)
# How many standard deviations of the reduced χ² (√(2/dof)) from 1 still count as noise.
CHI2_SPREAD = 3.0


def intervals(problem: FitProblem, theta: Any, batch: Batch,
              noise: Mapping[str, Any] | None = None,
              log: Callable[[str], None] = print,
              ) -> tuple[dict[str, Any], CurvatureParts | None]:
    """The ``uncertainty`` block of summary.json at ``theta`` (standard errors and 95 %
    intervals of the fitted shared scalars, :func:`pdefit.fitting.uncertainty.estimate`) with
    the noise level given as ``observe.noise_sigma`` (the problem's observation holds it),
    else the dataset's ``noise`` (its ``meta.noise``; None where the data come from another
    system), else estimated from the residual; and the curvature it comes from (None without
    intervals, with the reason). With fitted initial fields the block also says how much of
    each the data determine (``field_signal``, :mod:`pdefit.fitting.signal`), and the degrees
    of freedom of the residual subtract that; with a background prior on them, whether it is
    as wide as their first guess is wrong (``field_background``,
    :mod:`pdefit.fitting.background`)."""
    fields = _field_signal(problem, theta, batch, log)
    extra = 0.0 if fields is None else (fields["signal_dof"]
                                        - fitted_initial_values(problem, batch))
    signal_block = {} if fields is None else {"field_signal": fields}
    reason = unavailable_reason(problem, batch)
    if reason is not None:
        log(f"no parameter intervals: {reason}")
        block: dict[str, Any] = {"available": False, "reason": reason, **signal_block}
        # A fit of initial fields alone still has a residual to set against the noise.
        statistics = residual_statistics(problem, theta, batch, *noise_level(problem, noise),
                                         fields_dof=extra)
        if statistics is not None:
            block["residual"] = statistics
        return {**block, **_background(problem, theta, batch, statistics, fields, log)}, None
    log("parameter intervals: one forward-tangent sweep over the training window…")
    parts = curvature_parts(problem, theta, batch)
    sigma, source = noise_level(problem, noise)
    block = estimate(problem, theta, batch, sigma, parts=parts, source=source,
                     fields_dof=extra)
    return {**block, **signal_block,
            **_background(problem, theta, batch, block, fields, log)}, parts


def _background(problem: FitProblem, theta: Any, batch: Batch,
                statistics: Mapping[str, Any] | None, signal_block: Mapping[str, Any] | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    """``{"field_background": ...}`` (:func:`pdefit.fitting.background.background_check`,
    with the fields' determined fractions of ``signal_block``) where the fitted fields have a
    background prior and the residual statistics give one σ for one misfit weight per
    observed value; else empty."""
    # Noise-free data (σ at rounding) make any prior narrow against them: not judged.
    if (not statistics or not statistics.get("sigma") or statistics.get("residual_at_roundoff")
            or statistics.get("sigma_per_field") is not None
            or not background.available(problem, batch)):
        return {}
    weight = marginal.common_weight(misfit_weights(problem, batch))
    if weight is None:
        return {}
    determined = {f: row["determined_fraction"]
                  for f, row in (signal_block or {"fields": {}})["fields"].items()}
    check = background.background_check(problem, theta, batch, float(statistics["sigma"]),
                                        weight, determined)
    for line in background.format_check(check):
        log(line)
    return {"field_background": check}


def _field_signal(problem: FitProblem, theta: Any, batch: Batch,
                  log: Callable[[str], None]) -> dict[str, Any] | None:
    """How much of each fitted initial field the data determine (None: no fitted field, or
    a fit :mod:`pdefit.fitting.signal` does not cover)."""
    if not signal.available(problem):
        return None
    log(f"fitted initial fields: their degrees of freedom for signal from {signal.PROBES} "
        "probes…")
    result = signal.field_signal(problem, theta, batch)
    for line in signal.format_signal(result):
        log(line)
    return result


def noise_level(problem: FitProblem, noise: Mapping[str, Any] | None,
                ) -> tuple[float | dict[str, float] | None, str]:
    """(σ the intervals take as known, its source): ``observe.noise_sigma`` where the fit was
    given it, else the dataset's record ``noise``; (None, "residual") where neither."""
    observation = problem.observation
    if observation.noise_source == NOISE_KEY and observation.noise_sigma:
        return dict(observation.noise_sigma), NOISE_KEY
    sigma = known_sigma(noise, observation.fields)
    return sigma, ("residual" if sigma is None else "dataset")


def residual_verdict(uncertainty: Mapping[str, Any]) -> dict[str, Any]:
    """What the residual of a fit is, from its ``uncertainty`` block (after the
    discretization check marked it, :func:`pdefit.fitting.discretization.mark_intervals`):
    ``verdict`` (one of this module's constants), ``rms_residual``, ``noise_sigma`` (the
    known level, per field where the fields' levels differ, or None), ``noise_source``
    (``dataset``, ``observe.noise_sigma`` or ``residual``), ``reduced_chi2`` (RSS / (dof σ²)
    against a known level; the RSS whitened by the fields' levels) and a one-line
    ``message``."""
    if not uncertainty.get("available") and uncertainty.get("residual"):
        # No intervals, but the residual's statistics (a fit of initial fields alone).
        marks = {k: uncertainty[k] for k in ("model_error_dominated",) if k in uncertainty}
        uncertainty = {**uncertainty["residual"], **marks, "available": True}
    if not uncertainty.get("available"):
        reason = uncertainty.get("reason", "no intervals")
        return {"verdict": UNKNOWN, "rms_residual": None, "noise_sigma": None,
                "noise_source": None, "reduced_chi2": None,
                "message": f"no residual statistics: {reason}"}
    rss, n_values, dof = uncertainty["rss"], uncertainty["n_values"], uncertainty["dof"]
    rms = math.sqrt(rss / n_values) if n_values else 0.0
    recorded = uncertainty["sigma_source"] in KNOWN_SOURCES
    sigma = uncertainty["sigma"] if recorded else None
    chi2 = rss / (dof * sigma**2) if recorded and dof > 0 and sigma else None
    verdict, message = _verdict(uncertainty, rms, sigma, chi2, dof, n_values)
    per_field = uncertainty.get("sigma_per_field") if recorded else None
    return {"verdict": verdict, "rms_residual": rms,
            "noise_sigma": per_field or sigma, "noise_source": uncertainty["sigma_source"],
            "reduced_chi2": chi2, "message": message}


def _verdict(uncertainty: Mapping[str, Any], rms: float, sigma: float | None,
             chi2: float | None, dof: float, n_values: int) -> tuple[str, str]:
    """(verdict, message) of :func:`residual_verdict`."""
    # First: a residual at the data's rounding holds no discretization error, however much
    # the check's finer run moves the predictions against so small a residual.
    if uncertainty.get("residual_at_roundoff"):
        return ROUNDOFF, (f"RMS residual {rms:.3g} is at the data's rounding level: "
                          "noise-free data fitted to their precision")
    if uncertainty.get("model_error_dominated"):
        return MODEL_ERROR, (f"RMS residual {rms:.3g} is partly discretization error (see the "
                             "discretization check): the intervals take it for noise")
    if chi2 is None:
        return ESTIMATED, (f"RMS residual {rms:.3g}; the dataset records no noise level, so "
                           "the intervals take the residual for noise (give it with "
                           "observe.noise_sigma)")
    spread = CHI2_SPREAD * math.sqrt(2.0 / dof)
    # An initial state read from the noisy first frame carries that frame's noise into every
    # later one: up to about σ² more per value where the dynamics do not amplify it.
    copied = bool(uncertainty.get("copied_initial_values"))
    carried = " (with the first frame's noise carried by the initial state read from it)"
    level = _noise_level_phrase(sigma, dof, n_values)
    if chi2 > 1.0 + spread + (1.0 if copied else 0.0):
        return ABOVE_NOISE, (f"RMS residual {rms:.3g} exceeds {level} (reduced χ² "
                             f"{chi2:.3g}): model error, or the fit has not reached the optimum")
    if chi2 < 1.0 - spread:
        return BELOW_NOISE, (f"RMS residual {rms:.3g} is below {level} (reduced χ² "
                             f"{chi2:.3g}): the recorded level overstates the noise, or the "
                             "fit follows it")
    return NOISE, (f"RMS residual {rms:.3g} is {level} (reduced χ² {chi2:.3g})"
                   f"{carried if copied and chi2 > 1.0 + spread else ''}")


def _noise_level_phrase(sigma: float, dof: float, n_values: int) -> str:
    """What noise of level σ leaves as RMS residual: σ·√(dof/N) once the fit's fitted values
    have absorbed N − dof of its N degrees of freedom. Said in full where that differs from
    σ by a printed digit: "RMS 0.0193 exceeds the noise σ = 0.02" reads as a contradiction
    when the fitted field values leave 0.0126 (a 512² fit, reduced χ² 2.36)."""
    expected = sigma * math.sqrt(max(dof, 0.0) / n_values) if n_values else sigma
    if f"{expected:.3g}" == f"{sigma:.3g}":
        return f"the recorded noise σ = {sigma:.3g}"
    return (f"the {expected:.3g} that the recorded noise σ = {sigma:.3g} leaves over "
            f"{dof:.4g} degrees of freedom of its {n_values} values")


@dataclass(frozen=True)
class FitResult:
    """The outcome of :func:`fit`: ``params`` the fitted parameters in physical units (floats
    for scalars, arrays otherwise) at the best loss, ``fields`` the fitted initial fields,
    ``start`` and ``reference`` (true values, when the dataset has them) of the shared
    scalars, ``losses`` per step, ``best_loss``, ``steps`` taken, ``theta`` the optimiser's
    best point, the full :class:`~pdefit.fitting.train.FitHistory` and ``discretization``, the
    discretization check (:func:`pdefit.fitting.discretization.check`; None when skipped).

    As the command line's ``summary.json`` and ``status.json`` say them: ``stop_reason`` why
    the optimiser stopped (``converged``, ``stalled``, ``steps_done``, ...), ``uncertainty``
    the standard errors and 95 % intervals of the fitted shared scalars (the ``uncertainty``
    block, :func:`pdefit.fitting.uncertainty.estimate`; None when skipped; see
    :attr:`intervals`; with fitted initial fields also ``field_signal``, how many of each
    field's values the data determine, :mod:`pdefit.fitting.signal`, and ``field_background``,
    whether their background prior is as wide as their first guess is wrong,
    :mod:`pdefit.fitting.background`) and ``residual`` the
    verdict on the residual (noise, rounding, model error, ...:
    :func:`pdefit.fitting.outcome.residual_verdict`; None when skipped)."""

    params: dict[str, Any]
    fields: dict[str, np.ndarray]
    start: dict[str, float]
    reference: dict[str, float] | None
    losses: list[float]
    best_loss: float
    steps: int
    theta: Any
    history: FitHistory
    discretization: dict[str, Any] | None = None
    stop_reason: str = ""
    uncertainty: dict[str, Any] | None = None
    residual: dict[str, Any] | None = None

    def relative_errors(self) -> dict[str, float]:
        """|fitted − true| / |true| of each fitted scalar with a known nonzero truth."""
        ref = self.reference or {}
        return {k: abs(v - ref[k]) / abs(ref[k]) for k, v in self.params.items()
                if isinstance(v, float) and ref.get(k)}

    @property
    def intervals(self) -> dict[str, tuple[float, float]]:
        """The 95 % interval (low, high) of each fitted shared scalar that has one (those the
        data do not determine have none; their flag is in ``uncertainty``)."""
        rows = (self.uncertainty or {}).get("parameters") or {}
        return {name: (row["ci95_low"], row["ci95_high"]) for name, row in rows.items()
                if row.get("ci95_low") is not None}
