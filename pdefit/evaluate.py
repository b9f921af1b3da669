"""Reports of a finished fit: recovered-vs-true table, JSON summary and plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def parameter_table(fitted: Sequence[str], start: Mapping[str, float],
                    recovered: Mapping[str, float], truth: Mapping[str, float] | None,
                    ) -> list[dict[str, float | str | None]]:
    rows = []
    for name in fitted:
        true = None if truth is None else truth.get(name)
        rel = None if true in (None, 0) else abs(recovered[name] - true) / abs(true)
        rel0 = None if true in (None, 0) else abs(start[name] - true) / abs(true)
        rows.append({"name": name, "start": start[name], "recovered": recovered[name],
                     "true": true, "start_rel_error": rel0, "rel_error": rel})
    return rows


def error_summary(rows: Sequence[Mapping]) -> dict[str, float | None]:
    errors = [r["rel_error"] for r in rows if r["rel_error"] is not None]
    if not errors:
        return {"mean_rel_error": None, "median_rel_error": None, "max_rel_error": None}
    return {"mean_rel_error": float(np.mean(errors)),
            "median_rel_error": float(np.median(errors)),
            "max_rel_error": float(np.max(errors))}


def format_table(rows: Sequence[Mapping]) -> str:
    def num(x):
        return "—" if x is None else f"{x:.6g}"

    def pct(x):
        return "—" if x is None else f"{100 * x:.3f} %"

    lines = [f"{'parameter':<10} {'start':>12} {'recovered':>12} {'true':>12} "
             f"{'start err':>11} {'error':>11}"]
    for r in rows:
        lines.append(f"{r['name']:<10} {num(r['start']):>12} {num(r['recovered']):>12} "
                     f"{num(r['true']):>12} {pct(r['start_rel_error']):>11} "
                     f"{pct(r['rel_error']):>11}")
    return "\n".join(lines)


def plot_loss(losses: Sequence[float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.semilogy(np.arange(len(losses)), losses)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fields(observed: Mapping[str, np.ndarray], predicted: Mapping[str, np.ndarray],
                times: Sequence[float], path: Path) -> None:
    """Observed and predicted frames side by side: rows are (field, observed/predicted),
    columns a few times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(observed)
    n_cols = len(times)
    fig, axes = plt.subplots(2 * len(names), n_cols, figsize=(2.2 * n_cols, 4.2 * len(names)),
                             squeeze=False, layout="constrained")
    for i, name in enumerate(names):
        lo = float(np.nanmin(observed[name]))
        hi = float(np.nanmax(observed[name]))
        for j in range(n_cols):
            for k, (label, frames) in enumerate((("observed", observed), ("predicted", predicted))):
                ax = axes[2 * i + k, j]
                ax.imshow(frames[name][j], vmin=lo, vmax=hi, origin="lower", cmap="viridis")
                ax.set_xticks([])
                ax.set_yticks([])
                if j == 0:
                    ax.set_ylabel(f"{name} {label}")
                if i == 0 and k == 0:
                    ax.set_title(f"t = {times[j]:.3g}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
