"""JAX's persistent compilation cache for pdefit's commands.

A BOCF fit on a GPU spends most of its first minutes compiling (171 of 210 s at 512² on an
H100, docs/benchmarks.md), and a requeued job, a resumed run or the next point of a sweep
compiles the same programs again. JAX can keep compiled programs on disk, keyed by the
program, the device and the JAX version, but only when it is given a directory. The command
lines give it one:

- ``$PDEFIT_COMPILATION_CACHE``: a directory, or ``off`` (also ``0``, ``false``, ``no`` or
  empty) for none;
- else ``$JAX_COMPILATION_CACHE_DIR`` (JAX's own setting, kept as the user set it);
- else ``$XDG_CACHE_HOME/pdefit/jax`` (``~/.cache/pdefit/jax``).

The Python API leaves JAX's configuration to the program that imports pdefit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import jax

CACHE_VARIABLE = "PDEFIT_COMPILATION_CACHE"
JAX_VARIABLE = "JAX_COMPILATION_CACHE_DIR"
_OFF = ("", "0", "off", "false", "no", "none")


def cache_directory(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where the commands keep compiled programs (None: nowhere), from ``environ`` (default:
    the process environment); see the module docstring for the order."""
    env = os.environ if environ is None else environ
    chosen = env.get(CACHE_VARIABLE)
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF else Path(chosen).expanduser()
    if env.get(JAX_VARIABLE):
        return Path(env[JAX_VARIABLE]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "pdefit" / "jax"


def use_compilation_cache(environ: Mapping[str, str] | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at :func:`cache_directory` (before anything
    is compiled); return it. A directory that cannot be made leaves the cache off: a
    read-only home must not stop a fit."""
    directory = cache_directory(environ)
    if directory is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        logging.getLogger("pdefit").warning(
            f"no compilation cache ({err}); set {CACHE_VARIABLE} to a writable directory, "
            "or to off")
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    return directory
