"""Multi-start: several start points probed briefly, the best one fitted in full.

``fit.starts = N`` (the command line) or ``pdefit.fit(..., starts=N)`` (the API): the
configured start and N − 1 more are each run for a short probe (``fit.start_probe_steps``
optimiser steps; by default 10 % of ``optim.steps``, at least 1) with the fit's own optimiser
and step control, on the first training window of a staged fit; the fit then continues from
the best point of the probe with the lowest loss (ties: the lower index), and says which start
won (``starts.json``, ``summary.json["starts"]``).

The extra starts of the command line are drawn as ``fit.perturb`` draws the configured one,
with the seeds ``fit.perturb.seed + i``; the API's multiply the given start's shared scalars
by U(``low``, ``high``) with the seeds ``seed + i``.

The probes are not checkpointed: they are deterministic and cheap, so a fit that is
interrupted runs them again (the same numbers) and then resumes its main fit from that fit's
checkpoints as before.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.fitting import assemble
from pdefit.fitting.assemble import FitSetup
from pdefit.fitting.krylov import curvature_for
from pdefit.fitting.optimisers import (
    LEVENBERG_MARQUARDT,
    init_state,
    make_optimizer,
    step_limits,
)
from pdefit.fitting.updates import step_update
from pdefit.options import ConfigError, FitConfig, OptimConfig
from pdefit.runtime.checkpoint import write_json_atomic

STARTS_FILE = "starts.json"


class Probe(NamedTuple):
    """One start's probe: the lowest loss it evaluated (inf: none finite) and where."""

    loss: float
    theta: Any


def probe_length(optim: OptimConfig, requested: int | None) -> int:
    """Optimiser steps of each probe: ``requested``, else 10 % of ``optim.steps`` (≥ 1)."""
    return int(requested) if requested is not None else max(1, optim.steps // 10)


def probe_starts(setup: FitSetup, thetas: Sequence[Any], optim: OptimConfig, steps: int,
                 hold: Collection[str] = ()) -> list[Probe]:
    """Each of ``thetas`` (start points of ``setup``'s problem) run for ``steps`` steps of
    ``optim`` with the fit's step control; one compiled update serves every start. A probe
    ends early at a non-finite loss or gradient."""
    problem = setup.problem
    curvature = None
    if optim.name == LEVENBERG_MARQUARDT:
        try:
            curvature = curvature_for(problem)
        except ValueError as err:
            raise ConfigError(f"optim: {err}") from None
    optimizer = make_optimizer(optim)
    update = step_update(problem.loss, optimizer, optim, curvature, None, frozenset(hold),
                         step_limits(problem.layout, optim, problem.field_bounds))
    dtype = jax.eval_shape(problem.loss, thetas[0], setup.batch).dtype
    probes = []
    for theta in thetas:
        state = init_state(theta, optimizer, dtype)
        for _ in range(steps):
            state, report = update(state, setup.batch)
            if not bool(jax.device_get(report.finite)):
                break
        loss = float(jax.device_get(state.best_loss))
        probes.append(Probe(loss if math.isfinite(loss) else math.inf, state.best_theta))
    return probes


def winner(probes: Sequence[Probe]) -> int:
    """The index of the probe with the lowest loss (the first of equals)."""
    return min(range(len(probes)), key=lambda i: (probes[i].loss, i))


def record(starts: Sequence[dict[str, float]], probes: Sequence[Probe], steps: int,
           seeds: Sequence[int | None]) -> dict[str, Any]:
    """What the results say about the starts (``starts.json``, ``summary.json``)."""
    best = winner(probes)
    return {"count": len(probes), "probe_steps": steps, "chosen": best,
            "starts": [{"index": i, "seed": seed, "start": dict(start),
                        "probe_loss": probe.loss if math.isfinite(probe.loss) else None}
                       for i, (start, probe, seed) in enumerate(zip(starts, probes, seeds,
                                                                    strict=True))]}


def choose(setups: Sequence[FitSetup], optim: OptimConfig, steps: int,
           hold: Collection[str] = (), seeds: Sequence[int | None] | None = None,
           log: Callable[[str], None] = print) -> tuple[FitSetup, dict[str, Any]]:
    """The first of ``setups`` (the same problem from different starts) set to continue from
    the best probe's best point with that start's values, and the record of the starts."""
    probes = probe_starts(setups[0], [s.theta0 for s in setups], optim, steps, hold)
    best = winner(probes)
    summary = record([s.start_values for s in setups], probes, steps,
                     seeds if seeds is not None else [None] * len(setups))
    losses = ", ".join(f"{p.loss:.3e}" for p in probes)
    log(f"multi-start: {len(setups)} starts probed for {steps} steps each (losses {losses}); "
        f"continuing from start {best}")
    chosen = setups[0]._replace(theta0=probes[best].theta,
                                start_values=dict(setups[best].start_values))
    return chosen, summary


def choose_start(cfg: FitConfig, setup: FitSetup, dataset: Path, dtype: Any,
                 hold: Collection[str] = (), out: Path | None = None, lead: bool = True,
                 log: Callable[[str], None] = print) -> FitSetup:
    """The command line's multi-start on the first training window (``setup``, assembled
    from ``cfg``): ``fit.starts`` starts, the extra ones assembled with the seeds
    ``fit.perturb.seed + i``. Writes ``starts.json`` into ``out`` (the ``lead`` process).
    With ``fit.starts`` = 1: ``setup`` as it is."""
    count = int(cfg.fit.starts)
    if count <= 1:
        if out is not None and lead:  # a record of an earlier run with several starts
            (out / STARTS_FILE).unlink(missing_ok=True)
        return setup
    seed = cfg.fit.perturb.seed
    setups = [setup, *(assemble.build_fit(dataclasses.replace(cfg, fit=dataclasses.replace(
        cfg.fit, perturb=dataclasses.replace(cfg.fit.perturb, seed=seed + i))), dataset, dtype)
        for i in range(1, count))]
    chosen, summary = choose(setups, cfg.optim, probe_length(cfg.optim,
                                                             cfg.fit.start_probe_steps),
                             hold, [seed + i for i in range(count)], log)
    if out is not None and lead:
        write_json_atomic(out / STARTS_FILE, summary)
    return chosen


def add_to_summary(summary: dict[str, Any], out: Path, lead: bool = True) -> dict[str, Any]:
    """``summary`` with the record of a multi-start fit in ``out`` (``starts``), rewritten to
    ``summary.json`` by the ``lead`` process; unchanged without one."""
    path = out / STARTS_FILE
    if not path.is_file():
        return summary
    summary["starts"] = json.loads(path.read_text())
    if lead:
        write_json_atomic(out / "summary.json", summary)
    return summary


def perturbed(setup: FitSetup, low: float, high: float, seed: int) -> FitSetup:
    """``setup`` from another start: each fitted shared scalar's start multiplied by
    U(``low``, ``high``) (seeded by ``seed``), kept inside its bounds."""
    layout = setup.problem.layout
    factors = np.random.default_rng(seed).uniform(low, high, len(layout.scalars))
    values = dict(setup.start_values)
    params = dict(setup.theta0["params"])
    for name, factor in zip(layout.scalars, factors, strict=True):
        spec = layout.specs[name]
        value = float(np.clip(values[name] * factor, spec.lower, spec.upper))
        spec.check(name, value)
        values[name] = value
        old = params[name]
        new = jnp.asarray(spec.to_unconstrained(value), old.dtype)
        sharding = getattr(old, "sharding", None)
        params[name] = jax.device_put(new, sharding) if sharding is not None else new
    return setup._replace(theta0={**setup.theta0, "params": params}, start_values=values)
