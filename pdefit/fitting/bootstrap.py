"""Parametric bootstrap of a fit: the bias and spread of its estimate, measured by refitting
data the fitted model makes.

Why: the Laplace intervals (:mod:`pdefit.fitting.uncertainty`) are centred on the estimate and
assume it unbiased. With fitted initial fields the estimate is not: the fields' prior pulls it
towards their first guess, and thousands of nuisance values, a model with thresholds (kinks a
second derivative does not see) and noise bend it by a few standard errors, more as the grid
grows (docs/benchmarks.md, "Bias and intervals by parametric bootstrap"). A replicate is the
fitted model's prediction at the observed frames plus fresh Gaussian noise of the fit's noise
level; it is fitted the way the data were — the same start, the first guesses and the prior's
background remade from the replicate's own first frame — so the replicates' mean minus the
estimate estimates the estimator's bias there, and their spread its standard error.

The corrected estimate is the estimate minus that bias, in the fit's unconstrained
coordinates (log for log-transformed parameters); its 95 % interval is ± t(0.975, n − 1) ×
the replicates' standard deviation × √(1 + 1/n), the last factor for the noise of a bias
estimated from n replicates. Refits cost a whole fit each, so each finished replicate is
kept in ``store`` (a JSON file written atomically): a run stopped between replicates (a
preemption signal, ``stop``) or killed during one goes on from the replicates kept. With
``scratch`` the refits of the replicate under way checkpoint there too, so that a signal
during one (a replicate after re-centred refits is several whole fits, longer than a
cluster's grace period) stops it within a step and the run goes on from that step. Replicate
i's noise depends on the seed and i alone, so the resumed result equals an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from pdefit.fitting import krylov
from pdefit.fitting.background import Refit
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.runtime.checkpoint import write_json_atomic


def replicate_batch(problem: FitProblem, theta: Any, batch: Batch,
                    sigma: Mapping[str, float], key: jax.Array) -> Batch:
    """``batch`` with its observed values replaced by the model's values at ``theta`` plus
    Gaussian noise of ``sigma[field]`` (missing values stay missing), and with the known
    initial fields read from an observed first frame replaced by the replicate's frame."""
    predicted = krylov.predictions(problem, theta, batch)
    obs = batch.observed
    values = {}
    for index, name in enumerate(sorted(obs.values)):
        mean = predicted[name].astype(obs.values[name].dtype)
        noise = jax.random.normal(jax.random.fold_in(key, index), mean.shape, mean.dtype)
        values[name] = jnp.where(obs.weights[name] > 0, mean + sigma[name] * noise,
                                 obs.values[name])
    replicate = batch._replace(observed=obs._replace(values=values))
    data_first, first = first_frames(batch), first_frames(replicate)
    initial = dict(batch.initial)
    for name, known in batch.initial.items():
        if name in first and _same(known, data_first[name]):
            frame = jnp.reshape(first[name], known.shape)
            initial[name] = jnp.where(jnp.isfinite(frame), frame, known).astype(known.dtype)
    return replicate._replace(initial=initial)


def first_frames(batch: Batch) -> dict[str, jnp.ndarray]:
    """The observed values at t = 0, (n_exp, ...) per field (none if step 0 is unobserved);
    NaN where a value is missing."""
    slot = int(np.asarray(batch.observed.slot_of_step)[0])
    if slot < 0:
        return {}
    obs = batch.observed
    return {f: jnp.where(obs.weights[f][:, slot] > 0, v[:, slot], jnp.nan)
            for f, v in obs.values.items()}


def first_guesses(problem: FitProblem, batch: Batch, start_params: Mapping[str, Any],
                  ) -> dict[str, jnp.ndarray]:
    """What a fit takes as the fitted fields' first guess from ``batch``'s first frame: an
    observed field its frame (0 where missing), another the system's ``initial_guess`` at
    ``start_params`` (physical) where it has one."""
    first = {f: x for f, x in first_frames(batch).items() if f in problem.system.fields}
    hook = getattr(problem.system, "initial_guess", None)
    guesses = {}
    if hook is not None and first:
        guesses = dict(hook({f: jnp.nan_to_num(x) for f, x in first.items()},
                            dict(start_params)))
    return {name: jnp.nan_to_num(first.get(name, guesses.get(name)))
            for name in problem.fitted_fields if name in first or name in guesses}


def rebased_start(problem: FitProblem, theta0: Any, batch: Batch, replicate: Batch,
                  start_params: Mapping[str, Any]) -> tuple[Batch, Any]:
    """The replicate's background and start θ: where the data's were their first guess
    (:func:`first_guesses`), the replicate's own; elsewhere (a later stage starts from the
    last one's fit, a background the user gave) unchanged."""
    data_guess = first_guesses(problem, batch, start_params)
    new_guess = first_guesses(problem, replicate, start_params)
    background, fields = dict(batch.background), dict(theta0.get("fields", {}))
    for name, new in new_guess.items():
        old = data_guess[name]
        for target in (background, fields):
            if name in target and _same(target[name], old):
                target[name] = jnp.asarray(new, target[name].dtype).reshape(target[name].shape)
    return replicate._replace(background=background), {**theta0, "fields": fields}


def _same(value: Any, made: Any) -> bool:
    """Whether ``value`` was made from the data as ``made`` is (a first frame, a first guess),
    where ``made`` is finite, up to the rounding of remaking it (the start parameters pass
    through their transform and back)."""
    value = np.asarray(value).ravel()
    made = np.asarray(made, value.dtype).ravel()
    if value.size != made.size:
        return False
    finite = np.isfinite(made)
    scale = float(np.max(np.abs(made[finite]), initial=0.0))
    return bool(np.allclose(value[finite], made[finite], rtol=1e-5, atol=1e-6 * scale))


def replicates(problem: FitProblem, batch: Batch, theta0: Any, theta: Any,
               sigma: Mapping[str, float], count: int, refit: Refit, seed: int = 0,
               start_params: Mapping[str, Any] | None = None,
               log: Callable[[str], None] = print, store: Path | None = None,
               stop: Callable[[str], None] | None = None,
               scratch: Path | None = None) -> list[dict[str, Any]]:
    """The fitted shared scalars (unconstrained) of ``count`` replicates of the data at
    ``theta``, each fitted by ``refit`` from ``theta0`` remade for it, with ``moved``: whether
    they left their start. With ``store``, those
    of an earlier, interrupted call for the same estimate, noise and seed are reused and each
    new one is saved; ``stop(what)`` is called before each new replicate (it may raise to end
    the run, e.g. on a preemption signal). With ``scratch``, replicate i is refitted in
    ``scratch/replicate-<i>`` (its checkpoints, resumed by the next call for the same
    estimate), removed once the replicate is kept."""
    params = start_params if start_params is not None else problem.physical_params(theta0)
    identity = _identity(problem, theta, sigma, seed)
    out = _kept(store, identity, count, log)
    work = _scratch(scratch, identity, log)
    for index in range(len(out), count):
        if stop is not None:
            stop(f"during the bootstrap ({index} of {count} replicates kept)")
        replicate = replicate_batch(problem, theta, batch, sigma,
                                    jax.random.fold_in(jax.random.PRNGKey(seed), index))
        replicate, start = rebased_start(problem, theta0, batch, replicate, params)
        where = None if work is None else work / f"replicate-{index}"
        fitted = refit(replicate, start, where)
        values = {n: float(fitted["params"][n]) for n in problem.layout.scalars}
        # A refit that accepted no step ends exactly at its start: its value describes the
        # start, not the estimator, and summary() says how many did.
        moved = any(values[n] != float(start["params"][n]) for n in values)
        out.append({**values, "moved": moved})
        if store is not None and jax.process_index() == 0:  # one writer; all read it
            write_json_atomic(store, {**identity, "replicates": out})
        if where is not None and jax.process_index() == 0:  # kept: its checkpoints are done
            shutil.rmtree(where, ignore_errors=True)
        log(f"bootstrap replicate {index + 1}/{count}: " + ", ".join(
            f"{n} {float(v):.5g}" for n, v in problem.scalar_values(fitted).items())
            + ("" if moved else " (no step accepted: the refit ended at its start)"))
    if work is not None and jax.process_index() == 0:
        for index in range(count):  # one a kill left while it was being removed, too
            shutil.rmtree(work / f"replicate-{index}", ignore_errors=True)
        (work / "identity.json").unlink(missing_ok=True)
        if not any(work.iterdir()):
            work.rmdir()
    return out


def _scratch(scratch: Path | None, identity: dict[str, Any],
             log: Callable[[str], None]) -> Path | None:
    """``scratch``, made for ``identity``: the replicates' checkpoints an earlier call left
    there for another estimate (the directories this module names, nothing else) removed."""
    if scratch is None:
        return None
    marker = scratch / "identity.json"
    if jax.process_index() == 0:
        left = sorted(p for p in scratch.glob("replicate-*")
                      if p.name.removeprefix("replicate-").isdigit()) if scratch.is_dir() else []
        if left and (not marker.exists() or json.loads(marker.read_text()) != identity):
            log(f"bootstrap: the checkpoints in {scratch} belong to another estimate; "
                "removed")
            for directory in left:
                shutil.rmtree(directory, ignore_errors=True)
        scratch.mkdir(parents=True, exist_ok=True)
        write_json_atomic(marker, identity)
    return scratch


def _identity(problem: FitProblem, theta: Any, sigma: Mapping[str, float],
              seed: int) -> dict[str, Any]:
    """What kept replicates must share with this call: the estimate they replicate (its
    shared scalars, unconstrained), the noise level and the seed."""
    return {"estimate": {n: float(theta["params"][n]) for n in problem.layout.scalars},
            "sigma": {f: float(v) for f, v in sigma.items()}, "seed": int(seed)}


def _kept(store: Path | None, identity: dict[str, Any], count: int,
          log: Callable[[str], None]) -> list[dict[str, float]]:
    """The replicates kept in ``store`` for ``identity`` (at most ``count``), else none."""
    if store is None or not store.exists():
        return []
    kept = json.loads(store.read_text())
    if {k: kept.get(k) for k in identity} != identity:
        log(f"bootstrap: {store.name} belongs to another estimate; its replicates are redone")
        return []
    log(f"bootstrap: {min(len(kept['replicates']), count)} replicate(s) kept from {store}")
    return [dict(r) for r in kept["replicates"][:count]]


def summary(problem: FitProblem, theta: Any, fitted: list[dict[str, float]],
            level: float = 0.95) -> dict[str, Any]:
    """The ``bootstrap`` block: per fitted shared scalar the estimated bias (also in units of
    the replicates' spread), the standard error (physical units, to first order at the
    corrected estimate), the corrected estimate and its interval; a corrected value beyond
    the parameter's bounds is held at the bound (``at_bound``). ``unmoved``: how many
    replicates' refits accepted no step (their scalars are their start's; kept in the
    statistics, since that is what the estimator did, but the block then warns)."""
    n = len(fitted)
    if n < 2:
        raise ValueError(f"a bootstrap needs at least 2 replicates, got {n}")
    quantile = float(stats.t.ppf(0.5 + level / 2, n - 1)) * math.sqrt(1 + 1 / n)
    rows = {}
    for name in problem.layout.scalars:
        spec = problem.layout.specs[name]
        z_hat = float(theta["params"][name])
        z = np.array([f[name] for f in fitted])
        bias_z, spread_z = float(z.mean() - z_hat), float(z.std(ddof=1))

        def physical(x: float, spec: Any = spec) -> float:
            return float(np.clip(spec.to_physical(jnp.asarray(x)), spec.lower, spec.upper))

        centre = z_hat - bias_z
        value = physical(centre)
        slope = float(jax.grad(lambda x, spec=spec: spec.to_physical(x))(jnp.asarray(centre)))
        low, high = sorted(physical(centre + sign * quantile * spread_z) for sign in (-1, 1))
        rows[name] = {"estimate": physical(z_hat), "bias": physical(z_hat) - value,
                      "bias_in_spreads": bias_z / spread_z if spread_z > 0 else None,
                      "std_error": abs(slope) * spread_z, "corrected": value,
                      "at_bound": value in (spec.lower, spec.upper),
                      "ci95_low": low, "ci95_high": high}
    unmoved = sum(1 for f in fitted if f.get("moved") is False)  # older stores: unknown
    return {"replicates": n, "level": level, "quantile": quantile, "unmoved": unmoved,
            "parameters": rows}


def format_block(block: Mapping[str, Any]) -> str:
    """The printed lines of a ``bootstrap`` block."""
    lines = [f"bootstrap ({block['replicates']} refits of replicates of the data): the "
             "estimate's bias, and the estimate without it"]
    for name, row in block["parameters"].items():
        spreads = row["bias_in_spreads"]
        in_spreads = "" if spreads is None else f" ({spreads:+.2f} standard errors)"
        bound = ", held at its bound" if row["at_bound"] else ""
        lines.append(f"  {name}: bias {row['bias']:+.4g}{in_spreads}; corrected "
                     f"{row['corrected']:.6g} ± {row['std_error']:.3g}{bound}, "
                     f"{100 * block['level']:.0f} % interval [{row['ci95_low']:.6g}, "
                     f"{row['ci95_high']:.6g}]")
    if block.get("unmoved"):
        lines.append(f"  warning: {block['unmoved']} of {block['replicates']} refits accepted "
                     "no step and ended at their start: the spread and bias above describe "
                     "the start as much as the estimator (give the refits more steps)")
    return "\n".join(lines)
