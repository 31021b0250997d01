"""torch DDP's comm hooks on gradsync's DistributedDataParallel, 2 gloo ranks with different data: torch's
own ``allreduce_hook`` trains exactly as one process; ``bf16_compress_hook`` stays near it; torch's
``powerSGD_hook`` (rank-2 matrices, error feedback, warm start) starts as plain all-reduce, then sends a
fraction of the bytes, keeps the replicas identical and trains as well as the plain all-reduce; refusals name the reason."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import (
    TinyGPT,
    Trainer,
    flat_params,
    local_microbatches,
    max_relative_difference,
    reference_training,
)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from gradsync.buffers import DistributedDataParallelConfig, LowPrecisionHookState, low_precision_hook
from gradsync.buffers.testing import issued_collectives
from gradsync.ddp import DistributedDataParallel
from gradsync.groups import ModelParallelConfig, ProcessGroupCollection
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


def grads_through_a_compress_wrapper(wrapper_name: str) -> list[float]:
    """torch's ``*_compress_wrapper`` swaps in a cast copy of the buffer (``set_buffer``) and averages
    that: world 2, ``Linear(4, 1)`` fed ``rank + 1``, so the local grads are ``rank + 1`` and the mean 1.5."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True), model
    )
    wrapper = getattr(default_hooks, wrapper_name)
    ddp.register_comm_hook(None, wrapper(default_hooks.allreduce_hook))
    ddp(torch.full((1, 4), rank + 1.0)).sum().backward()
    ddp.finish_grad_sync()
    return model.weight.grad.view(-1).tolist()  # type: ignore[union-attr]


@pytest.mark.parametrize("wrapper_name", ["bf16_compress_wrapper", "fp16_compress_wrapper"])
def test_torchs_compress_wrappers_land_the_mean_in_the_bucket(wrapper_name: str) -> None:
    for grads in run_distributed(grads_through_a_compress_wrapper, 2, args=(wrapper_name,)):
        assert grads == [1.5] * 4  # as torch DDP gives; each rank's own grad would be 1 or 2


def chained_hook(done: list[bool]) -> Any:
    """A hook that chains a second all-reduce from its future's callback, slowed on rank 1, as PowerSGD
    chains P's and Q's: the bucket ends as the mean."""

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size())
        first = dist.all_reduce(buffer, async_op=True).get_future()

        def second(_: Any) -> torch.Tensor:
            time.sleep(0.3 * dist.get_rank())
            copy = buffer.clone()
            dist.all_reduce(copy, async_op=True).get_future().wait()
            done.append(True)
            return copy / dist.get_world_size()  # the mean again: the mean of equal values

        return first.then(second)

    return hook


def a_user_collective_right_after_backward() -> tuple[bool, float, list[float]]:
    """Whether the hook's chain had finished when backward returned, a loss all-reduced right after it
    (as a training loop logs one), and the synced grads."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True), model
    )
    done: list[bool] = []
    ddp.register_comm_hook(None, chained_hook(done))
    for step in range(2):  # the first iteration reduces in finish_grad_sync: it learns when grads come
        ddp.zero_grad_buffer()
        done.clear()
        loss = ddp(torch.full((1, 4), rank + 1.0)).sum()
        loss.backward()
        finished = bool(done)
        while step == 1 and not done:  # had backward not waited: let the chain end, to fail, not hang
            time.sleep(0.01)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        ddp.finish_grad_sync()
    return finished, float(logged), model.weight.grad.view(-1).tolist()  # type: ignore[union-attr]


def test_a_hooks_chained_collectives_end_with_backward() -> None:
    """torch DDP's backward waits for its hook's future; so does gradsync's cycle, so a user collective
    may follow backward at once (before finish_grad_sync)."""
    results = run_distributed(a_user_collective_right_after_backward, 2)
    for finished, logged, grads in results:
        assert finished
        assert grads == [1.5] * 4
        assert logged == results[0][1]


def lowp_hook_on_torch_ddp(matrices_a_bucket: int | None) -> tuple[float, float, int]:
    """gradsync's ``low_precision_hook`` with fp8 error feedback on torch's own DDP over four equal
    matrices. torch first buckets them in registration order, then rebuilds its buckets in the order grads
    came (the reverse): with one bucket, index 0 then holds the same number of values, reordered (a
    residual kept by index would land on other elements without any error); with two matrices a bucket,
    two buckets whose hooks chain collectives. The weights never step, so
    each step's local grads come from a plain copy of the model. Returns how far the summed applied grads
    are from the summed exact means, how far that is from the mean of the ranks' last residuals (the
    residuals follow their params), and how many indexes came with other params than before."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(8, 8, bias=False), nn.Tanh())))
    plain = copy.deepcopy(model)
    cap = None if matrices_a_bucket is None else matrices_a_bucket * 64 * 4 / 2**20
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    state = LowPrecisionHookState(None, torch.float8_e4m3fn, error_feedback=True)
    layouts: set[tuple[int, tuple[int, ...]]] = set()

    def recording(state, bucket):  # type: ignore[no-untyped-def]  # torch refuses a string annotation
        layouts.add((bucket.index(), tuple(id(p) for p in bucket.parameters())))
        return low_precision_hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    # torch accepts the hook itself (it refuses any bucket annotation but dist.GradBucket)
    nn.parallel.DistributedDataParallel(copy.deepcopy(plain)).register_comm_hook(state, low_precision_hook)
    applied = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for step in range(8):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank)) * (rank + 1)
        ddp.zero_grad()
        ddp(batch).pow(2).sum().backward()
        plain.zero_grad()
        plain(batch).pow(2).sum().backward()
        for total, want, param, local in zip(
            applied, exact, model.parameters(), plain.parameters(), strict=True
        ):
            total.add_(param.grad.double())  # type: ignore[union-attr]
            gathered = [torch.empty_like(local.grad) for _ in range(world)]  # type: ignore[arg-type]
            dist.all_gather(gathered, local.grad)  # type: ignore[arg-type]
            want.add_(torch.stack(gathered).double().mean(dim=0))
    assert state.residuals is not None
    error = unexplained = 0.0
    for total, want, param in zip(applied, exact, model.parameters(), strict=True):
        residual = state.residuals.of_param(param).double().view_as(param)
        dist.all_reduce(residual)
        error = max(error, float((total - want).abs().max()))
        unexplained = max(unexplained, float((total - want + residual / world).abs().max()))
    return error, unexplained, len(layouts) - len({index for index, _ in layouts})


@pytest.mark.parametrize("matrices_a_bucket", [None, 2], ids=["one-bucket", "two-buckets"])
def test_the_low_precision_hook_on_torchs_ddp_keeps_residuals_through_its_bucket_rebuild(
    matrices_a_bucket: int | None,
) -> None:
    for error, unexplained, changed in run_distributed(lowp_hook_on_torch_ddp, 2, args=(matrices_a_bucket,)):
        assert changed > 0  # torch rebuilt its buckets: other params under the same indexes
        assert error > 1e-3  # fp8 does round
        assert unexplained <= 1e-4 * error  # the residuals account for all of it, each on its own param


def refused_hooks() -> list[str]:
    """Registrations torch refuses, and a state that names no group where the data-parallel group is
    smaller than the world (each rank its own replica here)."""
    messages = []
    trainer = Trainer.build(DistributedDataParallelConfig(), "sgd")
    with pytest.raises(TypeError) as caught:
        trainer.ddp.register_comm_hook(None, "allreduce")  # type: ignore[arg-type]
    messages.append(str(caught.value))
    for dtype, block in [(torch.int8, 32), (torch.bfloat16, 0)]:
        with pytest.raises(ValueError, match="LowPrecisionHookState: ") as caught_value:
            LowPrecisionHookState(None, dtype, block_size=block)
        messages.append(str(caught_value.value))
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(), TinyGPT(),
        pg_collection=ProcessGroupCollection(dp=own, dp_cp=own),
    )  # fmt: skip
    for state in (None, powerSGD_hook.PowerSGDState(process_group=None)):
        with pytest.raises(ValueError, match="names no process group") as caught_value:
            ddp.register_comm_hook(state, default_hooks.allreduce_hook)
        messages.append(str(caught_value.value))
    ddp.register_comm_hook(own, default_hooks.allreduce_hook)  # naming the group is accepted
    return messages


def test_hooks_torch_refuses_and_states_that_name_no_group_are_refused() -> None:
    for messages in run_distributed(refused_hooks, 2):
        callable_, int8, block, *world = messages
        assert "the hook must be callable, got str" in callable_
        assert "dtype=torch.int8 is not a wire dtype" in int8
        assert "block_size must be a positive number of elements, got 0" in block
        assert all("would reduce over all 2 ranks, but the data-parallel group holds 1" in m for m in world)
