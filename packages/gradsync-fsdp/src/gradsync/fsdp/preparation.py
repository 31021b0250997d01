"""What MegatronFSDP settles and refuses before it builds anything.

The config MegatronFSDP runs with, and which of its fields it honours; the rest are refused by name
before any collective.

CUDA-only features are refused off CUDA/NCCL with ValueError; features not built yet (fp8, decoupled
grads, ...) raise NotImplementedError naming the field, instead of being silently ignored.

What MegatronFSDP settles before it builds anything: the config it runs with, the device, every refusal
of an unsupported or contradictory setting, and one collective in which every data-parallel rank agrees
on the params and settings it wraps.

All of it runs before any other collective, so bad input raises on every rank, by name, instead of
leaving some ranks in a collective the others never join.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import (
    DistributedDataParallelConfig,
    as_ddp_config,
    broadcast_from_first_rank,
    check_params_match_across_ranks,
    is_expert_parallel,
    non_default_fields,
    non_default_values,
    settings_of,
)
from gradsync.buffers.shard_alignment import ShardAlignmentSpec, set_shard_alignments
from gradsync.buffers.wrapper_claims import first_owned_elsewhere, refuse_owned_elsewhere
from gradsync.groups import FSDPDistributedIndex, get_backend_capabilities

from .layout import OuterReplication, UnitEntry, outer_replication, resolve_unit_classes
from .meta_init import MetaReplacement, replace_meta_params
from .settings import (
    MixedPrecisionPolicy,
    Sharding,
    parse_strategy,
    policy_from_config,
    wrapped_module_device,
)

CUDA_ONLY_FIELDS = (
    "nccl_ub",
    "fsdp_manual_registration",
    "disable_symmetric_registration",
    "fp8_param_gather",
    "fp4_param_gather",
    "reuse_grad_buf_for_mxfp8_param_ag",
    "keep_fp8_transpose_cache",
    "megatron_fsdp_cuda_graph_mode",
)
"""NCCL user buffers, Transformer Engine fp8/fp4 and CUDA graphs: CUDA with NCCL only."""

BUILT_CUDA_ONLY_FIELDS = ("nccl_ub", "disable_symmetric_registration")
"""The CUDA-only fields gradsync-fsdp implements (on CUDA with NCCL)."""

NOT_YET_FIELDS = (
    "megatron_fsdp_use_decoupled_grad",
    "megatron_fsdp_enable_fine_grained_param_gather",
    "num_distributed_optimizer_instances",
    "delay_wgrad_compute",
)
"""Megatron-FSDP features gradsync-fsdp does not provide yet."""

DDP_ONLY_FIELDS = (
    "use_distributed_optimizer",
    "align_param_gather",
    "pad_buckets_for_high_nccl_busbw",
    "reduce_scatter_with_fp32_accumulation",
    "check_for_large_grads",
    "param_name_patterns_for_fp32_local_accumulation",
    "num_buckets",
)
"""Fields only the DDP wrapper reads."""


def refuse_unsupported(
    config: DistributedDataParallelConfig,
    dist_index: FSDPDistributedIndex,
    device: torch.device,
) -> None:
    """Raise, naming the field and the fix, for anything MegatronFSDP would otherwise ignore."""
    _check_index_matches_world(dist_index, device)  # first: a rank outside the mesh cannot query its group
    group = dist_index.get_fsdp_group()
    on_cuda_nccl = device.type == "cuda" and get_backend_capabilities(group, device).userbuffers
    for name in non_default_fields(config, CUDA_ONLY_FIELDS):
        if not on_cuda_nccl:
            raise ValueError(
                f"MegatronFSDP: {name}={getattr(config, name)!r} needs CUDA tensors on an NCCL group, but "
                f"the model is on {device.type} with backend {dist.get_backend(group)!r}; set it back to "
                "its default"
            )
        if name not in BUILT_CUDA_ONLY_FIELDS:
            raise NotImplementedError(f"MegatronFSDP: {name} is not implemented by gradsync-fsdp yet")
    _check_buffering(config)
    if config.megatron_fsdp_version != 1:
        raise NotImplementedError(
            f"MegatronFSDP: megatron_fsdp_version={config.megatron_fsdp_version!r} selects Megatron-FSDP v2 "
            "(the experimental DBuffer implementation), which gradsync-fsdp does not provide; set it to 1"
        )
    for name in non_default_fields(config, NOT_YET_FIELDS):
        raise NotImplementedError(
            f"MegatronFSDP: {name}={getattr(config, name)!r} is not implemented by gradsync-fsdp yet; set it "
            "back to its default"
        )
    ignored = non_default_values(config, DDP_ONLY_FIELDS)
    if ignored:
        raise ValueError(
            f"MegatronFSDP: {ignored} only configure gradsync-ddp's DistributedDataParallel and would be "
            "ignored here; leave them at their defaults"
        )


def _check_buffering(config: DistributedDataParallelConfig) -> None:
    """Double buffers replace the whole-bucket grads and weights that ZeRO-2/3 allocate per use; ``no_shard``
    and ``optim`` allocate none, so ``fsdp_double_buffer`` (and ``megatron_fsdp_max_pool_double_buffer``,
    which implies it) is a no-op there, accepted as the reference accepts it. Refused: what only modifies an
    option that is off (``disable_symmetric_registration`` without ``nccl_ub``,
    ``fsdp_db_use_persist_buf_on_alloc_fail`` without double buffering), and NCCL user buffers where there
    is nothing of gradsync's to register (``nccl_ub`` registers the double buffers only)."""
    if config.disable_symmetric_registration and not config.nccl_ub:
        raise ValueError(
            "MegatronFSDP: disable_symmetric_registration=True only applies with nccl_ub=True; set it back "
            "to False or turn nccl_ub on"
        )
    if config.fsdp_db_use_persist_buf_on_alloc_fail and not config.fsdp_double_buffer:
        raise ValueError(
            "MegatronFSDP: fsdp_db_use_persist_buf_on_alloc_fail=True only chooses where buckets that do not "
            "fit the double buffers go; set it back to False or turn fsdp_double_buffer on"
        )
    strategy = config.data_parallel_sharding_strategy
    if config.nccl_ub and strategy not in ("optim_grads", "optim_grads_params"):
        raise ValueError(
            "MegatronFSDP: nccl_ub=True registers the double buffers of the whole-bucket grads and weights "
            f"that 'optim_grads' and 'optim_grads_params' allocate per use; "
            f"data_parallel_sharding_strategy={strategy!r} allocates none, so nothing would be registered. "
            "Use one of those, or turn nccl_ub off"
        )


def _check_index_matches_world(dist_index: FSDPDistributedIndex, device: torch.device) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = dist_index.device_mesh
    if world % mesh.size() or rank not in mesh.mesh.flatten().tolist():
        raise ValueError(
            f"MegatronFSDP: dist_index's device mesh {mesh.mesh.tolist()} does not fit the world of {world} "
            f"ranks around rank {rank}; build it over this job's ranks (FSDPDistributedIndex.from_sizes or "
            "FSDPDistributedIndex.from_group)"
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"MegatronFSDP: dist_index's mesh is for {mesh.device_type!r} devices but the model is on "
            f"{device}; build the mesh with device_type={device.type!r}"
        )


def refuse_fine_grained_gathers(forward: bool, backward: bool) -> None:
    if forward or backward:
        raise NotImplementedError(
            "MegatronFSDP: enable_fine_grained_param_gather_hook / _backward_hook (per-submodule "
            "gathers) are not implemented by gradsync-fsdp; leave them False (units gather whole)"
        )


def default_fsdp_config() -> DistributedDataParallelConfig:
    """ZeRO-3 with overlapped gathers and reductions, as Megatron-FSDP defaults to."""
    return DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )


def config_for_wrap(
    config: DistributedDataParallelConfig | None, keywords: dict[str, bool]
) -> DistributedDataParallelConfig:
    """The config MegatronFSDP runs with. Without one, the default with ``keywords`` (``nccl_ub``, ...;
    ``nccl_ub`` brings the double buffer it lives in). With one (Megatron-Core's own config objects too),
    the keywords only applied when none is given: one it contradicts would be ignored, so it is refused
    by name. The caller's config is never mutated."""
    if config is None:
        double_buffer = keywords["fsdp_double_buffer"] or keywords["nccl_ub"]
        fields: dict[str, Any] = {**keywords, "fsdp_double_buffer": double_buffer}
        return dataclasses.replace(default_fsdp_config(), **fields)
    config = as_ddp_config(config)
    for name, value in keywords.items():
        if value and not getattr(config, name):
            raise ValueError(
                f"MegatronFSDP: {name}=True was passed, but ddp_config.{name}={getattr(config, name)!r}; the "
                f"keyword only applies when no ddp_config is given. Set ddp_config.{name}=True instead"
            )
    return config


def refuse_two_grad_wires(config: DistributedDataParallelConfig, policy: MixedPrecisionPolicy) -> None:
    """``grad_comm_dtype`` (a low-precision wire, summed in fp32 on arrival) and the policy's
    ``grad_comm_dtype`` (``megatron_fsdp_grad_comm_dtype``: sent and summed in that dtype by the backend)
    both choose what the reductions send: one of them would be ignored."""
    if config.grad_comm_dtype is not None and policy.grad_comm_dtype is not None:
        raise ValueError(
            f"MegatronFSDP: ddp_config.grad_comm_dtype={config.grad_comm_dtype} (summed in fp32) and the "
            f"mixed precision policy's grad_comm_dtype={policy.grad_comm_dtype} "
            "(megatron_fsdp_grad_comm_dtype, summed in that dtype) both set the grad wire; keep one of them"
        )


def refuse_packed_gathers_where_nothing_is_gathered(config: DistributedDataParallelConfig) -> None:
    """``param_gather_dtype`` packs the weights the sharded strategies gather (ZeRO-3 before every use,
    ZeRO-1/2 once per step); no_shard keeps whole weights, and HFSDP's outer gather is not packed."""
    if config.param_gather_dtype is None:
        return
    if config.data_parallel_sharding_strategy == "no_shard":
        raise ValueError(
            f"MegatronFSDP: param_gather_dtype={config.param_gather_dtype} packs the sharded strategies' "
            "weight gathers, but data_parallel_sharding_strategy='no_shard' gathers no weights; use "
            "'optim', 'optim_grads' or 'optim_grads_params', or leave param_gather_dtype unset"
        )
    if config.outer_dp_sharding_strategy != "no_shard":
        raise NotImplementedError(
            f"MegatronFSDP: param_gather_dtype with outer_dp_sharding_strategy="
            f"{config.outer_dp_sharding_strategy!r} (HFSDP) is not implemented: its outer gather is not "
            "packed; use outer_dp_sharding_strategy='no_shard' or leave param_gather_dtype unset"
        )


@dataclass(frozen=True)
class WrapArguments:
    """MegatronFSDP's own arguments that change what it builds: every rank must pass the same."""

    disable_bucketing: bool
    calculate_per_token_loss: bool
    init_model_with_meta_device: bool
    sync_model_each_microbatch: bool
    report_nan_in_param_grad: bool
    shard_alignment: ShardAlignmentSpec
    gather_lane: bool
    init_sync: bool


@dataclass(frozen=True)
class Prepared:
    """The settled inputs: ``named`` is the module's params after the move to ``device``, and ``meta`` what
    a meta-device model's params were replaced with (None for a real one)."""

    config: DistributedDataParallelConfig
    sharding: Sharding
    policy: MixedPrecisionPolicy
    device: torch.device
    outer: OuterReplication | None
    meta: MetaReplacement | None
    named: list[tuple[str, nn.Parameter]]
    unit_classes: tuple[type[nn.Module], ...]


def prepare_wrap(
    owner: nn.Module,
    module: nn.Module,
    dist_index: FSDPDistributedIndex,
    config: DistributedDataParallelConfig | None,
    policy: MixedPrecisionPolicy | None,
    unit_modules: Sequence[UnitEntry] | None,
    asked_device: torch.device | None,
    keywords: dict[str, bool],
    arguments: WrapArguments,
) -> Prepared:
    """Settle ``owner``'s inputs (``keywords``: the config-building flags, see :func:`config_for_wrap`),
    check them on every rank at once, and give every replica the first rank's weights when
    ``arguments.init_sync`` asks (a meta-device model is broadcast after it is materialised)."""
    config = config_for_wrap(config, keywords)
    sharding = parse_strategy(config.data_parallel_sharding_strategy)
    policy = policy_from_config(config, policy)
    meta_init = arguments.init_model_with_meta_device
    device = wrapped_module_device(asked_device, module, dist_index.device_mesh.device_type, meta_init)
    refuse_unsupported(config, dist_index, device)
    refuse_two_grad_wires(config, policy)
    refuse_packed_gathers_where_nothing_is_gathered(config)
    outer = outer_replication(config, dist_index, sharding)
    meta = replace_meta_params(module, device) if meta_init else None
    # Looked for before the move: module.to() swaps copies into a live wrapper's DTensor params.
    # A module held elsewhere is not moved; it is refused below, once every rank agrees.
    owned_elsewhere = first_owned_elsewhere(list(module.named_parameters()), owner)
    if asked_device is not None and owned_elsewhere is None:
        module.to(asked_device)
    named = list(module.named_parameters())
    set_shard_alignments(named, arguments.shard_alignment)
    unit_classes = resolve_unit_classes(unit_modules)
    given = {field.name: getattr(arguments, field.name) for field in dataclasses.fields(arguments)}
    settings = settings_of(
        config,
        mixed_precision_policy=policy,
        fsdp_unit_modules=unit_classes,
        device_type=device.type,
        **given,
        params_owned_by_another_wrapper=owned_elsewhere,
    )
    check_params_match_across_ranks(named, dist_index.get_dp_group(), who="MegatronFSDP", settings=settings)
    refuse_owned_elsewhere(owned_elsewhere, "MegatronFSDP")
    if arguments.init_sync and meta is None:
        dense = [p.data for p in module.parameters() if not is_expert_parallel(p)]
        broadcast_from_first_rank(dense, dist_index.get_dp_group())
    return Prepared(config, sharding, policy, device, outer, meta, named, unit_classes)
