"""Coverage of the 95 % intervals when initial fields are fitted: a biased prior against one
consistent with the truth.

What it measures
----------------
Aliev–Panfilov on 16² (spun up 100 steps so that v belongs to u's dynamics), u observed every
10 steps for 200 steps of dt = 0.05 with additive noise σ = 0.01 (a new draw per ``--draws``
index), v never observed; k and a fitted from (9, 0.12) with u(0) and v(0) by matrix-free
Levenberg–Marquardt through ``pdefit.build_problem`` / ``pdefit.fit``, under a Gaussian
background of weight ``--background`` (regularization.field_background). Two priors:

- ``first_guess``: the background is the system's first guess (v on its nullcline where u is
  excited, 0 elsewhere; u the noisy first frame), as every fit has it: a guess that is wrong
  in a structured way, the same for every draw;
- ``consistent``: the background is the truth plus independent Gaussian noise of the standard
  deviation σ_b the weight stands for (σ_b = σ √(C / (N w)), docs/design-decisions.md), drawn
  anew for each draw: the prior the Laplace intervals assume.

- ``zero``: v's background is 0 (u's the first guess);
- ``recentred``: the first guess, then ``--passes`` − 1 refits, each with the background moved
  to the last estimate.

Per prior: how many of the parameter × draw pairs the 95 % intervals cover, the mean |error| /
standard error, and the errors of k and a. Unbiased Gaussian estimates give 95 % and 0.8.
``--sigma`` sets the noise (the consistent prior's σ_b follows it), ``--draws`` and
``--first-draw`` the noise seeds, ``--model unclamped`` a twin of Aliev–Panfilov whose recovery
rate has no kink at v = 0 (its first three fits ended far off: k 8.44,
7.16, 8.89, a 0.091, 0.039, 0.119), ``--v-offset`` lifts v
before the spin-up so that no cell rests at that kink.

How to run
----------
    python benchmarks/coverage_fields.py                 # 8 draws × 2 priors, ~15 min on 2 cores

Writes ``benchmarks/results/coverage_fields.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import pdefit
from pdefit.model.system import stepper
from pdefit.numerics.grid import Grid
from pdefit.numerics.integrate import simulate
from pdefit.numerics.stencils import laplacian
from pdefit.systems.aliev_panfilov import AP96, AlievPanfilov

TRUTH = {"k": 8.0, "a": 0.15}


@dataclasses.dataclass(frozen=True)
class UnclampedAP(AlievPanfilov):
    """Aliev–Panfilov with the published recovery rate for every v (``--model unclamped``):
    the built-in system's rate sees v only where v ≥ 0 (a kink at v = 0, where resting tissue
    sits), which this one has not; to tell whether that kink biases the estimates."""

    name: ClassVar[str] = "aliev_panfilov_unclamped"

    def rhs(self, state, params, t, grid):
        u, v = state["u"], state["v"]
        lap = laplacian(u, grid, self.laplacian)
        k, a, b = params["k"], params["a"], params["b"]
        eps = params["eps0"] + params["mu1"] * v / (u + params["mu2"])
        return {"u": params["D"] * lap - k * u * (u - a) * (u - 1.0) - u * v,
                "v": eps * (-v - k * u * (u - b - 1.0))}


MODELS = {"published": ("aliev_panfilov", AlievPanfilov),
          "unclamped": ("coverage_fields:UnclampedAP", UnclampedAP)}
SIGMA = 0.01  # the noise's standard deviation unless --sigma says otherwise


def truth_frames(shape: int, n_steps: int, model: str = "published",
                 v_offset: float = 0.0) -> dict[str, np.ndarray]:
    """Noise-free frames (every 10 steps) after a spin-up of 100 steps from one bump of
    excitation and recovery (the state of tests/helpers.py's ``voltage_only_setup``)."""
    grid = Grid((shape, shape), (1.0, 1.0))
    params = {k: jnp.asarray(v, jnp.float64) for k, v in AP96.items()}
    step = stepper(MODELS[model][1](), grid, "euler")
    rng = np.random.default_rng(0)
    y, x = np.meshgrid(np.arange(shape), np.arange(shape), indexing="ij")
    cy, cx = rng.uniform(0, shape), rng.uniform(0, shape)
    r2 = ((y - cy) ** 2 + (x - cx) ** 2) / (0.1 * shape) ** 2
    start = {"u": jnp.asarray(np.exp(-r2)),
             "v": jnp.asarray(0.5 * np.exp(-r2 / 4) * rng.uniform(0.5, 1.0) + v_offset)}
    spun = simulate(step, start, params, 0.0, 0.05, 100, 100)
    frames = simulate(step, {k: v[-1] for k, v in spun.items()}, params, 0.0, 0.05, n_steps, 10)
    return {k: np.asarray(v) for k, v in frames.items()}


def one_fit(frames: dict[str, np.ndarray], draw: int, prior: str, background: float,
            steps: int, krylov: int = 40, sigma: float = SIGMA, passes: int = 2,
            model: str = "published", bootstrap: int = 0) -> dict:
    rng = np.random.default_rng(draw)
    u = frames["u"] + sigma * rng.standard_normal(frames["u"].shape)
    shape = u.shape[1:]
    setup = pdefit.build_problem(
        MODELS[model][0], {"u": u}, fit=["k", "a"], start={"k": 9.0, "a": 0.12}, dt=0.05,
        frame_interval=0.5, grid=Grid(shape, (1.0, 1.0)),
        initial_fields={"u": "fit", "v": "fit"},
        regularization={"field_background": background}, precision="float64")
    if prior == "consistent":
        n_values = u.size
        sigma_b = sigma * math.sqrt(np.prod(shape) / (n_values * background))
        noise = np.random.default_rng(10_000 + draw)
        centre = {f: jnp.asarray(frames[f][0][None] + sigma_b * noise.standard_normal(
            (1, *shape))) for f in ("u", "v")}
        setup = setup._replace(batch=setup.batch._replace(background=centre),
                               theta0={**setup.theta0, "fields": centre})
    if prior == "zero":
        centre = {**setup.batch.background, "v": jnp.zeros_like(setup.batch.background["v"])}
        setup = setup._replace(batch=setup.batch._replace(background=centre),
                               theta0={**setup.theta0, "fields": centre})
    started = time.perf_counter()
    options = {"optimizer": "levenberg_marquardt", "steps": steps, "initial_damping": 1.0,
               "krylov_iterations": krylov, "discretization_check": False}
    result = pdefit.fit(setup, **options, bootstrap=bootstrap)
    for _ in range(passes - 1 if prior == "recentred" else 0):
        # The background moved to the last estimate of the fields, the fit resumed there.
        setup = setup._replace(batch=setup.batch._replace(background=result.theta["fields"]),
                               theta0=result.theta)
        result = pdefit.fit(setup, **options)
    rows = (result.uncertainty or {}).get("parameters") or {}
    record = {"draw": draw, "prior": prior, "wall_s": time.perf_counter() - started,
              "reduced_chi2": (result.residual or {}).get("reduced_chi2"),
              "stop_reason": result.stop_reason, "parameters": {}}
    for name, true in TRUTH.items():
        row = rows.get(name, {})
        low, high = row.get("ci95_low"), row.get("ci95_high")
        record["parameters"][name] = {
            "recovered": result.params[name], "std_error": row.get("std_error"),
            "covered": None if low is None else bool(low <= true <= high),
            "z": None if not row.get("std_error") else
            abs(result.params[name] - true) / row["std_error"]}
        boot = ((result.uncertainty or {}).get("bootstrap") or {}).get("parameters", {})
        if name in boot:
            b = boot[name]
            record["parameters"][name]["bootstrap"] = {
                **b, "covered": bool(b["ci95_low"] <= true <= b["ci95_high"]),
                "z": abs(b["corrected"] - true) / b["std_error"]}
    return record


def summary(records: list[dict], prior: str) -> str:
    pairs = [p for r in records if r["prior"] == prior for p in r["parameters"].values()]
    covered = sum(bool(p["covered"]) for p in pairs)
    z = [p["z"] for p in pairs if p["z"] is not None]
    errors = {n: [abs(r["parameters"][n]["recovered"] / t - 1) * 100 for r in records
                  if r["prior"] == prior] for n, t in TRUTH.items()}
    line = (f"| {prior} | {covered}/{len(pairs)} | {np.mean(z):.2f} | "
            f"{np.mean(errors['k']):.3f} | {np.mean(errors['a']):.3f} |")
    boot = [p["bootstrap"] for p in pairs if "bootstrap" in p]
    if boot:
        corrected = {n: [abs(r["parameters"][n]["bootstrap"]["corrected"] / t - 1) * 100
                         for r in records if r["prior"] == prior] for n, t in TRUTH.items()}
        line += (f"\n| {prior}, bootstrap-corrected | {sum(b['covered'] for b in boot)}/"
                 f"{len(boot)} | {np.mean([b['z'] for b in boot]):.2f} | "
                 f"{np.mean(corrected['k']):.3f} | {np.mean(corrected['a']):.3f} |")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--model", choices=sorted(MODELS), default="published",
                        help="the data's and the fit's model (a twin either way)")
    parser.add_argument("--v-offset", type=float, default=0.0,
                        help="added to v before the spin-up, so that no cell rests at v = 0")
    parser.add_argument("--first-draw", type=int, default=0,
                        help="the noise seed of the first draw (draws are consecutive seeds)")
    parser.add_argument("--grid", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="optimiser steps per fit")
    parser.add_argument("--background", type=float, default=1e-4)
    parser.add_argument("--sigma", type=float, default=SIGMA,
                        help="the noise's standard deviation (the consistent prior's σ_b "
                             "scales with it at a fixed --background)")
    parser.add_argument("--krylov", type=int, default=40,
                        help="conjugate-gradient iterations per Levenberg–Marquardt step")
    parser.add_argument("--priors", nargs="+", default=["first_guess", "consistent"],
                        choices=["first_guess", "consistent", "recentred", "zero"])
    parser.add_argument("--passes", type=int, default=2,
                        help="fits of the recentred prior: the first from the first guess, "
                             "each further one with the background at the last estimate")
    parser.add_argument("--bootstrap", type=int, default=0,
                        help="replicates of pdefit.fit(bootstrap=...) per fit (0: none): the "
                             "bias-corrected estimates' intervals are scored too")
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/coverage_fields.json"))
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    frames = truth_frames(args.grid, 200, args.model, args.v_offset)
    records = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for prior in args.priors:
        for draw in range(args.first_draw, args.first_draw + args.draws):
            records.append(one_fit(frames, draw, prior, args.background, args.steps,
                                   args.krylov, args.sigma, args.passes, args.model,
                                   args.bootstrap))
            r = records[-1]
            print(prior, draw, {n: (f"{p['recovered']:.5g}", p["covered"],
                                    p.get("bootstrap", {}).get("covered"))
                                for n, p in r["parameters"].items()}, f"χ² {r['reduced_chi2']}",
                  f"{r['wall_s']:.0f} s", flush=True)
            args.output.write_text(json.dumps({"args": vars(args) | {"output": str(
                args.output)}, "records": records}, indent=1))
    print("| prior | 95 % cover | mean abs(err)/SE | k mean err % | a mean err % |")
    print("|---|---|---|---|---|")
    for prior in args.priors:
        print(summary(records, prior))


if __name__ == "__main__":
    main()
