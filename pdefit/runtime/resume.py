"""Which differences between a checkpoint's config and the current one allow a resume: the
keys that only drive a run (where and how it runs), the keys that only say when to stop, and
the comparison itself on plain (JSON-able) configs. Used by the training loop when it
restores a checkpoint and by the command line before it touches a run directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pdefit.options import FitConfig

# Keys that change how a run is driven, not what it computes: a resumed run may change them
# (a requeued job may land on another mesh shape or process count).
# fit.uncertainty and fit.discretization_check: the end report only (absent from older runs).
DRIVING_KEYS = ("run.", "mesh.", "distributed.", "rank.", "evaluate.",
                "fit.uncertainty", "fit.discretization_check")
# Keys that only say when to stop: a finished (or stopped) run may be continued with more
# optim.steps or other stopping tolerances. With a decaying learning-rate schedule the
# schedule is recomputed for the new step count from the step reached.
CONTINUATION_KEYS = ("optim.steps", "optim.reduced_steps", "optim.grad_tol", "optim.patience")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       ignore: tuple[str, ...] = DRIVING_KEYS) -> list[str]:
    """``key: saved → current`` for every value that differs, except under ``ignore``."""
    a, b = _without_neutral(flatten(saved)), _without_neutral(flatten(current))
    defaults = _schema_defaults()
    return [f"{key}: {a.get(key, '<unset>')!r} → {b.get(key, '<unset>')!r}"
            for key in sorted(set(a) | set(b))
            if not key.startswith(ignore) and a.get(key) != b.get(key)
            # A config saved before a key existed meant the key's default by leaving it out:
            # a new option must not refuse every older run's resume.
            and not (key not in a and key in defaults and b.get(key) == defaults[key])]


def _without_neutral(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` without entries that change nothing: a hold of 0 stages (``fit.hold.X=0``,
    how an override drops an experiment's hold) and an empty or null ``fit.hold``."""
    return {k: v for k, v in flat.items()
            if not ((k.startswith("fit.hold.") and v == 0)
                    or (k == "fit.hold" and v in ({}, None)))}


def _schema_defaults() -> dict[str, Any]:
    """Every key of the fit schema with its default value, flattened."""
    return flatten(dataclasses.asdict(FitConfig()))
