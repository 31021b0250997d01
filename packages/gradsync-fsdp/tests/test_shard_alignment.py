"""Shard-alignment policies in gradsync-fsdp: ``tensor`` keeps each param whole on one rank, ``block``
cuts only between whole blocks, per param name; the layout obeys them, reports what they cost, and every
strategy still trains exactly like one process."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import pytest
import torch
from fsdp_testkit import (
    STRATEGIES,
    TinyTransformer,
    Trainer,
    full_weights,
    max_relative_difference,
    reference_training,
)

from gradsync.buffers.shard_alignment import (
    ShardAlignment,
    parse_shard_alignment,
    resolve_shard_alignments,
)
from gradsync.fsdp import compute_bucket_layout
from gradsync.groups.testing import run_distributed

TENSOR_WEIGHTS = {"*.weight": "tensor"}
MIXED = {"blocks.*.up.weight": "block:4x6", "blocks.*.down.weight": "tensor", "*.bias": "block:6"}


def _cuts(layout: Any, index: int) -> list[int]:
    """Element offsets inside item ``index`` where a shard boundary cuts it."""
    item = layout.items[index]
    cuts = []
    for rank in range(1, layout.world):
        boundary = layout.cuts[rank]
        if item.offset < boundary < item.end:
            cuts.append(boundary - item.offset)
    return cuts


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_tensor_params_sit_whole_in_one_shard_and_balance(world: int) -> None:
    shapes = [torch.Size(s) for s in ([40, 12], [12], [37, 12], [12, 37], [24, 12], [7], [5, 5])]
    layout = compute_bucket_layout(shapes, world, [parse_shard_alignment("tensor")] * len(shapes))
    for index in range(len(shapes)):
        assert _cuts(layout, index) == [], shapes[index]
    spans = sorted((item.offset, item.end) for item in layout.items)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "items overlap"
    balance = layout.balance()
    assert sum(balance.owned) == sum(math.prod(s) for s in shapes)
    # greedy largest-first: no shard holds more than the mean plus the largest param
    assert max(balance.owned) <= sum(balance.owned) / world + max(math.prod(s) for s in shapes)
    assert balance.padding == layout.size - sum(balance.owned)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    ("policy", "shape", "multiple"),
    [("block:32", [40, 12], 96), ("block:4x6", [37, 12], 48), ("block:5", [23], 5), ("row", [9, 7], 7)],
)
def test_block_and_row_cuts_fall_on_whole_blocks(
    world: int, policy: str, shape: list[int], multiple: int
) -> None:
    shapes = [torch.Size([3]), torch.Size(shape), torch.Size([11, 5])]
    policies = [parse_shard_alignment("row"), parse_shard_alignment(policy), parse_shard_alignment("row")]
    layout = compute_bucket_layout(shapes, world, policies)
    assert all(cut % multiple == 0 for cut in _cuts(layout, 1))
    assert all(cut % 5 == 0 for cut in _cuts(layout, 2))
    if policy == "row":  # equal shards; a block param makes them ragged
        assert layout.cuts == tuple(r * layout.size // world for r in range(world + 1))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ragged_buckets_hold_no_tail_padding(world: int) -> None:
    """Whole matrices in equal shards pad every shard up to the largest (DP x the largest matrix when
    ranks outnumber matrices); ragged shards hold what they own and nothing else."""
    shapes = [torch.Size(s) for s in ([40, 12], [12], [37, 12], [12, 37], [7])]
    numels = [math.prod(s) for s in shapes]
    layout = compute_bucket_layout(shapes, world, [parse_shard_alignment("tensor")] * len(shapes))
    assert layout.size == sum(numels)  # whole params need no alignment gaps
    assert layout.balance().padding == 0
    assert all(_cuts(layout, index) == [] for index in range(len(shapes)))
    sizes = [hi - lo for lo, hi in itertools.pairwise(layout.cuts)]
    assert sorted(sizes, reverse=True)[0] >= max(numels)
    if world > len(shapes):
        assert sizes.count(0) == world - len(shapes)  # ranks without a matrix hold nothing
    # the rows each rank holds still tile every param
    for index, shape in enumerate(shapes):
        rows = [layout.local_rows(index, r) for r in range(world)]
        assert sum(last - first for first, last in rows) == shape[0]


def test_policies_by_name_pattern_and_callable() -> None:
    named = [(n, torch.zeros(4, 4)) for n in ("blocks.0.up.weight", "blocks.0.up.bias", "head.weight")]
    by_pattern = resolve_shard_alignments({"blocks.*.up.*": "block:2x4", "*.weight": "tensor"}, named)
    assert [str(p) for p in by_pattern.values()] == ["block:2x4", "block:2x4", "tensor"]
    by_call = resolve_shard_alignments(lambda name, p: "tensor" if name.endswith("bias") else None, named)
    assert [str(p) for p in by_call.values()] == ["row", "tensor", "row"]
    assert parse_shard_alignment("block:(128, 128)") == ShardAlignment("block", (128, 128))
    assert str(parse_shard_alignment("block:32")) == "block:32"
    with pytest.raises(ValueError, match="match no param"):
        resolve_shard_alignments({"mlp.*": "tensor"}, named)
    with pytest.raises(ValueError, match="'diagonal' is not a policy"):
        parse_shard_alignment("diagonal")
    with pytest.raises(ValueError, match="positive"):
        parse_shard_alignment("block:0")


def _locals(strategy: str, alignment: Any, outer: int = 1) -> dict[str, tuple[int, int, int]]:
    """Each param's (local rows, first row, global rows) on this rank."""
    trainer = Trainer.build(strategy, shard_alignment=alignment, outer=outer)
    out = {}
    for name, param in trainer.model.named_parameters():
        local = param.to_local()
        first = (trainer.model.params.first_row(param) or 0) if local.numel() else -1
        out[name] = (local.shape[0] if local.dim() else 1, first, param.shape[0] if param.dim() else 1)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_params_have_one_owner_holding_all_rows(world: int) -> None:
    results = run_distributed(_locals, world, args=("optim_grads_params", TENSOR_WEIGHTS))
    for name in results[0]:
        rows = [r[name][0] for r in results]
        if name.endswith(".weight"):
            owners = [rank for rank, n in enumerate(rows) if n]
            assert len(owners) == 1, (name, rows)
            assert rows[owners[0]] == results[0][name][2], (name, rows)
        assert sum(rows) == results[0][name][2], (name, rows)


def test_block_rows_start_on_block_boundaries() -> None:
    results = run_distributed(_locals, 4, args=("optim_grads_params", MIXED))
    for name in results[0]:
        if name.endswith("up.weight"):
            firsts = [r[name][1] for r in results if r[name][0]]
            assert all(first % 4 == 0 for first in firsts), (name, firsts)
            assert all(r[name][0] % 4 == 0 or r[name][1] + r[name][0] == 37 for r in results if r[name][0])


@functools.lru_cache(maxsize=4)
def reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    return reference_training(world, 1, steps)


def train(strategy: str, alignment: Any, steps: int, outer: int = 1) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(strategy, shard_alignment=alignment, outer=outer)
    for step in range(steps):
        trainer.step(step, 1)
    return full_weights(trainer.model)


@pytest.mark.parametrize("alignment", ["tensor", MIXED], ids=["tensor", "mixed"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_like_one_process(strategy: str, alignment: Any) -> None:
    results = run_distributed(train, 2, args=(strategy, alignment, 8))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(2, 8)) <= 1e-6, rank


@pytest.mark.parametrize(("outer", "outer_strategy"), [(1, "no_shard"), (2, "no_shard"), (2, "optim")])
def test_four_ranks_and_hybrid_sharding(outer: int, outer_strategy: str) -> None:
    alignment = TENSOR_WEIGHTS if outer_strategy == "no_shard" else MIXED
    config = {"outer_dp_sharding_strategy": outer_strategy} if outer > 1 else {}
    results = run_distributed(_train_with_config, 4, args=(alignment, outer, config))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(4, 8)) <= 1e-6, rank


def _train_with_config(alignment: Any, outer: int, config: dict[str, str]) -> dict[str, torch.Tensor]:
    trainer = Trainer.build("optim_grads_params", shard_alignment=alignment, outer=outer, **config)
    for step in range(8):
        trainer.step(step, 1)
    return full_weights(trainer.model)


def _balance(alignment: Any) -> tuple[int, int, float, int]:
    trainer = Trainer.build("optim_grads_params", shard_alignment=alignment)
    balance = trainer.model.shard_balance()
    held = sum(p.to_local().numel() for p in trainer.model.parameters())
    return balance.numel, balance.padding, balance.imbalance, held


@pytest.mark.parametrize("alignment", [None, "tensor"])
def test_the_wrapper_reports_padding_and_imbalance(alignment: Any) -> None:
    """Counted against the module's own params and against what each rank's DTensors hold."""
    results = run_distributed(_balance, 4, args=(alignment,))
    numel = sum(p.numel() for p in TinyTransformer().parameters())
    held = [r[3] for r in results]
    for total, padding, imbalance, _ in results:
        assert total == sum(held) == numel
        assert imbalance == pytest.approx(max(held) / (sum(held) / len(held)))
        if alignment is None:
            assert padding > 0  # odd widths: 37-row matrices, 12-wide rows, in equal shards
        else:
            assert padding == 0  # ragged shards: whole params, no alignment gaps


def test_buckets_of_one_shape_spread_their_largest_params() -> None:
    """Ties start at ``first_rank`` (the unit's index): rank 0 would otherwise take the largest matrix of
    every unit, and with it most of a matrix optimizer's work."""
    shapes = [torch.Size([40, 12]), torch.Size([12]), torch.Size([24, 12])]
    tensor = [parse_shard_alignment("tensor")] * 3
    for first in range(4):
        layout = compute_bucket_layout(shapes, 4, tensor, first_rank=first)
        assert layout.local_rows(0, first) == (0, 40), first


def largest_owners() -> list[bool]:
    trainer = Trainer.build("optim_grads_params", shard_alignment="tensor")  # equal tails: ties
    return [p.to_local().numel() > 0 for n, p in trainer.model.named_parameters() if n.endswith("up.weight")]


def test_units_give_their_largest_params_to_different_ranks() -> None:
    owned = run_distributed(largest_owners, 2)
    assert owned[0] != owned[1]  # each rank holds one unit's up.weight
    assert owned[0][0] != owned[0][1]
