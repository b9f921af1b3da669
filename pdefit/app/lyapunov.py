"""``pdefit-lyapunov``: the Lyapunov time of the configured system, the command line of
:mod:`pdefit.analysis.lyapunov` (the composed config becomes typed options here, once).

Printed: λ, the Lyapunov time 1/λ, and how many frames of the configured
``simulate.steps_per_frame × system.dt`` spacing span ``WINDOW`` (0.35) Lyapunov times; the
numbers and the separation curve go to ``lyapunov.json`` in the run directory.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from pdefit.analysis.lyapunov import estimate, format_estimate
from pdefit.app.config import CONF_DIR, register_configs, to_options
from pdefit.app.errors import one_line_errors, task_errors
from pdefit.app.rundir import open_run_record, output_dir, register_resolvers
from pdefit.runtime.compile_cache import use_compilation_cache

register_configs()
register_resolvers()


@one_line_errors("pdefit-lyapunov")
@hydra.main(config_path=CONF_DIR, config_name="fit", version_base="1.3")
@task_errors
def lyapunov_main(cfg: DictConfig) -> None:
    """pdefit-lyapunov: the maximal Lyapunov exponent of the configured simulation (the data's
    system from simulate.seed's initial state and a twin perturbed by
    evaluate.lyapunov_perturbation), to choose a training window (simulate.n_frames) and a
    forecast horizon before fitting. Prints λ, the Lyapunov time and a suggested window;
    writes lyapunov.json to the run directory. Takes every pdefit-fit key (same config).

    Example:
      pdefit-lyapunov experiment=rb_temperature_from_velocity"""
    use_compilation_cache()
    options = to_options(cfg)
    result = estimate(options)
    out = output_dir(options)
    open_run_record(out, options)
    (out / "lyapunov.json").write_text(json.dumps(result, indent=2))
    print(format_estimate(result))
    print(f"wrote {out / 'lyapunov.json'} ({result['wall_time_s']['total']:.1f} s)")
