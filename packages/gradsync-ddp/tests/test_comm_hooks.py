"""torch DDP's comm hooks on gradsync's DistributedDataParallel, 2 gloo ranks with different data: torch's
own ``allreduce_hook`` trains exactly as one process; ``bf16_compress_hook`` stays near it; torch's
``powerSGD_hook`` (rank-2 matrices, error feedback, warm start) starts as plain all-reduce, then sends a
fraction of the bytes, keeps the replicas identical and trains as well as the plain all-reduce; refusals name the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import Trainer, flat_params, local_microbatches, max_relative_difference, reference_training
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from gradsync.buffers import DistributedDataParallelConfig, LowPrecisionHookState, low_precision_hook
from gradsync.buffers.testing import issued_collectives
from gradsync.groups.testing import run_distributed

STEPS, BUCKET_SIZE = 6, 600


def train_with_hook(
    kind: str, overlap: bool, optimizer: str = "adam", **fields: Any
) -> tuple[torch.Tensor, list[int], list[float]]:
    """The params after training, the bytes each step handed to torch.distributed, each step's loss
    (``fields``: more config fields)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=BUCKET_SIZE, **fields)
    trainer = Trainer.build(config, optimizer)
    state: Any = None
    hook: Any = {"allreduce": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook}.get(
        kind
    )
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1.5
        )
        hook = powerSGD_hook.powerSGD_hook
    if kind.startswith("wire-"):
        dtype = torch.bfloat16 if kind == "wire-bf16" else torch.float8_e4m3fn
        state, hook = (
            LowPrecisionHookState(None, dtype, error_feedback=kind == "wire-fp8-ef"),
            low_precision_hook,
        )
    if hook is not None:
        trainer.ddp.register_comm_hook(state, hook)
    sent, losses = [], []
    for step in range(STEPS):
        with issued_collectives() as seen:
            trainer.ddp.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            loss = trainer.ddp(local_microbatches(step, rank, world, 1)[0])
            loss.backward()
            trainer.ddp.finish_grad_sync()
            trainer.optimizer.step()
        sent.append(sum(c.nbytes for c in seen))
        losses.append(float(loss))
        params = flat_params(trainer.model)
        replicas = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(replicas, params)
        assert all(torch.equal(r, params) for r in replicas), f"replicas differ after step {step}"
    return flat_params(trainer.model), sent, losses


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_torchs_allreduce_hook_trains_as_one_process(overlap: bool) -> None:
    reference = reference_training("sgd", 2, 1, STEPS)  # plain SGD: a grad off by a factor shows
    for params, _, _ in run_distributed(train_with_hook, 2, args=("allreduce", overlap, "sgd")):
        assert max_relative_difference(params, reference) <= 1e-6


def test_torchs_bf16_compress_hook_stays_near_one_process() -> None:
    reference = reference_training("adam", 2, 1, STEPS)
    for params, _, _ in run_distributed(train_with_hook, 2, args=("bf16", True)):
        assert 1e-6 < max_relative_difference(params, reference) <= 1e-3


def test_torchs_powersgd_hook_compresses_after_its_start_iteration() -> None:
    plain = run_distributed(train_with_hook, 2, args=("none", True))
    compressed = run_distributed(train_with_hook, 2, args=("powersgd", True))
    for (exact, exact_sent, exact_losses), (params, sent, losses) in zip(plain, compressed, strict=True):
        assert sent[0] == exact_sent[0]  # before start_powerSGD_iter: plain all-reduce
        assert max(sent[2:]) < 0.5 * exact_sent[2]  # then rank-2 factors instead of whole matrices
        assert losses[:2] == exact_losses[:2]
        assert abs(losses[-1] - exact_losses[-1]) <= 0.01 * exact_losses[-1]  # it trains as well
        assert max_relative_difference(params, exact) > 1e-4  # and it is not the plain all-reduce


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["wire-bf16", "wire-fp8-ef"])
def test_the_low_precision_hook_lands_the_config_wires_bits(kind: str, world: int) -> None:
    wire = torch.bfloat16 if kind == "wire-bf16" else torch.float8_e4m3fn
    fields = {"grad_comm_dtype": wire, "grad_comm_error_feedback": kind == "wire-fp8-ef"}
    by_config = run_distributed(train_with_hook, world, args=("none", True), kwargs=fields)
    by_hook = run_distributed(train_with_hook, world, args=(kind, True))
    reference = reference_training("adam", world, 1, STEPS)
    for (want, _, _), (got, _, _) in zip(by_config, by_hook, strict=True):
        assert max_relative_difference(want, reference) > 1e-6  # the wire is really low-precision
        assert torch.equal(got, want)


def refusals() -> list[str]:
    messages = []
    for config, hook in [
        (DistributedDataParallelConfig(use_distributed_optimizer=True), default_hooks.allreduce_hook),
        (DistributedDataParallelConfig(grad_comm_dtype=torch.bfloat16), default_hooks.allreduce_hook),
    ]:
        trainer = Trainer.build(config, "sgd")
        with pytest.raises((NotImplementedError, ValueError)) as caught:
            trainer.ddp.register_comm_hook(None, hook)
        messages.append(str(caught.value))
    trainer = Trainer.build(DistributedDataParallelConfig(), "sgd")
    trainer.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="can only be called once"):
        trainer.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return messages


def test_hooks_are_refused_where_they_cannot_work() -> None:
    for distopt, wire in run_distributed(refusals, 2):
        assert "use_distributed_optimizer=True reduce-scatters them" in distopt
        assert "grad_comm_dtype already sets how buckets are reduced" in wire
