"""The megatron-fsdp user API: ``fully_shard_model``, ``fully_shard_optimizer`` and ``fully_shard``.

With no mesh they build a one-dimensional shard mesh over the default group, on the params' device type
(CPU/gloo or CUDA/NCCL). Unlike the reference, ``fully_shard`` keeps the optimizer's param groups and
their hyper-parameters (each param is replaced by its sharded counterpart).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.checkpointing import materialize_optimizer_state
from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.buffers.wrapper_claims import live_owner
from gradsync.groups import FSDPDistributedIndex

from .layout import UnitEntry
from .local_step import LENDING_ATTR, local_tensors_for_step
from .megatron_fsdp import MegatronFSDP
from .meta_init import ParamInitFn
from .ragged import describe_optimizer_state
from .settings import STRATEGY_NAMES, MixedPrecisionPolicy, choose_device, parse_strategy


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    fsdp_unit_modules: Sequence[UnitEntry] | None = None,
    zero_dp_strategy: str | int = 3,
    outer_dp_sharding_strategy: str | int = 0,
    device: torch.device | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    param_init_fn: ParamInitFn | None = None,
    report_nan_in_param_grad: bool = False,
    shard_alignment: ShardAlignmentSpec = None,
    **cuda_only: Any,
) -> MegatronFSDP:
    """Wrap ``module`` in :class:`MegatronFSDP` with ``zero_dp_strategy`` (0-3 or its name).

    ``shard_alignment``: where shards may cut each param (gradsync's addition, see
    :class:`MegatronFSDP`). ``cuda_only`` takes the reference's NCCL-userbuffer / fp8 / double-buffer keywords
    (``nccl_ub``, ``fsdp_double_buffer``, ``keep_fp8_transpose_cache``, ...); they are refused with a
    clear error where they cannot work.
    """
    strategy = parse_strategy(zero_dp_strategy, "zero_dp_strategy")
    outer = parse_strategy(outer_dp_sharding_strategy, "outer_dp_sharding_strategy")
    if outer.name not in STRATEGY_NAMES[:2]:
        raise ValueError(
            f"outer_dp_sharding_strategy={outer_dp_sharding_strategy!r}: use 'no_shard' (0) or 'optim' (1)"
        )
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        raise ValueError("dp_outer_dim and hybrid_fsdp_group must be given together (hybrid sharding)")
    if init_model_with_meta_device and strategy.name == "no_shard":
        raise ValueError(
            "init_model_with_meta_device is not supported or necessary for the 'no_shard' (0) strategy"
        )
    if device_mesh is None:
        kind = (choose_device(device, module.parameters()) or torch.device("cpu")).type
        device_type = None if kind == "meta" else kind
        dist_index = FSDPDistributedIndex.from_sizes(dist.get_world_size(), device_type=device_type)
    else:
        dist_index = FSDPDistributedIndex(
            device_mesh,
            dp_shard_dim=dp_shard_dim,
            dp_outer_dim=dp_outer_dim,
            tp_dim=tp_dim,
            hybrid_fsdp_group=hybrid_fsdp_group,
            hsdp_outer_dp_shard=outer.name == "optim",
        )
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy.name,
        outer_dp_sharding_strategy=outer.name,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        average_in_collective=average_in_collective,
        **_config_fields(cuda_only),
    )
    return MegatronFSDP(
        module,
        dist_index,
        ddp_config=config,
        fsdp_unit_modules=fsdp_unit_modules,
        disable_bucketing=disable_bucketing,
        device=device,
        calculate_per_token_loss=calculate_per_token_loss,
        init_model_with_meta_device=init_model_with_meta_device,
        sync_model_each_microbatch=sync_model_each_microbatch,
        mixed_precision_policy=mixed_precision_policy or MixedPrecisionPolicy(),
        param_init_fn=param_init_fn,
        report_nan_in_param_grad=report_nan_in_param_grad,
        shard_alignment=shard_alignment,
    )


_CUDA_ONLY_KEYWORDS = {
    "nccl_ub": "nccl_ub",
    "fsdp_double_buffer": "fsdp_double_buffer",
    "fsdp_db_use_persist_buf_on_alloc_fail": "fsdp_db_use_persist_buf_on_alloc_fail",
    "disable_symmetric_registration": "disable_symmetric_registration",
    "keep_fp8_transpose_cache": "keep_fp8_transpose_cache",
    "enable_fine_grained_param_gather": "megatron_fsdp_enable_fine_grained_param_gather",
    "use_decoupled_grad": "megatron_fsdp_use_decoupled_grad",
    "cuda_graph_mode": "megatron_fsdp_cuda_graph_mode",
    "maxpool_double_buffer": "megatron_fsdp_max_pool_double_buffer",
}


def _config_fields(keywords: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(keywords) - set(_CUDA_ONLY_KEYWORDS))
    if unknown:
        raise TypeError(f"fully_shard_model() got unexpected keyword arguments {unknown}")
    fields = {_CUDA_ONLY_KEYWORDS[k]: v for k, v in keywords.items()}
    if fields.get("nccl_ub"):
        fields["fsdp_double_buffer"] = True
    return fields


def fully_shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` finish the grad sync first (unless auto-sync already did) and install
    the updated weights after, and ``optimizer.zero_grad()`` also zero the grad buffers. The state is
    materialised and its state dict described for ``torch.distributed.checkpoint``. In place.

    Megatron-FSDP's own ``fully_shard_optimizer`` replaces both methods, and their keyword-only flags
    (``sync_grad_before_optimizer_step``, ``install_optimized_model_weights``, ``zero_grad_buffer``) are
    its API, so they are replaced here too, not hooked."""
    model = _model_of(optimizer)
    setattr(optimizer, LENDING_ATTR, True)  # its steps lend the locals below: not to be adopted
    materialize_optimizer_state(optimizer)  # a step with zero grads and lr 0: not a training step
    model.zero_grad_buffer()
    optimizer.register_state_dict_post_hook(_describe_state)
    base_step, base_zero_grad = optimizer.step, optimizer.zero_grad

    def step(
        self: torch.optim.Optimizer,
        *args: Any,
        sync_grad_before_optimizer_step: bool = True,
        install_optimized_model_weights: bool = True,
        **kwargs: Any,
    ) -> Any:
        if sync_grad_before_optimizer_step and not model.model_auto_sync:
            model.finish_grad_sync()
        with local_tensors_for_step(self):
            result = base_step(*args, **kwargs)
        if install_optimized_model_weights:
            model.install_optimized_model_weights()
        return result

    def zero_grad(
        self: torch.optim.Optimizer, *args: Any, zero_grad_buffer: bool = True, **kwargs: Any
    ) -> None:
        base_zero_grad(*args, **kwargs)
        if zero_grad_buffer:
            model.zero_grad_buffer()

    # Bound methods, as LR schedulers expect of optimizer.step (they wrap step.__func__).
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
    return optimizer


def _describe_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    numbered: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            numbered.setdefault(id(param), param)
    describe_optimizer_state(state_dict, list(numbered.values()), _first_row)


def _first_row(param: torch.Tensor) -> int | None:
    """The first row of ``param``'s shard if it is a MegatronFSDP's sharded param (of any model)."""
    owner = live_owner(param)
    return owner.params.first_row(param) if isinstance(owner, MegatronFSDP) else None


def _model_of(optimizer: torch.optim.Optimizer) -> MegatronFSDP:
    if not optimizer.param_groups or not optimizer.param_groups[0]["params"]:
        raise ValueError("fully_shard_optimizer: the optimizer has no params")
    first = optimizer.param_groups[0]["params"][0]
    model = live_owner(first)
    if not isinstance(model, MegatronFSDP) or model.params.of(first).sharded is not first:
        raise ValueError(
            "fully_shard_optimizer: the optimizer's params are not MegatronFSDP's; build the optimizer on "
            "MegatronFSDP(...).parameters() (or use fully_shard(module, optimizer))"
        )
    return model


def fully_shard(
    module: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """Shard ``module`` (keywords as :func:`fully_shard_model`) and re-point ``optimizer``, built on
    ``module``'s params, at the sharded params, keeping its param groups and hyper-parameters."""
    model = fully_shard_model(module, **kwargs)
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if p not in model.params]
        if unknown:
            raise ValueError(
                f"fully_shard: the optimizer holds {len(unknown)} param(s) that are not module's params "
                f"(first shape {list(unknown[0].shape)}); build it on module.parameters()"
            )
        group["params"] = [model.params.of(p).sharded for p in group["params"]]
    optimizer.state.clear()
    return model, fully_shard_optimizer(optimizer)
