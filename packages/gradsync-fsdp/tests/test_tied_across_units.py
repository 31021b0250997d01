"""A param used on both sides of a unit boundary (a non-unit head tied to a unit's embedding, or two units
sharing a weight) lives in a non-unit bucket, gathered for the whole forward and backward, so ZeRO-3 and
double buffers train it like one process instead of reading released or recycled storage."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_testkit import DIM, VOCAB, Block, global_batch, local_microbatches, shard_index
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP
from gradsync.groups.testing import run_distributed, test_device

STEPS = 3


class Embedder(nn.Module):
    """A unit holding the embedding that the (non-unit) head reuses."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


class TiedAcrossUnits(nn.Module):
    """``head`` (no unit) is tied to the ``Embedder`` unit's table; with ``share_blocks`` the first
    projection of every Block is one weight, shared by all Block units."""

    def __init__(self, share_blocks: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = Embedder()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.table.weight
        if share_blocks:
            for block in self.blocks[1:]:
                block.up.weight = self.blocks[0].up.weight
        self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def reference(share_blocks: bool, world: int) -> dict[str, torch.Tensor]:
    model = TiedAcrossUnits(share_blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        model(global_batch(step, world, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


def train(strategy: str, share_blocks: bool, double_buffer: bool) -> dict[str, torch.Tensor]:
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        fsdp_double_buffer=double_buffer,
    )
    model = MegatronFSDP(
        TiedAcrossUnits(share_blocks), shard_index(), config, fsdp_unit_modules=[Embedder, Block]
    )
    tied = {model.params.of(model.module.head.weight).bucket.spec.unit_id}
    if share_blocks:
        tied.add(model.params.of(model.module.blocks[0].up.weight).bucket.spec.unit_id)
    assert tied == {None}, "params used across a unit boundary belong to no unit"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        model(local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
        model.zero_grad_buffer()
    return model.full_state_dict(rank0_only=False)  # bucket by bucket, as double buffers need


@pytest.mark.parametrize("double_buffer", [False, True])
@pytest.mark.parametrize("share_blocks", [False, True])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_params_tied_across_units_train_like_one_process(
    strategy: str, share_blocks: bool, double_buffer: bool
) -> None:
    want = reference(share_blocks, 2)
    for rank, got in enumerate(run_distributed(train, 2, args=(strategy, share_blocks, double_buffer))):
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} on rank {rank}")


class ReusedSubmodule(nn.Module):
    """A unit's submodule registered again on the root and used after the units."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.tail = self.blocks[0].norm
        self.head = nn.Linear(DIM, VOCAB)
        self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.tail(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def loss_with_reused_submodule() -> tuple[float, list[int | None]]:
    model = MegatronFSDP(ReusedSubmodule(), shard_index(), fsdp_unit_modules=[Block])  # ZeRO-3
    tokens = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    return float(model(tokens)), [
        model.params.of(p).bucket.spec.unit_id for p in model.module.tail.parameters()
    ]


def test_a_submodule_reused_outside_its_unit_leaves_the_unit() -> None:
    for rank, (loss, units) in enumerate(run_distributed(loss_with_reused_submodule, 2)):
        tokens = local_microbatches(0, rank, 2, 1)[0]
        assert loss == pytest.approx(float(ReusedSubmodule()(tokens)), rel=1e-6)
        assert units == [None, None]
