"""Shard-alignment policies under the distributed optimizer: ``tensor`` params are stepped whole by one
rank, shaped as the param; ``block`` pieces are whole block-rows, shaped as rows; each rank's pieces tile
every param once; and training equals one process at 2 and 4 ranks."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, Trainer, max_relative_difference, reference_training

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed

DISTOPT = DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=600
)
MIXED = {"attention.*.weight": "tensor", "mlp.*.weight": "block:4x8", "*.bias": "block:8"}


def pieces(alignment: Any) -> list[tuple[str, tuple[int, ...], tuple[int, int], tuple[int, ...]]]:
    """This rank's pieces: name, the main param's shape, its range in the flat param, the param's shape."""
    trainer = Trainer.build(DISTOPT, "adamw", shard_alignment=alignment)
    return [
        (p.name, tuple(p.main.shape), p.param_range, tuple(p.param.shape)) for p in trainer.optimizer.pieces
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_params_are_whole_on_one_rank(world: int) -> None:
    results = run_distributed(pieces, world, args=("tensor",))
    owners: dict[str, list[int]] = {}
    for rank, owned in enumerate(results):
        for name, shape, (lo, hi), param_shape in owned:
            assert shape == param_shape, name
            assert (lo, hi) == (0, torch.Size(param_shape).numel()), name
            owners.setdefault(name, []).append(rank)
    assert all(len(ranks) == 1 for ranks in owners.values()), owners
    assert len({rank for ranks in owners.values() for rank in ranks}) == world  # every rank steps something


def test_block_pieces_are_whole_block_rows_and_tile_each_param() -> None:
    results = run_distributed(pieces, 4, args=(MIXED,))
    covered: dict[str, list[tuple[int, int]]] = {}
    for owned in results:
        for name, shape, (lo, hi), param_shape in owned:
            covered.setdefault(name, []).append((lo, hi))
            if name.startswith("mlp.") and name.endswith("weight"):
                row = param_shape[1]
                assert lo % (4 * row) == 0, (name, lo)
                assert hi % (4 * row) == 0 or hi == torch.Size(param_shape).numel(), (name, hi)
                assert shape == ((hi - lo) // row, row), name
            if name.endswith("bias"):
                assert lo % 8 == 0, (name, lo)
            if name.startswith("attention.") and name.endswith("weight"):
                assert shape == param_shape, name
    shapes = {name: param_shape for owned in results for name, _, _, param_shape in owned}
    for name, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0, name
        assert ranges[-1][1] == torch.Size(shapes[name]).numel(), name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), (name, ranges)


def train(alignment: Any, optimizer: str, steps: int) -> torch.Tensor:
    trainer = Trainer.build(DISTOPT, optimizer, shard_alignment=alignment)
    for step in range(steps):
        trainer.step(step, dist.get_rank(), dist.get_world_size(), 1)
    return trainer.full_params()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("alignment", ["tensor", MIXED], ids=["tensor", "mixed"])
def test_trains_like_one_process(alignment: Any, world: int) -> None:
    want = reference_training("adamw", world, 1, 6)
    for rank, got in enumerate(run_distributed(train, world, args=(alignment, "adamw", 6))):
        assert max_relative_difference(got, want) < 1e-5, rank


def balance(alignment: Any) -> tuple[int, int, float]:
    trainer = Trainer.build(DISTOPT, "adamw", shard_alignment=alignment)
    report = trainer.ddp.shard_balance()
    return report.numel, report.padding, report.imbalance


def test_shard_balance_counts_every_param_and_the_padding() -> None:
    default = run_distributed(balance, 4, args=(None,))[0]
    tensor = run_distributed(balance, 4, args=("tensor",))[0]
    numel = sum(p.numel() for p in TinyGPT().parameters())
    assert default[0] == tensor[0] == numel
    assert default[2] < tensor[2]  # cutting anywhere balances best
    assert default[1] < tensor[1]


def resume_with_policy(alignment: Any, sharded: bool) -> bool:
    """10 steps, a checkpoint (gathered or per-rank shards), 10 more, against 20 straight: the shaped
    main params and their state must go through the checkpoint and come back in place."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def steps(trainer: Trainer, span: range) -> None:
        for step in span:
            trainer.step(step, rank, world, 1)

    straight = Trainer.build(DISTOPT, "adamw", shard_alignment=alignment)
    steps(straight, range(20))
    first = Trainer.build(DISTOPT, "adamw", shard_alignment=alignment)
    steps(first, range(10))
    model_state = {k: v.clone() for k, v in first.ddp.state_dict().items()}
    resumed = Trainer.build(DISTOPT, "adamw", seed=1, shard_alignment=alignment)
    resumed.ddp.load_state_dict(model_state)
    if sharded:
        shards: list[Any] = [None] * world
        dist.all_gather_object(shards, first.optimizer.sharded_state_dict())
        resumed.optimizer.load_sharded_state_dict(shards)
    else:
        saved = first.optimizer.state_dict()  # a collective: rank 0 holds the whole state
        gathered: list[Any] = [saved if rank == 0 else None]
        dist.broadcast_object_list(gathered, src=0)
        resumed.optimizer.load_state_dict(gathered[0])
    steps(resumed, range(10, 20))
    return torch.equal(resumed.full_params(), straight.full_params())


@pytest.mark.parametrize("sharded", [False, True], ids=["gathered", "shards"])
@pytest.mark.parametrize("alignment", ["tensor", MIXED], ids=["tensor", "mixed"])
def test_checkpoints_resume_bit_exact(alignment: Any, sharded: bool) -> None:
    assert run_distributed(resume_with_policy, 2, args=(alignment, sharded)) == [True, True]


def layout_and_policy() -> str:
    model = TinyGPT()
    layout = DistributedOptimizer.compute_full_param_layout(
        [p for p in model.parameters()], 600, dist.get_world_size(), DISTOPT
    )
    try:
        DistributedDataParallel(
            ModelParallelConfig(), DISTOPT, model, full_param_layout=layout, shard_alignment="tensor"
        )
    except ValueError as error:
        return str(error)
    return "built"


def test_a_precomputed_layout_with_a_policy_is_refused() -> None:
    for message in run_distributed(layout_and_policy, 2):
        assert "full_param_layout was computed before shard_alignment" in message
