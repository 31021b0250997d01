"""gradsync.ddp (layer 3): the DistributedDataParallel wrapper and a sharded optimizer for
use_distributed_optimizer.

Skeleton only for now: the package exists so that its tests, type check and layering run from day one.
"""

from .version import __version__

__all__ = ["__version__"]
