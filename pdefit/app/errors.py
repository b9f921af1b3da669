"""One line per mistake: how the command lines report an error the user can fix.

A console entry point's ``main`` is wrapped by :func:`one_line_errors`. A mistake in the
configuration (:class:`pdefit.options.ConfigError`), in a dataset
(:class:`pdefit.data.DatasetError`), in a system's hooks
(:class:`pdefit.model.system.SystemCheckError`), a time step beyond the stability limit
(:class:`pdefit.model.system.UnstableTimeStepError`), and Hydra's own refusals of an override
(an unknown key, a value of the wrong type, a missing config group option, bad override
syntax) are printed as ONE line, ``<program>: error: <message>``, on stderr, and the process
exits with status 2. ``PDEFIT_TRACEBACK=1`` prints the full traceback as well. Anything else is
a bug, not a mistake: its traceback is shown in full (exit status 1).

Hydra catches every exception of the task itself and prints its own abridged traceback; with
``HYDRA_FULL_ERROR`` set it re-raises instead. So a Hydra command takes two decorators:
:func:`one_line_errors` outside ``@hydra.main`` sets that variable for the duration of the call
and reports what reaches it (Hydra's own errors are raised before the task runs), and
:func:`task_errors` inside it hands a single run's mistake past Hydra as a ``SystemExit`` (which
Hydra lets through without its "Error executing job" line). In a multirun (``-m``) a mistake
stays an exception: Hydra's basic launcher records that point as failed, names its overrides
and runs the others, and once the sweep has run the first failure is reported as one line
(exit status 2). A preempted or interrupted fit (``Preempted``, a ``SystemExit`` with status 75
or 130) passes through untouched.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from pdefit.app.config import raised_by_resolver, schema_keys, unknown_key_message
from pdefit.data import DatasetError
from pdefit.model.system import SystemCheckError, UnstableTimeStepError
from pdefit.options import ConfigError, FitConfig

TRACEBACK_VARIABLE = "PDEFIT_TRACEBACK"
USAGE_EXIT_CODE = 2  # as argparse: the command was given something it cannot use

# The mistakes a user can fix, reported as one line.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DatasetError, SystemCheckError, UnstableTimeStepError)

# OmegaConf's detail lines under a message, which name what the first line already says.
_DETAIL = re.compile(r"^\s*(full_key:|reference_type=|object_type=|Config search path:)")


class _Mistake(SystemExit):
    """A user's mistake in a single Hydra run, carried past Hydra to :func:`one_line_errors`
    (a ``SystemExit``: Hydra lets it through without reporting it)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(USAGE_EXIT_CODE)
        self.error = error


def task_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a Hydra task function (inside ``@hydra.main``): in a single run a user's
    mistake leaves as a :class:`_Mistake` for :func:`one_line_errors` to report."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except USER_ERRORS as err:
            if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
                raise  # Hydra names the failed point and runs the others
            raise _Mistake(err) from err

    return wrapper


def one_line_errors(program: str, options: type = FitConfig) -> Callable:
    """Decorate a console entry point (a ``@hydra.main`` function, or a plain ``main``) so
    that a user's mistake is one line ``<program>: error: <message>`` on stderr and exit
    status 2; ``options``: the typed options the command composes (for the closest valid
    key of an unknown one)."""

    def decorate(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            previous = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises; we report
            try:
                return main(*args, **kwargs)
            except _Mistake as mistake:
                _report(program, mistake.error, options)
            except (*USER_ERRORS, CompactHydraException, OmegaConfBaseException) as err:
                _report(program, err, options)
            finally:
                if previous is None:
                    os.environ.pop("HYDRA_FULL_ERROR", None)
                else:
                    os.environ["HYDRA_FULL_ERROR"] = previous

        return wrapper

    return decorate


def _report(program: str, err: BaseException, options: type) -> None:
    """Print ``err`` as one line (after its traceback with ``PDEFIT_TRACEBACK=1``); exit 2."""
    if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        traceback.print_exception(err)
    print(f"{program}: error: {one_line(err, options)}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE) from None


def one_line(err: BaseException, options: type = FitConfig) -> str:
    """The single line that reports ``err`` (a user's mistake or Hydra's refusal)."""
    if isinstance(err, CompactHydraException):
        return _hydra_message(err, options)
    if isinstance(err, OmegaConfBaseException):
        return _omegaconf_message(err, options)
    return _flatten(str(err))


def _hydra_message(err: CompactHydraException, options: type) -> str:
    cause = err.__cause__
    override = re.search(r"Could not override '([^']+)'", str(err))
    if override is not None and isinstance(cause, ConfigKeyError | ConfigAttributeError):
        key = override.group(1)
        inner = re.search(r"Key '([^']+)' is not in struct", str(cause))
        keys = schema_keys(options)
        if inner is not None and key in keys:
            # A valid dict key given a whole new value with keys the composed one lacks.
            new = inner.group(1)
            return (f"{key}: '{new}' is not among its composed entries; add it as "
                    f"+{key}.{new}=<value> (or give the whole value with ++{key}=...)")
        parent, _, new = key.rpartition(".")
        if inner is not None and parent in keys and not any(
                k.startswith(parent + ".") for k in keys):
            # A new entry of a dict whose keys are free (fields, parameter names, ...).
            return (f"{key}: '{new}' is not among the composed entries of {parent}; add it "
                    f"as +{key}=<value>")
        return unknown_key_message(key, options)
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_message(cause, options)
    if isinstance(err, MissingConfigException) and err.options:
        return f"{_flatten(str(err).splitlines()[0])}; choose one of {sorted(err.options)}"
    return _flatten(str(err))


def _omegaconf_message(err: OmegaConfBaseException, options: type) -> str:
    raised = raised_by_resolver(err)  # by a resolver (pdefit.required)
    if raised is not None:
        return _flatten(str(raised))
    key = getattr(err, "full_key", None)
    if isinstance(err, ConfigKeyError | ConfigAttributeError) and key:
        return unknown_key_message(str(key), options)
    text = _flatten(getattr(err, "msg", None) or str(err))
    return f"{key}: {text}" if key else text


def _flatten(text: str) -> str:
    """``text`` as one line: its lines joined with "; ", OmegaConf's detail lines dropped."""
    lines = []
    for line in text.splitlines():
        if _DETAIL.match(line):
            if line.strip().startswith("Config search path:"):
                break
            continue
        if line.strip():
            lines.append(line.strip())
    return "; ".join(lines).replace(":; ", ": ")
