"""What `finalize_model_grads` needs from a model chunk, as Protocols any wrapper can meet.

gradsync-ddp's and gradsync-fsdp's wrappers, Megatron's own, and a user's module all qualify: finalize
imports none of them. A chunk is the wrapper (finish_grad_sync, scale_gradients, ddp_config); the
embedding attributes live on the wrapped model, found by following ``.module``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class GradSyncConfig(Protocol):
    """The two fields of a DistributedDataParallelConfig that finalize reads."""

    use_megatron_fsdp: bool
    use_distributed_optimizer: bool


@runtime_checkable
class FinalizableChunk(Protocol):
    """A data-parallel wrapper: it completes its DP reduction and can scale its grads."""

    ddp_config: GradSyncConfig

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None: ...

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None: ...


@runtime_checkable
class EmbeddingOwner(Protocol):
    """The model inside a chunk: which pipeline ends it holds and its tied embedding weight.

    ``shared_embedding_or_output_weight()`` returns the input embedding on the first stage and the output
    weight on the last; with ``share_embeddings_and_output_weights`` their grads are summed across the two
    stages.
    """

    pre_process: bool
    post_process: bool
    share_embeddings_and_output_weights: bool

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None: ...


def find_attribute_owner(chunk: Any, attribute: str) -> Any:
    """The first object down the ``.module`` chain that has ``attribute`` set (not None)."""
    current = chunk
    while current is not None:
        if getattr(current, attribute, None) is not None:
            return current
        current = getattr(current, "module", None)
    raise RuntimeError(
        f"couldn't find attribute {attribute} on {type(chunk).__name__} or the modules it wraps (.module)"
    )
