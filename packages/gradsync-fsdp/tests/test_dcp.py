"""torch.distributed.checkpoint with MegatronFSDP's uneven shards: a checkpoint of model and optimizer
saved at one DP size (after step 10) loads at another (4 -> 2 and 2 -> 4), and training continues as if
uninterrupted: equal (<= 1e-6) to the run that never stopped, on the same global batches; at the same
size, bit-identical.
A full state dict on rank 0 gives every param whole, for export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import (
    Block,
    TinyTransformer,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    shard_index,
    wrap,
)
from torch import nn

from gradsync.fsdp import MegatronFSDP, fully_shard_optimizer
from gradsync.groups.testing import run_distributed

ROWS_PER_STEP = 4  # microbatches per step x world, the same at every DP size
SAVED_AT = 10  # the checkpoint is taken after this many steps


def build(
    strategy: str, seed: int, outer: int = 1, outer_strategy: str = "no_shard"
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    model = wrap(strategy, seed=seed, outer=outer, outer_dp_sharding_strategy=outer_strategy)
    return model, fully_shard_optimizer(make_optimizer(model.parameters()))


def train(model: MegatronFSDP, optimizer: torch.optim.Optimizer, steps: range) -> None:
    world = dist.get_world_size()
    micro = ROWS_PER_STEP // world
    for step in steps:
        batches = local_microbatches(step, dist.get_rank(), world, micro)
        for batch in batches[:-1]:
            with model.no_sync():
                (model(batch) / micro).backward()
        (model(batches[-1]) / micro).backward()
        optimizer.step()
        optimizer.zero_grad()


def save_then_continue(strategy: str, directory: str, *hybrid: Any) -> dict[str, torch.Tensor]:
    model, optimizer = build(strategy, 0, *hybrid)
    train(model, optimizer, range(SAVED_AT))
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=directory)
    train(model, optimizer, range(SAVED_AT, SAVED_AT + 2))
    return full_weights(model)


def load_then_continue(strategy: str, directory: str, *hybrid: Any) -> dict[str, torch.Tensor]:
    model, optimizer = build(strategy, 1, *hybrid)  # other weights, to be overwritten
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    train(model, optimizer, range(SAVED_AT, SAVED_AT + 2))
    return full_weights(model)


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(4, 2), (2, 4), (2, 2)])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_checkpoint_reshards_across_dp_sizes(
    strategy: str, saved_at: int, loaded_at: int, tmp_path: Path
) -> None:
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(save_then_continue, saved_at, args=(strategy, directory))[0]
    resumed = run_distributed(load_then_continue, loaded_at, args=(strategy, directory))
    for rank, weights in enumerate(resumed):
        if saved_at == loaded_at:  # the same reductions in the same order: bit-identical
            assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted), rank
        else:
            assert max_relative_difference(weights, uninterrupted) <= 1e-6, rank


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((4, 2, "optim"), (2, 1, "no_shard")),
        ((2, 1, "no_shard"), (4, 2, "optim")),
        ((4, 2, "no_shard"), (4, 2, "optim")),
    ],
    ids=["hfsdp2x2-to-dp2", "dp2-to-hfsdp2x2", "hsdp2x2-to-hfsdp2x2"],
)
def test_hybrid_checkpoints_reshard(
    saved: tuple[int, int, str], loaded: tuple[int, int, str], tmp_path: Path
) -> None:
    """Outer replicas (HSDP) write their shards once; outer-sharded state (HFSDP) loads anywhere."""
    directory = str(tmp_path / "ckpt")
    strategy = "optim_grads_params"
    uninterrupted = run_distributed(save_then_continue, saved[0], args=(strategy, directory, *saved[1:]))[0]
    resumed = run_distributed(load_then_continue, loaded[0], args=(strategy, directory, *loaded[1:]))
    for rank, weights in enumerate(resumed):
        assert max_relative_difference(weights, uninterrupted) <= 1e-6, rank


def export(strategy: str) -> dict[str, torch.Tensor]:
    model, optimizer = build(strategy, seed=0)
    train(model, optimizer, range(2))
    full = model.full_state_dict()
    assert (dist.get_rank() == 0) == bool(full)
    weights = full_weights(model)
    if full:
        TinyTransformer().load_state_dict(full)  # every key of the plain model, the tied alias included
        assert all(torch.equal(full[k], w) for k, w in weights.items())
    return full


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_full_state_dict_on_rank_0(strategy: str) -> None:
    full = run_distributed(export, 2, args=(strategy,))[0]
    assert set(full) == set(TinyTransformer().state_dict())


class WithExtraState(nn.Module):
    """As Megatron's layers: ``get_extra_state`` gives None (Transformer Engine's fp8 metadata elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyTransformer()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)

    def get_extra_state(self) -> Any:
        return None

    def set_extra_state(self, state: Any) -> None:
        assert state is None


def export_with_extra_state() -> dict[str, Any]:
    model = MegatronFSDP(WithExtraState(), shard_index(), fsdp_unit_modules=[Block])
    return model.full_state_dict(rank0_only=False)


def test_full_state_dict_keeps_non_tensor_entries() -> None:
    for full in run_distributed(export_with_extra_state, 2):
        assert set(full) == set(WithExtraState().state_dict())
        assert full["_extra_state"] is None
        assert torch.equal(full["inner.blocks.1.up.weight"], TinyTransformer().blocks[1].up.weight.cpu())
