"""Is the fitted fields' background prior as wide as their first guess is wrong?

The background prior ``regularization.field_background`` = w weighs the mean square of a
fitted initial field's distance from its first guess (the background x_b). With a data loss
a Σ r² of one weight a per observed value and noise σ, it is a Gaussian prior of standard
deviation

    σ_b = σ √(a C / w)

per cell, C the field's number of values (for one field observed in every cell of n frames,
a = 1 / (n C) and σ_b = σ / √(n w): docs/design-decisions.md). The intervals and the fields'
degrees of freedom for signal take that prior as true. Where the first guess is wrong by much
more than σ_b, the prior pulls the directions of the field the data leave to it towards a
wrong value, and through them the parameters: a bias the intervals do not hold (measured on
``ap_from_voltage``: docs/benchmarks.md).

After the fit, the distance of the fitted field x̂ from its background measures that error:
for a linear model and a right prior, E[mean over the cells of (x̂ − x_b)²] = σ_b² f, f the
share of the field the data determine (its degrees of freedom for signal over its values,
:mod:`pdefit.fitting.signal`: each direction of eigenvalue λ of the averaging kernel moves
λ σ_b² of prior variance into x̂ − x_b). This is the analysis-minus-background check of data
assimilation (Desroziers et al., Q. J. R. Meteorol. Soc. 131, 2005). So per field the ratio
d / (σ_b √f), d the root mean square of x̂ − x_b, is about 1 when the prior is right and
grows with the first guess's error; a field is flagged above ``NARROW`` (the prior narrower
than its guess is wrong), where the data determine at least ``JUDGED`` of its directions
(fewer say too little of the guess's error). For the flagged fields the module gives the
weight w* = a σ² C f / d² at which the ratio is 1 (an empirical-Bayes estimate of the
prior's width; a refit with it is the user's choice, never made silently).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pdefit.fitting.problem import Batch, FitProblem

# A fitted field this many σ_b √f or more from its background: the prior is too narrow.
NARROW = 2.0
# The fewest directions of a field the data must determine (f × its values) to judge it.
JUDGED = 10.0


def available(problem: FitProblem, batch: Batch) -> bool:
    """Whether ``problem`` has a background prior on a fitted initial field."""
    return (problem.regularization.field_background > 0
            and any(f in batch.background for f in problem.fitted_fields))


def background_check(problem: FitProblem, theta: Any, batch: Batch, sigma: float,
                     misfit_weight: float, determined: dict[str, float] | None = None,
                     ) -> dict[str, Any]:
    """{"weight", "fields": {field: {"values", "rms_from_background", "prior_sigma",
    "determined_fraction", "ratio", "judged", "narrow"}}, "narrow", "matching_weight"} at
    the fitted ``theta``, for noise ``sigma`` > 0, the data loss's weight ``misfit_weight``
    per observed value and each field's ``determined`` fraction (absent: 1); see the module
    docstring. ``matching_weight`` is None where no field is flagged."""
    weight = float(problem.regularization.field_background)
    rows = {}
    for name in problem.fitted_fields:
        if name not in batch.background:
            continue
        field = jnp.asarray(theta["fields"][name])
        size = int(np.prod(field.shape))
        share = min(max(float((determined or {}).get(name, 1.0)), 0.0), 1.0)
        distance = float(jnp.sqrt(jnp.mean((field - batch.background[name]) ** 2)))
        prior_sigma = sigma * math.sqrt(misfit_weight * size / weight)
        judged = share * size >= JUDGED
        ratio = distance / (prior_sigma * math.sqrt(share)) if judged else None
        rows[name] = {"values": size, "rms_from_background": distance,
                      "prior_sigma": prior_sigma, "determined_fraction": share,
                      "ratio": ratio, "judged": judged,
                      "narrow": judged and ratio > NARROW}
    narrow = sorted(f for f, r in rows.items() if r["narrow"])
    # The weakest prior the flagged fields ask for.
    matching = min((sigma**2 * misfit_weight * rows[f]["values"] * rows[f]["determined_fraction"]
                    / rows[f]["rms_from_background"]**2 for f in narrow), default=None)
    return {"weight": weight, "fields": rows, "narrow": narrow, "matching_weight": matching}


def format_check(block: dict[str, Any]) -> list[str]:
    """One line per field, and one more naming the weight to use where the prior is narrow."""
    lines = []
    for name, row in block["fields"].items():
        where = (f"{name} at t = 0: {row['rms_from_background']:.3g} (rms) from its first "
                 "guess")
        prior = (f"the σ_b = {row['prior_sigma']:.3g} that regularization.field_background = "
                 f"{block['weight']:.3g} stands for")
        if not row["judged"]:
            lines.append(f"{where}; the data determine too little of it to tell whether {prior} "
                         "is as wide as the guess is wrong")
            continue
        lines.append(f"{where}, {row['ratio']:.3g} × what {prior} leaves to the "
                     f"{100 * row['determined_fraction']:.3g} % the data determine (about 1 "
                     "when the prior is right)")
    if block["narrow"]:
        lines.append(
            f"the background prior is narrower than the first guess of "
            f"{', '.join(block['narrow'])} is wrong: it pulls the directions the data leave to "
            "it, and the parameters, towards the guess, a bias the intervals do not hold; "
            f"regularization.field_background = {block['matching_weight']:.2g} would make it as "
            "wide (a weaker prior leaves more to the optimiser: give it more steps)")
    return lines


def recentred(batch: Batch, theta: Any) -> Batch:
    """``batch`` with its background moved to the fitted fields of ``theta``: one step of the
    proximal-point iteration (``fit.recentre_background``). Its fixed point is a stationary
    point of the data misfit alone, where the data determine the fields; the directions they
    leave to the prior stay where the last fit put them instead of being pulled back to the
    first guess."""
    fields = theta.get("fields", {})
    return batch._replace(background={name: fields.get(name, value)
                                      for name, value in batch.background.items()})


# A fit (batch, θ₀, a directory it may checkpoint in or None) → θ, as a bootstrap's refit.
Refit = Callable[[Batch, Any, Path | None], Any]


def with_recentring(first: Refit, again: Refit, passes: int) -> Refit:
    """A refit ``(batch, θ₀, where) → θ`` that fits as a re-centred fit did
    (``fit.recentre_background`` = ``passes``; a bootstrap replicate repeats it): ``first``
    from θ₀ with the batch's own background, then ``passes`` times ``again`` from the last
    result with the background moved to its fields (:func:`recentred`); fit i checkpoints in
    ``where/refit-<i>`` (none without ``where``)."""
    def refit(batch: Batch, theta0: Any, where: Path | None) -> Any:
        def within(index: int) -> Path | None:
            return None if where is None else where / f"refit-{index}"

        theta = first(batch, theta0, within(0))
        for index in range(1, passes + 1):
            theta = again(recentred(batch, theta), theta, within(index))
        return theta
    return refit
