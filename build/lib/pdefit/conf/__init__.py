"""Hydra configs, installed as the package ``pdefit.conf`` (found as ``pkg://pdefit.conf``)."""
