"""What keeps a long run alive and legible: Orbax checkpoints and atomic writes
(``checkpoint``), preemption signals turned into a checkpoint and an exit status (``signals``),
and progress reporting (``progress``).

Imports nothing of pdefit (the package's ``__init__`` imports ``signals`` first of all, so
this ``__init__`` stays empty): the training loop and the command lines both use it.
"""
