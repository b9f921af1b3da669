"""What keeps a long run alive and legible: Orbax checkpoints and atomic writes
(``checkpoint``), preemption signals turned into a checkpoint and an exit status (``signals``),
progress reporting (``progress``) and which config changes a resume allows (``resume``).

Imports only :mod:`pdefit.options` of pdefit: the training loop and the command lines both
use it. The package's ``__init__`` imports ``signals`` first of all, before JAX, so this
``__init__`` stays empty.
"""
