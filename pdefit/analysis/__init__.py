"""Analysis of a finished fit: forecasts past the training window against the truth,
Lyapunov times, activity of excitable media, and the reports (tables, figures) a scientist
reads.

Imports the fitting layer and below, and :mod:`pdefit.options`; never Hydra, never the app
layer.
"""
