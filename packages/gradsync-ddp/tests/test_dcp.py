"""The DistributedOptimizer through torch.distributed.checkpoint: a checkpoint saved at one DP size loads at
another (4 -> 2, 2 -> 4, and between the sharded and the unsharded optimizer) and training continues as
one process would on the same global batches (<= 1e-6); at the same size, bit-identical, bf16 weights
included (their fp32 main params come from the checkpoint, not from the rounded weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_testkit import (
    TinyGPT,
    flat_params,
    global_batch,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
)
from torch.distributed.tensor import DTensor

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig, destroy_process_groups, initialize_model_parallel
from gradsync.groups.testing import run_distributed

SAVED_AT_STEP, STEPS = 3, 6


def build(
    sharded: bool, seed: int, dtype: torch.dtype
) -> tuple[DistributedDataParallel, DistributedOptimizer]:
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, overlap_grad_reduce=True, bucket_size=600
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), config, TinyGPT(seed).to(dtype))
    return ddp, DistributedOptimizer(make_optimizer("adam", ddp.parameters()), ddp)


def train(ddp: DistributedDataParallel, optimizer: DistributedOptimizer, steps: range) -> None:
    for step in steps:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)
        ddp(batch).backward()
        ddp.finish_grad_sync()
        optimizer.step()


def params(ddp: DistributedDataParallel) -> torch.Tensor:
    if ddp.ddp_config.overlap_param_gather:
        ddp.disable_forward_pre_hook(param_sync=True)
    return flat_params(ddp.module).float()


def save_then_continue(directory: str, sharded: bool, dtype: torch.dtype) -> torch.Tensor:
    ddp, optimizer = build(sharded, 0, dtype)
    train(ddp, optimizer, range(SAVED_AT_STEP))
    state = {"model": ddp.state_dict(), "optim": optimizer.dcp_state_dict()}
    assert (
        any(isinstance(v, DTensor) for e in state["optim"]["state"].values() for v in e.values()) == sharded
    )
    dcp.save(state, checkpoint_id=directory)
    train(ddp, optimizer, range(SAVED_AT_STEP, STEPS))
    return params(ddp)


def load_then_continue(directory: str, sharded: bool, dtype: torch.dtype) -> torch.Tensor:
    ddp, optimizer = build(sharded, 7, dtype)  # other weights and no state: all must come from the checkpoint
    state = {"model": ddp.state_dict(), "optim": optimizer.dcp_state_dict()}
    dcp.load(state, checkpoint_id=directory)
    ddp.load_state_dict(state["model"])
    optimizer.load_dcp_state_dict(state["optim"])
    train(ddp, optimizer, range(SAVED_AT_STEP, STEPS))
    return params(ddp)


def one_process(saved_world: int, loaded_world: int) -> torch.Tensor:
    """The same global batches in one process: the saving run's DP size before the checkpoint, the
    loading run's after."""
    model = TinyGPT()
    opt = make_optimizer("adam", model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        model(global_batch(step, saved_world if step < SAVED_AT_STEP else loaded_world, 1)).backward()
        opt.step()
    return flat_params(model)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((4, True), (2, True)), ((2, True), (4, True)), ((4, True), (2, False)), ((2, False), (4, True))],
    ids=["sharded-4-to-2", "sharded-2-to-4", "sharded-4-to-unsharded-2", "unsharded-2-to-sharded-4"],
)
def test_a_checkpoint_reshards_across_dp_sizes(
    saved: tuple[int, bool], loaded: tuple[int, bool], tmp_path: Path
) -> None:
    directory = str(tmp_path / "ckpt")
    run_distributed(save_then_continue, saved[0], args=(directory, saved[1], torch.float32))
    resumed = run_distributed(load_then_continue, loaded[0], args=(directory, loaded[1], torch.float32))
    want = one_process(saved[0], loaded[0])
    for rank, got in enumerate(resumed):
        assert max_relative_difference(got, want) <= 1e-6, rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sharded", [True, False])
def test_resume_at_the_same_size_is_bit_identical(sharded: bool, dtype: torch.dtype, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(save_then_continue, 2, args=(directory, sharded, dtype))
    resumed = run_distributed(load_then_continue, 2, args=(directory, sharded, dtype))
    for rank, (got, want) in enumerate(zip(resumed, uninterrupted, strict=True)):
        assert torch.equal(got, want), rank


def state_after(directory: str, saving: bool) -> tuple[int, torch.Tensor, dict[str, torch.Tensor] | None]:
    """Save (after one step) or load the optimizer of a DP x TP2 layout whose two TP positions hold
    different models; returns this rank's TP rank, its params and (on DP rank 0) the gathered exp_avg."""
    groups = initialize_model_parallel(2)
    assert groups.tp is not None
    assert groups.dp is not None
    tp_rank = groups.tp.rank()
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=600)
    model = TinyGPT(seed=tp_rank if saving else 100 + tp_rank)
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model, pg_collection=groups)
    optimizer = DistributedOptimizer(make_optimizer("adam", ddp.parameters()), ddp)
    if saving:  # a step, so that the optimizer state differs between the TP positions
        ddp.zero_grad_buffer()
        (batch,) = local_microbatches(0, groups.dp.rank(), groups.dp.size(), 1)
        ddp(batch).backward()
        ddp.finish_grad_sync()
        optimizer.step()
    state = {"optim": optimizer.dcp_state_dict()}
    assert all(key.startswith(f"tp{tp_rank}.") for key in state["optim"]["state"])
    if saving:
        dcp.save(state, checkpoint_id=directory)
    else:
        dcp.load(state, checkpoint_id=directory)
        optimizer.load_dcp_state_dict(state["optim"])
    gathered = optimizer.state_dict()["state"]
    exp_avg = {name: entry["exp_avg"] for name, entry in gathered.items()} if groups.dp.rank() == 0 else None
    result = flat_params(model)
    destroy_process_groups(groups)
    return tp_rank, result, exp_avg


def test_tensor_parallel_positions_keep_their_own_state(tmp_path: Path) -> None:
    """Saved at DP2 x TP2, loaded at DP1 x TP2: each TP position gets its own params and Adam state back."""
    directory = str(tmp_path / "ckpt")
    saved = {
        tp: (p, e) for tp, p, e in run_distributed(state_after, 4, args=(directory, True)) if e is not None
    }
    for tp_rank, params, exp_avg in run_distributed(state_after, 2, args=(directory, False)):
        want_params, want_exp_avg = saved[tp_rank]
        assert torch.equal(params, want_params), tp_rank
        assert exp_avg is not None
        assert exp_avg.keys() == want_exp_avg.keys()
        assert all(torch.equal(exp_avg[k], want_exp_avg[k]) for k in want_exp_avg), tp_rank
    assert not torch.equal(saved[0][0], saved[1][0])
    assert any(not torch.equal(saved[0][1][k], saved[1][1][k]) for k in saved[0][1])
