"""pdefit: fit parameters and initial fields of discretized PDEs to observed data with exact
discrete adjoints and bounded memory.

The public engine API is re-exported here; each concept lives in its own module.
"""

from .signals import hold_early

hold_early()  # pdefit-fit only: a signal during the imports below is recorded, not fatal

from .adjoint import LossChain, Nested, Revolve, StoreAll, revolve_plan, snapshots_for_budget  # noqa: E402
from .grid import Grid  # noqa: E402
from .integrate import make_stepper, simulate  # noqa: E402
from .observe import Observation, ObservedData, observed_data  # noqa: E402
from .params import ParameterLayout, ParamSpec  # noqa: E402
from .problem import Batch, FitProblem, Regularization  # noqa: E402

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
