"""Fitting: from typed options and a dataset to a fit and what it says — the fit problem
(system + observation + parameters + schedule → ``loss(theta, batch)``), observation
operators and losses, the optimisers (optax, L-BFGS, Levenberg–Marquardt) and their
checkpointed loop, Gauss–Newton curvature, parameter uncertainty, the discretization check,
parameter ranking, fitted initial fields, the saved fit, and the assembly of all of these
from :class:`pdefit.options.FitConfig`.

Imports the lower layers (numerics, model, adjoint, data, parallel, runtime) and
:mod:`pdefit.options`; never Hydra, never the analysis or app layers.
"""
