"""How much the discretization moves a fit, and data made by a finer one.

**The check** (``fit.discretization_check``). A fit matches the data with the model *as
discretized* (its ``system.dt``, ``system.integrator`` and ``system.grid``); when the data come
from the continuous system (or another solver) the difference between the two is model error,
which the fitted parameters absorb as bias. After a fit, :func:`check` runs the fitted model
(fitted parameters and initial fields) over the training window again with the time step
divided by ``dt_factor`` (the same frame times), and optionally on the grid refined
``grid_factor`` times (the initial state interpolated to it, the prediction block-averaged
back to the observed grid, see below). With the fit's own misfit normalisation
(:mod:`pdefit.fitting.observe`: weights, masks, stride, ``mse`` or ``relative_mse``) it reports

- ``misfit``: the data misfit at the fit's discretization, and ``misfit_refined`` at the
  finer one (same parameters);
- ``change``: the same misfit measure between the two predictions, and
  ``change_vs_residual`` = √(change / misfit), the RMS change of the predicted observations
  relative to the RMS residual; ``change_vs_data`` = √(change / data), relative to the RMS
  of the observations.

For a scheme of order p the change is (1 − 2^−p) of the coarse discretization error (half of
it for first order), so it estimates that error from below. When the change is not small
against the residual (``change_vs_residual > tolerance``, and ``change_vs_data >
negligible``) the residual is (partly) discretization error and the fitted parameters may be
biased by it: a warning names the knob (``system.dt``, ``system.integrator`` or
``system.grid.shape``). On noise-free data of another solver the residual *is* model error,
so the ratio is then of order one whatever the scheme (only ``negligible`` can make such a
check quiet); on noisy data the residual is the noise and the ratio says whether the
discretization error stands out of it. When the dataset records that it was made with the
fit's own time step, integrator and grid (a twin experiment, the "inverse crime"), the
residual cannot show discretization error at all: the verdict is ``twin`` and the numbers
say how far a finer discretization would move the predictions.

The bias itself, for fits of shared scalars on one device (``parameters: true``):
:func:`parameter_shift` estimates how far each fitted scalar's optimum moves at the finer
time step, by a Gauss–Newton step from the difference of the two gradients, on the curvature
the intervals (:mod:`pdefit.fitting.uncertainty`) computed when the fit has them. It then decides
for the time step (a warning above ``parameter_tolerance``, relative), whatever the noise. The
shift is reported as measured, not extrapolated: for a scheme of order p the bias at dt would
be k^p/(k^p − 1) times the shift to dt/k asymptotically, but the order that holds is the
model's as much as the scheme's (a right-hand side with sharp thresholds makes every scheme
first order as dt → 0), and on a staircase-shaped misfit the Gauss–Newton step is only an
order of magnitude of the bias; on a smooth model it tracks each parameter's error closely
(measured: docs/design-decisions.md, "Discretization error"). Settings the check cannot
serve (``parameters`` without a Gauss–Newton curvature: fitted fields, array or
per-experiment parameters, a device mesh; ``grid_factor`` > 1 on a grid that cannot be
refined) are refused before the fit (:func:`unsupported`,
:func:`pdefit.app.validate.validate_discretization_check`).

Where the residual is partly discretization error (``model_error_in_residual``: the residual
test above, not in a twin), the intervals of :mod:`pdefit.fitting.uncertainty`, which take the
residual for noise, are marked unreliable (:func:`mark_intervals`).

With ``grid_factor`` > 1 the same numbers for the refined grid (its time step refined too,
by as much more as the finer grid's stability limit needs) are under ``grid_check``, and the
grid is named as the knob when refining it moves the prediction more than twice as far (RMS)
as refining the time step alone.

Cost: one compiled call per refinement, no gradient: the fit's model and the pair side by
side (the fine one ``dt_factor`` steps per coarse step), whose one run gives both the refined
model's misfit and the change, about one gradient evaluation in all; with ``parameters`` one
gradient at the finer step more (and the curvature's forward-tangent sweep where the fit has
no intervals). It goes through the fit's own loss code
(:meth:`pdefit.fitting.problem.FitProblem.data_loss`, with the chain and initial state of the pair),
so experiments, per-experiment parameters and device meshes work as in the fit.

**Grid transfer** (refined data, ``simulate.refine``, and the grid part of the check). Fields
live at cell centres, and a coarse cell is exactly ``m × m`` fine cells, so no fine centre
coincides with a coarse one (injection has nothing to inject for even m): a fine field goes
back to the coarse grid by the **block average** of each coarse cell's fine cells — what a
coarse cell-centred (finite-volume) value represents, second-order accurate. A coarse field
goes to the fine grid by **conservative linear prolongation**: in each coarse cell, along each
axis, the value plus the central-difference slope times the sub-cell offset (ghosts from the
axis's boundary condition). It is second-order accurate and its block average is the coarse
field exactly, so a refined simulation starts from the same physical state as the coarse one:
the refined dataset's first frame is the coarse generator's state. Only systems that declare
``refinable_grid = True`` (cell-centred fields and nothing tied to the cell count, e.g.
reaction–diffusion) are refined; a staggered or spectral grid is not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from pdefit.adjoint import LossChain, StoreAll
from pdefit.fitting import directions, uncertainty
from pdefit.fitting.observe import ObservedData, zero_like_state
from pdefit.fitting.problem import Batch, FitProblem
from pdefit.model.system import System, made_by, stable_dt_limit, stepper
from pdefit.numerics.grid import PERIODIC, Grid
from pdefit.parallel.processes import host_scalar

TWIN = "twin"
OK = "ok"
WARNING = "warning"
SKIPPED = "skipped"

# ---------------------------------------------------------------------------------------------
# Grid transfer.


def refinement_unsupported(system: System) -> str | None:
    """Why ``system``'s fields cannot be moved to a refined grid (None: they can)."""
    if not getattr(system, "refinable_grid", False):
        return (f"{system.name} does not declare a refinable cell-centred grid "
                "(refinable_grid)")
    arrays = sorted(n for n, spec in system.params.items() if spec.shape)
    if arrays:
        return f"{system.name} has array parameters {arrays} tied to the grid"
    return None


def refined_grid(grid: Grid, factor: int) -> Grid:
    """``grid`` with ``factor`` × the cells per axis over the same extent."""
    return dataclasses.replace(grid, shape=tuple(n * factor for n in grid.shape),
                               spacing=tuple(h / factor for h in grid.spacing))


def _prolong_axis(u: jnp.ndarray, axis: int, factor: int, boundary: str) -> jnp.ndarray:
    u = jnp.moveaxis(u, axis, -1)
    padded = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(1, 1)],
                     mode="wrap" if boundary == PERIODIC else "symmetric")
    slope = 0.5 * (padded[..., 2:] - padded[..., :-2])
    offsets = jnp.asarray((np.arange(factor) + 0.5) / factor - 0.5, u.dtype)
    fine = u[..., None] + slope[..., None] * offsets
    return jnp.moveaxis(fine.reshape(*u.shape[:-1], u.shape[-1] * factor), -1, axis)


def prolong(u: jnp.ndarray, factor: int, boundaries: tuple[str, str]) -> jnp.ndarray:
    """A field (last two axes the grid's) on the grid refined ``factor`` times: conservative
    linear prolongation, so ``restrict(prolong(u)) == u``."""
    if factor == 1:
        return u
    for axis, boundary in zip((-2, -1), boundaries, strict=True):
        u = _prolong_axis(u, u.ndim + axis, factor, boundary)
    return u


def restrict(u: jnp.ndarray, factor: int) -> jnp.ndarray:
    """The block average of each ``factor × factor`` block of the last two axes."""
    if factor == 1:
        return u
    ny, nx = u.shape[-2] // factor, u.shape[-1] // factor
    return u.reshape(*u.shape[:-2], ny, factor, nx, factor).mean(axis=(-3, -1))


def stable_substeps(system: System, params: Mapping[str, Any], grid: Grid, dt: float,
                    integrator: str, at_least: int) -> int:
    """The smallest number of substeps ≥ ``at_least`` that makes dt/substeps stable on
    ``grid`` (a finer grid lowers a diffusive limit as h²)."""
    limit = stable_dt_limit(system, params, grid, integrator)
    return max(at_least, math.ceil(dt / limit * (1.0 - 1e-12)))


# ---------------------------------------------------------------------------------------------
# The check.


@dataclasses.dataclass(frozen=True)
class _Refined(FitProblem):
    """The fit's problem run side by side with the same model at ``dt / substeps`` (on the
    grid refined ``grid_factor`` times), or with ``alone`` the refined model only, whose
    misfit is the refined prediction's. The pair's misfit is complex: its real part the
    misfit between the fit's prediction and the refined one, its imaginary part the refined
    prediction's misfit to the data; two measures of one run through the fit's loss code,
    which sums one scalar per step."""

    substeps: int = 2
    grid_factor: int = 1
    alone: bool = False

    def initial_state(self, theta: Mapping[str, Any], batch: Batch) -> dict[str, Any]:
        x0 = super().initial_state(theta, batch)
        fine = {k: prolong(v, self.grid_factor, self.grid.boundaries) for k, v in x0.items()}
        return {"fine": fine} if self.alone else {"coarse": x0, "fine": fine}

    def chain(self, grid: Any = None) -> LossChain:
        grid = grid or self.grid
        fine_grid = refined_grid(getattr(grid, "grid", grid), self.grid_factor)
        if hasattr(grid, "devices"):  # a device's tile
            fine_grid = dataclasses.replace(grid, grid=fine_grid)
        coarse_step = stepper(self.system, grid, self.integrator)
        fine_step = stepper(self.system, fine_grid, self.integrator)
        dt, t0, k, m = self.dt, self.t0, self.substeps, self.grid_factor
        observation = self.observation.on_grid(grid)  # both predictions are compared on grid

        def step(state, params, n):
            def sub(j, x):
                return fine_step(x, params, t0 + n * dt + j * (dt / k), dt / k)

            new = {"fine": jax.lax.fori_loop(0, k, sub, state["fine"])}
            if "coarse" in state:
                new["coarse"] = coarse_step(state["coarse"], params, t0 + n * dt, dt)
            return new

        def cost(state, params, n, data):
            fine = {f: restrict(v, m) for f, v in state["fine"].items()}
            to_data = observation.cost(fine, data, n)
            if "coarse" not in state:
                return to_data
            slot = data.slot_of_step[n]

            def change():
                at = jnp.maximum(slot, 0)
                target = ObservedData(
                    {f: v[None] for f, v in observation.project(fine).items()},
                    {f: jax.lax.dynamic_index_in_dim(w, at, 0) for f, w in data.weights.items()},
                    data.scale, data.slot_of_step)
                return observation.misfit(state["coarse"], target, 0)

            between = jax.lax.cond(slot >= 0, change, lambda: zero_like_state(state))
            return jax.lax.complex(between, to_data)

        def observed(n, data):
            return observation.observed(data, n)

        return LossChain(step, cost, observed)


def _refined_problem(problem: FitProblem, substeps: int, grid_factor: int = 1,
                     alone: bool = False, schedule: Any = None) -> _Refined:
    """``problem`` as a :class:`_Refined`; by default a forward evaluation only (no snapshots
    are kept whatever the fit's schedule)."""
    values = {f.name: getattr(problem, f.name) for f in dataclasses.fields(FitProblem)}
    values["schedule"] = StoreAll() if schedule is None else schedule
    return _Refined(**values, substeps=substeps, grid_factor=grid_factor, alone=alone)


def _data_norm(problem: FitProblem, batch: Batch) -> jnp.ndarray:
    """The misfit measure of a prediction of zero: the size of the observations."""
    weights = dict(problem.observation.field_weights)
    obs = batch.observed
    total = sum(weights.get(f, 1.0) * jnp.sum(obs.scale[f] * jnp.sum(
        obs.weights[f] * obs.values[f] ** 2, axis=tuple(range(1, obs.values[f].ndim))))
        for f in obs.values)
    return total / next(iter(obs.scale.values())).shape[0]


def unsupported(problem: FitProblem, options: Any, key: str = "fit.discretization_check",
                ) -> str | None:
    """Why ``options`` (``fit.discretization_check``'s, under ``key``) cannot check fits of
    ``problem``, naming the offending key (None: they can). Known before the fit, so that
    :mod:`pdefit.app.validate` refuses them before anything is compiled."""
    if not options.enabled:
        return None
    if int(options.grid_factor) > 1:
        reason = refinement_unsupported(problem.system)
        if reason is None and problem.domain is not None and hasattr(problem.system, "step"):
            reason = "a system with its own step is not refined on a device mesh"
        if reason is not None:
            return (f"{key}.grid_factor={options.grid_factor}: {reason}; use "
                    f"{key}.grid_factor=1")
    if options.parameters:
        reason = uncertainty.unavailable_reason(problem)
        if reason is not None:
            return (f"{key}.parameters=true needs the Gauss–Newton curvature of the fitted "
                    f"scalars, which is not available: {reason}; set {key}.parameters=false")
    return None


def twin_reason(meta: Any, problem: FitProblem) -> str | None:
    """Why the dataset ``meta`` describes was made by ``problem``'s own discretization (None:
    it was not, or it does not say): same system, time step, integrator and grid."""
    made = (meta.provenance or {}).get("discretization")
    config = ((meta.provenance or {}).get("config") or {})
    system_cfg = (config.get("simulate") or {}).get("system") or config.get("system") or {}
    if made is None and not system_cfg:
        return None  # not simulated by pdefit: nothing says how it was made
    if not made_by(meta.system, problem.system):
        return None
    integrator = (made or {}).get("integrator", system_cfg.get("integrator"))
    own_step = hasattr(problem.system, "step")  # the integrator is not used
    grid_shape = tuple((made or {}).get("grid_shape", meta.grid_shape))
    # A recording (no dt) was made by no solver of ours: independent data.
    same_dt = meta.dt is not None and math.isclose(float(meta.dt), float(problem.dt),
                                                   rel_tol=1e-9)
    if (same_dt and (own_step or integrator == problem.integrator)
            and grid_shape == tuple(problem.grid.shape)):
        stepping = "step" if own_step else f"integrator {problem.integrator}"
        return (f"the data were simulated with the fit's own dt={problem.dt}, {stepping} and "
                f"grid {list(problem.grid.shape)}")
    return None


def _ratio(numerator: float, denominator: float) -> float | None:
    """√(numerator / denominator); None for a zero denominator (JSON has no infinity)."""
    return math.sqrt(numerator / denominator) if denominator > 0 else None


def _measure(problem: FitProblem, theta: Any, batch: Batch, substeps: int, grid_factor: int,
             ) -> dict[str, Any]:
    """The fit's misfit, the size of the data, the refined model's misfit and the change
    from the fit's prediction to the refined one: one compiled call (the fit's model and the
    pair side by side)."""
    pair = _refined_problem(problem, substeps, grid_factor)

    def values(th, b):
        both = pair.data_loss(th, b)
        return [problem.data_loss(th, b), _data_norm(problem, b), jnp.imag(both),
                jnp.real(both)]

    misfit, data, refined, change = map(host_scalar, jax.jit(values)(theta, batch))
    return {"misfit": misfit, "data": data, "dt": problem.dt / substeps,
            "grid": list(refined_grid(problem.grid, grid_factor).shape),
            "misfit_refined": refined, "change": change,
            "change_vs_residual": _ratio(change, misfit), "change_vs_data": _ratio(change, data)}


def _large(measure: Mapping[str, Any], options: Any) -> bool:
    ratio, relative = measure["change_vs_residual"], measure["change_vs_data"]
    return ((ratio is None or ratio > options.tolerance)
            and (relative is None or relative > options.negligible))


def _grid_substeps(problem: FitProblem, theta: Any, batch: Batch, factor: int,
                   at_least: int) -> int:
    """Time substeps on the grid refined ``factor`` times (every experiment's limit)."""
    n_experiments = jax.tree.leaves(problem.initial_state(theta, batch))[0].shape[0]
    return max(stable_substeps(problem.system, problem.experiment_params(theta, e),
                               refined_grid(problem.grid, factor), problem.dt,
                               problem.integrator, at_least)
               for e in range(n_experiments))


def parameter_shift(problem: FitProblem, theta: Any, batch: Batch, substeps: int,
                    parts: uncertainty.CurvatureParts | None = None) -> dict[str, Any]:
    """How far the optimum of the fitted shared scalars moves when the time step is divided
    by ``substeps``: the Gauss–Newton step δθ = −(2B)⁺ (∇L_fine − ∇L) from the fitted θ, B the
    curvature of :mod:`pdefit.fitting.uncertainty` (``parts``: :func:`uncertainty.curvature_parts`
    at θ where already computed; the difference of gradients makes it the shift of the
    optimum whether or not the fit reached it). Per parameter in physical units and relative
    to its value. Costs a gradient at the refined step (and the forward-tangent sweep of the
    curvature without ``parts``)."""
    if parts is None:
        parts = uncertainty.curvature_parts(problem, theta, batch)
    refined = _refined_problem(problem, substeps, alone=True, schedule=problem.schedule)
    flat, unravel = ravel_pytree(theta["params"])
    gradient = np.asarray(ravel_pytree(jax.jit(jax.grad(refined.loss))(theta, batch)["params"])[0],
                          np.float64)
    inverse = directions.pseudo_inverse(parts.bread, directions.default_rcond(flat.dtype))[0]
    step = -0.5 * inverse @ (gradient - parts.gradient)
    index = unravel(jnp.arange(flat.shape[0]))
    shifts = {}
    for name in problem.layout.scalars:
        with jax.enable_x64(True):  # float64 even in a float32 fit
            value, slope = uncertainty.mapped(problem.layout.specs[name],
                                              float(theta["params"][name]))[:2]
        shift = slope * float(step[int(index[name])])
        shifts[name] = {"shift": shift, "relative": abs(shift / value) if value else None}
    relative = {n: r["relative"] for n, r in shifts.items() if r["relative"] is not None}
    largest = max(relative, key=relative.get) if relative else None
    return {"available": True, "parameters": shifts, "largest": largest,
            "max_relative": relative.get(largest)}


def check(problem: FitProblem, theta: Any, batch: Batch, options: Any, meta: Any = None,
          log: Callable[[str], None] = print,
          curvature: uncertainty.CurvatureParts | None = None) -> dict[str, Any]:
    """The ``discretization_check`` block of summary.json for the fitted ``theta`` (see the
    module docstring); ``options`` are ``fit.discretization_check``'s (ValueError for those
    :func:`unsupported` refuses), ``meta`` the dataset's metadata (for the twin verdict),
    ``curvature`` the :func:`pdefit.fitting.uncertainty.curvature_parts` at ``theta`` where the fit
    has them (for ``parameters``).

    Top level: the time-step refinement (``refined_dt``, ``misfit_refined``, ``change``,
    ``change_vs_residual``, ``change_vs_data``); under ``grid`` the same for the grid
    refinement where asked for and possible (its time step refined too, as far as the finer
    grid's stability limit needs)."""
    refused = unsupported(problem, options)
    if refused is not None:
        raise ValueError(refused)
    k, m = int(options.dt_factor), int(options.grid_factor)
    log(f"discretization check: the fitted model again at dt/{k}"
        + (f" and on the grid ×{m}" if m > 1 else "") + "…")
    time = _measure(problem, theta, batch, k, 1)
    result: dict[str, Any] = {
        "dt": problem.dt, "integrator": problem.integrator, "grid": list(problem.grid.shape),
        "dt_factor": k, "tolerance": float(options.tolerance),
        "negligible": float(options.negligible), "misfit": time["misfit"],
        "data": time["data"], "refined_dt": time["dt"],
        **{key: time[key] for key in ("misfit_refined", "change", "change_vs_residual",
                                      "change_vs_data")}}
    residual_large = _large(time, options)
    # With the parameter shift at hand it decides for the time step: it measures the bias
    # itself, which the residual does not on data without noise.
    by_shift = bool(options.parameters)
    if by_shift:
        shift = parameter_shift(problem, theta, batch, k, curvature)
        result.update(parameter_shift=shift,
                      parameter_tolerance=float(options.parameter_tolerance))
        time_large = (shift["max_relative"] or 0.0) > options.parameter_tolerance
    else:
        time_large = residual_large
    result["criterion"] = "parameter_shift" if by_shift else "residual"
    grid: dict[str, Any] | None = None
    notes: list[str] = []
    if m > 1:
        substeps = _grid_substeps(problem, theta, batch, m, k)
        if substeps > k:
            notes.append(f"dt/{substeps} on the grid ×{m} (its stability limit)")
        grid = _measure(problem, theta, batch, substeps, m)
        result["grid_check"] = {"grid_factor": m, **{
            key: grid[key] for key in ("dt", "grid", "misfit_refined", "change",
                                       "change_vs_residual", "change_vs_data")}}
        residual_large = residual_large or _large(grid, options)
    knobs = _knobs(problem, options, time_large, by_shift, time, grid)
    return _with_verdict(result, problem, meta, knobs, notes, residual_large)


def _knobs(problem: FitProblem, options: Any, time_large: bool, by_shift: bool,
           time: Mapping[str, Any], grid: Mapping[str, Any] | None) -> list[str]:
    """The config keys to turn: the time stepping where its refinement matters, the grid
    where its refinement does (first)."""
    # A system with its own step ignores system.integrator.
    stepping = ["system.dt"] + ([] if hasattr(problem.system, "step") else ["system.integrator"])
    knobs = list(stepping) if time_large else []
    if grid is None:
        return knobs
    # The grid is the knob when refining it moves the prediction well beyond what the
    # time step alone does (RMS change more than twice as large), or when the parameter
    # shift has already cleared the time step: naming the stepping then would contradict
    # the shift just measured.
    if _large(grid, options) and (by_shift or grid["change"] > 4.0 * time["change"]):
        return ["system.grid.shape", *knobs]
    if _large(grid, options) and not knobs:
        return stepping
    return knobs


def _with_verdict(result: dict[str, Any], problem: FitProblem, meta: Any, knobs: list[str],
                  notes: list[str], residual_large: bool) -> dict[str, Any]:
    """``result`` with its verdict (twin, warning or ok), the knobs, notes and message."""
    twin = None if meta is None else twin_reason(meta, problem)
    if twin is not None:
        verdict = TWIN
        notes = [*notes, f"{twin} (a twin experiment): the residual cannot show discretization "
                         "error; fit data simulated more finely (simulate.refine) to see it"]
    else:
        verdict = WARNING if knobs else OK
    # Whether the residual is partly discretization error (not pure noise): what the
    # uncertainty intervals assume fails (mark_intervals); a twin's residual cannot be.
    result["model_error_in_residual"] = residual_large and verdict != TWIN
    result.update(verdict=verdict, knobs=knobs if verdict == WARNING else [], notes=notes)
    result["message"] = _message(result)
    return result


MODEL_ERROR_NOTE = ("the residual is partly discretization error (discretization check), "
                    "not the pure noise the intervals assume: they are not reliable")


def mark_intervals(intervals: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """The ``uncertainty`` block of summary.json (:func:`pdefit.fitting.uncertainty.estimate`) with
    ``model_error_dominated`` from the check's ``result``: true where the residual is partly
    discretization error, which the intervals take for noise (they then neither hold nor
    cover the bias), with a note saying so."""
    flagged = bool(result.get("model_error_in_residual", False))
    if not intervals.get("available"):
        # Without intervals the residual's statistics (if any) carry the flag alone.
        return ({**intervals, "model_error_dominated": flagged} if intervals.get("residual")
                else dict(intervals))
    note = intervals.get("note")
    if flagged:
        note = MODEL_ERROR_NOTE if not note else f"{note}; {MODEL_ERROR_NOTE}"
    return {**intervals, "model_error_dominated": flagged, "note": note}


def _message(result: Mapping[str, Any]) -> str:
    line = (f"discretization check (dt/{result['dt_factor']}): predictions change by "
            f"{_times(result['change_vs_residual'])} the RMS residual "
            f"({_times(result['change_vs_data'])} the data's RMS); misfit "
            f"{result['misfit']:.3e} → {result['misfit_refined']:.3e}")
    grid = result.get("grid_check", {})
    if "change" in grid:
        line += (f"; grid ×{grid['grid_factor']} (dt → {grid['dt']:.4g}): "
                 f"{_times(grid['change_vs_residual'])} the RMS residual")
    shift = result.get("parameter_shift", {})
    if shift.get("max_relative") is not None:
        line += (f"; the optimum moves by up to {100 * shift['max_relative']:.3g} % "
                 f"({shift['largest']}) at dt/{result['dt_factor']}")
    knobs = " or ".join(result["knobs"])
    if result["verdict"] == WARNING and result["criterion"] == "parameter_shift" and (
            result["knobs"][0] != "system.grid.shape"):
        line += (f". WARNING: the fitted values move by more than "
                 f"{100 * result['parameter_tolerance']:g} % at dt/{result['dt_factor']} "
                 f"(their discretization bias is of that order); refine {knobs}")
    elif result["verdict"] == WARNING:
        line += (f". WARNING: the discretization error is not small against the residual "
                 f"(> {result['tolerance']:g}): the residual is partly model error and the "
                 f"fitted values may be biased by it; refine {knobs}")
    elif result["verdict"] == OK and result["criterion"] == "parameter_shift":
        line += f" — small (≤ {100 * result['parameter_tolerance']:g} %)"
    elif result["verdict"] == OK:
        line += f" — small against the residual (≤ {result['tolerance']:g})"
    return line


def _times(ratio: float | None) -> str:
    return "∞ ×" if ratio is None else f"{ratio:.3g} ×"


def format_check(result: Mapping[str, Any]) -> str:
    """The check's lines for the end of the final table."""
    return "\n".join([result["message"], *(f"  note: {n}" for n in result["notes"])])
