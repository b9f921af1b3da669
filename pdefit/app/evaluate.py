"""``pdefit-evaluate RUN_DIR``: forecast a finished fit past its training window, the command
line of :mod:`pdefit.analysis.forecast`. A run's saved ``config.yaml`` (and those of the runs
``evaluate.compare`` names) with the evaluation's overrides become typed options here, once;
the analysis takes those."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pdefit.analysis.forecast import evaluate_fit
from pdefit.analysis.reports import format_evaluation
from pdefit.analysis.truth import EvaluationError, check_compared_run, check_evaluate_settings
from pdefit.app.config import schema, to_options
from pdefit.app.errors import one_line_errors
from pdefit.options import ConfigError, EvaluateConfig, FitConfig
from pdefit.runtime.compile_cache import use_compilation_cache

__all__ = ["EVALUATE_HELP", "EvaluationError", "compared_runs", "evaluate_run",
           "format_evaluation", "load_run_config", "main"]


def load_run_config(run_dir: Path, overrides: Sequence[str] = ()) -> FitConfig:
    """The run's saved config on the current schema; ``overrides`` (``evaluate.*=...`` or
    ``precision=...``) apply on top. Other keys would change the fit itself and are refused."""
    path = run_dir / "config.yaml"
    if not path.exists():
        raise EvaluationError(f"{run_dir} has no config.yaml: is it a pdefit-fit run directory?")
    bad = [o for o in overrides if not (o.startswith("evaluate.") or o.startswith("precision="))]
    if bad:
        raise EvaluationError(f"only evaluate.* and precision may be overridden, got {bad}")
    cfg = OmegaConf.merge(schema(FitConfig), OmegaConf.load(path))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    # The evaluation's own settings first: they are named even where the rest of the config
    # is not complete.
    check_evaluate_settings(to_options(cfg.evaluate, EvaluateConfig))
    return to_options(cfg)


def compared_runs(cfg: FitConfig, run_dir: Path, experiment: int = 0,
                  ) -> list[tuple[Path, FitConfig]]:
    """The finished fits ``evaluate.compare`` names, with their saved configs, each checked to
    be evaluable against the same truth as ``run_dir`` (before anything is simulated): the
    same truth description and the same first frame of their datasets
    (:func:`pdefit.analysis.truth.check_compared_run`)."""
    if not cfg.evaluate.compare:
        return []
    saved = load_run_config(run_dir)  # the precision its data were made at, not overridden
    others = []
    for name in cfg.evaluate.compare:
        other = Path(name)
        try:
            other_cfg = load_run_config(other)
        except EvaluationError as err:
            raise EvaluationError(f"evaluate.compare: {err}") from None
        check_compared_run(saved, other_cfg, run_dir, other, experiment)
        others.append((other, other_cfg))
    return others


def evaluate_run(run_dir: Path, overrides: Sequence[str] = (), experiment: int = 0,
                 log: Callable[[str], None] = print, write: bool = True) -> dict[str, Any]:
    """Forecast, metrics, plots and ``evaluation.json`` for the finished fit in ``run_dir``
    (``write=False``: the result only, nothing written), with the runs of
    ``evaluate.compare`` forecast alongside
    (:func:`pdefit.analysis.forecast.evaluate_fit`)."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir, overrides)
    others = compared_runs(cfg, run_dir, experiment)
    return evaluate_fit(run_dir, cfg, others, experiment, log, write, started=started)


EVALUATE_HELP = """\
usage: pdefit-evaluate RUN_DIR [evaluate.<key>=<value> ...] [precision=float64]

Forecast a finished fit (RUN_DIR of pdefit-fit) past its training window against the truth:
re-simulates the data's system and runs the fitted model and evaluate.lyapunov_directions
twins of the truth perturbed by evaluate.lyapunov_perturbation in one jitted scan. Prints how
long the forecast stays valid (normalised MAE below evaluate.threshold), the truth's active
fraction and whether it comes to rest (a validity that runs into resting truth is reported
as such), the Lyapunov exponent of the truth with its spread over the directions (or
"undetermined" and why) and the activation-time error; writes RUN_DIR/evaluation.json and
plots (forecast_mae.png, centre_trace.png, difference_maps.png, separation.png, activity.png,
activation_error.png).

keys: horizon (default 4 x the training window), frame_interval, threshold (0.05), field,
activation_level, maps_at, lyapunov_perturbation, lyapunov_directions (4),
min_active_fraction (0.05), compare (pdefit/options.py EvaluateConfig)

evaluate.compare=[RUN_DIR2,...] forecasts other fits of the same truth alongside (refused,
naming the differing keys, if their truth is not the same) and plots every run's MAE of the
fields they share on one log axis with the training windows marked (forecast_compare.png;
the curves and each run's validity under "comparison" in evaluation.json).

examples:
  pdefit-fit experiment=bocf_recovery run.name=bocf
  pdefit-evaluate runs/fit/bocf evaluate.horizon=2000
  pdefit-fit experiment=ap_from_bocf run.name=ap
  pdefit-fit experiment=bocf_refit_for_ap run.name=bocf_for_ap
  pdefit-evaluate runs/fit/ap evaluate.compare=[runs/fit/bocf_for_ap]"""


@one_line_errors("pdefit-evaluate")
def main(argv: Sequence[str] | None = None) -> None:
    """``pdefit-evaluate RUN_DIR [evaluate.horizon=2000 ...]``"""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(EVALUATE_HELP)
        raise SystemExit(0 if args else 2)
    use_compilation_cache()
    try:
        result = evaluate_run(Path(args[0]), args[1:])
    except (EvaluationError, ConfigError) as err:
        print(f"pdefit-evaluate: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_evaluation(result))
    print(f"wrote {Path(args[0]) / 'evaluation.json'} and plots ({result['wall_time_s']:.1f} s)")
