"""``pdefit-evaluate``: forecast a finished fit past its training window (the command line of
:mod:`pdefit.analysis.forecast`)."""

from pdefit.analysis.forecast import main

__all__ = ["main"]
