"""Which parameters matter: perturb each by a factor and measure how far the trajectory moves.

The seed paper chooses what to fit this way: every parameter in turn is multiplied by 1.5 and
the mean absolute deviation (MAE) of the whole trajectory (all fields, all frames) from the
unperturbed one ranks them. Parameters the data barely see are left at their published values.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit.model.system import System, stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate


def _trajectory_mae(system: System, grid: Grid, integrator: str, n_steps: int, every: int,
                    names: tuple[str, ...]):
    """Jitted ``reference(x0, params, dt) -> frames`` and ``mae(x0, params, dt, factor, index,
    frames) -> MAE`` of the rollout with ``names[index]`` multiplied by ``factor`` against
    ``frames``; one compiled function serves every parameter, called once each so that the
    ranking can report as it goes."""
    step = stepper(system, grid, integrator)

    @jax.jit
    def reference(x0, params, dt):
        return simulate(step, x0, params, 0.0, dt, n_steps, every)

    @jax.jit
    def mae(x0, params, dt, factor, index, frames):
        scaled = {n: jnp.where(index == i, factor * params[n], params[n])
                  for i, n in enumerate(names)}
        perturbed = simulate(step, x0, {**params, **scaled}, 0.0, dt, n_steps, every)
        errors = jax.tree.map(lambda a, b: jnp.mean(jnp.abs(a - b)), perturbed, frames)
        return jnp.mean(jnp.stack(jax.tree.leaves(errors)))

    return reference, mae


def rank_parameters(system: System, grid: Grid, params: Mapping[str, float], dt: float,
                    integrator: str, x0: Mapping[str, Any], n_steps: int, every: int = 1,
                    factor: float = 1.5, names: Sequence[str] | None = None,
                    dtype: Any = jnp.float32,
                    log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows ``{rank, name, value, mae}`` sorted by decreasing MAE of the trajectory (frames every
    ``every`` steps over ``n_steps``, all fields) when ``name`` is multiplied by ``factor``.
    ``log`` (if given) hears of each simulation as it finishes.

    A perturbation that makes the rollout blow up ranks first with ``mae = inf`` (the data
    certainly constrain it) and is flagged ``unstable``."""
    names = tuple(system.params if names is None else names)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for {system.name}")
    if not names:
        raise ValueError("no parameters to rank")
    if not (factor > 0 and factor != 1):
        raise ValueError(f"the perturbation factor must be positive and not 1, got {factor}")
    if n_steps < 1 or every < 1:
        raise ValueError("n_steps and every must be >= 1")
    say = log or (lambda message: None)
    reference, mae = _trajectory_mae(system, grid, integrator, int(n_steps), int(every), names)
    p = {k: jnp.asarray(v, dtype) for k, v in params.items()}
    state = {k: jnp.asarray(v, dtype) for k, v in x0.items()}
    dt_, factor_ = jnp.asarray(dt, dtype), jnp.asarray(factor, dtype)
    started = time.perf_counter()
    say(f"rank: simulating the reference ({n_steps} steps), then {len(names)} perturbed "
        "runs…")
    frames = jax.block_until_ready(reference(state, p, dt_))
    say(f"rank: reference done in {time.perf_counter() - started:.1f} s (with compilation)")
    maes = []
    for index, name in enumerate(names):
        tick = time.perf_counter()
        maes.append(float(mae(state, p, dt_, factor_, jnp.asarray(index), frames)))
        say(f"rank: {index + 1}/{len(names)} {name} × {factor:g}: MAE {maes[-1]:.3e} "
            f"({time.perf_counter() - tick:.1f} s)")
    rows = [{"name": n, "value": float(params[n]), "mae": m if np.isfinite(m) else math.inf,
             "unstable": not bool(np.isfinite(m))} for n, m in zip(names, maes, strict=True)]
    # Stable order: by MAE, ties (e.g. parameters that are zero, so scaling does nothing)
    # broken by name.
    rows.sort(key=lambda r: (-r["mae"], r["name"]))
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return rows


def format_ranking(rows: Sequence[Mapping[str, Any]], factor: float) -> str:
    lines = [f"{'rank':>4}  {'parameter':<14} {'value':>10}  MAE of the trajectory (× {factor})"]
    for r in rows:
        note = "  (rollout blew up)" if r["unstable"] else ""
        lines.append(f"{r['rank']:>4}  {r['name']:<14} {r['value']:>10.5g}  {r['mae']:.4e}{note}")
    return "\n".join(lines)


def plot_ranking(rows: Sequence[Mapping[str, Any]], factor: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r["mae"] for r in rows if math.isfinite(r["mae"]) and r["mae"] > 0]
    ceiling = 2 * max(finite) if finite else 1.0
    floor = 0.5 * min(finite) if finite else 1e-12
    heights = [ceiling if not math.isfinite(r["mae"]) else max(r["mae"], floor) for r in rows]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.32 * len(rows)), 3.6), layout="constrained")
    colours = ["tab:red" if r["unstable"] else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), heights, color=colours)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=75, fontsize=8)
    ax.set_ylabel(f"trajectory MAE, parameter × {factor}")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_ranking(rows: Sequence[Mapping[str, Any]], factor: float, out: Path,
                  extra: Mapping[str, Any] | None = None) -> None:
    """``ranking.json``, ``ranking.txt`` and ``ranking.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"factor": factor, **(extra or {}),
               "ranking": [{**r, "mae": r["mae"] if math.isfinite(r["mae"]) else None}
                           for r in rows]}
    (out / "ranking.json").write_text(json.dumps(payload, indent=2))
    (out / "ranking.txt").write_text(format_ranking(rows, factor) + "\n")
    plot_ranking(rows, factor, out / "ranking.png")
