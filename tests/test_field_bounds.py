"""Fitted initial fields stay in the range their system declares (``field_bounds``): every
step projects them there, as the parameters are projected onto their bounds."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pdefit
from pdefit.fitting.krylov import curvature_for
from pdefit.fitting.optimisers import limit_step, step_limits
from pdefit.fitting.train import run_fit
from pdefit.model.params import ParameterLayout, ParamSpec
from pdefit.model.system import SystemCheckError, check_system
from pdefit.numerics.grid import Grid
from pdefit.options import OptimConfig
from systems.bocf import BOCF

GATES = ("v", "w", "s")


def test_limit_step_projects_bounded_fields_and_segments_but_no_field_is_a_run_off():
    layout = ParameterLayout.build({"p": ParamSpec(1.0, "log", lower=0.1, upper=10.0)},
                                   {"p": 1.0}, ["p"])
    limits = step_limits(layout, OptimConfig(max_log_step=math.log(10)), (("g", 0.0, 1.0),))
    old = {"params": {"p": jnp.asarray(0.0)},
           "fields": {"g": jnp.full((1, 2, 2), 0.5), "u": jnp.zeros((1, 2, 2))},
           "segments": {"g": jnp.full((1, 1, 2, 2), 0.5), "u": jnp.zeros((1, 1, 2, 2))}}
    wild = jnp.asarray([[[-2.0, 0.3], [1.0, 3.5]]])
    new = {"params": {"p": jnp.asarray(0.5)}, "fields": {"g": wild, "u": 5.0 * wild},
           "segments": {"g": wild[:, None], "u": 5.0 * wild[:, None]}}
    theta, changed, at_bound = limit_step(old, new, limits)
    projected = np.asarray([[[0.0, 0.3], [1.0, 1.0]]])
    np.testing.assert_array_equal(theta["fields"]["g"], projected)
    np.testing.assert_array_equal(theta["segments"]["g"], projected[:, None])
    np.testing.assert_array_equal(theta["fields"]["u"], 5.0 * wild)  # not bounded
    assert float(theta["params"]["p"]) == 0.5
    # The projection moved the step (a line search must not trust it), but a field on its
    # bound is where resting tissue sits: no parameter is on a bound.
    assert bool(changed) and not bool(at_bound)
    inside = {**new, "fields": {**new["fields"], "g": jnp.full((1, 2, 2), 0.2)},
              "segments": {**new["segments"], "g": jnp.full((1, 1, 2, 2), 0.2)}}
    assert not bool(limit_step(old, inside, limits)[1])
    # Field bounds alone make a step control.
    free = ParameterLayout.build({"p": ParamSpec(1.0, "log")}, {"p": 1.0}, ["p"])
    assert step_limits(free, OptimConfig(max_log_step=None)) is None
    assert step_limits(free, OptimConfig(max_log_step=None), (("g", 0.0, 1.0),)) is not None


@pytest.mark.parametrize(("bounds", "message"), [
    ({"q": (0.0, 1.0)}, "field_bounds names 'q', not one of its fields"),
    ({"v": (1.0, 1.0)}, "field_bounds['v'] = (1.0, 1.0) is not a range"),
    ({"v": 1.0}, "field_bounds['v'] must be (lower, upper)"),
    ([("v", 0.0, 1.0)], "field_bounds must be a dict of field -> (lower, upper)"),
])
def test_a_system_with_malformed_field_bounds_is_refused_naming_the_field(bounds, message):
    @dataclasses.dataclass(frozen=True)
    class Bad(BOCF):
        field_bounds = bounds  # a class attribute, as BOCF's

    with pytest.raises(SystemCheckError, match=message.replace("(", r"\(").replace(
            ")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        check_system(Bad())


def _bocf_from_voltage(bound_fields: bool):
    """BOCF TNNP on 32², waves from random stimuli, u recorded every 0.5 ms for 5 ms with
    σ = 0.02; the ten parameters of bocf_from_voltage 20 % off, u(0) and the gates fitted
    from BOCF's first guess under the experiment's background prior."""
    system = pdefit.get_system("bocf", initial="stimuli", laplacian="9pt")
    with tempfile.TemporaryDirectory() as where:
        data = pdefit.simulate_dataset(system, Path(where) / "u.zarr",
                                       grid=Grid((32, 32), (1.0, 1.0)), dt=0.5 / 14,
                                       n_frames=11, steps_per_frame=14, params={"D": 0.1},
                                       noise_sigma=0.02, integrator="heun", fields=["u"],
                                       precision="float64")
        names = ["u_s", "u_so", "k_so", "tau_so1", "tau_si", "k_s", "u_u", "theta_v", "D",
                 "tau_fi"]
        start = {n: 1.2 * v for n, v in data.meta.true_params.items() if n in names}
        return pdefit.build_problem(
            system, data, fit=names, start=start, params={"D": 0.1},
            initial_fields=dict.fromkeys(("u", *GATES), "fit"), bound_fields=bound_fields,
            regularization={"field_background": 0.02**2 / (11 * 0.09)}, precision="float64")


def test_a_voltage_only_fit_keeps_the_hidden_gates_in_zero_one():
    """Unbounded, Levenberg–Marquardt steps on 5 ms of voltage leave the hidden gates outside
    [0, 1] (what a fit at wrong parameters does to explain the voltage: on 64², 10 ms, they
    reached −2.7 … 3.2); bounded (the default, from BOCF's field_bounds), the fit starts
    inside and every step keeps them there, and the loss still falls."""
    ends = {}
    for bound_fields in (True, False):
        setup = _bocf_from_voltage(bound_fields)
        problem = setup.problem
        expected = tuple((g, 0.0, 1.0) for g in GATES) if bound_fields else ()
        assert problem.field_bounds == expected
        # The quasi-steady first guess of w is 1 − u/τw∞ > 1 where the noisy u(0) < 0; the
        # bounded fit starts from it projected, its prior's background too.
        guess = {g: (float(jnp.min(setup.theta0["fields"][g])),
                     float(jnp.max(setup.theta0["fields"][g]))) for g in GATES}
        inside = all(low >= 0.0 and high <= 1.0 for low, high in guess.values())
        assert inside is bound_fields
        if bound_fields:
            np.testing.assert_array_equal(setup.batch.background["w"],
                                          setup.theta0["fields"]["w"])
        cfg = OptimConfig(name="levenberg_marquardt", steps=6, krylov_iterations=20,
                          initial_damping=1.0)
        _, history = run_fit(problem.loss, setup.theta0, setup.batch, cfg,
                             progress=False, log=lambda _: None,
                             curvature=curvature_for(problem), layout=problem.layout,
                             field_bounds=problem.field_bounds)
        assert history.losses[-1] < 0.5 * history.losses[0]
        fields = history.best_theta["fields"]
        ends[bound_fields] = {g: (float(jnp.min(fields[g])), float(jnp.max(fields[g])))
                              for g in GATES}
    assert all(low >= 0.0 and high <= 1.0 for low, high in ends[True].values()), ends
    # Unbounded, the steps take a gate further out than its first guess was.
    further = [g for g, (low, high) in ends[False].items()
               if low < min(0.0, guess[g][0]) - 1e-3 or high > max(1.0, guess[g][1]) + 1e-3]
    assert further, (ends, guess)
