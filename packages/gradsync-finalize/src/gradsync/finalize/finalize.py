"""`finalize_model_grads`: complete every gradient reduction a step needs, in Megatron-Core's order.

1. each chunk's DP reduction (``finish_grad_sync``; expert grads over expert-DP inside it),
2. conditional-embedder grads over PP, 3. layernorm-type grads over TP, 4. the tied word embedding
between the first and last PP stage, 5. position embeddings, 6. the router expert-bias update,
7. scaling by the global token count. Groups are checked before any communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.groups import ProcessGroupCollection
from gradsync.groups.model_config import describe_model_parallel

from . import reductions
from .protocol import find_attribute_owner


def get_model_config(model: Any) -> Any:
    """The model config (``config`` attribute) of a model chunk or of the module it wraps.

    The parameter is named ``model`` as in Megatron's ``get_model_config``, so keyword calls carry over."""
    return find_attribute_owner(model, "config").config


def _size_of(config: Any, name: str) -> int:
    return int(getattr(config, name, 1) or 1)


def _required_groups(config: Any, num_tokens: torch.Tensor | None) -> dict[str, str]:
    """Collection fields each active axis needs, with the reason."""
    needed: dict[str, str] = {}
    if num_tokens is not None:
        needed["dp_cp"] = "num_tokens is summed over dp x cp"
    if _size_of(config, "tensor_model_parallel_size") > 1:
        needed["tp"] = "tensor_model_parallel_size > 1"
    if _size_of(config, "pipeline_model_parallel_size") > 1:
        needed["pp"] = "pipeline_model_parallel_size > 1"
    if getattr(config, "moe_router_enable_expert_bias", False):
        needed["tp_dp_cp"] = "moe_router_enable_expert_bias sums token counts over tp x dp x cp"
    if num_tokens is not None and _size_of(config, "pipeline_model_parallel_size") > 1:
        needed["pp"] = "num_tokens is broadcast from the last pipeline stage"
    return needed


def resolve_groups(
    model: Sequence[Any],
    config: Any,
    pg_collection: ProcessGroupCollection | None,
    num_tokens: torch.Tensor | None,
) -> ProcessGroupCollection:
    """The groups to use; raises ``ValueError`` naming a missing field before any communication."""
    if pg_collection is None:
        pg_collection = getattr(model[0], "pg_collection", None)
        if pg_collection is None:
            sizes = describe_model_parallel(config)
            if sizes:
                raise ValueError(
                    f"finalize_model_grads: the config says {sizes} but neither the pg_collection argument "
                    "nor the model chunk carries process groups, so the model-parallel reductions cannot "
                    "run. Pass pg_collection=gradsync.groups.initialize_model_parallel(...)."
                )
            return ProcessGroupCollection(dp_cp=dist.group.WORLD, tp_dp_cp=dist.group.WORLD)
    for name, reason in _required_groups(config, num_tokens).items():
        if getattr(pg_collection, name) is None:
            raise ValueError(
                f"finalize_model_grads: pg_collection.{name} is required because {reason}, but it is not set"
            )
    if _size_of(config, "pipeline_model_parallel_size") > 1:
        for name in ("embd", "pos_embd"):
            if name not in vars(pg_collection):
                raise ValueError(
                    f"finalize_model_grads: pg_collection.{name} must be set with pipeline parallelism "
                    "(to None on ranks that hold no such group)"
                )
    return pg_collection


def finalize_model_grads(
    model: list[Any],
    num_tokens: torch.Tensor | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool = False,
) -> None:
    """All-reduce all model grads across DP replicas, layernorm grads for sequence parallelism, embedding
    grads across the first and last pipeline stages (if tied), update router expert biases, and scale
    grads by the global ``num_tokens`` (per-token loss).

    ``pg_collection`` None uses the first chunk's collection (gradsync-ddp wrappers carry one), else pure
    data parallelism over the default group.
    """
    config = get_model_config(model[0])
    groups = resolve_groups(model, config, pg_collection, num_tokens)
    for chunk in model:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    reductions.allreduce_conditional_embedding_grads(model, config, groups.pp)
    reductions.allreduce_non_tensor_model_parallel_grads(model, config, groups.tp)
    reductions.allreduce_word_embedding_grads(model, config, groups.embd, groups.pp)
    reductions.allreduce_position_embedding_grads(model, config, groups.pos_embd, groups.pp)
    if getattr(config, "moe_router_enable_expert_bias", False):
        assert groups.tp_dp_cp is not None  # checked by resolve_groups
        reductions.update_router_expert_bias(model, config, groups.tp_dp_cp)
    reductions.reset_model_temporary_tensors(config, model)
    if num_tokens is not None:
        reductions.scale_by_token_count(model, num_tokens, groups.pp, groups.dp_cp)
