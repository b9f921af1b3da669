"""Parallel execution: the processes of a multi-process run (``jax.distributed``, found from
Slurm or MPI), the device mesh over experiments and grid tiles, halo exchange for stencils on
tiles (``shard_map``), and moving data between hosts and devices.

Owns: ``processes``, ``domain``. Imports :mod:`pdefit.numerics` and :mod:`pdefit.data`. The
physics never imports it: a system computes on a block with halos and does not know whether
the halos came from a neighbour device.
"""

from pdefit.parallel.domain import Domain, TileGrid
from pdefit.parallel.processes import (
    ProcessInfo,
    dataset_array,
    host_array,
    host_scalar,
    initialize,
)

__all__ = ["Domain", "ProcessInfo", "TileGrid", "dataset_array", "host_array", "host_scalar",
           "initialize"]
