"""The application: the Hydra command lines — ``cli`` (``pdefit-fit``, ``-simulate``,
``-gradcheck``, ``-rank``; ``fit_report``: what a finished fit reports), ``evaluate``
(``pdefit-evaluate``), ``lyapunov`` (``pdefit-lyapunov``), ``sweep``
(``pdefit-sweep-summary``) and ``batch`` (job-array shares of a dataset) — the one place a
``DictConfig`` becomes typed options (``config``), validation of a whole config before any
work (``validate``), and run directories and their records (``rundir``).

The only layer that imports Hydra or OmegaConf. May import every layer below.
"""
