"""How much of each fitted initial field the data determine: its degrees of freedom for signal.

A fitted initial field has as many unknowns as cells, and where the data say little about it
its estimate is its prior's (the background, the smoothness) and its first guess's. The
standard measure (Rodgers, *Inverse Methods for Atmospheric Sounding*, 2000, §2.4: the
degrees of freedom for signal) is the trace of the averaging kernel

    A = G_xx⁻¹ D_xx,   G_xx = D_xx + P_xx,

with D_xx the data misfit's Gauss–Newton block over the fitted fields and P_xx the priors'
Hessian, at the fitted parameters: each of its eigenvalues, between 0 and 1, is how far one
direction of the fields follows the data rather than the prior. tr A over a field's cells,
divided by their number, is the fraction of that field the data determine; 1 for a field the
data fix (an observed u(0)), near 0 for one they hardly see (θ(0) under noisy velocity).

The same trace is the fields' share in the hat matrix's trace, so E[RSS] ≈ σ² (N − k − tr A)
for k fitted scalars: the residual verdict's degrees of freedom subtract it (without it a
fit whose hidden field absorbs noise sits below the noise; the RB rows of docs/benchmarks.md).

A is never formed. Since A = I − G_xx⁻¹ P_xx, A z takes the priors' Hessian product P_xx z
and one conjugate-gradient solve on the field block (:func:`pdefit.fitting.marginal.field_solution`
with the products of :func:`pdefit.fitting.krylov.gauss_newton_product`), and tr A over each
field comes from Hutchinson's estimator Σ_cells z ⊙ A z over ``probes`` random ±1 vectors z,
with its standard error from their spread. Where the fields hold no more values than
``probes`` the unit vectors are used instead, which gives the trace exactly. Truncated
conjugate gradients resolve the weakest directions of G_xx last; solving for G_xx⁻¹ P_xx z
(rather than G_xx⁻¹ D_xx z) makes that error small where the prior is weak and nil without
one (A = I): on an 8² Aliev–Panfilov fit of u(0) and v(0) with background weight 1e-4, 95.50
against the dense 95.45 of 128, where the D_xx form gave 87.5 (tests/test_signal.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.fitting import marginal
from pdefit.fitting.problem import Batch, FitProblem

PROBES = 4
# Below this share of its values determined, a field's estimate is said to be its prior's.
MOSTLY_PRIOR = 0.5


def available(problem: FitProblem) -> bool:
    """Whether :func:`field_signal` covers ``problem``: fitted initial fields on one device,
    one trajectory (not multiple shooting, whose segment starts are unknowns too)."""
    return bool(problem.fitted_fields) and problem.domain is None and problem.shooting is None


def field_signal(problem: FitProblem, theta: Any, batch: Batch, probes: int = PROBES,
                 iterations: int = marginal.ITERATIONS, seed: int = 0,
                 batch_size: int | None = None) -> dict[str, Any]:
    """{"fields": {field: {"values", "signal_dof", "standard_error", "determined_fraction",
    "prior"}}, "probes", "exact", "signal_dof", "solver_iterations", "solves_at_cap"} at
    ``theta`` (see the module docstring; ``prior``: whether a prior acts on the field; where
    none acts on any, A = I and nothing is solved); ``seed`` draws the probes, which are solved
    ``batch_size`` at a time (:func:`pdefit.fitting.marginal.batched`)."""
    fields = theta["fields"]
    sizes = {f: int(np.prod(x.shape)) for f, x in fields.items()}
    zero = jax.tree.map(jnp.zeros_like, theta)

    def prior(t):
        return problem.penalty(t) + problem.field_prior(t, batch)

    @jax.jit
    def prior_product(v):  # P_xx v: no model run
        return jax.jvp(jax.grad(prior), (theta,), ({**zero, "fields": v},))[1]["fields"]

    # Which fields a prior acts on, from one random probe (P_xx z ≠ 0 on its cells).
    acted = prior_product(_rademacher(fields, 1, seed)[0])
    has_prior = {f: bool(jnp.any(acted[f] != 0)) for f in fields}
    if not any(has_prior.values()):  # A = I: nothing to solve
        return {"fields": {f: {"values": n, "signal_dof": float(n), "standard_error": None,
                               "determined_fraction": 1.0, "prior": False}
                           for f, n in sizes.items()},
                "probes": 0, "exact": True, "signal_dof": float(sum(sizes.values())),
                "solver_iterations": [], "solves_at_cap": 0}
    product, scale = marginal.field_block(problem, theta, batch, jax.random.key(seed))

    def sample(z):  # per field: Σ over its cells of z ⊙ A z, A z = z − G_xx⁻¹ P_xx z
        solution = marginal.field_solution(product, prior_product(z), scale, iterations)
        traces = {f: jnp.sum(z[f] * (z[f] - solution.value[f])) for f in z}
        return traces, solution.stats["num_steps"]

    exact = sum(sizes.values()) <= probes
    vectors = _unit_vectors(fields) if exact else _rademacher(fields, probes, seed)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *vectors)
    traces, steps = marginal.batched(sample, stacked, batch_size, batch)
    per_field = {}
    for f, n in sizes.items():
        values = np.asarray(traces[f], np.float64)
        total = float(values.sum()) if exact else float(values.mean())
        spread = None if exact else float(values.std(ddof=1) / math.sqrt(len(values)))
        # tr A lies in [0, n] (A's eigenvalues lie in [0, 1]); a random-probe estimate of a
        # field the data fix almost entirely, or one from solves at their cap, can fall
        # outside it (a 512² BOCF u(0): 2.622e+05 ± 0.43 of its 262144 values).
        bounded = min(max(total, 0.0), float(n))
        per_field[f] = {"values": n, "signal_dof": bounded, "standard_error": spread,
                        "determined_fraction": bounded / n, "prior": has_prior[f],
                        "estimate": total}
    # A solve stopped at its cap leaves the weakest directions' share of G_xx⁻¹ P_xx z out:
    # the traces are then upper bounds.
    capped = int(sum(int(k) >= iterations for k in steps))
    return {"fields": per_field, "probes": len(vectors), "exact": exact,
            "signal_dof": sum(r["signal_dof"] for r in per_field.values()),
            "solver_iterations": [int(k) for k in steps], "solves_at_cap": capped}


def _rademacher(fields: dict[str, jax.Array], probes: int, seed: int) -> list[dict[str, Any]]:
    names = sorted(fields)
    keys = jax.random.split(jax.random.key(seed + 1), probes * len(names)).reshape(
        probes, len(names))
    return [{f: jax.random.rademacher(keys[i, j], fields[f].shape, fields[f].dtype)
             for j, f in enumerate(names)} for i in range(probes)]


def _unit_vectors(fields: dict[str, jax.Array]) -> list[dict[str, Any]]:
    units = []
    for name, x in sorted(fields.items()):
        for i in range(int(np.prod(x.shape))):
            unit = {f: jnp.zeros_like(y) for f, y in fields.items()}
            unit[name] = unit[name].reshape(-1).at[i].set(1.0).reshape(x.shape)
            units.append(unit)
    return units


def format_signal(block: dict[str, Any]) -> list[str]:
    """One line per fitted field: how many of its values the data determine."""
    lines = []
    bound = (f"; an upper bound, {block['solves_at_cap']} of {block['probes']} "
             "conjugate-gradient solves stopped at their cap" if block.get("solves_at_cap")
             else "")
    for name, row in block["fields"].items():
        if not row.get("prior", True):
            lines.append(f"{name} at t = 0: no prior, so all its {row['values']} values are "
                         "fitted to the data (degrees of freedom for signal: their number), "
                         "however little the data say of some; a background prior "
                         "(regularization.field_background) measures what they determine")
            continue
        spread = "" if row["standard_error"] is None else f" ± {row['standard_error']:.2g}"
        share = row["determined_fraction"]
        estimate = row.get("estimate", row["signal_dof"])
        if estimate != row["signal_dof"]:  # outside [0, n]: say so rather than print it
            above = estimate > row["values"]
            # The excess itself: "the estimate 64 lies outside [0, 64]" would hide it.
            outside = (f"{estimate - row['values']:.2g} above their number" if above
                       else f"{estimate:.2g}, below zero")
            lines.append(f"{name} at t = 0: the data determine {'all' if above else 'none'} "
                         f"of its {row['values']} values (degrees of freedom for signal: the "
                         f"estimate is {outside}{spread}, which bounds it{bound})")
            continue
        rest = (": mostly its prior and first guess" if share < MOSTLY_PRIOR
                else "; the rest is its prior's")
        lines.append(f"{name} at t = 0: the data determine {row['signal_dof']:.4g}{spread} of "
                     f"its {row['values']} values ({100 * share:.3g} %, degrees of freedom "
                     f"for signal{bound}){rest}")
    return lines
