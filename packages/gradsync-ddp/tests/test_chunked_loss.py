"""A module run through several backwards in one iteration (a chunked cross-entropy: the output head once per
sequence chunk, each with its own ``backward()``, then the trunk's backward) under gradsync DDP. The first
iteration's grad counts decide when a bucket group is complete (Megatron's golden counts), so a fixed chunk
count accumulates every chunk: the weights equal one process on the global batch with the plain loss, with
and without the distributed optimizer. A later iteration with more chunks is refused by the param's name
before a grad is lost; one with fewer names the params short of their count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_testkit import MICRO_ROWS, SEQ, VOCAB, flat_params, make_optimizer, max_relative_difference
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed, test_device

DIM, STEPS, CHUNKS = 16, 3, 3


class ChunkedLM(nn.Module):
    """A trunk whose forward returns hidden states; the loss runs ``head`` outside the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 3 * DIM), nn.GELU(), nn.Linear(3 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        return self.norm(x + self.mlp(x))  # type: ignore[no-any-return]


def token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1), reduction="sum")


def chunked_backward(
    head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, scale: float, chunks: int
) -> None:
    detached = hidden[:, :-1].detach().requires_grad_()
    for piece, targets in zip(detached.chunk(chunks, 1), tokens[:, 1:].chunk(chunks, 1), strict=True):
        (token_loss(head(piece), targets) * scale).backward()
    hidden[:, :-1].backward(detached.grad)


def batch(step: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4000 + step)
    return torch.randint(0, VOCAB, (world * MICRO_ROWS, SEQ), generator=generator).to(test_device())


def reference(world: int) -> torch.Tensor:
    model = ChunkedLM()
    optimizer = make_optimizer("adam", model.parameters())
    for step in range(STEPS):
        tokens = batch(step, world)
        optimizer.zero_grad()
        (token_loss(model.head(model(tokens))[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
        optimizer.step()
    return flat_params(model)


def train(distributed_optimizer: bool, chunks: tuple[int, ...]) -> torch.Tensor:
    """``chunks``: each iteration's chunk count."""
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=distributed_optimizer, bucket_size=200
    )
    model = ChunkedLM()
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model)
    optimizer = make_optimizer("adam", ddp.parameters())
    if distributed_optimizer:
        optimizer = DistributedOptimizer(optimizer, ddp)
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = 1.0 / (MICRO_ROWS * (SEQ - 1))  # the local mean: DDP averages over ranks
    for step, count in enumerate(chunks):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = batch(step, world)[rank * MICRO_ROWS : (rank + 1) * MICRO_ROWS]
        chunked_backward(model.head, ddp(tokens), tokens, scale, count)
        ddp.finish_grad_sync()
        optimizer.step()
    if config.overlap_param_gather:
        ddp.disable_forward_pre_hook(param_sync=True)
    return flat_params(model)


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distributed_optimizer"])
def test_every_chunk_counts(distributed_optimizer: bool) -> None:
    results = run_distributed(train, 2, args=(distributed_optimizer, (CHUNKS,) * STEPS))
    for rank, params in enumerate(results):
        assert max_relative_difference(params, reference(2)) <= 1e-6, rank


def test_more_chunks_than_the_first_iteration_is_refused_by_name() -> None:
    with pytest.raises(Exception, match=r"param head\.weight got a grad after its bucket group's reduction"):
        run_distributed(train, 2, args=(False, (CHUNKS, CHUNKS + 1)))


def test_fewer_chunks_than_the_first_iteration_names_the_param() -> None:
    with pytest.raises(Exception, match=r"fewer grads than in the first iteration: head\.weight \(2 of 3\)"):
        run_distributed(train, 2, args=(False, (CHUNKS, CHUNKS - 1)))
