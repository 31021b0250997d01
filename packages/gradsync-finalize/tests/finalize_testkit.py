"""Toy chunks meeting finalize's Protocols without any gradsync wrapper: a model that owns (maybe tied)
embedding weights and a sequence-parallel layernorm, and a minimal DP wrapper that averages grads. Models
live on the harness device (:func:`test_device`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import test_device


@dataclass
class ToyDDPConfig:
    use_megatron_fsdp: bool = False
    use_distributed_optimizer: bool = False


class ToyStage(nn.Module):
    """One pipeline stage: an embedding on the first stage, an output weight on the last."""

    def __init__(
        self, config: ModelParallelConfig, pre_process: bool, post_process: bool, tied: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = tied
        self.embedding = nn.Parameter(torch.zeros(6, 4)) if pre_process else None
        self.output = nn.Parameter(torch.zeros(6, 4)) if post_process and not pre_process else None
        self.norm = nn.LayerNorm(4)
        self.norm.weight.sequence_parallel = True  # type: ignore[attr-defined]
        self.norm.bias.sequence_parallel = True  # type: ignore[attr-defined]
        self.dense = nn.Linear(4, 4)
        self.to(test_device())
        for param in self.parameters():
            param.main_grad = torch.zeros_like(param)  # type: ignore[attr-defined]

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        return self.embedding if self.pre_process else self.output


class ToyDataParallel(nn.Module):
    """A FinalizableChunk: finish_grad_sync averages main_grads over the DP group."""

    def __init__(
        self, module: nn.Module, dp_group: dist.ProcessGroup | None, per_token_loss: bool = False
    ) -> None:
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.ddp_config = ToyDDPConfig()
        self.per_token_loss = per_token_loss
        self.finished = 0

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.finished += 1
        for param in self.module.parameters():
            grad = param.main_grad  # type: ignore[attr-defined]
            dist.all_reduce(grad, group=self.dp_group)
            if not self.per_token_loss:
                grad /= self.dp_group.size() if self.dp_group is not None else dist.get_world_size()

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        for param in self.module.parameters():
            param.main_grad *= scaling_factor  # type: ignore[attr-defined]
