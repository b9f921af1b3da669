"""Which jitted update a fit runs, and keeping it across fits of one problem.

:func:`step_update` picks among the updates of :mod:`pdefit.fitting.optimisers` (optax,
Levenberg–Marquardt on dense or matrix-free curvature) and :mod:`pdefit.fitting.reduced_steps`
(``optim.parameter_step=reduced``, with its own step count: :func:`stage_options`);
:func:`kept_step_update` keeps what it built for later fits
of the same loss and options (a bootstrap's refits), so that they compile nothing new.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax

from pdefit.fitting.krylov import MatrixFree
from pdefit.fitting.optimisers import (
    LEVENBERG_MARQUARDT,
    StepLimits,
    make_damped_update,
    make_matrix_free_update,
    make_update,
)
from pdefit.fitting.reduced_steps import make_reduced_update
from pdefit.options import OptimConfig


def takes_reduced_steps(cfg: OptimConfig, curvature: Callable | None,
                        hold: frozenset[str]) -> bool:
    """Whether a fit with these options, curvature and holds steps its parameters on the
    fields' Schur complement (a stage that holds every fitted parameter takes joint steps)."""
    return (cfg.name == LEVENBERG_MARQUARDT and cfg.parameter_step == "reduced"
            and isinstance(curvature, MatrixFree)
            and not set(curvature.problem.layout.fitted) <= hold)


def stage_options(cfg: OptimConfig, curvature: Callable | None,
                  hold: frozenset[str]) -> OptimConfig:
    """``cfg`` with ``optim.reduced_steps`` as its step count where the fit takes reduced
    steps, else ``cfg``."""
    if cfg.reduced_steps is None or not takes_reduced_steps(cfg, curvature, hold):
        return cfg
    return dataclasses.replace(cfg, steps=cfg.reduced_steps)


def step_update(loss: Callable, optimizer: optax.GradientTransformation, cfg: OptimConfig,
                curvature: Callable | None,
                describe: Callable[[Any], Mapping[str, Any]] | None,
                hold: frozenset[str], limits: StepLimits | None = None) -> Callable:
    """The jitted update of ``cfg.name``: Levenberg–Marquardt's, or the optax one."""
    if cfg.name == LEVENBERG_MARQUARDT:
        if isinstance(curvature, MatrixFree):
            make = make_reduced_update if takes_reduced_steps(cfg, curvature, hold) else (
                make_matrix_free_update)
            return make(loss, curvature, cfg, describe, hold, limits)
        if curvature is None:
            raise ValueError("optim.name=levenberg_marquardt needs the problem's Gauss–Newton "
                             "curvature (pdefit.fitting.gauss_newton)")
        return make_damped_update(loss, curvature, describe, hold, limits)
    return make_update(loss, optimizer, describe, hold, limits)


def kept_step_update(steps: dict[Any, Any] | None, loss: Callable,
                     optimizer: optax.GradientTransformation, cfg: OptimConfig,
                     curvature: Callable | None,
                     describe: Callable[[Any], Mapping[str, Any]] | None,
                     hold: frozenset[str], limits: StepLimits | None = None) -> Callable:
    """:func:`step_update`, kept in ``steps`` (a dict the caller holds across fits of one
    problem; None: built afresh) for later fits with the same loss, options, curvature (by
    identity, kept in the entry so that its id is not reused), description, holds and limits:
    those on arrays of the same shapes (a bootstrap's refits) then compile nothing new."""
    key = (loss, cfg, hold, describe, id(curvature), repr(limits))
    if steps is None or key not in steps:
        built = step_update(loss, optimizer, cfg, curvature, describe, hold, limits)
        if steps is None:
            return built
        steps[key] = (curvature, built)
    return steps[key][1]
