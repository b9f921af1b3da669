"""Preemption: SIGTERM, SIGUSR1 and SIGUSR2 ask a fit to checkpoint and exit at the next step.

A handler only records the signal (nothing else is safe inside a signal handler, and the
state mid-step is not worth saving). The training loop asks :meth:`PreemptionFlag.agreed` at
every step boundary; with several processes they exchange their flags there, so all of them
stop after the same step and the collective Orbax save cannot deadlock.

Exit protocol (see slurm/README.md): after the checkpoint is written and the write has
finished, :class:`Preempted` ends the process with status 75 (``EX_TEMPFAIL``, "try again
later"). Slurm requeues the job itself after ``scontrol requeue`` or a preemption; after a
time-limit warning (``--signal=USR1@…``) ``slurm/fit.sbatch`` sees 75 and requeues the job.
Under submitit the handler submitit installed for USR2 (it requeues the job and exits) is
called once the save is done: the "USR2 bridge".

SIGINT (Ctrl-C) is handled the same way by ``pdefit-fit`` (the checkpoint is written, one
line says so) but exits with status 130, the shell's code for an interrupt, so that
``slurm/fit.sbatch`` does not requeue a job its user stopped. A second Ctrl-C ends the process
at once (status 130): everything on disk is written atomically, so nothing is half-written.

``pdefit-fit`` holds these signals for the whole life of the process: :func:`hold_early`
records them from the moment the package is imported (before JAX, whose import takes
seconds), and the flag that ``fit_main`` installs takes the recorded signal over.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL from sysexits.h
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for Ctrl-C
FIT_SIGNALS: tuple[signal.Signals, ...] = (*PREEMPTION_SIGNALS, signal.SIGINT)


def exit_code(signum: int) -> int:
    """75 (requeue me) for the preemption signals, 130 for Ctrl-C."""
    return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else PREEMPTED_EXIT_CODE


def stop_reason(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else "preempted"


class Preempted(SystemExit):
    """The run saved its state after a preemption signal and should exit with status 75.

    A ``SystemExit`` so that nothing on the way out treats it as a failure: Hydra and
    submitit catch ``Exception`` and would record a failed job whose result the launcher
    then reads, although Slurm is about to run the job again.
    """

    def __init__(self, step: int | None, signum: int) -> None:
        super().__init__(exit_code(signum))
        self.step = step  # the checkpoint's step; None: stopped before training started
        self.signum = signum

    def __str__(self) -> str:
        where = ("before training started, nothing written" if self.step is None
                 else f"checkpoint saved at step {self.step}")
        return (f"{stop_reason(self.signum)} by {signal_name(self.signum)}: {where}; exiting "
                f"with status {self.code}")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


Handler = Callable[[int, FrameType | None], Any] | int | None


class PreemptionFlag:
    """Records the first preemption signal; install it with ``with PreemptionFlag() as flag``.

    Handlers can only be installed from the main thread; elsewhere (a test runner thread) the
    flag is still usable through :meth:`request`.
    """

    def __init__(self, signals: tuple[int, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.signum = 0
        self._previous: dict[int, Handler] = {}
        self._depth = 0  # nested ``with`` blocks: only the outermost installs and restores

    # -- installing ----------------------------------------------------------------------------

    def __enter__(self) -> PreemptionFlag:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                previous = signal.signal(sig, self._handle)
                early = getattr(previous, "__self__", None)
                if isinstance(early, PreemptionFlag) and early is not self:
                    # Taking over from hold_early: its signal and the handler before it.
                    if early.signum:
                        self.request(early.signum)
                    previous = early._previous.get(sig, previous)
                self._previous[sig] = previous
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def ignore_from_now(self) -> None:
        """The process has decided how it ends (done, preempted, failed): ignore these signals
        until it has exited. Python gives its handlers back to the default action while it
        shuts down, and a signal then would turn the decided status into a death by signal
        (an ignored one is left ignored)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            # Ctrl-C twice: the user wants out now. Checkpoints, status.json and datasets are
            # written atomically, so stopping here leaves nothing half-written.
            import os
            import sys

            sys.stderr.write("\nsecond Ctrl-C: exiting now without a checkpoint\n")
            os._exit(INTERRUPTED_EXIT_CODE)
        self.request(signum)

    # -- asking ---------------------------------------------------------------------------------

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a checkpoint-and-exit (what a signal does); the first request wins."""
        if not self.signum:
            self.signum = int(signum)

    @property
    def requested(self) -> bool:
        return bool(self.signum)

    def stop_if_requested(self, what: str, log: Callable[[str], None]) -> None:
        """Between the phases of a fit's start-up, where nothing is half-written: exit now
        (``Preempted``, status 75 or 130) if a signal came to any process of the run (all
        of them call this at the same points)."""
        signum = self.agreed()
        if signum:
            log(f"{signal_name(signum)} {what}: exiting with status {exit_code(signum)} "
                "(nothing half-written); the same command goes on")
            raise Preempted(None, signum)

    def agreed(self) -> int:
        """The signal every process acts on at this step boundary (0: carry on).

        One process: its own flag, no communication. Several: the largest signal number any
        process received, through one small all-gather, so either all stop here or none does.
        """
        import jax
        import numpy as np  # not at the top: this module is imported first of all (hold_early)

        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.signum, np.int32))
        return int(np.max(flags))

    def forward(self) -> None:
        """After the checkpoint: run the handler that was installed before ours for the signal
        this process received, if it is a Python function (submitit's USR2 handler requeues
        the job and exits). Default and ignore dispositions are left alone: the caller exits
        with :data:`PREEMPTED_EXIT_CODE` instead."""
        previous = self._previous.get(self.signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)


@contextlib.contextmanager
def preemption_flag(flag: PreemptionFlag | None = None) -> Iterator[PreemptionFlag]:
    """``flag`` installed for the duration (a fresh one if None)."""
    with flag if flag is not None else PreemptionFlag() as active:
        yield active


# Command-line flags with which the console script runs no fit in this process.
NOT_A_FIT = frozenset({"-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg",
                       "--info", "--shell-completion", "-sc"})


def hold_early(program: str = "pdefit-fit") -> PreemptionFlag | None:
    """Record :data:`FIT_SIGNALS` from now on when this process is ``program`` (the console
    script), so that one arriving during the imports is acted on, not fatal. The flag stays
    installed until the flag of ``fit_main`` takes over (see ``PreemptionFlag.__enter__``)."""
    import sys
    from pathlib import Path

    if not sys.argv or Path(sys.argv[0]).name != program:
        return None
    if NOT_A_FIT.intersection(sys.argv[1:]):
        return None  # a sweep's submitting process, --help, --cfg: keep the default actions
    flag = PreemptionFlag(FIT_SIGNALS)
    flag.__enter__()
    return flag
