"""Progress of an optimisation: a tqdm bar on a terminal, plain log lines otherwise.

Redirected to a file, a carriage-return bar writes kilobytes of redraws that read as one long
line; there a line every ``every`` steps (step, loss, time per step, ETA) says the same. Both
report the first step apart, since it includes compiling the loss and its gradient, which can
take a minute with nothing else to show. A staged fit labels each stage's bar ("stage 2/4 (6
frames)") and estimates the time left for the whole fit from ``later_work``: the later stages'
steps, weighted by their length relative to this one.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm.auto import tqdm

log = logging.getLogger("pdefit")


@dataclass(frozen=True)
class ProgressOptions:
    label: str = "fit"
    every: int = 25  # steps between lines when the output is not a terminal
    enabled: bool = True
    rollout_steps: int | None = None  # time steps of the rollout (for the compile message)
    later_work: float = 0.0  # work after this bar, in this bar's steps (staged fits)


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class Progress:
    """Counts optimiser steps; ``update``/``set_postfix``/``n``/``close`` as tqdm's."""

    def __init__(self, total: int, initial: int, options: ProgressOptions,
                 stream: TextIO | None = None, announce: bool = True) -> None:
        self.total, self.n, self.options = total, initial, options
        self.postfix: dict[str, Any] = {}
        self._started = time.perf_counter()
        self._timed_from: tuple[int, float] | None = None  # after the compiling first step
        self._announce = announce
        stream = sys.stderr if stream is None else stream
        # A notebook's output is no terminal but draws tqdm's (auto) widget.
        terminal = options.enabled and (stream.isatty() or "ipykernel" in sys.modules)
        what = (f" ({options.rollout_steps} time steps)" if options.rollout_steps else "")
        if announce and initial < total:
            log.info(f"{options.label}: compiling the loss and gradient{what}…")
        self._bar = (tqdm(total=total, initial=initial, desc=options.label, dynamic_ncols=True,
                          file=stream) if terminal else None)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = values
        if self._bar is not None:
            self._bar.set_postfix(refresh=False, **values, **self._overall())

    def update(self, steps: int = 1) -> None:
        self.n += steps
        now = time.perf_counter()
        if self._timed_from is None and self._announce:
            log.info(f"{self.options.label}: compiled and ran the first step in "
                     f"{now - self._started:.1f} s")
        if self._timed_from is None:
            self._timed_from = (self.n, now)
        if self._bar is not None:
            self._bar.update(steps)
        elif self.options.enabled and (self.n % max(1, self.options.every) == 0
                                       or self.n >= self.total):
            log.info(self._line())

    def _seconds_per_step(self) -> float | None:
        if self._timed_from is None or self.n <= self._timed_from[0]:
            return None
        step, since = self._timed_from
        return (time.perf_counter() - since) / (self.n - step)

    def _overall(self) -> dict[str, str]:
        rate = self._seconds_per_step()
        if not self.options.later_work or rate is None:
            return {}
        left = (self.total - self.n + self.options.later_work) * rate
        return {"all stages": f"~{duration(left)}"}

    def _line(self) -> str:
        parts = [f"{self.options.label}: step {self.n}/{self.total}"]
        parts += [f"{key} {value}" for key, value in self.postfix.items()]
        rate = self._seconds_per_step()
        if rate is not None:
            parts.append(f"{rate:.3g} s/step, ETA {duration((self.total - self.n) * rate)}")
            parts += [f"{key} ETA {value}" for key, value in self._overall().items()]
        return ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_bar(total: int, initial: int, options: ProgressOptions | bool,
                 primary: bool = True) -> Progress:
    """The progress of ``total`` steps from ``initial``; ``options`` True/False: a plain "fit"
    bar or none. Only the primary process shows anything."""
    if not isinstance(options, ProgressOptions):
        options = ProgressOptions(enabled=bool(options))
    if not primary:
        options = ProgressOptions(label=options.label, enabled=False)
    return Progress(total, initial, options, announce=primary)
