"""pdefit: fit parameters and initial fields of discretized PDEs to observed data with exact
discrete adjoints and bounded memory.

The public engine API is re-exported here; each concept lives in its own module.
"""

from .adjoint import LossChain, Nested, Revolve, StoreAll, revolve_plan, snapshots_for_budget
from .grid import Grid
from .integrate import make_stepper, simulate
from .observe import Observation, ObservedData, observed_data
from .params import ParameterLayout, ParamSpec
from .problem import Batch, FitProblem, Regularization

__all__ = [
    "Batch",
    "FitProblem",
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
    "make_stepper",
    "observed_data",
    "revolve_plan",
    "simulate",
    "snapshots_for_budget",
]
