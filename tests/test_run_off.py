"""Never run off: parameter bounds and the per-step limit hold for every optimiser, a fit
that runs off stops as ``diverged`` with its best point, and a multi-start picks the start of
the lowest probe loss, deterministically."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import pdefit
from pdefit.app import cli
from pdefit.fitting import multistart
from pdefit.fitting.assemble import FitSetup
from pdefit.fitting.gauss_newton import gauss_newton
from pdefit.fitting.optimisers import limit_step, step_limits
from pdefit.fitting.train import run_fit
from pdefit.model.params import ParameterLayout, ParamSpec
from pdefit.options import ConfigError, OptimConfig
from systems.aliev_panfilov import AP96
from tests.helpers import ap_problem

CONF = str(Path(__file__).resolve().parents[1] / "conf")
OPTIMISERS = {"adam": {"lr": 1.0}, "lbfgs": {}, "levenberg_marquardt": {}}


def _noisy_ap(upper_a: float | None = None):
    """A small noisy Aliev–Panfilov twin (σ = 0.05 on u and v), four fitted parameters;
    ``upper_a`` replaces the upper bound of ``a`` (1.0)."""
    problem, batch, _, _ = ap_problem(shape=(10, 10), n_steps=40, every=5,
                                      fitted=("k", "a", "eps0", "mu1"), noise=0.05)
    if upper_a is not None:
        layout = problem.layout
        specs = {**layout.specs, "a": dataclasses.replace(layout.specs["a"], upper=upper_a)}
        problem = dataclasses.replace(problem, layout=dataclasses.replace(layout, specs=specs))
    return problem, batch


def _theta(problem, factor: float, a: float | None = None):
    start = {**AP96, **{n: AP96[n] * factor for n in problem.layout.fitted}}
    if a is not None:
        start["a"] = a
    return {"params": {k: jnp.asarray(v) for k, v in
                       problem.layout.unconstrained(start).items()}, "fields": {}}


def _fit(problem, batch, theta, name: str, steps: int = 40, layout=True):
    cfg = OptimConfig(name=name, steps=steps, clip=None, **OPTIMISERS[name])
    return run_fit(problem.loss, theta, batch, cfg, describe=problem.scalar_values,
                   progress=False, log=lambda _: None,
                   curvature=gauss_newton(problem) if name == "levenberg_marquardt" else None,
                   layout=problem.layout if layout else None)


def test_a_start_that_runs_off_ends_within_bounds_as_diverged():
    """Adam with a large learning rate from 3 × the truth: without the step control (as on
    the command line before) ``a`` ends at 20, beyond its declared upper bound 1; with it the
    fit stops as diverged once ``a`` has sat on the bound, and its best point is finite and
    inside every bound."""
    problem, batch = _noisy_ap()
    theta = _theta(problem, 3.0)
    _, before = _fit(problem, batch, theta, "adam", layout=False)
    assert float(problem.scalar_values(before.best_theta)["a"]) > 1.0  # ran off
    _, history = _fit(problem, batch, theta, "adam")
    assert history.stop_reason == "diverged"
    values = {k: float(v) for k, v in problem.scalar_values(history.best_theta).items()}
    assert all(math.isfinite(v) for v in values.values())
    assert values["a"] <= 1.0 + 1e-12
    assert all(r["params"]["a"] <= 1.0 + 1e-12 for r in history.records)
    assert history.best_loss == min(history.losses)


@pytest.mark.parametrize("name", list(OPTIMISERS))
def test_bounds_and_the_step_limit_hold_for_every_optimiser(name):
    """The truth a = 0.15 lies above a declared upper bound 0.12: every optimiser pushes
    against it and none crosses it; no step changes a log parameter by more than a factor
    of 10 (optim.max_log_step)."""
    problem, batch = _noisy_ap(upper_a=0.12)
    _, history = _fit(problem, batch, _theta(problem, 0.2, a=0.1), name, steps=25)
    values = [r["params"] for r in history.records]
    final = {k: float(v) for k, v in problem.scalar_values(history.best_theta).items()}
    assert max(v["a"] for v in [*values, final]) <= 0.12 * (1 + 1e-12)
    if name != "adam":  # (Adam at this learning rate wanders elsewhere)
        assert final["a"] > 0.11  # pushed against the bound by the data
    for before, after in itertools.pairwise(values):
        for key in before:
            assert abs(math.log(after[key] / before[key])) <= math.log(10) * (1 + 1e-9), key
    assert any(r.get("at_bound") for r in history.records)


def test_limit_step_clips_log_identity_and_leaves_bounded_alone():
    specs = {"p": ParamSpec(1.0, "log", lower=0.1, upper=50.0),
             "q": ParamSpec(0.0, "identity", lower=-1.0, upper=2.0, scale=0.5),
             "r": ParamSpec(0.5, "bounded", lower=0.0, upper=1.0)}
    layout = ParameterLayout.build(specs, {"p": 1.0, "q": 0.0, "r": 0.5}, ["p", "q", "r"])
    limits = step_limits(layout, OptimConfig(max_log_step=math.log(10)))
    old = {"params": {"p": jnp.asarray(0.0), "q": jnp.asarray(0.0), "r": jnp.asarray(0.0)}}
    new = {"params": {"p": jnp.asarray(9.0), "q": jnp.asarray(-7.0), "r": jnp.asarray(30.0)}}
    theta, changed, at_bound = limit_step(old, new, limits)
    physical = layout.physical(theta["params"])
    assert float(physical["p"]) == pytest.approx(10.0)  # one factor of 10, not e^9
    assert float(physical["q"]) == pytest.approx(-1.0)  # its lower bound (scale 0.5)
    assert float(theta["params"]["r"]) == 30.0  # the sigmoid keeps it inside by itself
    assert bool(changed) and bool(at_bound)
    theta, changed, _ = limit_step(old, {"params": {"p": jnp.asarray(2.0),
                                                    "q": jnp.asarray(1.0),
                                                    "r": jnp.asarray(-3.0)}}, limits)
    assert not bool(changed)
    # No limit at all without bounds and with optim.max_log_step=null.
    free = ParameterLayout.build({"p": ParamSpec(1.0, "log")}, {"p": 1.0}, ["p"])
    assert step_limits(free, OptimConfig(max_log_step=None)) is None


def _setups(problem, batch, factors):
    return [FitSetup(problem, batch, _theta(problem, f),
                     {n: AP96[n] * f for n in problem.layout.fitted}, None, [])
            for f in factors]


def test_multi_start_picks_the_lowest_probe_loss_deterministically():
    problem, batch = _noisy_ap()
    setups = _setups(problem, batch, (3.0, 1.1, 0.4))
    cfg = OptimConfig(name="levenberg_marquardt", steps=30, clip=None)
    steps = multistart.probe_length(cfg, None)
    assert steps == 3
    chosen, record = multistart.choose(setups, cfg, steps, seeds=[0, 1, 2],
                                       log=lambda _: None)
    losses = [s["probe_loss"] for s in record["starts"]]
    assert record["chosen"] == int(np.argmin(losses)) == 1
    assert chosen.start_values == setups[1].start_values
    assert float(problem.loss(chosen.theta0, batch)) == pytest.approx(losses[1], rel=1e-12)
    again, record_again = multistart.choose(setups, cfg, steps, seeds=[0, 1, 2],
                                            log=lambda _: None)
    assert record_again == record
    np.testing.assert_array_equal(np.asarray(again.theta0["params"]["k"]),
                                  np.asarray(chosen.theta0["params"]["k"]))


def _config(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="fit", overrides=[
            f"run.dir={tmp_path}", "system.grid.shape=[12,12]", "+system.options.initial=blobs",
            "simulate.n_frames=4", "simulate.steps_per_frame=5", "run.progress=false",
            "run.plots=false", "fit.params=[k,a]", "fit.uncertainty=false",
            "fit.discretization_check.enabled=false", *overrides])


def test_command_line_multi_start_says_which_start_won(tmp_path):
    summary = cli.fit(_config(tmp_path, "fit.starts=2", "fit.start_probe_steps=2",
                              "optim.steps=4", "fit.perturb.low=0.3", "fit.perturb.high=3"))
    starts = summary["starts"]
    assert starts["count"] == 2 and starts["probe_steps"] == 2
    assert [s["seed"] for s in starts["starts"]] == [0, 1]
    losses = [s["probe_loss"] for s in starts["starts"]]
    assert starts["chosen"] == int(np.argmin(losses))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["starts"] == starts
    rows = {r["name"]: r["start"] for r in summary["parameters"]}
    assert rows == pytest.approx(starts["starts"][starts["chosen"]]["start"])
    # The API's multi-start: the given start and one more, the given one's scalars × U(0.5,
    # 1.5) with seed 1.
    setup = pdefit.build_problem("aliev_panfilov", tmp_path / "data.zarr", fit=["k", "a"])
    other = multistart.perturbed(setup, 0.5, 1.5, 1)
    result = pdefit.fit(setup, optimizer="lbfgs", steps=4, starts=2,
                        discretization_check=False, uncertainty=False)
    assert result.start in (setup.start_values, other.start_values)
    assert all(math.isfinite(v) for v in result.params.values())


@pytest.mark.parametrize(("override", "key"), [
    ("fit.starts=0", "fit.starts"), ("fit.start_probe_steps=0", "fit.start_probe_steps"),
    ("optim.max_log_step=0", "optim.max_log_step"),
    ("optim.divergence_factor=1", "optim.divergence_factor"),
    ("optim.max_steps_at_bound=0", "optim.max_steps_at_bound"),
    ("optim.parameter_step=schur", "optim.parameter_step"),
    ("optim.krylov_preconditioner=block", "optim.krylov_preconditioner"),
    ("optim.reduced_tries=0", "optim.reduced_tries"),
    ("optim.reduced_field_steps=0", "optim.reduced_field_steps"),
    ("optim.reduced_steps=0", "optim.reduced_steps"),
    ("optim.reduced_radius=0", "optim.reduced_radius"),
    # Reduced steps eliminate fitted initial fields: this fit has none (and L-BFGS).
    ("optim.parameter_step=reduced", "optim.parameter_step")])
def test_bad_step_options_are_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        cli.fit(_config(tmp_path, override))
    assert not (tmp_path / "config.yaml").exists()


def test_run_off_rules_on_the_metrics_records():
    """The loss growing optim.divergence_factor-fold over its best, or a parameter on its
    bound for optim.max_steps_at_bound steps in a row, ends a fit as diverged; null turns
    either rule off."""
    from pdefit.fitting.train import _stopping

    def records(losses, at_bound=0):
        out = [{"loss": x, "grad_norm": 1.0} for x in losses]
        for r in out[len(out) - at_bound:]:
            r["at_bound"] = True
        return out

    cfg = OptimConfig(divergence_factor=1000.0, max_steps_at_bound=3)
    assert _stopping(records([1.0, 0.5, 400.0]), cfg, 3, best=0.5) is None
    assert _stopping(records([1.0, 0.5, 600.0]), cfg, 3, best=0.5)[0] == "diverged"
    assert _stopping(records([3.0, 2.0, 1.0], at_bound=2), cfg, 3, best=2.0) is None
    assert _stopping(records([3.0, 2.0, 1.0], at_bound=3), cfg, 3, best=2.0)[0] == "diverged"
    off = OptimConfig(divergence_factor=None, max_steps_at_bound=None)
    assert _stopping(records([1.0, 0.5, 1e9], at_bound=3), off, 3, best=0.5) is None
