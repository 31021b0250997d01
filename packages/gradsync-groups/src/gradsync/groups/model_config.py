"""The model-parallel config that the upper layers read, as a Protocol and a small default dataclass.

Megatron passes its ``TransformerConfig`` to DDP, FSDP and ``finalize_model_grads``; those only read a handful
of attributes. The Protocol names them, so Megatron's own object type-checks and works unchanged, and
:class:`ModelParallelConfig` gives everyone else the same attributes with Megatron's defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelParallelConfigProtocol(Protocol):
    """Attributes of Megatron's ``TransformerConfig`` that gradsync reads."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    sequence_parallel: bool
    calculate_per_token_loss: bool
    qk_layernorm: bool
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    moe_router_load_balancing_type: str | list[str]
    mtp_num_layers: int | None
    barrier_with_L1_time: bool  # Megatron's field name
    timers: Callable[..., Any] | None


@dataclass
class ModelParallelConfig:
    """A ready-made config for models that are not Megatron's; defaults are Megatron's."""

    tensor_model_parallel_size: int = 1
    """Ranks one layer's weights are split across."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""
    context_parallel_size: int = 1
    """Ranks one sequence is split across; dense grads are reduced over dp × cp."""
    expert_model_parallel_size: int = 1
    """Ranks the MoE experts are spread across."""
    sequence_parallel: bool = False
    """Activations are split along the sequence in TP regions, so layernorm-type grads must be summed
    across TP (for params marked ``sequence_parallel``)."""
    calculate_per_token_loss: bool = False
    """The loss is a sum over tokens, normalised later by the global token count: grads are summed across
    DP instead of averaged."""
    qk_layernorm: bool = False
    """Query/key layernorm params (named ``q_layernorm``/``k_layernorm``) are summed across TP."""
    moe_router_enable_expert_bias: bool = False
    """Update router expert biases from token counts after every step."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of that expert-bias update."""
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    """MoE load-balancing kind(s)."""
    mtp_num_layers: int | None = None
    """Multi-token-prediction layers; when set the last stage also holds an embedding copy."""
    barrier_with_L1_time: bool = True  # Megatron's field name
    """Timers put a barrier before L1 timings."""
    timers: Callable[..., Any] | None = None
    """Megatron-style timers callable, or None to time nothing."""
    pipeline_dtype: torch.dtype | None = None
    """dtype of the tensors sent between pipeline stages (Megatron requires it with pipeline parallelism).
    Here so Megatron code that sets or reads it finds it; nothing in gradsync reads it yet, nor requires
    it: gradsync does no pipeline p2p communication."""


MODEL_PARALLEL_SIZE_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def model_parallel_sizes(config: object) -> dict[str, int]:
    """The config's model-parallel sizes above 1, by field name (a field it lacks, or None, counts as 1).

    Wrappers use it to refuse a model-parallel config given without process groups, which would otherwise
    treat TP shards or pipeline stages as data-parallel replicas.
    """
    sizes = {name: int(getattr(config, name, 1) or 1) for name in MODEL_PARALLEL_SIZE_FIELDS}
    return {name: size for name, size in sizes.items() if size > 1}


def describe_model_parallel(config: object) -> str:
    """``"tensor_model_parallel_size=2, pipeline_model_parallel_size=2"`` for the config's model-parallel
    sizes above 1; empty when it has none. The wrappers name these in their refusals."""
    return ", ".join(f"{name}={size}" for name, size in model_parallel_sizes(config).items())
