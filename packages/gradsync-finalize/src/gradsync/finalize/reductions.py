"""The cross-group gradient reductions of `finalize_model_grads`, one function per step.

Each takes explicit groups and acts only where its axis is active (group size > 1), in the reference's
order; none touches the DP reduction, which the chunks' ``finish_grad_sync`` has already done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.groups import device_for_group

from .grad_access import all_reduce_grads, read_grad, write_grad
from .protocol import find_attribute_owner


def _size(group: dist.ProcessGroup | None) -> int:
    return group.size() if group is not None else 1


def _trainable(chunk: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in chunk.named_parameters() if p.requires_grad]


def allreduce_conditional_embedding_grads(
    model: Sequence[nn.Module], config: Any, pp_group: dist.ProcessGroup | None
) -> None:
    """Params marked ``pipeline_parallel`` (replicated conditional embedders) end with the sum over every
    pipeline stage and every local chunk."""
    if _size(pp_group) <= 1 or not getattr(config, "has_cond_embedder", False):
        return
    assert pp_group is not None
    copies: dict[str, list[nn.Parameter]] = {}
    for chunk in model:
        for name, param in _trainable(chunk):
            if getattr(param, "pipeline_parallel", False):
                copies.setdefault(name, []).append(param)
    firsts = []
    for params in copies.values():
        first_grad = read_grad(params[0])
        assert first_grad is not None
        for other in params[1:]:
            other_grad = read_grad(other)
            assert other_grad is not None
            first_grad += other_grad
        write_grad(params[0], first_grad)
        firsts.append(params[0])
    all_reduce_grads(firsts, pp_group)
    for params in copies.values():
        reduced = read_grad(params[0])
        assert reduced is not None
        for other in params[1:]:
            write_grad(other, reduced.clone())


def allreduce_non_tensor_model_parallel_grads(
    model: Sequence[nn.Module], config: Any, tp_group: dist.ProcessGroup | None
) -> None:
    """Grads of params replicated across TP: summed for sequence-parallel ones (each TP rank saw part of
    the sequence) and q/k layernorms, averaged for ``average_gradients_across_tp_domain`` ones."""
    if _size(tp_group) <= 1:
        return
    assert tp_group is not None
    summed, averaged = [], []
    sequence_parallel = getattr(config, "sequence_parallel", False)
    qk_layernorm = getattr(config, "qk_layernorm", False)
    for chunk in model:
        for name, param in _trainable(chunk):
            if getattr(param, "average_gradients_across_tp_domain", False):
                averaged.append(param)
            elif (sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            ):
                summed.append(param)
    all_reduce_grads(summed, tp_group)
    all_reduce_grads(averaged, tp_group, average=True)


def _embedding_chunk(
    model: Sequence[nn.Module], pp_group: dist.ProcessGroup | None, config: Any
) -> nn.Module:
    """model[0] on the first stage, model[-1] on the last (virtual pipeline chunks), as the reference."""
    if pp_group is None or pp_group.rank() == 0:
        return model[0]
    if pp_group.rank() == pp_group.size() - 1:
        return model[-1]
    return model[-1] if (getattr(config, "mtp_num_layers", None) or 0) > 0 else model[0]


def _member_chunk(
    model: Sequence[nn.Module],
    config: Any,
    group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> nn.Module | None:
    """The chunk holding this rank's embedding, if ``group`` spans several ranks and this rank is in it."""
    if group is None or group.size() <= 1 or dist.get_rank() not in dist.get_process_group_ranks(group):
        return None
    return _embedding_chunk(model, pp_group, config)


def allreduce_word_embedding_grads(
    model: Sequence[nn.Module],
    config: Any,
    embd_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> None:
    """Sum the tied embedding's grads between the first and the last pipeline stage (untied: skipped)."""
    chunk = _member_chunk(model, config, embd_group, pp_group)
    if chunk is None:
        return
    assert embd_group is not None
    owner = find_attribute_owner(chunk, "pre_process")
    tied = getattr(owner, "share_embeddings_and_output_weights", False) or getattr(
        config, "mtp_num_layers", None
    )
    weight = owner.shared_embedding_or_output_weight() if tied else None
    if weight is None:
        return  # untied
    if getattr(chunk, "data_parallel_sharding_strategy", None) is not None:
        raise NotImplementedError(
            "finalize_model_grads: a word embedding tied across pipeline stages under MegatronFSDP: the two "
            "stages shard different models, so their grad shards do not line up (Megatron-FSDP does not "
            "support pipeline parallelism either). Use gradsync-ddp with pipeline parallelism."
        )
    if read_grad(weight) is None:
        return  # a frozen embedding
    ddp_config = getattr(chunk, "ddp_config", None)
    if getattr(ddp_config, "use_distributed_optimizer", False) and not getattr(
        weight, "shared_embedding", False
    ):
        raise ValueError(
            "with use_distributed_optimizer the tied embedding/output weight must carry "
            "shared_embedding=True on both pipeline stages, so that it gets a bucket of its own and the same "
            "shard ranges on both: otherwise the reduce-scattered shards of the two stages do not line up "
            "and the summed grads are wrong. Set weight.shared_embedding = True before wrapping."
        )
    all_reduce_grads([weight], embd_group)


def allreduce_position_embedding_grads(
    model: Sequence[nn.Module],
    config: Any,
    pos_embd_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> None:
    """Sum ``position_embeddings.weight`` grads over a position-embedding group larger than one rank."""
    chunk = _member_chunk(model, config, pos_embd_group, pp_group)
    if chunk is None:
        return
    assert pos_embd_group is not None
    weight = find_attribute_owner(chunk, "pre_process").position_embeddings.weight
    if read_grad(weight) is None:
        raise RuntimeError(
            "position_embeddings.weight has no grad to reduce over the position-embedding group"
        )
    all_reduce_grads([weight], pos_embd_group)


def update_router_expert_bias(
    model: Sequence[nn.Module], config: Any, tp_dp_cp_group: dist.ProcessGroup
) -> None:
    """bias += sign(mean - tokens) * rate, from token counts summed over tp x dp x cp (training mode)."""
    routers: list[Any] = [
        m
        for chunk in model
        for m in chunk.modules()
        if getattr(m, "expert_bias", None) is not None
        and m.training
        and not getattr(m, "frozen_expert_bias", False)
    ]
    if not routers:
        return
    tokens = torch.stack([m.local_tokens_per_expert for m in routers]).to(torch.float32)
    biases = torch.stack([m.expert_bias for m in routers])
    dist.all_reduce(tokens, group=tp_dp_cp_group)
    offset = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1] - tokens
    updated = biases + torch.sign(offset).to(biases.dtype) * config.moe_router_bias_update_rate
    with torch.no_grad():
        for router, bias in zip(routers, updated, strict=True):
            router.expert_bias.copy_(bias)


def reset_model_temporary_tensors(config: Any, model: Sequence[nn.Module]) -> None:
    """Zero the routers' token counts and reset global aux-loss trackers after every step.

    Public with Megatron's argument order (config first): Megatron also calls it on its own, to clear
    what a CUDA-graph capture left in the routers, and such code works unchanged."""
    balancing = getattr(config, "moe_router_load_balancing_type", "")
    kinds = balancing if isinstance(balancing, list) else [balancing]
    global_aux = any("global_aux_loss" in kind for kind in kinds)
    expert_bias = getattr(config, "moe_router_enable_expert_bias", False)
    if not (expert_bias or global_aux):  # nothing to reset: a dense model's step skips walking its modules
        return
    for chunk in model:
        module: Any
        for module in chunk.modules():
            if expert_bias and getattr(module, "expert_bias", None) is not None:
                module.local_tokens_per_expert.zero_()
            if global_aux and hasattr(module, "reset_global_aux_loss_tracker"):
                module.reset_global_aux_loss_tracker()


def scale_by_token_count(
    model: Sequence[Any],
    num_tokens: torch.Tensor,
    pp_group: dist.ProcessGroup | None,
    dp_cp_group: dist.ProcessGroup | None,
) -> None:
    """Broadcast the token count from the last pipeline stage, sum it over dp x cp, and scale every
    chunk's grads by 1 / max(count, 1). ``num_tokens`` is updated in place to the global count.

    The count travels on a device the groups take (a CPU count with NCCL groups is moved to the GPU and
    back), and the scaling stays a tensor, so no host sync is needed."""
    device = device_for_group(dp_cp_group or pp_group, preferred=num_tokens.device)
    count = num_tokens.to(device)
    if _size(pp_group) > 1:
        assert pp_group is not None
        dist.broadcast(count, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    if dp_cp_group is not None:
        dist.all_reduce(count, group=dp_cp_group)
    if count.data_ptr() != num_tokens.data_ptr():
        num_tokens.copy_(count)
    scaling = 1.0 / torch.clamp(count, min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)
