"""Evaluation of a sphere force fit (systems/sphere_ns.py) against a synthetic truth: how well
the shared force field and the per-experiment alignments (azimuthal rotation, time shift)
were recovered, and plots of the force.

The force is compared on the simulation grid (both truth and fit interpolated from their
nodes), over the observed region (points observed in any frame of any experiment; all of
the sphere without masks) at the frame times of the fitted window (in the experiments' mean
clock, that of the zero-mean time shifts), with area weights: where and when the data saw
it. (Node times at the ends of the window are seen only through a small interpolation
weight; the correlation at the node times is reported as well.) Three numbers:
the correlation of the force vectors themselves; of their divergence-free (solenoidal) parts,
the part of a force an incompressible flow responds to (the gradient part is balanced by
pressure and is invisible, so without a gauge penalty such as the system's
``force_gradient`` a fit may carry any gradient part); and of their curls, which weigh small
scales more. The share of the fitted force's mean square in its gradient part is reported too.

Alignments are only determined up to a common offset when the shared force can absorb it
(rotating every experiment by c and the force by −c changes nothing), so errors are given
both as they are and after removing their mean.

:func:`evaluate_fit` is the system's ``evaluate_fit`` hook (``SphereNS.evaluate_fit`` delegates
to it). It builds on the force of :mod:`pdefit.systems.sphere_force`, never on the system
module, and, being an evaluation, it reads the dataset's truths
(:mod:`pdefit.data`) and gathers fitted values onto the host
(:func:`pdefit.parallel.processes.host_array`), which the physics itself never does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pdefit import data as zd
from pdefit.model.system import SystemEvaluation
from pdefit.parallel.processes import host_array

from .sphere_force import force_at_times, gradient_part, solenoidal_part

ALIGNMENT = ("force_azimuth", "force_time_shift")


def force_fields(system: Any, grid: Any, nodes: np.ndarray,
                 times: np.ndarray | None = None) -> np.ndarray:
    """(F_θ, F_φ) on the simulation grid at ``times`` (default: the node times),
    (n_times, 2, nlat, nlon)."""
    node_times = system.force_times(nodes.shape[0])
    return np.asarray(force_at_times(nodes, node_times if times is None else times,
                                     node_times, grid))


def curls(system: Any, grid: Any, fields: np.ndarray) -> np.ndarray:
    """r̂·curl F on the grid for fields (..., 2, nlat, nlon)."""
    transform = system.transform(grid)
    f = jnp.asarray(fields)
    return np.asarray(transform.synthesis(transform.curl_analysis(f[..., 0, :, :],
                                                                  f[..., 1, :, :],
                                                                  system.radius)))


def helmholtz_parts(system: Any, grid: Any, fields: np.ndarray,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(solenoidal, gradient) parts of fields (..., 2, nlat, nlon), each of that shape."""
    transform = system.transform(grid)
    f = jnp.asarray(fields)
    parts = [np.stack(np.asarray(part(transform, f[..., 0, :, :], f[..., 1, :, :],
                                      system.radius)), axis=-3)
             for part in (solenoidal_part, gradient_part)]
    return parts[0], parts[1]


def weighted_correlation(a: np.ndarray, b: np.ndarray, weights: np.ndarray) -> float:
    """Pearson correlation of a and b with non-negative weights (broadcast to their shape)."""
    w = np.broadcast_to(weights, a.shape).astype(np.float64)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    total = w.sum()
    if total <= 0:
        return float("nan")
    da, db = a - (w * a).sum() / total, b - (w * b).sum() / total
    denominator = np.sqrt((w * da**2).sum() * (w * db**2).sum())
    return float((w * da * db).sum() / denominator) if denominator > 0 else float("nan")


def wrap_angle(x: np.ndarray) -> np.ndarray:
    """Into (−π, π]."""
    return np.pi - np.mod(np.pi - x, 2 * np.pi)


def alignment_errors(fitted: np.ndarray, truth: np.ndarray, angle: bool) -> dict[str, Any]:
    """RMS and max |error| as they are and with the common offset removed."""
    error = np.asarray(fitted, np.float64) - np.asarray(truth, np.float64)
    if angle:
        error = wrap_angle(error)
    offset = float(np.angle(np.mean(np.exp(1j * error)))) if angle else float(np.mean(error))
    relative = wrap_angle(error - offset) if angle else error - offset
    return {"rms_error": float(np.sqrt(np.mean(error**2))),
            "max_error": float(np.max(np.abs(error))), "common_offset": offset,
            "rms_error_offset_removed": float(np.sqrt(np.mean(relative**2))),
            "fitted": [float(v) for v in fitted], "true": [float(v) for v in truth]}


def observed_region(ds: zd.Dataset, fields: Sequence[str], experiments: Sequence[int],
                    ) -> np.ndarray:
    """(nlat, nlon) weights 1 where any observed field is observed in any selected frame."""
    masked = [f for f in fields if ds.has_mask(f)]
    if not masked:
        return np.ones(ds.meta.grid_shape)
    region = np.zeros(ds.meta.grid_shape, bool)
    for name in masked:
        region |= np.any(ds.read_mask(name, list(experiments)), axis=(0, 1))
    return region.astype(np.float64)


def evaluate_fit(problem: Any, theta: Mapping[str, Any], dataset: Path,
                 experiments: Sequence[int] | None, out: Path | None, plots: bool,
                 ) -> SystemEvaluation | None:
    """The sphere's ``evaluate_fit`` hook (see :mod:`pdefit.model.system`), which
    :class:`~pdefit.systems.sphere_ns.SphereNS` offers: the recovered force and alignments
    against the dataset's truths; None unless they were fitted or the dataset has none."""
    if "force" not in problem.layout.fitted and not problem.layout.per_experiment:
        return None
    result = evaluate_force_fit(problem, theta, dataset, experiments, out, plots)
    return SystemEvaluation({"sphere_force": result}, format_report(result)) if result else None


def evaluate_force_fit(problem: Any, theta: Mapping[str, Any], dataset: Path,
                       experiments: Sequence[int] | None = None,
                       out: Path | None = None, plots: bool = False) -> dict[str, Any]:
    """Correlations of the recovered force with the dataset's true force, and alignment
    errors; empty if the dataset has no such truths or nothing of them was fitted."""
    ds = zd.open_dataset(dataset)
    meta = ds.meta
    layout = problem.layout
    if experiments is None:
        experiments = list(range(meta.n_experiments))
    physical = {k: host_array(v) for k, v in layout.physical(theta["params"]).items()
                if k in layout.fitted}
    truths = meta.true_per_experiment or {}
    result = alignment_report(layout, physical, truths, experiments)
    if "force" in layout.fitted and "force" in meta.true_arrays:
        result["force"] = force_report(problem, ds, physical["force"], experiments,
                                       out if plots else None)
    return result


def alignment_report(layout: Any, physical: Mapping[str, np.ndarray],
                     truths: Mapping[str, Any], experiments: Sequence[int],
                     ) -> dict[str, Any]:
    """The errors of each per-experiment alignment that was fitted and has a truth."""
    result: dict[str, Any] = {}
    for name in ALIGNMENT:
        if name in layout.per_experiment and name in truths:
            true = np.asarray(truths[name])[list(experiments)]
            result[name] = alignment_errors(physical[name], true, name == "force_azimuth")
    return result


def force_report(problem: Any, ds: zd.Dataset, fitted: np.ndarray, experiments: Sequence[int],
                 plots_to: Path | None) -> dict[str, Any]:
    """The ``force`` entry of :func:`evaluate_force_fit`: the fitted force against the true
    one over the observed region, at the frame times of the fitted window and at the node
    times the data reach; plots in ``plots_to`` (None: no plots)."""
    system, grid = problem.system, problem.grid
    true_nodes = ds.read_true_array("force")
    fitted_nodes = np.asarray(fitted, np.float64)
    theta_nodes, _ = system.coordinates(grid)
    area = np.sin(theta_nodes)[:, None] * observed_region(ds, problem.observation.fields,
                                                          experiments)
    window = (problem.t0, problem.t0 + problem.n_steps * problem.dt)
    frame_times = frames_in_window(ds.meta.times, window, problem.dt)
    true_f = force_fields(system, grid, true_nodes, frame_times)
    fit_f = force_fields(system, grid, fitted_nodes, frame_times)
    times = system.force_times(true_nodes.shape[0])
    seen = node_times_seen(times, window, ds.meta.true_per_experiment or {})
    true_at_nodes = force_fields(system, grid, true_nodes)
    fit_at_nodes = force_fields(system, grid, fitted_nodes)
    report = {
        **frame_correlations(system, grid, fit_f, true_f, area),
        "correlation_at_node_times": weighted_correlation(
            fit_at_nodes, true_at_nodes, area[None, None] * seen[:, None, None, None]),
        "node_correlation": weighted_correlation(fitted_nodes, true_nodes, 1.0),
        "rms_true": float(np.sqrt(np.mean(true_f**2))),
        "rms_fitted": float(np.sqrt(np.mean(fit_f**2))),
        "frame_times": len(frame_times),
        "node_times_seen": int(seen.sum()),
    }
    if plots_to is not None:
        plot_force_maps(true_at_nodes, fit_at_nodes, system, grid, times,
                        plots_to / "force_maps.png")
        plot_force_hovmoller(true_at_nodes, fit_at_nodes, system, grid, times,
                             plots_to / "force_theta_vs_time.png")
    return report


def frames_in_window(times: Sequence[float], window: tuple[float, float], dt: float,
                     ) -> np.ndarray:
    """The dataset's frame times inside the fitted window (to a tolerance of 1e-9 steps)."""
    frame_times = np.asarray(times, np.float64)
    return frame_times[(frame_times >= window[0] - 1e-9 * dt)
                       & (frame_times <= window[1] + 1e-9 * dt)]


def node_times_seen(times: np.ndarray, window: tuple[float, float],
                    truths: Mapping[str, Any]) -> np.ndarray:
    """Which force node times the data reach: those in the window moved by the true time
    shifts, ± one node spacing."""
    shifts = np.asarray(truths.get("force_time_shift", [0.0]))
    spacing = (times[1] - times[0]) if len(times) > 1 else np.inf
    return ((times >= window[0] + shifts.min() - spacing)
            & (times <= window[1] + shifts.max() + spacing))


def frame_correlations(system: Any, grid: Any, fit_f: np.ndarray, true_f: np.ndarray,
                       area: np.ndarray) -> dict[str, float]:
    """Correlations of the force fields at the frame times (area-weighted): of the vectors,
    their solenoidal parts and their curls, and the fitted force's share in its gradient
    part."""
    w = np.broadcast_to(area, true_f.shape)
    true_solenoidal, _ = helmholtz_parts(system, grid, true_f)
    fit_solenoidal, fit_gradient = helmholtz_parts(system, grid, fit_f)
    return {
        "correlation": weighted_correlation(fit_f, true_f, w),
        "solenoidal_correlation": weighted_correlation(fit_solenoidal, true_solenoidal, w),
        "curl_correlation": weighted_correlation(
            curls(system, grid, fit_f), curls(system, grid, true_f), w[:, 0]),
        "gradient_share_fitted": float((w * fit_gradient**2).sum()
                                       / max((w * fit_f**2).sum(), 1e-300)),
    }


def format_report(result: Mapping[str, Any]) -> str:
    lines = []
    if "force" in result:
        f = result["force"]
        lines.append(f"force over the {f['frame_times']} frame times: correlation "
                     f"{f['correlation']:.4f} (solenoidal part {f['solenoidal_correlation']:.4f}"
                     f", curl {f['curl_correlation']:.4f}); RMS fitted {f['rms_fitted']:.3g} vs "
                     f"true {f['rms_true']:.3g}; gradient part {f['gradient_share_fitted']:.2%} "
                     "of the fitted mean square")
        lines.append(f"force at the {f['node_times_seen']} node times seen: correlation "
                     f"{f['correlation_at_node_times']:.4f}; raw nodes "
                     f"{f['node_correlation']:.4f}")
    for name, unit in (("force_azimuth", "rad"), ("force_time_shift", "time")):
        if name in result:
            e = result[name]
            lines.append(f"{name}: RMS error {e['rms_error']:.4g} {unit} (max "
                         f"{e['max_error']:.4g}; common offset {e['common_offset']:.3g}, RMS "
                         f"without it {e['rms_error_offset_removed']:.4g})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots.


def plot_force_maps(true_f: np.ndarray, fit_f: np.ndarray, system: Any, grid: Any,
                    times: np.ndarray, path: Path) -> None:
    """F_θ and F_φ, true and fitted, on a longitude–colatitude map at the middle node time."""
    k = len(times) // 2
    theta, _ = system.coordinates(grid)
    vmax = [float(np.max(np.abs(true_f[k, c]))) or 1.0 for c in range(2)]
    panels = [[(f"{label} {what}, t = {times[k]:.3g}", f[k, c], vmax[c])
               for c, label in enumerate(("F_θ", "F_φ"))]
              for what, f in (("true", true_f), ("fitted", fit_f))]
    _save_panels(panels, (0, 360, np.degrees(theta[-1]), np.degrees(theta[0])),
                 "longitude φ (°)", path, figsize=(10, 6))


def plot_force_hovmoller(true_f: np.ndarray, fit_f: np.ndarray, system: Any, grid: Any,
                         times: np.ndarray, path: Path) -> None:
    """The components averaged over longitude, versus colatitude and time: ⟨F_θ⟩_φ (top) and
    ⟨F_φ⟩_φ (bottom), true and fitted. A zonally symmetric F_θ(θ) θ̂ has no curl, so it does
    not act on an incompressible flow and cannot be recovered; ⟨F_φ⟩_φ can."""
    theta, _ = system.coordinates(grid)
    panels = []
    for row, label in enumerate(("F_θ", "F_φ")):
        means = (true_f[:, row].mean(axis=-1), fit_f[:, row].mean(axis=-1))
        vmax = max(float(np.max(np.abs(m))) for m in means) or 1.0
        panels.append([(f"⟨{label}⟩_φ {what}", mean.T, vmax)
                       for what, mean in zip(("true", "fitted"), means, strict=True)])
    _save_panels(panels, (times[0], times[-1], np.degrees(theta[-1]), np.degrees(theta[0])),
                 "time", path, figsize=(10, 7), sharey=True)


def _save_panels(panels: Sequence[Sequence[tuple[str, np.ndarray, float]]],
                 extent: tuple[float, ...], xlabel: str, path: Path, **subplots: Any) -> None:
    """A 2 × 2 figure of images against colatitude, ``panels[row][col] = (title, image,
    vmax)``, each on the diverging scale ±vmax with its own colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, constrained_layout=True, **subplots)
    for row, axes_row in zip(panels, axes, strict=True):
        for (title, image, vmax), ax in zip(row, axes_row, strict=True):
            im = ax.imshow(image, extent=extent, aspect="auto", cmap="RdBu_r", vmin=-vmax,
                           vmax=vmax)
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("colatitude θ (°)")
            fig.colorbar(im, ax=ax)
    fig.savefig(path, dpi=100)
    plt.close(fig)
