"""A tiny GPT (embedding, attention, MLP, layernorm, tied output) and the data and training loops the DDP
tests share. Spawned ranks import this module, so everything stays at module level.

Models and batches live on the harness device (:func:`test_device`), but are always drawn on the CPU
first: every device starts from the same weights and data, and CPU runs are unchanged."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import test_device

VOCAB, DIM, HEADS, SEQ, MICRO_ROWS = 32, 16, 2, 8, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, DIM))  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.ln1 = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.ln_f = nn.LayerNorm(DIM)
        self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position
        x = x + self.attention(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        logits = self.ln_f(x) @ self.embedding.weight.T  # output tied to the embedding
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_batch(step: int, world: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (world * micro * MICRO_ROWS, SEQ), generator=generator)
    return tokens.to(test_device())


def local_microbatches(step: int, rank: int, world: int, micro: int) -> list[torch.Tensor]:
    rows = global_batch(step, world, micro)[rank * micro * MICRO_ROWS : (rank + 1) * micro * MICRO_ROWS]
    return list(rows.split(MICRO_ROWS))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # eps well above fp32 rounding noise: with eps=1e-8 a grad that cancels to ~1e-9 in one summation
    # order and to 0 in another moves a weight by up to lr/4, whatever the sync is; that is Adam's
    # conditioning, not a sync error (torch DDP shows the same).
    if name == "adamw":  # its defaults hold a key its constructor does not take (decoupled_weight_decay)
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.1)
    return torch.optim.Adam(params, lr=1e-3, eps=1e-4)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def reference_training(optimizer: str, world: int, micro: int, steps: int) -> torch.Tensor:
    """One process, the whole global batch every step: what every DP run must reproduce."""
    model = TinyGPT()
    opt = make_optimizer(optimizer, model.parameters())
    for step in range(steps):
        opt.zero_grad()
        model(global_batch(step, world, micro)).backward()
        opt.step()
    return flat_params(model)


@dataclass
class Trainer:
    """A DDP-wrapped TinyGPT and its optimizer, plain or distributed."""

    model: TinyGPT
    ddp: DistributedDataParallel
    optimizer: Any

    @classmethod
    def build(
        cls,
        ddp_config: DistributedDataParallelConfig,
        optimizer: str,
        seed: int = 0,
        shard_alignment: Any = None,
        dtype: torch.dtype = torch.float32,
    ) -> Trainer:
        model = TinyGPT(seed).to(dtype)
        ddp = DistributedDataParallel(
            ModelParallelConfig(), ddp_config, model, shard_alignment=shard_alignment
        )
        opt = make_optimizer(optimizer, ddp.parameters())
        if ddp_config.use_distributed_optimizer:
            return cls(model, ddp, DistributedOptimizer(opt, ddp))
        return cls(model, ddp, opt)

    def step(self, step: int, rank: int, world: int, micro: int) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = local_microbatches(step, rank, world, micro)
        for index, batch in enumerate(batches):
            context = self.ddp.no_sync() if index < len(batches) - 1 else nullcontext()
            with context:
                (self.ddp(batch) / len(batches)).backward()
        self.ddp.finish_grad_sync()
        self.optimizer.step()

    def full_params(self) -> torch.Tensor:
        """Params as a forward pass would see them (gathers first with overlap_param_gather)."""
        if self.ddp.ddp_config.overlap_param_gather:
            self.ddp.disable_forward_pre_hook(param_sync=True)
            self.ddp.enable_forward_pre_hook()
        return flat_params(self.model)


def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """On the CPU: a rank's result may come back on its own GPU, the reference on another."""
    a, b = a.cpu(), b.cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(math.ulp(1.0)))
