"""gradsync-buffers' matrix optimizers on MegatronFSDP's shards: with the shard-alignment policy each
needs (``tensor`` for Muon, ``block:RxC`` for BlockShampoo), every rank steps what it holds, through
``fully_shard_optimizer`` (which lends the optimizer local tensors), and 20 steps equal one process with
the same optimizer for every strategy at 2 ranks, ZeRO-3 at 4 and HSDP / HFSDP 2 x 2; checkpoints of
their state reshard across DP sizes through DCP; a Muon matrix cut by the default ``row`` policy is
refused by name."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import (
    STRATEGIES,
    TinyTransformer,
    full_weights,
    global_batch,
    local_microbatches,
    max_relative_difference,
    named_weights,
    wrap,
)
from torch import nn

from gradsync.buffers import BlockShampoo, Muon, muon_param_groups
from gradsync.fsdp import fully_shard_optimizer
from gradsync.groups.testing import RankFailure, run_distributed

POLICIES = {"muon": {"*": "tensor"}, "shampoo": {"*": "block:4x3"}}
STEPS = 20
ROWS_PER_STEP = 4  # microbatches per step x world: the same global batches at 2 and 4 ranks


def make_optimizer(name: str, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    # eps well above fp32 rounding noise, whose summation order differs between the runs compared
    if name == "muon":
        return Muon(muon_param_groups(named), lr=0.02, weight_decay=0.1, adamw_eps=1e-4)
    return BlockShampoo([p for _, p in named], lr=0.01, block_size=(4, 3), eps=1e-2, grafting_eps=1e-4)


def build(name: str, strategy: str, alignment: Any, **hybrid: Any) -> tuple[Any, torch.optim.Optimizer]:
    model = wrap(strategy, shard_alignment=alignment, **hybrid)
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
    return model, fully_shard_optimizer(make_optimizer(name, named))


def run_steps(model: Any, optimizer: torch.optim.Optimizer, steps: range, micro: int = 1) -> None:
    for step in steps:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for batch in local_microbatches(step, dist.get_rank(), dist.get_world_size(), micro):
            (model(batch) / micro).backward()
        optimizer.step()


def train(name: str, strategy: str, alignment: Any, steps: int, **hybrid: Any) -> dict[str, torch.Tensor]:
    model, optimizer = build(name, strategy, alignment, **hybrid)
    run_steps(model, optimizer, range(steps))
    return full_weights(model)


def reference(name: str, world: int, steps: int) -> dict[str, torch.Tensor]:
    model = TinyTransformer()
    optimizer = make_optimizer(name, list(model.named_parameters()))
    for step in range(steps):
        optimizer.zero_grad()
        model(global_batch(step, world, 1)).backward()
        optimizer.step()
    return named_weights(model)


@functools.lru_cache(maxsize=4)
def cached_reference(name: str, world: int) -> dict[str, torch.Tensor]:
    return reference(name, world, STEPS)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["muon", "shampoo"])
def test_matrix_optimizers_train_like_one_process(name: str, strategy: str) -> None:
    want = cached_reference(name, 2)
    for rank, got in enumerate(run_distributed(train, 2, args=(name, strategy, POLICIES[name], STEPS))):
        assert max_relative_difference(got, want) <= 1e-5, rank


@pytest.mark.parametrize("hybrid", [{}, {"outer": 2}, {"outer": 2, "outer_dp_sharding_strategy": "optim"}])
@pytest.mark.parametrize("name", ["muon", "shampoo"])
def test_four_ranks_and_hybrid_sharding(name: str, hybrid: dict[str, Any]) -> None:
    want = cached_reference(name, 4)
    results = run_distributed(
        train, 4, args=(name, "optim_grads_params", POLICIES[name], STEPS), kwargs=hybrid
    )
    for rank, got in enumerate(results):
        assert max_relative_difference(got, want) <= 1e-5, rank


def save_then_continue(name: str, directory: str) -> dict[str, torch.Tensor]:
    model, optimizer = build(name, "optim_grads_params", POLICIES[name])
    micro = ROWS_PER_STEP // dist.get_world_size()
    run_steps(model, optimizer, range(6), micro)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=directory)
    run_steps(model, optimizer, range(6, 9), micro)
    return full_weights(model)


def load_then_continue(name: str, directory: str) -> dict[str, torch.Tensor]:
    model, optimizer = build(name, "optim_grads_params", POLICIES[name])
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    run_steps(model, optimizer, range(6, 9), ROWS_PER_STEP // dist.get_world_size())
    return full_weights(model)


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 4), (4, 2)])
@pytest.mark.parametrize("name", ["muon", "shampoo"])
def test_checkpoints_reshard_across_dp_sizes(
    name: str, saved_at: int, loaded_at: int, tmp_path: Path
) -> None:
    """Each rank owns other whole matrices (other tiles) at the other size: the momentum, Adam and
    Shampoo statistics must land with them. The batches are the same global batches at both sizes."""
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(save_then_continue, saved_at, args=(name, directory))[0]
    for rank, got in enumerate(run_distributed(load_then_continue, loaded_at, args=(name, directory))):
        assert max_relative_difference(got, uninterrupted) <= 1e-5, rank


def test_muon_refuses_a_matrix_cut_into_rows() -> None:
    with pytest.raises(RankFailure, match=r"Muon: param \d+ of shape .* shard_alignment='tensor'"):
        run_distributed(train, 2, args=("muon", "optim_grads_params", None, 1), reuse=False)


def refusal_on_every_rank() -> str:
    """ZeRO-3 at 4 ranks with the default ``row`` policy: some ranks hold rows of a matrix, others none.
    Every rank must refuse alike, from the policy (a check of the local part alone would let the ranks
    holding nothing go on into the next gather and wait there for ranks that raised)."""
    try:
        model, optimizer = build("muon", "optim_grads_params", None)
        (batch,) = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)
        model(batch).backward()
        optimizer.step()
    except ValueError as error:
        return str(error)
    return "stepped"


def test_a_policy_that_cuts_matrices_is_refused_on_every_rank() -> None:
    for message in run_distributed(refusal_on_every_rank, 4, timeout=60):
        assert "sharded with shard_alignment 'row', which may cut it" in message
