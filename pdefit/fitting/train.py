"""The optimisation loop: optax over the unconstrained parameters and fitted fields, with
checkpoints, preemption and resume.

One jitted update (:mod:`pdefit.fitting.optimisers`) computes loss, gradient and the optimiser
step, and a small report of it (loss, gradient norm, the physical values, how many loss
evaluations the step took, line search included); the Python loop here runs over optimiser
iterations and reads that report in one transfer per step — its only wait on the device, which
also keeps the dispatch queue short. The step counter lives on the host.

Non-finite steps. The loss and gradient are evaluated at the current parameters; if either is
not finite those parameters are bad, so the loop goes back to the *anchor* — the last state
whose loss and gradient were finite — scales the learning rate down by ``optim.nan_lr_factor``
and takes that step again, shorter. After ``optim.max_nan_failures`` such failures the run
stops with :class:`TrainingDivergedError`.

Run-off. Given the parameters' ``layout`` every step is limited (optimisers.StepLimits), and
the loop stops as ``diverged``, its best point kept, once the loss exceeds
``optim.divergence_factor`` × the best so far or a parameter has sat on one of its bounds for
``optim.max_steps_at_bound`` steps in a row.

Checkpoints hold the anchor and the metric history before its step, never a state that was
not yet evaluated. A resumed run therefore re-evaluates the anchor first — the same numbers,
because the update is deterministic and the state comes back bit for bit — and follows
exactly the path the uninterrupted run took, including what happens after a non-finite step.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from pdefit.fitting.optimisers import (
    LEVENBERG_MARQUARDT,
    StepReport,
    TrainState,
    init_state,
    make_optimizer,
    step_limits,
)
from pdefit.fitting.resuming import ResumeMismatchError as ResumeMismatchError  # re-exported
from pdefit.fitting.resuming import data_fingerprint, open_checkpoints
from pdefit.fitting.resuming import resume_mismatch as resume_mismatch  # re-exported
from pdefit.fitting.updates import kept_step_update, stage_options
from pdefit.model.params import ParameterLayout
from pdefit.options import OptimConfig
from pdefit.runtime.checkpoint import CheckpointOptions, CheckpointStore, write_json_atomic
from pdefit.runtime.progress import Progress, ProgressOptions, progress_bar
from pdefit.runtime.signals import Preempted, PreemptionFlag, exit_code, signal_name, stop_reason


class TrainingDivergedError(RuntimeError):
    """Too many non-finite losses or gradients."""


@dataclass
class FitHistory:
    losses: list[float] = field(default_factory=list)  # per applied step, then the final loss
    records: list[dict[str, Any]] = field(default_factory=list)  # the metrics.jsonl lines
    best_loss: float = math.inf
    best_theta: Any = None
    nan_failures: int = 0
    wall_time: float = 0.0  # over all restarts
    restarts: int = 0  # how many times this run was resumed from a checkpoint
    resumed_from: int | None = None  # the step this process resumed from
    # Why the loop ended: steps_done | converged | stalled (patience, or steps that no longer
    # change anything) | preempted | interrupted (Ctrl-C) | diverged.
    stop_reason: str = ""


def run_fit(loss: Callable, theta0: Any, batch: Any, cfg: OptimConfig, *,
            describe: Callable[[Any], Mapping[str, float]] | None = None,
            metrics_path: Path | None = None, progress: bool | ProgressOptions = True,
            log: Callable[[str], None] = print,
            checkpoint: CheckpointOptions | None = None, resume: bool = True,
            config: Mapping[str, Any] | None = None, status_path: Path | None = None,
            seed: int = 0, preemption: PreemptionFlag | None = None,
            on_step: Callable[[int, Mapping[str, Any]], None] | None = None,
            curvature: Callable | None = None, hold: Collection[str] = (),
            layout: ParameterLayout | None = None, steps: dict[Any, Any] | None = None,
            field_bounds: tuple[tuple[str, float, float], ...] = (),
            ) -> tuple[TrainState, FitHistory]:
    """Minimise ``loss(theta, batch)`` from ``theta0``.

    ``describe(theta)`` gives the physical values written with each metrics record.
    ``checkpoint`` enables Orbax checkpoints (every ``checkpoint.every`` steps and at the end)
    and preemption handling; a directory that already holds checkpoints is resumed from
    unless ``resume`` is False (then they are deleted). ``config`` (the resolved run config) is
    saved with each checkpoint and must match on resume, except ``run.*``. ``on_step(step,
    record)`` is called after every applied step (tests use it to send signals).
    ``curvature`` (from :func:`pdefit.fitting.krylov.curvature_for`) is needed by
    ``levenberg_marquardt``. ``hold`` names entries of ``theta0["params"]`` that every
    optimiser keeps at their values (a stage of a staged fit that frees them later).
    ``layout`` (the problem's :class:`~pdefit.model.params.ParameterLayout`) turns on the step
    control: bounds and ``optim.max_log_step``, and keeps fitted fields in ``field_bounds``
    (``FitProblem.field_bounds``: (field, lower, upper)). ``steps``: a dict kept across fits of one
    problem, which then share their compiled step
    (:func:`pdefit.fitting.updates.kept_step_update`).

    Raises :class:`Preempted` (a ``SystemExit`` with status 75) after a preemption signal, once
    the checkpoint is on disk, and :class:`TrainingDivergedError` after too many non-finite
    steps.
    """
    optimizer = make_optimizer(cfg)
    hold = frozenset(hold)
    _check_hold(theta0, hold)
    cfg = stage_options(cfg, curvature, hold)  # optim.reduced_steps where steps are reduced
    update = kept_step_update(steps, loss, optimizer, cfg, curvature, describe, hold,
                              step_limits(layout, cfg, field_bounds))
    state = init_state(theta0, optimizer, jax.eval_shape(loss, theta0, batch).dtype, seed)
    run, state = _open_run(state, batch, cfg, checkpoint=checkpoint, resume=resume,
                           config=config, metrics_path=metrics_path, status_path=status_path,
                           progress=progress, log=log)
    # Signals are taken over only where they can be honoured: with checkpoints, or when the
    # caller passes its own flag.
    watch = run.store is not None or preemption is not None
    flag = preemption if preemption is not None else PreemptionFlag()
    run.write_status("running")
    try:
        with flag if watch else contextlib.nullcontext():
            state = _step_loop(run, update, state, batch, flag if watch else None, on_step)
        final_loss = _finish(run, loss, state, batch)
    finally:
        run.close()
    return state, _final_history(run, state, final_loss)


def _check_hold(theta0: Any, hold: frozenset[str]) -> None:
    """``hold`` names fitted parameters of ``theta0`` and leaves something to fit."""
    if not hold:
        return
    names = set(theta0["params"]) if isinstance(theta0, Mapping) else set()
    if not hold <= names:
        raise ValueError(f"cannot hold {sorted(hold - names)}: not among the fitted "
                         f"parameters {sorted(names)}")
    if hold == names and not jax.tree.leaves(
            {k: v for k, v in theta0.items() if k != "params"}):
        raise ValueError(f"holding every fitted parameter {sorted(names)} leaves nothing "
                         "to fit")


# ---------------------------------------------------------------------------------------------
# The run: what the loop keeps on the host, and where it reports.


@dataclass(frozen=True)
class _Anchor:
    """The last state with a finite loss and gradient, how many records precede it, and its
    step (on the host)."""

    state: TrainState
    n_records: int
    step: int


@dataclass(frozen=True)
class _Clock:
    """Wall time over all restarts: what earlier processes spent plus this one's so far."""

    before: float
    start: float

    def elapsed(self) -> float:
        return self.before + time.perf_counter() - self.start


@dataclass
class _Run:
    """What the loop updates as it goes — the anchor, the history, the metrics file, the
    progress line — and where it reports: checkpoints (with the run's ``config`` and the
    data's ``fingerprint``) and the status file, written by the primary process only."""

    cfg: OptimConfig
    history: FitHistory
    anchor: _Anchor
    clock: _Clock
    store: CheckpointStore | None
    checkpoint_every: int
    config: dict[str, Any]
    fingerprint: str | None
    metrics_path: Path | None
    status_path: Path | None
    primary: bool
    log: Callable[[str], None]
    metrics: Any
    bar: Progress
    evaluations: int = 0  # in this process, for the progress line
    applied: int = 0

    def meta(self, status: str) -> dict[str, Any]:
        history = self.history
        return {"records": history.records[:self.anchor.n_records],
                "nan_failures": history.nan_failures, "restarts": history.restarts,
                "wall_time": self.clock.elapsed(), "data_fingerprint": self.fingerprint,
                "status": status, "stop_reason": history.stop_reason}

    def save(self, status: str, wait: bool = False) -> None:
        if self.store is not None:
            self.store.save(self.anchor.step, self.anchor.state, self.meta(status), self.config,
                            wait=wait)
        self.write_status(status)

    def write_status(self, status: str) -> None:
        if self.status_path is not None and self.primary:
            history = self.history
            write_json_atomic(self.status_path, {
                "status": status, "stop_reason": history.stop_reason or None,
                "step": self.anchor.step,
                "loss": history.records[-1]["loss"] if history.records else None,
                "best_loss": _finite_or_none(history.best_loss),
                "nan_failures": history.nan_failures, "restarts": history.restarts,
                "wall_time_s": self.clock.elapsed()})

    def close(self) -> None:
        self.bar.close()
        if self.metrics:
            self.metrics.close()
        if self.store is not None:
            self.store.close()  # waits for a write still in flight


def _open_run(state: TrainState, batch: Any, cfg: OptimConfig, *,
              checkpoint: CheckpointOptions | None, resume: bool,
              config: Mapping[str, Any] | None, metrics_path: Path | None,
              status_path: Path | None, progress: bool | ProgressOptions,
              log: Callable[[str], None]) -> tuple[_Run, TrainState]:
    """The run and the state to start from: the newest checkpoint's when ``checkpoint`` names
    a directory that holds one (see :func:`_open_checkpoints`), else ``state``."""
    history = FitHistory()
    fingerprint = data_fingerprint(batch) if checkpoint else None
    config = dict(config or {})
    primary = jax.process_index() == 0
    store = None
    if checkpoint:
        store, state, history = _open_checkpoints(checkpoint, resume, state, config,
                                                  fingerprint, log)
    anchor = _Anchor(state, len(history.records), int(jax.device_get(state.step)))
    clock = _Clock(history.wall_time, time.perf_counter())
    metrics = _open_metrics(metrics_path, history.records) if primary else None
    bar = progress_bar(cfg.steps, anchor.step, progress, primary)
    run = _Run(cfg, history, anchor, clock, store, checkpoint.every if checkpoint else 0, config,
               fingerprint, metrics_path, status_path, primary, log, metrics, bar)
    return run, state


# ---------------------------------------------------------------------------------------------
# The loop.


def _step_loop(run: _Run, update: Callable, state: TrainState, batch: Any,
               flag: PreemptionFlag | None,
               on_step: Callable[[int, Mapping[str, Any]], None] | None) -> TrainState:
    """Steps from the anchor until ``optim.steps`` or a stopping rule; the last state. A
    non-finite step goes back to the anchor; a preemption signal (``flag``, when watched)
    saves it and exits."""
    step = run.anchor.step  # of ``state``, kept on the host
    while step < run.cfg.steps:
        candidate, report = update(state, batch)
        # The step's one host transfer; waiting for it keeps one update in flight.
        report = jax.device_get(report)
        stop = False
        if report.finite:
            record = _recorded(run, state, step, report)
            state, step = candidate, step + 1
            stop = _should_stop(run, step)
            _show_progress(run, record, on_step)
        else:
            state, step = _rolled_back(run, step)
        # Step boundary: every process takes the same decision here.
        _exit_on_signal(run, flag)
        if stop:
            break
        if run.store is not None and run.anchor.step % run.checkpoint_every == 0:
            run.save("running")
    return state


def _recorded(run: _Run, state: TrainState, step: int, report: StepReport) -> dict[str, Any]:
    """The metrics record of a finite step from ``state`` (now the anchor), appended to the
    history and the metrics file."""
    history = run.history
    record = _record(report, run.clock.elapsed())
    run.anchor = _Anchor(state, len(history.records), step)
    history.records.append(record)
    if run.metrics:
        run.metrics.write(json.dumps(record) + "\n")
        run.metrics.flush()
    return record


def _should_stop(run: _Run, step: int) -> bool:
    """Whether a stopping rule ends the fit after ``step`` steps (said in the log, and kept
    as the history's ``stop_reason``)."""
    stopping = _stopping(run.history.records, run.cfg, step, run.history.best_loss)
    run.history.best_loss = min(run.history.best_loss, run.history.records[-1]["loss"])
    if stopping is None:
        return False
    run.history.stop_reason, message = stopping
    run.log(message)
    return True


def _show_progress(run: _Run, record: Mapping[str, Any],
                   on_step: Callable[[int, Mapping[str, Any]], None] | None) -> None:
    """The progress line after an applied step (with the mean loss evaluations per step in
    this process), then ``on_step``."""
    run.evaluations += record["evaluations"]
    run.applied += 1
    run.bar.set_postfix(loss=f"{record['loss']:.3e}",
                        evals=f"{run.evaluations / run.applied:.3g}/step", refresh=False)
    run.bar.update(1)
    if on_step:
        on_step(record["step"], record)


def _rolled_back(run: _Run, step: int) -> tuple[TrainState, int]:
    """After a non-finite ``step``: the anchor's state with its learning rate scaled down, and
    its step; the records after it dropped. Too many failures raise
    :class:`TrainingDivergedError`."""
    cfg, history, anchor = run.cfg, run.history, run.anchor
    history.nan_failures += 1
    if history.nan_failures > cfg.max_nan_failures:
        history.stop_reason = "diverged"
        run.write_status("diverged")
        raise TrainingDivergedError(
            f"loss or gradient not finite at step {step} "
            f"({history.nan_failures} failures, optim.max_nan_failures="
            f"{cfg.max_nan_failures}); last learning-rate scale "
            f"{float(anchor.state.lr_scale):.3g}. Lower optim.lr or check "
            "dt and the data.")
    state = anchor.state._replace(lr_scale=anchor.state.lr_scale * cfg.nan_lr_factor)
    del history.records[anchor.n_records:]
    if run.metrics:
        run.metrics = _open_metrics(run.metrics_path, history.records, run.metrics)
    run.anchor = _Anchor(state, anchor.n_records, anchor.step)
    run.bar.n = anchor.step
    run.log(f"step {step}: non-finite loss/gradient; back to "
            f"step {anchor.step}, learning rate scaled by "
            f"{float(state.lr_scale):.3g} (failure {history.nan_failures} of "
            f"at most {cfg.max_nan_failures})")
    return state, anchor.step


def _exit_on_signal(run: _Run, flag: PreemptionFlag | None) -> None:
    """After a preemption signal all processes agree on: save the anchor, then raise
    :class:`Preempted`."""
    signum = flag.agreed() if flag is not None else 0
    if not signum:
        return
    run.history.stop_reason = stop_reason(signum)
    run.save(run.history.stop_reason, wait=True)
    where = f"written to {run.store.directory}" if run.store else "not written"
    then = ("so that the job is requeued" if run.history.stop_reason == "preempted"
            else "(interrupted); the same command resumes")
    run.log(f"{signal_name(signum)}: checkpoint at step {run.anchor.step} "
            f"{where}; exiting with status {exit_code(signum)} {then}")
    flag.forward()
    raise Preempted(run.anchor.step, signum)


def _finish(run: _Run, loss: Callable, state: TrainState, batch: Any) -> float:
    """The loss of the final point, once the run's end is saved."""
    run.history.stop_reason = run.history.stop_reason or "steps_done"
    final_loss = float(jax.device_get(jax.jit(loss)(state.theta, batch)))
    run.save("done", wait=True)
    return final_loss


def _final_history(run: _Run, state: TrainState, final_loss: float) -> FitHistory:
    """The history with the final point counted: its loss, and the best point."""
    history = run.history
    history.best_theta = state.best_theta
    if math.isfinite(final_loss):
        if final_loss < float(jax.device_get(state.best_loss)):
            history.best_theta = state.theta
        history.best_loss = min(history.best_loss, final_loss)
    history.losses = [r["loss"] for r in history.records] + [final_loss]
    history.wall_time = run.clock.elapsed()
    return history


# ---------------------------------------------------------------------------------------------
# Stopping rules.


# Steps in a row with bit-identical loss and gradient norm after which a fit counts as stalled:
# the optimiser no longer moves θ (L-BFGS whose line search finds no descent below float
# resolution), so further steps would repeat the same numbers.
IDENTICAL_STEPS = 3


def _repeating(records: list[dict[str, Any]]) -> bool:
    recent = records[-IDENTICAL_STEPS:]
    return len(recent) == IDENTICAL_STEPS and all(
        (r["loss"], r["grad_norm"]) == (recent[0]["loss"], recent[0]["grad_norm"])
        for r in recent)


def _stalled(records: list[dict[str, Any]], patience: int) -> bool:
    """True when the best loss of the last ``patience`` records is no better (by a relative
    1e-6) than the best before them: the optimiser is going nowhere (e.g. an L-BFGS line
    search that can no longer find descent in float32 noise)."""
    if len(records) <= patience:
        return False
    before = min(r["loss"] for r in records[:-patience])
    recent = min(r["loss"] for r in records[-patience:])
    return recent > before * (1.0 - 1e-6)


def _running_off(records: list[dict[str, Any]], cfg: OptimConfig, best: float,
                 ) -> str | None:
    """Why the fit counts as running off after ``records[-1]`` (``best``: the lowest loss
    before it), else None: its loss grew ``optim.divergence_factor``-fold over the best, or a
    parameter has sat on a bound for ``optim.max_steps_at_bound`` steps."""
    loss = records[-1]["loss"]
    factor = cfg.divergence_factor
    if factor is not None and 0 < best < math.inf and loss > factor * best:
        return (f"the loss {loss:.3e} exceeds optim.divergence_factor={factor:g} x the best "
                f"loss {best:.3e}")
    patience = cfg.max_steps_at_bound
    if patience is not None and len(records) >= patience and all(
            r.get("at_bound") for r in records[-patience:]):
        return (f"a parameter has sat on one of its bounds (ParamSpec lower/upper) for "
                f"{patience} steps in a row (optim.max_steps_at_bound)")
    return None


def _stopping(records: list[dict[str, Any]], cfg: OptimConfig, step: int,
              best: float = math.inf) -> tuple[str, str] | None:
    """(stop reason, log message) when a stopping rule ends the fit after ``step`` steps whose
    last record is ``records[-1]`` (``best``: the lowest loss of the records before it), else
    None."""
    record = records[-1]
    running_off = _running_off(records, cfg, best)
    if running_off is not None:
        return "diverged", (f"stopped at step {step} as diverged: {running_off}; the fit "
                            "keeps its best point")
    if record["grad_norm"] <= cfg.grad_tol * records[0]["grad_norm"]:
        return "converged", (f"converged at step {step}: gradient norm "
                             f"{record['grad_norm']:.3e} <= {cfg.grad_tol:g} x initial")
    if cfg.patience and _stalled(records, cfg.patience):
        return "stalled", (f"stopped at step {step}: the loss has not improved "
                           f"by a relative 1e-6 in {cfg.patience} steps (optim.patience)")
    if cfg.name != LEVENBERG_MARQUARDT and _repeating(records):
        # (a rejected Levenberg–Marquardt step legitimately repeats θ)
        return "stalled", (f"stopped at step {step}: {IDENTICAL_STEPS} steps in "
                           f"a row with the same loss {record['loss']:.6e} and gradient norm; "
                           "the optimiser no longer changes the parameters")
    return None


# ---------------------------------------------------------------------------------------------
# Checkpoints and files.


def _open_checkpoints(options: CheckpointOptions, resume: bool, fresh: TrainState,
                      config: Mapping[str, Any], fingerprint: str | None,
                      log: Callable[[str], None],
                      ) -> tuple[CheckpointStore, TrainState, FitHistory]:
    """The run's checkpoint store, and the state and history to start from: the newest
    checkpoint's (shaped like ``fresh``), or ``fresh`` and an empty history."""
    store, restored = open_checkpoints(options, resume, fresh, config, fingerprint, log)
    if restored is None:
        return store, fresh, FitHistory()
    history = _history_from(restored.meta)
    history.restarts += 1
    history.resumed_from = restored.step
    log(f"resuming from checkpoint step {restored.step} in {store.directory} (restart "
        f"{history.restarts}; {len(history.records)} steps done, best loss "
        f"{_fmt(history.best_loss)}, lr scale {float(restored.state.lr_scale):.3g})")
    return store, restored.state, history


def _record(report: StepReport, t: float) -> dict[str, Any]:
    record: dict[str, Any] = {"step": int(report.step), "loss": float(report.loss),
                              "grad_norm": float(report.grad_norm),
                              "lr_scale": float(report.lr_scale),
                              "evaluations": int(report.evaluations), "time": t}
    if bool(report.at_bound):
        record["at_bound"] = True
    if report.params is not None:
        record["params"] = {k: float(v) for k, v in report.params.items()}
    return record


def _history_from(meta: Mapping[str, Any]) -> FitHistory:
    records = [dict(r) for r in meta.get("records", [])]
    return FitHistory(records=records,
                      best_loss=min((r["loss"] for r in records), default=math.inf),
                      nan_failures=int(meta.get("nan_failures", 0)),
                      wall_time=float(meta.get("wall_time", 0.0)),
                      restarts=int(meta.get("restarts", 0)))


def _open_metrics(path: Path | None, records: list[dict[str, Any]], current: Any = None):
    """metrics.jsonl holding exactly ``records``, open for appending (rewritten on resume and
    after a rollback, so the file always matches the run's history)."""
    if current is not None:
        current.close()
    if path is None:
        return None
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
    return path.open("a")


def _fmt(x: float) -> str:
    return f"{x:.4e}" if math.isfinite(x) else "—"


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
