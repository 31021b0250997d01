"""Which `DistributedDataParallelConfig` fields the DDP path (these buffers and bucket groups) honours.

The config carries Megatron-Core's every field, FSDP's included, so one object configures either wrapper.
A field the DDP path cannot honour is refused by name when set away from its default, instead of being
accepted and silently ignored. The buffers README has the table.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from .config import DistributedDataParallelConfig
from .foreign_config import as_ddp_config

FSDP_ONLY_FIELDS = (
    "megatron_fsdp_version",
    "data_parallel_sharding_strategy",
    "gradient_reduce_div_fusion",
    "suggested_communication_unit_size",
    "preserve_fp32_weights",
    "keep_fp8_transpose_cache",
    "fsdp_double_buffer",
    "fsdp_db_use_persist_buf_on_alloc_fail",
    "fsdp_all_gather_in_start_param_sync",
    "outer_dp_sharding_strategy",
    "fsdp_manual_registration",
    "megatron_fsdp_main_params_dtype",
    "megatron_fsdp_main_grads_dtype",
    "megatron_fsdp_grad_comm_dtype",
    "megatron_fsdp_use_decoupled_grad",
    "megatron_fsdp_cuda_graph_mode",
    "megatron_fsdp_enable_fine_grained_param_gather",
    "megatron_fsdp_max_pool_double_buffer",
    "param_gather_dtype",
    "param_gather_block_size",
)
"""Fields only Megatron-FSDP reads; the DDP path refuses them when set away from their defaults."""

NOT_IMPLEMENTED_FOR_DDP = {
    "nccl_ub": "NCCL user-buffer allocation of the DDP grad/param buffers is not implemented",
    "disable_symmetric_registration": "it only applies to nccl_ub, which the DDP path does not implement",
    "delay_wgrad_compute": (
        "delayed weight-gradient hooks need Transformer Engine modules "
        "(register_wgrad_accumulation_and_reduce_hooks), which gradsync does not support"
    ),
}
"""Fields the reference's DDP honours that gradsync's DDP path does not (yet)."""


def non_default_fields(config: Any, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` whose value differs from gradsync's default for the field. A config object that
    lacks a field (Megatron-Core's of an older version) has it at its default."""
    defaults = {f.name: f.default for f in fields(DistributedDataParallelConfig) if f.default is not MISSING}
    return [name for name in names if getattr(config, name, defaults[name]) != defaults[name]]


def non_default_values(config: Any, names: tuple[str, ...]) -> str:
    """``"a=1, b=True"`` for those of ``names`` set away from their defaults; empty when none is."""
    return ", ".join(f"{name}={getattr(config, name)!r}" for name in non_default_fields(config, names))


def refuse_fields_ddp_cannot_honour(config: Any, wrapper: str) -> None:
    """Raise, naming each field, when ``config`` asks the DDP path for something it would ignore.
    ``config`` may be any config object :func:`as_ddp_config` accepts."""
    config = as_ddp_config(config)
    if config.use_megatron_fsdp:
        raise ValueError(
            f"{wrapper}: use_megatron_fsdp=True selects Megatron-FSDP, which is gradsync-fsdp's "
            "gradsync.fsdp.MegatronFSDP; wrap the model with it, or set use_megatron_fsdp=False for DDP."
        )
    for name, why in NOT_IMPLEMENTED_FOR_DDP.items():
        if non_default_fields(config, (name,)):
            raise NotImplementedError(f"{wrapper}: {name}={getattr(config, name)!r}: {why}. Set it back.")
    ignored = non_default_values(config, FSDP_ONLY_FIELDS)
    if ignored:
        raise ValueError(
            f"{wrapper}: {ignored} only configure Megatron-FSDP (gradsync.fsdp) and would be ignored here. "
            "Leave them at their defaults for DDP, or wrap the model with gradsync.fsdp.MegatronFSDP."
        )
