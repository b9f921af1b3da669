"""The optimisation loop's accounting: every loss evaluation a step makes (line search
included) is counted in its metrics record, and L-BFGS takes the loss and gradient of the
point its line search accepted from the search instead of evaluating them again."""

from __future__ import annotations

import itertools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdefit.fitting.train import run_fit
from pdefit.options import OptimConfig


def rosenbrock_counting(calls: list[int]):
    """A loss that records, from inside the compiled program, each time it is evaluated."""

    def loss(theta, batch):
        x, y = theta["params"]["x"], theta["params"]["y"]
        value = (batch - x) ** 2 + 100.0 * (y - x**2) ** 2
        jax.debug.callback(lambda: calls.append(1))
        return value

    return loss


@pytest.mark.parametrize("name", ["adam", "lbfgs"])
def test_metrics_count_every_loss_evaluation(tmp_path, name, caplog):
    calls: list[int] = []
    loss = rosenbrock_counting(calls)
    theta0 = {"params": {"x": jnp.asarray(-1.2), "y": jnp.asarray(1.0)}}
    cfg = OptimConfig(name=name, lr=0.01, steps=12, clip=None, schedule="constant")
    metrics = tmp_path / "metrics.jsonl"
    with caplog.at_level(logging.INFO, logger="pdefit"):
        _, history = run_fit(loss, theta0, jnp.asarray(1.0), cfg, metrics_path=metrics,
                             describe=lambda theta: theta["params"], log=lambda _: None,
                             progress=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records == history.records and len(records) == 12
    evaluations = [r["evaluations"] for r in records]
    # The last evaluation is the loss of the final point, outside the loop.
    assert sum(evaluations) == len(calls) - 1
    if name == "adam":
        assert evaluations == [1] * 12
    else:
        # The first step evaluates its start point and then searches (≥ 1 evaluation); later
        # steps start where the last search stopped and evaluate only inside their search.
        assert evaluations[0] >= 2 and min(evaluations[1:]) >= 1
        assert sum(evaluations[1:]) < 2 * 11
        # The loss taken from the search is the loss of the point the step starts from.
        for before, after in itertools.pairwise(records):
            x, y = after["params"]["x"], after["params"]["y"]
            np.testing.assert_allclose(after["loss"], (1.0 - x) ** 2 + 100.0 * (y - x**2) ** 2,
                                       rtol=1e-12)
            assert after["loss"] <= before["loss"]
    mean = sum(evaluations) / len(evaluations)
    assert f"evals {mean:.3g}/step" in caplog.text


def test_fits_that_share_their_steps_compile_once_and_end_where_fresh_fits_end(monkeypatch):
    """``run_fit(..., steps=kept)``: fits of one loss with the same options and holds (a
    bootstrap's refits) build and compile one step between them; another hold builds its own;
    each fit ends exactly where the same fit ends on a step of its own."""
    from pdefit.fitting import train, updates

    built, build = [], updates.step_update

    def counted(*args, **kwargs):
        built.append(args[5])  # its hold
        return build(*args, **kwargs)

    monkeypatch.setattr(updates, "step_update", counted)
    loss = rosenbrock_counting([])
    cfg = OptimConfig(name="adam", lr=0.01, steps=8, clip=None, schedule="constant")

    def fit(start, target, steps, hold=()):
        theta0 = {"params": {"x": jnp.asarray(start), "y": jnp.asarray(1.0)}}
        return train.run_fit(loss, theta0, jnp.asarray(target), cfg, log=lambda _: None,
                             progress=False, steps=steps, hold=hold)[1].best_theta

    kept: dict = {}
    shared = [fit(-1.2, 1.0, kept), fit(0.3, 0.5, kept), fit(0.3, 0.5, kept, hold=("y",))]
    assert built == [frozenset(), frozenset({"y"})]
    assert [entry[1]._cache_size() for entry in kept.values()] == [1, 1]  # one compile each
    built.clear()
    fresh = [fit(-1.2, 1.0, None), fit(0.3, 0.5, None), fit(0.3, 0.5, None, hold=("y",))]
    assert len(built) == 3
    for a, b in zip(shared, fresh, strict=True):
        for name in ("x", "y"):
            assert float(a["params"][name]) == float(b["params"][name])
    assert float(shared[2]["params"]["y"]) == 1.0  # held
