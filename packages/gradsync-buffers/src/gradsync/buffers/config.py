"""`DistributedDataParallelConfig`: Megatron-Core's DDP config, field for field, validated at construction.

Every incompatible combination is rejected in ``__post_init__`` with the fields and the fix named, before
any buffer or collective exists. The object is never mutated after construction: effective values (the
default bucket size, say) are derived where they are used, by :func:`effective_bucket_size`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .wire_format import wire_problem

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    """Configuration for DistributedDataParallel (names and defaults as in Megatron-Core)."""

    grad_reduce_in_fp32: bool = False
    """If true, reduce grads in fp32."""
    overlap_grad_reduce: bool = False
    """If true, overlap grad all-reduce / reduce-scatter with backward compute."""
    overlap_param_gather: bool = False
    """If true, overlap param all-gather with forward compute."""
    align_param_gather: bool = False
    """If true, all PP stages launch param all-gathers simultaneously; otherwise each stage launches them
    as needed."""
    use_distributed_optimizer: bool = False
    """If true, reduce-scatter grads (each rank owns a shard) and keep params in a flat buffer; otherwise
    all-reduce."""
    num_distributed_optimizer_instances: int = 1
    """Factor by which the DP domain is split into distributed-optimizer instances (1 = one instance over
    the whole DP domain)."""
    check_for_nan_in_grad: bool = False
    """If true, check for NaNs and Infs in gradients before the communication collective."""
    check_for_large_grads: bool = False
    """If true, check for unexpectedly large gradients before the communication collective."""
    bucket_size: int | None = None
    """Maximum number of parameters in each bucket. If unspecified, max(40000000, 1000000 * dp_size)
    (larger DP sizes need larger buckets so collectives do not become latency-bound)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """If true, pad bucket ends to a multiple of 2^16 as well, for high NCCL bus bandwidth at large DP."""
    reduce_scatter_with_fp32_accumulation: bool = False
    """If true, reduce-scatter by an all-to-all in the grad dtype followed by a local fp32 sum."""
    average_in_collective: bool = False
    """If true, average in the collective instead of dividing by the DP size first and summing."""
    fp8_param_gather: bool = False
    """If true, keep compute params in fp8 and all-gather them in fp8 (CUDA with Transformer Engine)."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """If true, reuse the grad buffer for the param all-gather with the mxfp8 recipe (needs
    fp8_param_gather)."""
    use_megatron_fsdp: bool = False
    """If true, use the Megatron-FSDP code path instead of DDP."""
    use_custom_fsdp: bool = False
    """Deprecated alias of use_megatron_fsdp."""
    data_parallel_sharding_strategy: str = "no_shard"
    """FSDP sharding strategy: 'no_shard', 'optim', 'optim_grads' or 'optim_grads_params'."""
    gradient_reduce_div_fusion: bool = True
    """If true, fuse the gradient reduction and division (FSDP)."""
    suggested_communication_unit_size: int | None = None
    """Elements communicated at once by FSDP; also drives its all-gather prefetch."""
    preserve_fp32_weights: bool = True
    """If true, keep fp32 weights in the Megatron-FSDP buffer."""
    keep_fp8_transpose_cache: bool = False
    """If true, keep the fp8 transpose cache with Megatron-FSDP."""
    nccl_ub: bool = False
    """If true, allocate param and grad buffers from NCCL user buffers (CUDA + NCCL only). Implies
    fsdp_double_buffer."""
    fsdp_double_buffer: bool = False
    """If true, use persistently allocated double buffers for FSDP's temporary communication memory."""
    outer_dp_sharding_strategy: str = "no_shard"
    """Sharding strategy of the outer DP group with hybrid FSDP."""
    disable_symmetric_registration: bool = False
    """If true, register NCCL user buffers locally instead of symmetrically."""
    delay_wgrad_compute: bool = False
    """Delay the weight-gradient computation for better batch-level communication overlap."""

    # Fields the reference documents elsewhere (training arguments, FSDP); accepted for compatibility.
    num_buckets: int | None = None
    """Number of buckets to aim for instead of bucket_size (the DDP wrapper converts it)."""
    param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = ()
    """fnmatch patterns (or 'all') naming params whose main_grad is kept in fp32 locally."""
    fp4_param_gather: bool = False
    """If true, all-gather params in fp4 (CUDA with Transformer Engine)."""
    megatron_fsdp_version: int = 1
    """Megatron-FSDP implementation version (1 or 2)."""
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    """FSDP: fall back to a persistent buffer when the double buffer cannot be allocated."""
    fsdp_all_gather_in_start_param_sync: bool = True
    """FSDP: issue the first all-gather from start_param_sync."""
    fsdp_manual_registration: bool = False
    """FSDP: register NCCL user buffers manually (CUDA + NCCL only)."""
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    """FSDP: dtype of the main (optimizer) params."""
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    """FSDP: dtype of the main grads (None = param dtype)."""
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    """FSDP: dtype grads are communicated in (None = main-grad dtype)."""
    megatron_fsdp_use_decoupled_grad: bool = False
    """FSDP: expose grads as decoupled_grad for precision-aware optimizers."""
    megatron_fsdp_cuda_graph_mode: bool = False
    """FSDP: CUDA-graph-safe mode."""
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    """FSDP: gather params per module instead of per bucket."""
    megatron_fsdp_max_pool_double_buffer: bool = False
    """FSDP: size the double buffer by the largest unit; implies fsdp_double_buffer."""

    # gradsync's own fields (Megatron-Core has no such field): communication-efficient grad sync.
    grad_comm_dtype: torch.dtype | None = None
    """gradsync-ddp: the dtype grads travel in (bf16, fp16, or fp8 e4m3 / e5m2 with one fp32 scale per
    block), summed in fp32 on arrival (all-to-all, then a local sum). None: the grad buffer's dtype, reduced
    by the backend's collective."""
    grad_comm_block_size: int = 32
    """Elements per fp32 scale when grad_comm_dtype is an fp8 dtype (32, the block of the OCP microscaling
    formats; docs/grad-comm.md has what larger blocks cost in training)."""
    grad_comm_error_feedback: bool = False
    """If true, add what this rank's last low-precision send lost to its next one (error feedback; one
    extra grad-buffer-sized residual per bucket)."""

    param_gather_dtype: torch.dtype | None = None
    """MegatronFSDP's sharded strategies (ZeRO-1/2/3): the dtype weights are all-gathered in (bf16, fp16, or
    fp8 with one fp32 scale per block), each rank packing its own full-precision shard; the compute
    weights are the unpacked values, the optimizer's weights stay exact. None: gather in the weights'
    dtype."""
    param_gather_block_size: int = 32
    """Elements per fp32 scale when param_gather_dtype is an fp8 dtype."""

    check_abandoned_steps: bool = True
    """gradsync's own: every data-parallel rank votes at each finish_grad_sync() (one small gloo all-reduce)
    so that a rank abandoning its step (its backward raised and was caught) makes every rank raise, after
    completing the collectives the others wait for. False: no vote; that rank raises alone and the others
    wait for the process group's timeout, as with torch's DDP (docs/rank-agreement.md)."""

    def __post_init__(self) -> None:
        if self.use_custom_fsdp:
            warnings.warn(
                "use_custom_fsdp is deprecated: set use_megatron_fsdp=True instead",
                DeprecationWarning,
                stacklevel=3,
            )
            self.use_megatron_fsdp = True
        if self.nccl_ub or self.megatron_fsdp_max_pool_double_buffer:
            self.fsdp_double_buffer = True
        _validate(self)


def _fail(message: str) -> None:
    raise ValueError(f"DistributedDataParallelConfig: {message}")


def _validate(c: DistributedDataParallelConfig) -> None:
    if c.megatron_fsdp_version not in (1, 2):
        _fail(f"megatron_fsdp_version must be either 1 or 2, got {c.megatron_fsdp_version}")
    for name in ("data_parallel_sharding_strategy", "outer_dp_sharding_strategy"):
        value = getattr(c, name)
        if value not in SHARDING_STRATEGIES:
            _fail(f"{name}={value!r} is unknown; use one of {', '.join(SHARDING_STRATEGIES)}")
    if c.reuse_grad_buf_for_mxfp8_param_ag and not c.fp8_param_gather:
        _fail(
            "reuse_grad_buf_for_mxfp8_param_ag=True needs fp8_param_gather=True (reuse the grad buffer "
            "only when keeping params in MXFP8)"
        )
    if c.param_name_patterns_for_fp32_local_accumulation and c.grad_reduce_in_fp32:
        _fail(
            "param_name_patterns_for_fp32_local_accumulation is only needed when main grads are not "
            "already fp32: drop the patterns or set grad_reduce_in_fp32=False"
        )
    if c.num_buckets is not None:
        if c.bucket_size is not None:
            _fail("num_buckets and bucket_size cannot both be set: keep one of them")
        if c.num_buckets <= 0:
            _fail(f"num_buckets must be greater than 0, got {c.num_buckets}")
    if c.bucket_size is not None and c.bucket_size <= 0:
        _fail(f"bucket_size must be a positive number of elements or None, got {c.bucket_size}")
    if c.num_distributed_optimizer_instances < 1:
        _fail(
            f"num_distributed_optimizer_instances must be >= 1, got {c.num_distributed_optimizer_instances}"
        )
    if c.num_distributed_optimizer_instances > 1 and not c.use_distributed_optimizer:
        _fail(
            f"num_distributed_optimizer_instances={c.num_distributed_optimizer_instances} requires "
            "use_distributed_optimizer=True"
        )
    if c.reduce_scatter_with_fp32_accumulation:
        if not c.use_distributed_optimizer:
            _fail("reduce_scatter_with_fp32_accumulation=True requires use_distributed_optimizer=True")
        if c.average_in_collective:
            _fail(
                "reduce_scatter_with_fp32_accumulation sums locally and cannot average: set "
                "average_in_collective=False"
            )
        if c.num_distributed_optimizer_instances > 1:
            _fail(
                "reduce_scatter_with_fp32_accumulation is not supported with "
                "num_distributed_optimizer_instances > 1"
            )
    _validate_grad_comm(c)
    _validate_wire(c, "param_gather_dtype", "param_gather_block_size")
    if c.overlap_param_gather and not (c.use_distributed_optimizer or c.use_megatron_fsdp):
        _fail(
            "overlap_param_gather=True requires use_distributed_optimizer=True or use_megatron_fsdp=True "
            "(without them every rank already holds full params)"
        )


def _validate_wire(c: DistributedDataParallelConfig, dtype_field: str, block_field: str) -> bool:
    """Whether the wire ``dtype_field`` names is set (then its dtype and block size are valid)."""
    dtype, block = getattr(c, dtype_field), getattr(c, block_field)
    if dtype is None:
        return False
    problem = wire_problem(dtype, block, dtype_field, block_field)
    if problem is not None:
        _fail(problem)
    return True


def _validate_grad_comm(c: DistributedDataParallelConfig) -> None:
    if not _validate_wire(c, "grad_comm_dtype", "grad_comm_block_size"):
        if c.grad_comm_error_feedback:
            _fail("grad_comm_error_feedback=True needs a low-precision grad_comm_dtype (torch.bfloat16, say)")
        return
    if c.reduce_scatter_with_fp32_accumulation:
        _fail(
            "grad_comm_dtype already sums in fp32 after an all-to-all: drop "
            "reduce_scatter_with_fp32_accumulation=True (or grad_comm_dtype)"
        )
    if c.num_distributed_optimizer_instances > 1:
        _fail("grad_comm_dtype is not supported with num_distributed_optimizer_instances > 1")


def default_bucket_size(data_parallel_size: int) -> int:
    """max(40M, 1M x dp) elements: larger DP sizes need larger buckets to stay bandwidth-bound."""
    return max(40_000_000, 1_000_000 * data_parallel_size)


def effective_bucket_size(
    config: DistributedDataParallelConfig,
    data_parallel_size: int,
    *,
    total_params: int | None = None,
    single_bucket: bool = False,
) -> int | None:
    """The bucket size a wrapper actually uses (None = one bucket per buffer).

    Without overlap_grad_reduce all communication happens at finish_grad_sync, so one bucket is best;
    ``single_bucket`` covers disable_bucketing and pipeline ranks > 0. ``num_buckets`` becomes
    ``total_params // num_buckets``.
    """
    if single_bucket or not config.overlap_grad_reduce:
        return None
    if config.bucket_size is not None:
        return config.bucket_size
    if config.num_buckets is not None:
        if total_params is None:
            raise ValueError("num_buckets needs the total parameter count to derive a bucket size")
        return max(1, total_params // config.num_buckets)
    return default_bucket_size(data_parallel_size)
