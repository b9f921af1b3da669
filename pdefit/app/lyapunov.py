"""``pdefit-lyapunov``: the Lyapunov time of the configured system (the command line of
:mod:`pdefit.analysis.lyapunov`)."""

from pdefit.analysis.lyapunov import lyapunov_main

__all__ = ["lyapunov_main"]
