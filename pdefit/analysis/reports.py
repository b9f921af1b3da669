"""Reports of a finished fit: recovered-vs-true table, JSON summary and plots; the metrics,
plots and printed summary of its forecast (``pdefit-evaluate``) and the line on a Lyapunov
estimate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdefit.fitting.uncertainty import NOT_CONVERGED


def parameter_table(fitted: Sequence[str], start: Mapping[str, float],
                    recovered: Mapping[str, float], truth: Mapping[str, float] | None,
                    units: Mapping[str, str] | None = None,
                    intervals: Mapping[str, Mapping[str, Any]] | None = None,
                    ) -> list[dict[str, float | str | None]]:
    """One row per fitted scalar: start, recovered and true value, their relative errors
    and the parameter's unit (``units``: name → unit, e.g. from ``ParamSpec.unit``); with
    ``intervals`` (:func:`pdefit.fitting.uncertainty.estimate`'s ``parameters``) also the standard
    error, the 95 % interval and the flag of a parameter the data do not determine (and, with
    fitted initial fields, the std error's bracket; for a flagged one, the optimum its
    interval spans)."""
    rows = []
    for name in fitted:
        true = None if truth is None else truth.get(name)
        rel = None if true in (None, 0) else abs(recovered[name] - true) / abs(true)
        rel0 = None if true in (None, 0) else abs(start[name] - true) / abs(true)
        row = {"name": name, "unit": (units or {}).get(name, ""), "start": start[name],
               "recovered": recovered[name], "true": true, "start_rel_error": rel0,
               "rel_error": rel}
        if intervals and name in intervals:
            row.update({k: intervals[name][k] for k in ("std_error", "ci95_low", "ci95_high",
                                                         "flag")})
            for key in ("std_error_bounds", "optimum"):
                if intervals[name].get(key) is not None:
                    row[key] = intervals[name][key]
        rows.append(row)
    return rows


def error_summary(rows: Sequence[Mapping]) -> dict[str, float | None]:
    errors = [r["rel_error"] for r in rows if r["rel_error"] is not None]
    if not errors:
        return {"mean_rel_error": None, "median_rel_error": None, "max_rel_error": None}
    return {"mean_rel_error": float(np.mean(errors)),
            "median_rel_error": float(np.median(errors)),
            "max_rel_error": float(np.max(errors))}


def format_percent(fraction: float | None) -> str:
    """A relative error as a percentage in significant figures: three of them from 0.1 %
    up, else two in scientific notation, so a tiny error never prints as ``0.000 %``."""
    if fraction is None:
        return "—"
    percent = 100.0 * fraction
    if percent == 0 or not np.isfinite(percent):
        return f"{percent:g} %"
    if abs(percent) >= 0.1:
        return f"{percent:.3g} %"
    return f"{percent:.1e} %"


def format_error_summary(summary: Mapping[str, float | None]) -> str:
    """``mean relative error …, median …, max …`` of :func:`error_summary`'s result."""
    return (f"mean relative error {format_percent(summary['mean_rel_error'])}, median "
            f"{format_percent(summary['median_rel_error'])}, max "
            f"{format_percent(summary['max_rel_error'])}")


def format_table(rows: Sequence[Mapping]) -> str:
    def num(x):
        return "—" if x is None else f"{x:.6g}"

    def interval(r):
        low, high = r.get("ci95_low"), r.get("ci95_high")
        if low is None or not (math.isfinite(low) and math.isfinite(high)):
            return "—" if low is None else f"[{low:g}, {high:g}]"
        # Enough significant figures that the ends differ (two on the interval's width).
        size = max(abs(low), abs(high))
        digits = 5 if high <= low or size == 0 else max(
            5, int(np.ceil(np.log10(size / (high - low)))) + 2)
        return f"[{low:.{min(digits, 17)}g}, {high:.{min(digits, 17)}g}]"

    def bracket(r):  # with fitted fields a std error is bracketed: where it lies
        bounds = r.get("std_error_bounds")
        if bounds is None or bounds[0] is None:
            return ""
        return ("; " if r.get("flag") else "") + f"std err within [{bounds[0]:.3g}, " + (
            "∞)" if bounds[1] is None else f"{bounds[1]:.3g}]")

    def flag(r):  # a fit stopped short: its interval spans the optimum, so say where that is
        text = r.get("flag") or ""
        if text.startswith(NOT_CONVERGED) and r.get("optimum") is not None:
            text += f" at {r['optimum']:.6g}"
        return text

    width = max([len("unit"), *(len(r.get("unit") or "") for r in rows)])
    spread = any("std_error" in r for r in rows)
    span = max([len("95 % interval"), *(len(interval(r)) for r in rows)])
    header = (f"{'parameter':<10} {'unit':<{width}} {'start':>12} {'recovered':>12} "
              f"{'true':>12} {'start err':>11} {'error':>11}")
    if spread:
        header += f" {'± std err':>11} {'95 % interval':<{span}}"
    lines = [header.rstrip()]
    for r in rows:
        line = (f"{r['name']:<10} {r.get('unit') or '':<{width}} {num(r['start']):>12} "
                f"{num(r['recovered']):>12} {num(r['true']):>12} "
                f"{format_percent(r['start_rel_error']):>11} "
                f"{format_percent(r['rel_error']):>11}")
        if spread:
            line += (f" {num(r.get('std_error')):>11} {interval(r):<{span}}"
                     + (f"  {flag(r)}{bracket(r)}" if r.get("flag") or bracket(r) else ""))
        lines.append(line.rstrip())
    return "\n".join(lines)


def unit_label(name: str, unit: str) -> str:
    """An axis or colour-bar label: ``name [unit]``, ``name (dimensionless)`` for unit "1",
    the bare name where no unit is known."""
    if not unit:
        return name
    return f"{name} (dimensionless)" if unit == "1" else f"{name} [{unit}]"


def time_title(t: float, unit: str) -> str:
    """``t = 6.5 ms`` (no unit where it is unknown or dimensionless)."""
    return f"t = {t:.4g}" + ("" if unit in ("", "1") else f" {unit}")


def describe_loss(loss: str, fields: Sequence[str], regularized: Sequence[str] = (),
                  weights: Mapping[str, float] | None = None) -> str:
    """What a fit minimises, for plot labels: the sum over observed fields of each one's
    (weighted) misfit — ``MSE(u) + MSE(v)``, ``relative MSE(u) + 2·relative MSE(v)`` —
    plus the named regularisation terms."""
    kind = {"mse": "MSE", "relative_mse": "relative MSE"}.get(loss, loss)
    weights = weights or {}
    text = " + ".join(f"{kind}({f})" if weights.get(f, 1.0) == 1.0
                      else f"{weights[f]:g}·{kind}({f})" for f in fields)
    return text + (f" + regularisation ({', '.join(regularized)})" if regularized else "")


def plot_loss(losses: Sequence[float], path: Path, description: str = "loss") -> None:
    """The loss per optimiser step on a log axis, titled with what it measures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
    ax.semilogy(np.arange(len(losses)), losses)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss = {description}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fields(observed: Mapping[str, np.ndarray], predicted: Mapping[str, np.ndarray],
                times: Sequence[float], path: Path, units: Mapping[str, str] | None = None,
                time_unit: str = "", labels: tuple[str, str] = ("observed", "predicted"),
                origin: str = "lower") -> None:
    """:func:`fields_figure` written to ``path``."""
    import matplotlib.pyplot as plt

    fig = fields_figure(observed, predicted, times, units, time_unit, labels, origin)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def fields_figure(observed: Mapping[str, np.ndarray], predicted: Mapping[str, np.ndarray],
                  times: Sequence[float], units: Mapping[str, str] | None = None,
                  time_unit: str = "", labels: tuple[str, str] = ("observed", "predicted"),
                  origin: str = "lower") -> Any:
    """Per field three rows — observed, predicted and their difference (predicted −
    observed) — and one column per time, each row with a colour bar labelled with the
    field's unit; observed and predicted share a colour scale, the difference has its own,
    symmetric one. NaN in ``observed`` marks unobserved points. ``labels`` names the two
    kinds of frames (e.g. truth and model of a forecast). ``origin``: where row 0 is drawn
    (matplotlib's ``imshow``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(observed)
    n_cols = len(times)
    fig, axes = plt.subplots(3 * len(names), n_cols, figsize=(2.2 * n_cols + 1.2,
                                                             6.3 * len(names)),
                             squeeze=False, layout="constrained")
    for i, name in enumerate(names):
        label = unit_label(name, (units or {}).get(name, ""))
        obs, pred = np.asarray(observed[name]), np.asarray(predicted[name])
        residual = pred - obs
        lo, hi = float(np.nanmin(obs)), float(np.nanmax(obs))
        span = float(np.nanmax(np.abs(residual))) or 1.0
        rows = ((labels[0], obs, {"vmin": lo, "vmax": hi, "cmap": "viridis"}, label),
                (labels[1], pred, {"vmin": lo, "vmax": hi, "cmap": "viridis"}, label),
                ("difference", residual, {"vmin": -span, "vmax": span, "cmap": "RdBu_r"},
                 label))
        for k, (row_name, frames, kwargs, bar_label) in enumerate(rows):
            row = axes[3 * i + k]
            for j in range(n_cols):
                image = row[j].imshow(frames[j], origin=origin, **kwargs)
                row[j].set_xticks([])
                row[j].set_yticks([])
            row[0].set_ylabel(f"{name} {row_name}")
            fig.colorbar(image, ax=list(row), shrink=0.9, label=bar_label)
    for j, t in enumerate(times):
        axes[0, j].set_title(time_title(t, time_unit))
    fig.suptitle(f"difference = {labels[1]} − {labels[0]}", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------
# Forecast metrics. All take plain arrays: frames are (n_frames, ny, nx), times (n_frames,).


def validity_horizon(times: np.ndarray, normalised_error: np.ndarray, threshold: float,
                     ) -> float:
    """How long after ``times[0]`` the error stays at or below ``threshold``: the time of the
    last frame before the first one above it (the whole span if it never exceeds it)."""
    times = np.asarray(times, dtype=np.float64)
    above = np.flatnonzero(np.asarray(normalised_error) > threshold)
    if above.size == 0:
        return float(times[-1] - times[0])
    first = int(above[0])
    return float(times[max(first - 1, 0)] - times[0]) if first > 0 else 0.0


def activation_times(frames: np.ndarray, times: np.ndarray, level: float) -> list[np.ndarray]:
    """Per pixel (flattened y·nx + x), the times where the field crosses ``level`` upwards,
    linearly interpolated between frames: the activation (upstroke) times of a wave."""
    frames = np.asarray(frames, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    flat = frames.reshape(frames.shape[0], -1)
    before, after = flat[:-1], flat[1:]
    crossing = (before < level) & (after >= level)
    frame_index, pixel = np.nonzero(crossing)
    fraction = (level - before[frame_index, pixel]) / (
        after[frame_index, pixel] - before[frame_index, pixel])
    when = times[frame_index] + fraction * (times[frame_index + 1] - times[frame_index])
    order = np.lexsort((when, pixel))
    pixel, when = pixel[order], when[order]
    splits = np.searchsorted(pixel, np.arange(1, flat.shape[1]))
    return np.split(when, splits)


def activation_time_error(truth: np.ndarray, model: np.ndarray, times: np.ndarray,
                          level: float, bins: int = 40) -> dict[str, np.ndarray | float]:
    """For every upstroke of the truth at every pixel, the distance to the model's nearest
    upstroke at that pixel; averaged in ``bins`` bins of the truth's activation time.

    Returns ``bin_centres``, ``mean_error`` (NaN for bins without activations), ``count``,
    ``missed`` (truth activations at pixels where the model never activates, left out of the
    mean) and ``overall`` (the mean over all matched activations)."""
    t_truth = activation_times(truth, times, level)
    t_model = activation_times(model, times, level)
    when, error, missed = [], [], 0
    for a, b in zip(t_truth, t_model, strict=True):
        if a.size == 0:
            continue
        if b.size == 0:
            missed += a.size
            continue
        index = np.searchsorted(b, a)
        below = b[np.clip(index - 1, 0, b.size - 1)]
        above = b[np.clip(index, 0, b.size - 1)]
        nearest = np.minimum(np.abs(a - below), np.abs(a - above))
        when.append(a)
        error.append(nearest)
    when = np.concatenate(when) if when else np.zeros(0)
    error = np.concatenate(error) if error else np.zeros(0)
    edges = np.linspace(times[0], times[-1], bins + 1)
    which = np.clip(np.digitize(when, edges) - 1, 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    total = np.bincount(which, weights=error, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return {"bin_centres": 0.5 * (edges[:-1] + edges[1:]), "mean_error": mean,
            "count": count, "missed": int(missed),
            "overall": float(error.mean()) if error.size else float("nan")}


def format_lyapunov(fit: Mapping[str, Any], unit: str = "") -> str:
    """One line on :func:`lyapunov_estimate`'s result: λ with its range over the directions
    and the Lyapunov time, or "undetermined" and why."""
    if fit["exponent"] is None:
        return f"maximal Lyapunov exponent: undetermined ({fit['reason']})"
    n = sum(d["exponent"] is not None for d in fit["directions"])
    return (f"maximal Lyapunov exponent {fit['exponent']:.4g} per time unit (range "
            f"{fit['exponent_min']:.4g}–{fit['exponent_max']:.4g} over {n} of "
            f"{len(fit['directions'])} directions, spread {fit['spread']:.0%}); Lyapunov time "
            f"{fit['lyapunov_time']:.4g}{unit} ({fit['lyapunov_time_min']:.4g}–"
            f"{fit['lyapunov_time_max']:.4g})")


def format_evaluation(result: Mapping[str, Any]) -> str:
    unit = result.get("time_unit", "")
    unit = "" if unit in ("", "1") else f" {unit}"
    lines = [f"training window {result['training_window'][0]:g}–{result['training_window'][1]:g}"
             f"{unit}, forecast over {result['horizon']:g}{unit} (frames every "
             f"{result['frame_interval']:g})"]
    lam = result["lyapunov_exponent"]
    lyapunov = format_lyapunov(result["lyapunov_fit"], unit)
    if lam is not None:
        lyapunov += (f"; training window = {result['training_window_lyapunov_times']:.3g} "
                     "Lyapunov times")
    lines.append(lyapunov)
    if result["truth_quiescent_from"] is None:
        lines.append(f"truth active ({result['active_measure']}) on ≥ "
                     f"{result['truth_active_fraction_min']:.1%} of the points at every frame")
    else:
        lines.append(f"the truth is at rest ({result['active_measure']} on fewer than "
                     f"{result['min_active_fraction']:.0%} of the points) from t = "
                     f"{result['truth_quiescent_from']:g}{unit}")
    lines.append(_format_validity(result, unit))
    if result["activation_time_error_mean"] is not None:
        lines.append(f"mean activation-time error {result['activation_time_error_mean']:.4g}"
                     f"{unit} "
                     f"({result['activation_time_missed']} truth activations unmatched)")
    final = {f: values[-1] for f, values in result["curves"]["mae"].items()}
    lines.append("MAE at the horizon: " + ", ".join(f"{f} {v:.3g}" for f, v in final.items()))
    if result.get("parameter_mean_rel_error") is not None:
        lines.append(f"parameters: mean |rel. deviation| "
                     f"{format_percent(result['parameter_mean_rel_error'])}, median "
                     f"{format_percent(result['parameter_median_rel_error'])}")
    return "\n".join(lines + _format_comparison(result, unit))


def _format_validity(result: Mapping[str, Any], unit: str) -> str:
    valid = (f"forecast valid for {result['valid_for']:g}{unit} (normalised MAE ≤ "
             f"{result['threshold']})")
    if result["lyapunov_exponent"] is not None:
        valid += f" = {result['valid_for_lyapunov_times']:.3g} Lyapunov times"
    if result["forecast_runs_into_rest"]:
        valid = (f"forecast valid until t = {result['training_window'][0] + result['valid_for']:g}"
                 f"{unit}, but the truth is at rest from t = {result['truth_quiescent_from']:g}"
                 f"{unit}: valid while active for {result['valid_while_active']:g}{unit} only")
    return valid


def _format_comparison(result: Mapping[str, Any], unit: str) -> list[str]:
    comparison = result.get("comparison")
    if not comparison:
        return []
    lines = [f"compared on {', '.join(comparison['fields'])} (normalised MAE ≤ "
             f"{comparison['threshold']}):"]
    for run in comparison["runs"]:
        whole = run["valid_for"] >= result["curves"]["time"][-1] - result["curves"]["time"][0]
        lines.append(f"  {run['label']}: valid for {run['valid_for']:g}{unit}"
                     + (" (the whole horizon)" if whole else "")
                     + f" from the training window's start (window "
                     f"{run['training_window'][0]:g}–{run['training_window'][1]:g}{unit})")
    return lines


def plot_activity(times: np.ndarray, fraction: np.ndarray, minimum: float,
                  rest_from: float | None, train_end: float, ylabel: str, path: Path,
                  xlabel: str = "time") -> None:
    """The truth's active fraction over time, with the rest threshold, the onset of rest and
    the end of the training window marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3), layout="constrained")
    ax.plot(times, 100.0 * np.asarray(fraction), label="truth")
    ax.axhline(100.0 * minimum, color="tab:red", ls=":", lw=1, label="at-rest threshold")
    if rest_from is not None:
        ax.axvline(rest_from, color="tab:red", lw=1, label="truth at rest from here")
    ax.axvline(train_end, color="k", ls="--", lw=1, label="end of training window")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ylabel} [%]", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_forecast(times: np.ndarray, curves: Mapping[str, np.ndarray], train_end: float,
                  path: Path, ylabel: str = "MAE", xlabel: str = "time") -> None:
    """Error curves versus time on a log axis, with the end of the training window marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    for label, values in curves.items():
        ax.semilogy(times, np.maximum(np.asarray(values, dtype=np.float64), 1e-12), label=label)
    ax.axvline(train_end, color="k", ls="--", lw=1, label="end of training window")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_traces(times: np.ndarray, truth: np.ndarray, model: np.ndarray, train_end: float,
                label: str, path: Path, xlabel: str = "time") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    ax.plot(times, truth, label="truth", lw=1.5)
    ax.plot(times, model, label="fitted model", lw=1, ls="--")
    ax.axvline(train_end, color="k", ls=":", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(times: np.ndarray, comparison: Mapping[str, Any], path: Path,
                    time_unit: str = "", field_units: Mapping[str, str] | None = None) -> None:
    """The forecast MAE of several fits of one truth on one log axis (the seed paper's Fig.
    2c): one curve per run and compared field, each run's training window shaded and the end
    of its validity (normalised MAE ≤ the threshold) dotted in its colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = list(comparison["fields"])
    units = {(field_units or {}).get(f, "") for f in fields}
    name = fields[0] if len(fields) == 1 else ", ".join(fields)
    fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    windows = {tuple(run["training_window"]) for run in comparison["runs"]}
    for i, (start, end) in enumerate(sorted(windows)):
        ax.axvspan(start, end, color="0.85", zorder=0,
                   label="training window" if i == 0 else None)
    styles = ("-", "--", "-.", ":")
    for k, run in enumerate(comparison["runs"]):
        colour = f"C{k}"
        for j, f in enumerate(fields):
            label = run["label"] + ("" if len(fields) == 1 else f", {f}")
            ax.semilogy(times, np.maximum(np.asarray(run["mae"][f], np.float64), 1e-12),
                        color=colour, ls=styles[j % len(styles)], lw=1.2, label=label)
        end = run["training_window"][0] + run["valid_for"]
        whole = run["valid_for"] >= times[-1] - times[0]
        ax.axvline(end, color=colour, ls=":", lw=1,
                   label=("valid for " if not whole else "valid to the horizon, ")
                   + f"{run['valid_for']:.4g}"
                   + ("" if time_unit in ("", "1") else f" {time_unit}"))
    ax.set_xlabel(unit_label("time", time_unit))
    ax.set_ylabel(unit_label(f"MAE of {name}", units.pop() if len(units) == 1 else ""))
    ax.set_title(f"forecasts of one {comparison['truth_system']} truth (valid: normalised MAE "
                 f"≤ {comparison['threshold']:g})", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)
