"""gradsync.buffers (layer 2): DistributedDataParallelConfig, flat param/grad buffers, bucketing and
bucket-group collectives.

The pure layout (:mod:`.layout`) says where every param and grad lives; buffers hold that storage;
bucket groups reduce grads and gather params asynchronously, one group at a time, through the stateless
functions in :mod:`.collectives`.
"""

from .assembly import GradBuffers, build_grad_buffers
from .bucket_group import ParamAndGradBucketGroup, partition_buckets
from .buffer import ParamAndGradBucket, ParamAndGradBuffer
from .buffer import _ParamAndGradBuffer as _ParamAndGradBuffer
from .collectives import reduce_scatter_with_fp32_accumulation, shard_buffer
from .config import DistributedDataParallelConfig, default_bucket_size, effective_bucket_size
from .field_support import (
    FSDP_ONLY_FIELDS,
    non_default_fields,
    non_default_values,
    refuse_fields_ddp_cannot_honour,
)
from .foreign_config import as_ddp_config
from .grad_checks import LargeGradDetector
from .layout import (
    BufferKey,
    FullParamLayout,
    ParamSpec,
    PerBufferParamLayout,
    ShardParamRange,
    bucket_end_divisor,
    compute_full_param_layout,
    compute_param_layout,
    group_params_for_buffers,
    group_specs_for_buffers,
    is_expert_parallel,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)
from .matrix_optim import BlockShampoo, Muon, muon_param_groups
from .param_consistency import (
    broadcast_from_first_rank,
    check_experts_match_across_ranks,
    check_params_match_across_ranks,
    settings_of,
)
from .param_ready import PARAM_READY_CALLBACK_ATTR, ensure_params_ready
from .scaling import gradient_scaling_factors
from .shard_alignment import (
    ShardAlignment,
    ShardBalance,
    parse_shard_alignment,
    resolve_shard_alignments,
)
from .stats import CollectiveRecord, CommStats
from .step_ballot import AbandonedStepError
from .telemetry import CommTelemetry, active_telemetry, disable_telemetry, enable_telemetry
from .version import __version__
from .watchdog import (
    CollectiveHangError,
    HangWatchdog,
    pause_hang_watchdog,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from .wire_hook import LowPrecisionHookState, low_precision_hook

# Megatron-Core's private names, for code that imports them (_ParamAndGradBuffer takes Megatron's
# constructor arguments, so it is a class of its own).
_ParamAndGradBucket = ParamAndGradBucket
_ParamAndGradBucketGroup = ParamAndGradBucketGroup

__all__ = [
    "FSDP_ONLY_FIELDS",
    "PARAM_READY_CALLBACK_ATTR",
    "AbandonedStepError",
    "BlockShampoo",
    "BufferKey",
    "CollectiveHangError",
    "CollectiveRecord",
    "CommStats",
    "CommTelemetry",
    "DistributedDataParallelConfig",
    "FullParamLayout",
    "GradBuffers",
    "HangWatchdog",
    "LargeGradDetector",
    "LowPrecisionHookState",
    "Muon",
    "ParamAndGradBucket",
    "ParamAndGradBucketGroup",
    "ParamAndGradBuffer",
    "ParamSpec",
    "PerBufferParamLayout",
    "ShardAlignment",
    "ShardBalance",
    "ShardParamRange",
    "__version__",
    "active_telemetry",
    "as_ddp_config",
    "broadcast_from_first_rank",
    "bucket_end_divisor",
    "build_grad_buffers",
    "check_experts_match_across_ranks",
    "check_params_match_across_ranks",
    "compute_full_param_layout",
    "compute_param_layout",
    "default_bucket_size",
    "disable_telemetry",
    "effective_bucket_size",
    "enable_telemetry",
    "ensure_params_ready",
    "gradient_scaling_factors",
    "group_params_for_buffers",
    "group_specs_for_buffers",
    "is_expert_parallel",
    "low_precision_hook",
    "muon_param_groups",
    "non_default_fields",
    "non_default_values",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
    "parse_shard_alignment",
    "partition_buckets",
    "pause_hang_watchdog",
    "reduce_scatter_with_fp32_accumulation",
    "refuse_fields_ddp_cannot_honour",
    "resolve_shard_alignments",
    "settings_of",
    "shard_buffer",
    "start_hang_watchdog",
    "stop_hang_watchdog",
]
