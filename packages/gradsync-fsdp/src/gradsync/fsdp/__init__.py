"""gradsync.fsdp (layer 3): MegatronFSDP, its four sharding strategies and the megatron-fsdp user API.

Params live in flat per-bucket buffers (zero-copy); the optimizer sees dim-0 DTensor shards of the main
weights; hooks gather, release and reduce unit by unit. See the package README for the strategies and
where this deliberately differs from Megatron-FSDP v1.
"""

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups import FSDPDistributedIndex

from .bucket import BucketStatus, PrefetchOrder
from .fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from .hooks import RegisterFSDPBackwardFunction, TrainingState
from .hooks import replace_module_parameter as _replace_module_parameter
from .layout import BucketLayout, compute_bucket_layout, row_alignment
from .megatron_fsdp import MegatronFSDP
from .settings import MixedPrecisionPolicy, ShardingStrategy
from .uneven_dtensor import (
    gather_uneven_dtensor_to_full_tensor,
    preprocess_state_dict_for_uneven_dtensor,
    redistribute_uneven_dtensor_to_replicated,
    split_dtensor,
    uneven_dtensor_to_full_tensor,
    validate_uneven_dtensor,
)
from .version import __version__

__all__ = [
    "BucketLayout",
    "BucketStatus",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "PrefetchOrder",
    "RegisterFSDPBackwardFunction",
    "ShardingStrategy",
    "TrainingState",
    "__version__",
    "_replace_module_parameter",
    "compute_bucket_layout",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "gather_uneven_dtensor_to_full_tensor",
    "preprocess_state_dict_for_uneven_dtensor",
    "redistribute_uneven_dtensor_to_replicated",
    "row_alignment",
    "split_dtensor",
    "uneven_dtensor_to_full_tensor",
    "validate_uneven_dtensor",
]
