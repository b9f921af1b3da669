r"""Write docs/results.md from the outputs of the cardiac runs and the forward benchmark.

Every number on the page is read from the JSON files the commands below write; the figures
are copied next to it into docs/results/. Run from the repository root after the commands:

    pdefit-rank experiment=bocf_recovery run.dir=runs/results/bocf_ranking
    pdefit-rank experiment=bocf_recovery system.options.heaviside_width=0 \
        run.dir=runs/results/bocf_ranking_sharp
    pdefit-fit experiment=bocf_recovery run.dir=runs/results/bocf_recovery
    pdefit-evaluate runs/results/bocf_recovery
    pdefit-fit experiment=bocf_recovery system.options.heaviside_width=0 optim=lbfgs \
        optim.steps=150 optim.grad_tol=1e-7 optim.patience=10 \
        run.dir=runs/results/bocf_recovery_sharp
    nice -n 5 python benchmarks/bocf_robustness.py
    pdefit-fit experiment=ap_from_bocf run.dir=runs/results/ap_from_bocf
    pdefit-fit experiment=bocf_refit_for_ap run.dir=runs/results/bocf_refit_for_ap
    pdefit-evaluate runs/results/ap_from_bocf \
        evaluate.compare=[runs/results/bocf_refit_for_ap]
    pdefit-fit experiment=ap_from_bocf system.grid.shape=[256,256] \
        simulate.system.grid.shape=[256,256] run.dir=runs/results256/ap_from_bocf
    pdefit-fit experiment=bocf_refit_for_ap system.grid.shape=[256,256] \
        run.dir=runs/results256/bocf_refit_for_ap
    pdefit-evaluate runs/results256/ap_from_bocf \
        evaluate.compare=[runs/results256/bocf_refit_for_ap]
    python benchmarks/forward.py
    python docs/make_results.py

The README's shorter commands (run.name=bocf_ranking, bocf, ap) write runs/fit/<name>, which are
read too: of the directories a run may be in (RUN_DIRS), the one written last is used, and
``KEY=DIR`` arguments name others (``python docs/make_results.py bocf_recovery=runs/fit/b2``).
A section whose run is found nowhere keeps its text from the existing page (a measured result
is never replaced by "not run"); nothing is filled in by hand.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "results"
# Where each run may be: the commands above, then the README's (run.name=…).
RUN_DIRS = {
    "bocf_ranking": [RUNS / "bocf_ranking", ROOT / "runs/fit/bocf_ranking"],
    "bocf_ranking_sharp": [RUNS / "bocf_ranking_sharp"],
    "bocf_recovery": [RUNS / "bocf_recovery", ROOT / "runs/fit/bocf"],
    "bocf_recovery_sharp": [RUNS / "bocf_recovery_sharp"],
    "ap_from_bocf": [RUNS / "ap_from_bocf", ROOT / "runs/fit/ap"],
}
# The file that says a run finished.
RESULT_FILE = {"bocf_ranking": "ranking.json", "bocf_ranking_sharp": "ranking.json"}
# The surrogate case at 256² (a section of its own, kept when the run is not found).
SURROGATE_256 = ROOT / "runs" / "results256" / "ap_from_bocf"
FIGURES = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
FORWARD = ROOT / "benchmarks" / "results" / "forward.json"
ROBUSTNESS = ROOT / "benchmarks" / "results" / "bocf_robustness.json"
COMMANDS = [line.strip() for line in __doc__.splitlines() if line.startswith("    ")]


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def run_dir(run: str, chosen: dict[str, Path]) -> Path:
    """The directory of ``run``: the one named on the command line, else the candidate whose
    result file was written last, else the first candidate (missing)."""
    if run in chosen:
        return chosen[run]
    result = RESULT_FILE.get(run, "summary.json")
    found = [d for d in RUN_DIRS[run] if (d / result).exists()]
    return (max(found, key=lambda d: (d / result).stat().st_mtime) if found
            else RUN_DIRS[run][0])


def figure(dirs: Mapping[str, Path], run: str, name: str, title: str) -> str:
    source = dirs[run] / name
    if not source.exists():
        return f"*(figure {run}/{name} missing)*"
    FIGURES.mkdir(parents=True, exist_ok=True)
    target = FIGURES / f"{run}_{name}"
    shutil.copyfile(source, target)
    return f"![{title}](results/{target.name})"


def pct(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{100 * x:.1e} %" if 0 < abs(x) < 1e-5 else f"{100 * x:.3f} %"


def num(x: float | None, fmt: str = ".4g") -> str:
    return "—" if x is None else format(x, fmt)


def ranking_section(dirs: Mapping[str, Path]) -> list[str] | None:
    data = load(dirs["bocf_ranking"] / "ranking.json")
    if data is None:
        return None
    rows = data["ranking"]
    lines = [f"{data['system']} on {data['grid'][0]}×{data['grid'][1]}, {data['n_steps']} steps "
             f"of dt = {data['dt']} ms, each parameter × {data['factor']}:", "",
             "| rank | parameter | value | trajectory MAE |", "|---|---|---|---|"]
    for r in rows[:14]:
        lines.append(f"| {r['rank']} | {r['name']} | {r['value']:.5g} | {num(r['mae'], '.3e')} |")
    lines += ["", f"(ranks 15–{len(rows)} below {num(rows[14]['mae'], '.1e')}; "
              "full table in the run directory)", "",
              figure(dirs, "bocf_ranking", "ranking.png", "parameter ranking")]
    sharp = load(dirs["bocf_ranking_sharp"] / "ranking.json")
    if sharp is not None:
        top = ", ".join(r["name"] for r in sharp["ranking"][:10])
        lines += ["", f"With the sharp published thresholds the top 10 are: {top}."]
    return lines


def parameter_rows(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| parameter | true | start | recovered | start error | error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {num(r['true'], '.6g')} | {num(r['start'], '.6g')} | "
                     f"{num(r['recovered'], '.6g')} | {pct(r['start_rel_error'])} | "
                     f"{pct(r['rel_error'])} |")
    return lines


def forecast_lines(ev: dict[str, Any] | None, unit: str) -> list[str]:
    if ev is None:
        return ["*Not evaluated.*"]
    lam = ev["lyapunov_exponent"]
    lines = [f"- training window {ev['training_window'][0]:g}–{ev['training_window'][1]:g} "
             f"{unit}; forecast over {ev['horizon']:g} {unit} (frames every "
             f"{ev['frame_interval']:g} {unit});"]
    if lam is not None:
        lines.append(f"- maximal Lyapunov exponent of the truth {lam:.4g} /{unit} (Lyapunov "
                     f"time {1 / lam:.4g} {unit}; fitted on "
                     f"{ev['lyapunov_fit']['fit_start']:g}–{ev['lyapunov_fit']['fit_end']:g} "
                     f"{unit}); the training window is "
                     f"{ev['training_window_lyapunov_times']:.3g} Lyapunov times;")
    else:
        reason = ev.get("lyapunov_undetermined_reason") or "no exponential growth stretch"
        lines.append(f"- Lyapunov exponent undetermined ({reason});")
    valid = (f"- forecast valid (normalised MAE ≤ {ev['threshold']}) for {ev['valid_for']:g} "
             f"{unit}")
    if lam is not None:
        valid += f" = {ev['valid_for_lyapunov_times']:.3g} Lyapunov times"
    if ev.get("truth_quiescent_from") is not None:
        valid += (f", but the truth is at rest ({ev['active_measure']} on fewer than "
                  f"{ev['min_active_fraction']:.0%} of the tissue) from "
                  f"{ev['truth_quiescent_from']:g} {unit}")
        if ev["forecast_runs_into_rest"]:
            valid += f": valid while active for {ev['valid_while_active']:g} {unit} only"
    lines.append(valid + ";")
    lines.append(f"- mean activation-time error {num(ev['activation_time_error_mean'])} {unit} "
                 f"({ev['activation_time_missed']} truth activations without a model one).")
    comparison = ev.get("comparison")
    if comparison:
        lines.append(f"- forecasts of the same truth compared on "
                     f"{', '.join(comparison['fields'])} (normalised MAE ≤ "
                     f"{comparison['threshold']}):")
        span = ev["curves"]["time"][-1] - ev["curves"]["time"][0]
        for run in comparison["runs"]:
            window = run["training_window"]
            whole = " (the whole horizon)" if run["valid_for"] >= span else ""
            lines.append(f"  - {run['label']}: valid for {run['valid_for']:g} {unit}{whole} "
                         f"(training window {window[0]:g}–{window[1]:g} {unit}){fit_note(run)}")
    return lines


def fit_note(run: Mapping[str, Any]) -> str:
    """``; loss … in … s, parameters …`` of a compared run's summary.json, where it is found."""
    summary = load(ROOT / run["run_dir"] / "summary.json")
    if summary is None:
        return ""
    note = (f"; its fit: loss {summary['initial_loss']:.3e} → {summary['best_loss']:.3e} in "
            f"{summary['wall_time_s']:.0f} s")
    if summary.get("mean_rel_error") is not None:
        note += (f", parameters off by {pct(summary['mean_rel_error'])} on average (max "
                 f"{pct(summary['max_rel_error'])})")
    return note


def surrogate_256_section() -> list[str] | None:
    """The 256² surrogate run's fit and its comparison, without the figures."""
    summary = load(SURROGATE_256 / "summary.json")
    ev = load(SURROGATE_256 / "evaluation.json")
    if summary is None or ev is None:
        return None
    return [f"{summary['system']} on {summary['grid'][0]}×{summary['grid'][1]}, loss "
            f"{summary['initial_loss']:.3e} → {summary['best_loss']:.3e} in "
            f"{summary['wall_time_s']:.0f} s of optimisation:", "",
            *forecast_lines(ev, "ms")]


def stages_text(stages: list | None) -> str:
    if not stages or stages == [None]:
        return "one window"
    return "windows of " + " → ".join(str(k) for k in stages) + " frames"


def fit_section(dirs: Mapping[str, Path], run: str, unit: str) -> list[str] | None:
    summary = load(dirs[run] / "summary.json")
    if summary is None:
        return None
    ev = load(dirs[run] / "evaluation.json")
    lines = [f"{summary['system']} on {summary['grid'][0]}×{summary['grid'][1]}, "
             f"{summary['n_steps']} steps, {stages_text(summary.get('stages'))}, schedule "
             f"{summary['schedule']}; loss {summary['initial_loss']:.3e} → "
             f"{summary['best_loss']:.3e} in {summary['wall_time_s']:.0f} s of optimisation.", ""]
    if summary.get("mean_rel_error") is not None:
        lines += [f"**Mean absolute relative deviation {pct(summary['mean_rel_error'])}, median "
                  f"{pct(summary['median_rel_error'])}, max {pct(summary['max_rel_error'])}.**",
                  ""]
    lines += [*parameter_rows(summary["parameters"]), ""]
    if (summary.get("discretization_check") or {}).get("verdict") == "twin":
        lines += ["*Twin data*: the dataset was made with the fit's own integrator, dt and grid, "
                  "so the recovery above cannot show the model's discretization error; fits of "
                  "data from finer steps are under \"Independent data\" and \"Time stepping "
                  "for BOCF\" below.", ""]
    lines += [*forecast_lines(ev, unit), ""]
    if ev is not None and ev.get("comparison"):
        lines.append(figure(dirs, run, "forecast_compare.png", "forecasts compared"))
    for name, title in (("forecast_mae.png", "forecast error"),
                        ("activation_error.png", "activation-time error"),
                        ("centre_trace.png", "centre pixel"),
                        ("difference_maps.png", "difference maps"),
                        ("separation.png", "twin separation")):
        lines.append(figure(dirs, run, name, title))
    return lines


def partial_run(run: Path) -> list[str] | None:
    """An interrupted staged fit: the best record of each finished stage against the truth."""
    stages = sorted(run.glob("stage-*/metrics.jsonl"), key=lambda p: int(p.parent.name[6:]))
    if not stages or not (run / "data.zarr").exists():
        return None
    from pdefit.data import open_dataset

    truth = open_dataset(run / "data.zarr").meta.true_params
    lines = ["Interrupted run; the best point of each stage it finished:", "",
             "| stage | steps | best loss | mean error | median error | max error |",
             "|---|---|---|---|---|---|"]
    for path in stages:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if not records:
            continue
        best = min(records, key=lambda r: r["loss"])
        errors = sorted(abs(v / truth[k] - 1) for k, v in best["params"].items())
        median = 0.5 * (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2])
        lines.append(f"| {path.parent.name} | {len(records)} | {best['loss']:.3e} | "
                     f"{pct(sum(errors) / len(errors))} | {pct(median)} | {pct(errors[-1])} |")
    return lines


def sharp_section(dirs: Mapping[str, Path]) -> list[str] | None:
    summary = load(dirs["bocf_recovery_sharp"] / "summary.json")
    if summary is None:
        return partial_run(dirs["bocf_recovery_sharp"])
    return [f"{stages_text(summary.get('stages'))}, loss {summary['initial_loss']:.3e} → "
            f"{summary['best_loss']:.3e} in {summary['wall_time_s']:.0f} s; mean absolute "
            f"relative deviation {pct(summary['mean_rel_error'])}, median "
            f"{pct(summary['median_rel_error'])}, max {pct(summary['max_rel_error'])}.", "",
            *parameter_rows(summary["parameters"])]


def robustness_section() -> list[str] | None:
    data = load(ROBUSTNESS)
    if data is None or not data["records"]:
        return None
    extra = " ".join(data["overrides"])
    return [f"`experiment={data['experiment']}` on {data['grid']}², start = truth × U(0.5, 1.5) "
            f"of each `fit.perturb.seed`{f', with `{extra}`' if extra else ''}; host "
            f"{data['host']} ({data['cpus']} cores, shared: wall times include waiting). "
            "Errors in %; with noise, mean abs(err)/SE is the mean over the 10 parameters of "
            "|recovered − true| / standard error (`pdefit.fitting.uncertainty`), and max SE % the "
            "largest standard error relative to its parameter.", "", data["table"]]


def forward_section() -> list[str] | None:
    data = load(FORWARD)
    if data is None:
        return None
    bw = data["bandwidth_bytes_per_s"]
    lines = [f"Device {data['device']}, {data['cpu_count']} cores, JAX {data['jax']}, commit "
             f"{data['commit']}; copy bandwidth NumPy {bw['numpy_copy'] / 1e9:.2f} GB/s, XLA "
             f"{bw['xla_stream'] / 1e9:.2f} GB/s.", "",
             "| n | pdefit steps/s | NumPy steps/s | speed-up | memory bound steps/s | "
             "of bound | max \\|Δu\\| after 20 steps |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['n']}² | {r['pdefit_steps_per_s']:.1f} | "
                     f"{r['numpy_steps_per_s']:.1f} | {r['speedup']:.1f}× | "
                     f"{r['bound_steps_per_s']:.1f} | {100 * r['fraction_of_bound']:.0f} % | "
                     f"{r['max_abs_du_after_20_steps']:.1e} |")
    lines += ["", f"Target ≥ 10× NumPy: {'met' if data['target_met'] else 'missed'}."]
    return lines


INDEPENDENT_DATA = "## Independent data: fits of data from a finer time step (issue 14)"
TIME_STEPPING = "## Time stepping for BOCF (`benchmarks/stepping.py`)"


def sections_of(page: str) -> dict[str, list[str]]:
    """Heading line -> the lines under it (up to the next heading of any level). A ``#``
    line inside a fenced code block is a shell comment, not a heading."""
    sections: dict[str, list[str]] = {}
    body: list[str] | None = None
    fenced = False
    for line in page.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("#") and not fenced:
            body = sections.setdefault(line, [])
        elif body is not None:
            body.append(line)
    return sections


def section(heading: str, intro: list[str], lines: list[str] | None,
            old: Mapping[str, list[str]]) -> list[str]:
    """``heading``, ``intro`` and the generated ``lines``; without them (the run is not found)
    the section as the existing page has it, so a measured result is never lost."""
    if lines is not None:
        return [heading, "", *intro, *lines, ""]
    if heading in old:
        print(f"{heading.lstrip('# ')}: run not found, section kept as it was",
              file=sys.stderr)
        return [heading, *old[heading]]
    return [heading, "", *intro, "*Not run yet.*", ""]


def optional_section(heading: str, lines: list[str] | None,
                     old: Mapping[str, list[str]]) -> list[str]:
    """:func:`section` for a variant that need not have been run: nothing while it never was."""
    return section(heading, [], lines, old) if lines is not None or heading in old else []


def chosen_dirs(argv: Sequence[str]) -> dict[str, Path]:
    chosen = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in RUN_DIRS:
            raise SystemExit(f"usage: make_results.py [RUN=DIR ...], RUN one of "
                             f"{', '.join(RUN_DIRS)}; got {arg!r}")
        chosen[key] = Path(value).resolve()
    return chosen


def main(argv: Sequence[str] = ()) -> None:
    chosen = chosen_dirs(argv)
    dirs = {run: run_dir(run, chosen) for run in RUN_DIRS}
    old = sections_of(PAGE.read_text()) if PAGE.exists() else {}
    page = [
        "# Results: the seed paper's cardiac cases",
        "",
        "Generated by `python docs/make_results.py` from the run directories; do not edit by "
        "hand. Commands (from the repository root, in this order):",
        "",
        "```",
        *COMMANDS,
        "```",
        "",
        *section("## Which BOCF parameters matter", [], ranking_section(dirs), old),
        *section("## BOCF parameter recovery (`experiment=bocf_recovery`)", [
            "The paper reports a mean absolute deviation of 0.76 % and a median of 0.4 % for "
            "these 10 parameters (512², GPU) and a forecast valid for about 2 s.", ""],
            fit_section(dirs, "bocf_recovery", "ms"), old),
        *section("### The same with the published sharp thresholds (L-BFGS, float64)", [
            "With `heaviside_width=0` the discrete-time misfit is a staircase at small scales "
            "(docs/design-decisions.md); staged L-BFGS gets this far:", ""],
            sharp_section(dirs), old),
        *section("### Robustness of the sharp recovery: start seeds and noise "
                 "(`benchmarks/bocf_robustness.py`)", [
                     "Targets (issue 13): noise-free mean ≤ 0.5 % and median ≤ 0.3 % for every "
                     "seed, within 30 min per fit on 2 CPU cores. Twin data with the default "
                     "stepping (Heun, dt = 0.5/7 ms); stages 0.5 → 1 → 2.5 → 5 → 10 → 20 → 50 ms "
                     "with u_so and k_so held in the 0.5 ms stage (`fit.hold`); with noise the "
                     "model starts from the noisy first frame (a known initial state). The σ"
                     " = 0.01 rows were measured again at commit d8dfe98 (`python "
                     "benchmarks/bocf_robustness.py --seeds 0 1 2 3 4 --sigmas 0.01`): no "
                     "seed runs off now that the parameters' bounds hold in the step control"
                     " (issue 24), and all five end at 3.2–3.3 % mean error, inside their "
                     "standard errors (up to 280–345 % of a parameter with the first frame's"
                     " noise included; six of the ten flagged poorly determined); the "
                     "issue-24 target of ≤ 0.5 % per seed is missed with a copied noisy "
                     "initial state. Before, seeds 0–1 ended at 10.4 % and 10.0 % and seeds "
                     "2–4 ran off in the 0.5 ms stage (τsi and τso1 to 62–2e45 ×; this page "
                     "at commit ec0c1b9)"
                     " (docs/design-decisions.md, \"Why "
                     "Levenberg–Marquardt recovers the sharp model\"). Wall and CPU time of the "
                     "whole `pdefit.app.cli.fit` (uncertainty and discretization check included). "
                     "Before the hold, with Rush–Larsen at dt = 0.05 ms and a 1 ms first stage, "
                     "start seed 1 ran off (u_so 1e14 ×; this page at commit 61c8a20).", ""],
                 robustness_section(), old),
        *section("## Aliev–Panfilov as a surrogate for BOCF (`experiment=ap_from_bocf`)", [
            "The seed paper's case (its Fig. 2c): Aliev–Panfilov's six parameters, D and both "
            "initial fields (u and the unobserved v) fitted to u of the BOCF truth over the "
            "recovery's 50 ms window (sharp thresholds, S1–S2 spiral, D = 0.1; BOCF at dt = "
            "0.0645 ms so that every 0.645 ms frame falls on an AP step), and BOCF refitted "
            "to the same truth (`experiment=bocf_refit_for_ap`); `pdefit-evaluate` with "
            "`evaluate.compare` forecasts both against the one truth. The paper: AP "
            "reproduces the BOCF dynamics over the window and breaks down sooner after it. "
            "The 0.5 s variant (`experiment=ap_from_bocf_long`, D = 0.05, random stimuli) "
            "gave no valid forecast at all (0 ms; this page at commit 988a832). Times of "
            "these runs: 2 CPU cores shared with other jobs.", ""],
                 fit_section(dirs, "ap_from_bocf", "ms"), old),
        *optional_section("### The same at 256²", surrogate_256_section(), old),
        *section("## Forward speed (`benchmarks/forward.py`)", [], forward_section(), old),
        # Measured by hand (its commands are in the section): kept as the page has it.
        *([INDEPENDENT_DATA, *old[INDEPENDENT_DATA]] if INDEPENDENT_DATA in old else []),
        # Measured by hand from benchmarks/stepping.py and fits on refined data; kept as is.
        *section(TIME_STEPPING, [], None, old),
    ]
    PAGE.write_text("\n".join(page).rstrip("\n") + "\n")
    print(f"wrote {PAGE}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
