"""Where each initial field comes from, and fitted initial fields against the dataset's truth.

No hidden truth: a state field that is not observed never starts from the dataset's first
frame unless ``fit.initial_fields.<f>=data`` says so (a known initial state, e.g. a twin
experiment); it is fitted (``=fit``) or derived from the observed first frames by the system's
``state_from_observables`` hook (an estimate from what is observed), else the fit is refused
before any work (:func:`hidden_initial_fields`, :func:`hidden_state_message`; checked by
:mod:`pdefit.app.preflight` and again at assembly for the Python API).

Fitted initial fields (``fit.initial_fields.<f>=fit``) against the dataset's own first frame:

A synthetic dataset stores every state field, also those the fit does not observe, so the
fitted unobserved field — e.g. Aliev–Panfilov's v(0) fitted from u alone — can be compared
with the truth: a relative L2 error per field (over the fitted experiments) for summary.json
and the final output, and a plot of truth, fit and difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdefit import data as zd
from pdefit.fitting.observe import observable_names

# The sources of ``fit.initial_fields.<field>``.
DATA = "data"  # a known initial state: the dataset's first frame of the field
FIT = "fit"  # fitted with the parameters
SOURCES = (DATA, FIT)


def derivable_fields(system: Any, grid: Any, observed: Sequence[str]) -> tuple[str, ...]:
    """State fields the system's ``state_from_observables`` hook derives from the observed
    first frames (none without the hook, or unless every observable is observed)."""
    derive = getattr(system, "state_from_observables", None)
    names = observable_names(system, grid)
    if derive is None or not names or any(n not in observed for n in names):
        return ()
    state = {f: jax.ShapeDtypeStruct(tuple(grid.shape), jnp.float32) for f in system.fields}
    shapes = jax.eval_shape(system.observables, state)
    return tuple(f for f in jax.eval_shape(derive, dict(shapes)) if f in system.fields)


def hidden_initial_fields(system: Any, grid: Any, observed: Sequence[str],
                          sources: Mapping[str, str]) -> list[str]:
    """The state fields whose initial state would be the dataset's hidden truth: not
    observed, not named in ``fit.initial_fields`` (``sources``) and not derived from the
    observed fields by the system."""
    derived = derivable_fields(system, grid, observed)
    return [f for f in system.fields
            if f not in observed and f not in sources and f not in derived]


def hidden_state_message(hidden: Sequence[str], observed: Sequence[str]) -> str:
    """The one-line refusal of :func:`hidden_initial_fields`' fields, naming both choices."""
    names = ", ".join(hidden)
    fit = " ".join(f"fit.initial_fields.{f}={FIT}" for f in hidden)
    data = " ".join(f"fit.initial_fields.{f}={DATA}" for f in hidden)
    one = len(hidden) == 1
    return (f"fit.initial_fields: {names} {'is' if one else 'are'} not observed "
            f"(observe.fields=[{','.join(observed)}]) and would start from the dataset's "
            "first frame, a hidden truth a recording does not have; "
            f"fit {'it' if one else 'them'} ({fit}) or, for a known initial state, {data}")


def initial_field_errors(fitted: Mapping[str, np.ndarray], truth: Mapping[str, np.ndarray],
                         ) -> dict[str, dict[str, float]]:
    """Per field: ``rel_l2_error`` = ‖fit − truth‖ / ‖truth‖ and ``max_abs_error`` over all
    experiments and cells (arrays ``(n_experiments, ny, nx)``)."""
    errors = {}
    for name, true in truth.items():
        diff = np.asarray(fitted[name], np.float64) - np.asarray(true, np.float64)
        scale = float(np.linalg.norm(true))
        errors[name] = {"rel_l2_error": float(np.linalg.norm(diff)) / scale if scale else None,
                        "max_abs_error": float(np.max(np.abs(diff)))}
    return errors


def true_initial_fields(dataset: Path, names: Sequence[str], experiments: Sequence[int] | None,
                        frame: int) -> dict[str, np.ndarray]:
    """The dataset's frame ``frame`` of each of ``names`` it holds, ``(n_experiments, ny, nx)``;
    without its noise where the dataset drew additive noise from a seed (the noise is drawn
    again and taken off: the truth a fit's initial fields are scored against)."""
    ds = zd.open_dataset(dataset)
    chosen = list(range(ds.meta.n_experiments)) if experiments is None else list(experiments)
    out = {}
    for name in names:
        if name not in ds.meta.fields:
            continue
        values = ds.read(name, experiments=chosen, frames=[frame])[:, 0]
        out[name] = values - _drawn_noise(ds.meta, name, chosen, frame, values.shape[1:])
    return out


def _drawn_noise(meta: Any, name: str, experiments: Sequence[int], frame: int,
                 shape: tuple[int, ...]) -> np.ndarray | float:
    """The additive noise the dataset's writer drew for ``name`` at ``frame`` (0 where it
    drew none, or none that can be drawn again)."""
    noise = meta.noise or {}
    if (noise.get("kind") != "additive" or noise.get("seed") is None
            or isinstance(noise.get("sigma"), Mapping)):
        return 0.0
    zeros = np.zeros((1, *shape), np.float32)
    return np.stack([zd.add_noise_block(zeros, noise, experiment=e, frame_start=frame,
                                        stream=meta.fields.index(name))[0]
                     for e in experiments])


def format_errors(errors: Mapping[str, Mapping[str, float]]) -> str:
    return "\n".join(f"initial {name}: relative L2 error {100 * e['rel_l2_error']:.3g} %, max "
                     f"|error| {e['max_abs_error']:.3g}" for name, e in errors.items()
                     if e["rel_l2_error"] is not None)


def plot_initial_fields(fitted: Mapping[str, np.ndarray], truth: Mapping[str, np.ndarray],
                        path: Path) -> None:
    """First experiment: one row per field — truth, fit, fit − truth — with colour bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(truth)
    fig, axes = plt.subplots(len(names), 3, figsize=(9, 2.9 * len(names)), squeeze=False,
                             layout="constrained")
    for row, name in zip(axes, names, strict=True):
        true, fit = np.asarray(truth[name][0]), np.asarray(fitted[name][0])
        lo, hi = float(true.min()), float(true.max())
        diff = fit - true
        bound = float(np.abs(diff).max()) or 1.0
        panels = ((true, f"{name}(0) true", "viridis", lo, hi),
                  (fit, f"{name}(0) fitted", "viridis", lo, hi),
                  (diff, "fitted − true", "RdBu_r", -bound, bound))
        for ax, (image, title, cmap, vmin, vmax) in zip(row, panels, strict=True):
            shown = ax.imshow(image, origin="lower", cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_title(title)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(shown, ax=ax, shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate_initial_fields(problem: Any, theta: Any, batch: Any, cfg: Any, dataset: Path,
                            out: Path, plots: bool) -> dict[str, Any]:
    """``{"initial_fields": errors}`` for the fitted fields the dataset holds (plotted to
    ``out/initial_fields.png``); empty when none is fitted or the data come from another
    system (a surrogate fit), whose fields are not this system's."""
    import jax

    from pdefit.parallel.processes import host_array

    names = list(problem.fitted_fields)
    surrogate = cfg.data.system is not None and cfg.data.system != problem.system.name
    if not names or surrogate or jax.process_count() > 1:
        return {}
    frame = 0 if cfg.data.frames is None else int(cfg.data.frames[0])
    truth = true_initial_fields(dataset, names, cfg.data.experiments, frame)
    if not truth:
        return {}
    state = problem.initial_state(theta, batch)
    fitted = {name: host_array(state[name]) for name in truth}
    if plots:
        plot_initial_fields(fitted, truth, out / "initial_fields.png")
    return {"initial_fields": initial_field_errors(fitted, truth)}
