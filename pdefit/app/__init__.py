"""The application: the Hydra command lines (``pdefit-fit``, ``-simulate``, ``-gradcheck``,
``-rank``, ``-evaluate``, ``-lyapunov``, ``-sweep-summary``; what a finished fit reports is
``fit_report``), the one place a ``DictConfig``
becomes typed options (``config``), validation of a whole config before any work
(``validate``), run directories and their locks and records (``rundir``), job-array batches
(``batch``) and sweep summaries (``sweep``).

The only layer that imports Hydra or OmegaConf. May import every layer below.
"""
