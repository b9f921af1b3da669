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
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import numpy as np

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL from sysexits.h


class Preempted(SystemExit):
    """The run saved its state after a preemption signal and should exit with status 75.

    A ``SystemExit`` so that nothing on the way out treats it as a failure: Hydra and
    submitit catch ``Exception`` and would record a failed job whose result the launcher
    then reads, although Slurm is about to run the job again.
    """

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.signum = signum

    def __str__(self) -> str:
        return (f"preempted by {signal_name(self.signum)}: checkpoint saved at step {self.step}; "
                f"exiting with status {PREEMPTED_EXIT_CODE} so the job is requeued")


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

    # -- installing ----------------------------------------------------------------------------

    def __enter__(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)

    # -- asking ---------------------------------------------------------------------------------

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a checkpoint-and-exit (what a signal does); the first request wins."""
        if not self.signum:
            self.signum = int(signum)

    @property
    def requested(self) -> bool:
        return bool(self.signum)

    def agreed(self) -> int:
        """The signal every process acts on at this step boundary (0: carry on).

        One process: its own flag, no communication. Several: the largest signal number any
        process received, through one small all-gather, so either all stop here or none does.
        """
        import jax

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
        if callable(previous):
            previous(self.signum, None)


@contextlib.contextmanager
def preemption_flag(flag: PreemptionFlag | None = None) -> Iterator[PreemptionFlag]:
    """``flag`` installed for the duration (a fresh one if None)."""
    with flag if flag is not None else PreemptionFlag() as active:
        yield active
