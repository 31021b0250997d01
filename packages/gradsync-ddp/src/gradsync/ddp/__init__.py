"""gradsync.ddp (layer 3): the DistributedDataParallel wrapper and a sharded optimizer for
use_distributed_optimizer.

`DistributedDataParallel` wraps a module with contiguous grad buffers and bucketed, overlapped reductions;
`DistributedOptimizer` steps any torch.optim optimizer on this rank's reduce-scattered shard.
"""

from .base import _BaseDataParallel
from .diloco import DiLoCo
from .distributed_data_parallel import DistributedDataParallel
from .distributed_optimizer import DistributedOptimizer, merge_shards
from .version import __version__

__all__ = [
    "DiLoCo",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "_BaseDataParallel",
    "__version__",
    "merge_shards",
]
