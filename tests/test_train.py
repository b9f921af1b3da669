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
