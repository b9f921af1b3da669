"""pdefit: fit parameters and initial fields of discretized PDEs to observed data with exact
discrete adjoints and bounded memory.

The Python API (:mod:`pdefit.api`): :func:`get_system`, :func:`open_dataset`,
:func:`build_problem`, :func:`fit`. The engine's building blocks are re-exported here too; each
concept lives in its own module.
"""

from pdefit.runtime.signals import hold_early

hold_early()  # pdefit-fit only: a signal during the imports below is recorded, not fatal

from importlib.metadata import PackageNotFoundError, version  # noqa: E402

from pdefit.adjoint import (  # noqa: E402
    LossChain,
    Nested,
    Revolve,
    StoreAll,
    revolve_plan,
    snapshots_for_budget,
)
from pdefit.data.recording import write_recording as write_dataset  # noqa: E402
from pdefit.fitting.observe import Observation, ObservedData, observed_data  # noqa: E402
from pdefit.fitting.problem import Batch, FitProblem, Regularization  # noqa: E402
from pdefit.model.params import ParameterLayout, ParamSpec  # noqa: E402
from pdefit.model.system import System, SystemEvaluation  # noqa: E402
from pdefit.numerics.grid import Grid  # noqa: E402
from pdefit.numerics.integrate import make_stepper, simulate  # noqa: E402

from .api import (  # noqa: E402
    FitResult,
    FitSetup,
    build_problem,
    fit,
    get_system,
    open_dataset,
    simulate_dataset,
)

try:
    __version__ = version("pdefit")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Batch",
    "FitProblem",
    "FitResult",
    "FitSetup",
    "Grid",
    "LossChain",
    "Nested",
    "Observation",
    "ObservedData",
    "ParamSpec",
    "ParameterLayout",
    "Regularization",
    "Revolve",
    "StoreAll",
    "System",
    "SystemEvaluation",
    "__version__",
    "build_problem",
    "fit",
    "get_system",
    "make_stepper",
    "observed_data",
    "open_dataset",
    "revolve_plan",
    "simulate",
    "simulate_dataset",
    "snapshots_for_budget",
    "write_dataset",
]
