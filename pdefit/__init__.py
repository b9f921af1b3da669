"""pdefit: fit parameters and initial fields of discretized PDEs to observed data with exact
discrete adjoints and bounded memory.

The Python API (:mod:`pdefit.api`): :func:`get_system`, :func:`open_dataset`,
:func:`build_problem`, :func:`fit`. The engine's building blocks are re-exported here too; each
concept lives in its own module.
"""

from importlib.metadata import PackageNotFoundError, version

from .adjoint import LossChain, Nested, Revolve, StoreAll, revolve_plan, snapshots_for_budget
from .api import FitResult, FitSetup, build_problem, fit, get_system, open_dataset
from .grid import Grid
from .integrate import make_stepper, simulate
from .observe import Observation, ObservedData, observed_data
from .params import ParameterLayout, ParamSpec
from .problem import Batch, FitProblem, Regularization
from .system import System, SystemEvaluation

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
    "snapshots_for_budget",
]
