"""A module run through several backwards in one step: a chunked cross-entropy (torchtitan's default loss)
calls the output head once per sequence chunk, each chunk with its own ``backward()``, then backpropagates
the trunk from the hidden states' accumulated grad. Every chunk's head grads must reach the optimizer: on
every MegatronFSDP strategy and through the FSDP2-style ``fully_shard``, fp32 and bf16, with and without
``no_sync`` accumulation, the weights after N steps equal one process on the global batch with the plain,
unchunked loss."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_testkit import (
    DIM,
    MICRO_ROWS,
    SEQ,
    STRATEGIES,
    VOCAB,
    Block,
    make_optimizer,
    max_relative_difference,
    shard_index,
)
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, MixedPrecisionPolicy, uneven_dtensor_to_full_tensor
from gradsync.fsdp.fsdp2 import MixedPrecisionPolicy as FSDP2Precision
from gradsync.fsdp.fsdp2 import fully_shard
from gradsync.groups.testing import run_distributed, test_device

STEPS, MICRO, CHUNKS = 3, 2, 3
# bf16: one process takes bf16 grads of the whole batch, gradsync reduces each chunk's. Measured after 3 steps
# (2-core CPU, torch 2.13, 2026-12-07): 5.3e-5 (ZeRO-3), 7.3e-5 (fully_shard) from one process; with the
# later chunks dropped, 8.6e-3. The bound leaves a margin of 13 on the one side and 8 on the other.
BF16_BOUND = 1e-3


class Head(nn.Linear):
    """The output head as its own unit (torchtitan shards ``norm`` and ``output`` together)."""


class ChunkedLM(nn.Module):
    """A trunk whose forward returns hidden states; the loss runs ``head`` outside the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = Head(DIM, VOCAB, bias=False)
        self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (the caller divides by the global token count)."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.reshape(-1), reduction="sum")


def chunked_backward(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, scale: float) -> None:
    """The head and the loss over sequence chunks, one backward each, then the trunk's backward."""
    detached = hidden[:, :-1].detach().requires_grad_()
    for piece, targets in zip(detached.chunk(CHUNKS, 1), tokens[:, 1:].chunk(CHUNKS, 1), strict=True):
        (token_loss(head(piece), targets) * scale).backward()
    hidden[:, :-1].backward(detached.grad)


def batches(step: int, world: int) -> torch.Tensor:
    """The global batch of ``step``: ``MICRO`` microbatches of ``MICRO_ROWS`` rows per rank."""
    generator = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, VOCAB, (world * MICRO * MICRO_ROWS, SEQ), generator=generator).to(test_device())


@functools.lru_cache(maxsize=4)
def reference(dtype: torch.dtype, world: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, the plain loss; bf16: fp32 main weights, as MegatronFSDP."""
    model = ChunkedLM().to(dtype)
    params = list(model.parameters())
    mains = [nn.Parameter(p.detach().float()) for p in params]
    optimizer = make_optimizer(mains)
    for step in range(STEPS):
        tokens = batches(step, world)
        model.zero_grad()
        (token_loss(model.head(model(tokens))[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
        for main, param in zip(mains, params, strict=True):
            main.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for main, param in zip(mains, params, strict=True):
                param.copy_(main)
    return {
        name: main.detach().cpu() for (name, _), main in zip(model.named_parameters(), mains, strict=True)
    }


def local_batches(step: int) -> list[torch.Tensor]:
    rank = dist.get_rank()
    rows = batches(step, dist.get_world_size())[rank * MICRO * MICRO_ROWS : (rank + 1) * MICRO * MICRO_ROWS]
    return list(rows.split(MICRO_ROWS))


def train_megatron_fsdp(
    strategy: str, dtype: torch.dtype, no_sync: bool, outer: int = 1
) -> dict[str, torch.Tensor]:
    """``outer`` > 1: HSDP, ``outer`` replicas of a shard group (the outer stage reduces whole grads)."""
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    model = MegatronFSDP(
        ChunkedLM().to(dtype),
        shard_index(outer),
        config,
        fsdp_unit_modules=[Block, Head],
        mixed_precision_policy=MixedPrecisionPolicy(torch.float32, None, None),
    )
    optimizer = make_optimizer(model.parameters())
    scale = 1.0 / (MICRO * MICRO_ROWS * (SEQ - 1))  # the local mean: the reduction averages over ranks
    model.set_model_auto_sync(not no_sync)  # every backward reduces in it, as the last one under no_sync
    for step in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = local_batches(step)
        for i, tokens in enumerate(micro):
            if no_sync and i < len(micro) - 1:
                with model.no_sync():
                    chunked_backward(model.module.head, model(tokens), tokens, scale)
            else:
                chunked_backward(model.module.head, model(tokens), tokens, scale)
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
    # the optimizer's fp32 weights, whole, under the module's names
    names = dict(model.named_parameters())
    return {name: uneven_dtensor_to_full_tensor(p).detach().float().cpu() for name, p in names.items()}


def train_fully_shard(dtype: torch.dtype, no_sync: bool) -> dict[str, torch.Tensor]:
    model = ChunkedLM()
    policy = FSDP2Precision(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model.head, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = make_optimizer(model.parameters())
    scale = 1.0 / (MICRO * MICRO_ROWS * (SEQ - 1))  # the local mean: the reduction averages over ranks
    for step in range(STEPS):
        micro = local_batches(step)
        for i, tokens in enumerate(micro):
            model.set_requires_gradient_sync(not no_sync or i == len(micro) - 1)
            chunked_backward(model.head, model(tokens), tokens, scale)
        optimizer.step()
        optimizer.zero_grad()
    return {
        name: uneven_dtensor_to_full_tensor(p).detach().float().cpu() for name, p in model.named_parameters()
    }


def check(results: list[dict[str, torch.Tensor]], dtype: torch.dtype, model_dtype: torch.dtype) -> None:
    """``model_dtype``: the dtype the model was built in (MegatronFSDP's bf16 recipe starts from bf16
    weights; FSDP2's ``param_dtype`` casts fp32 ones)."""
    want = reference(model_dtype, len(results))
    bound = 1e-6 if dtype == torch.float32 else BF16_BOUND
    for rank, weights in enumerate(results):
        got = {name.removeprefix("module."): value for name, value in weights.items()}
        assert max_relative_difference(got, want) <= bound, rank


@pytest.mark.parametrize("no_sync", [False, True], ids=["every_microbatch_syncs", "no_sync"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_fsdp_counts_every_chunk(strategy: str, no_sync: bool) -> None:
    check(
        run_distributed(train_megatron_fsdp, 2, args=(strategy, torch.float32, no_sync)),
        torch.float32,
        torch.float32,
    )


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_hsdp_counts_every_chunk(strategy: str) -> None:
    results = run_distributed(train_megatron_fsdp, 4, args=(strategy, torch.float32, False, 2))
    check(results, torch.float32, torch.float32)


@pytest.mark.parametrize("no_sync", [False, True], ids=["every_microbatch_syncs", "no_sync"])
def test_fully_shard_counts_every_chunk(no_sync: bool) -> None:
    check(run_distributed(train_fully_shard, 2, args=(torch.float32, no_sync)), torch.float32, torch.float32)


@pytest.mark.parametrize("api", ["megatron_fsdp", "fully_shard"])
def test_bf16_counts_every_chunk(api: str) -> None:
    args: tuple[Any, ...] = (
        ("optim_grads_params", torch.bfloat16, False) if api == "megatron_fsdp" else (torch.bfloat16, False)
    )
    trainer = train_megatron_fsdp if api == "megatron_fsdp" else train_fully_shard
    model_dtype = torch.bfloat16 if api == "megatron_fsdp" else torch.float32
    check(run_distributed(trainer, 2, args=args), torch.bfloat16, model_dtype)
