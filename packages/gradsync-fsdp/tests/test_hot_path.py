"""The per-step hot path: fully_shard_optimizer's step runs on the shards' local tensors (same results,
DTensors back afterwards), reductions into persistent grad buffers are never waited mid-backward, the
NaN check reads the host once per cycle, and (on CUDA) a step has no host-device sync at all; nor has a
step of the fsdp2 API, whose steps read nothing on the host (CPU included)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import STRATEGIES, TinyTransformer, full_weights, local_microbatches, make_optimizer, wrap
from torch.distributed.tensor import DTensor

from gradsync.buffers import collectives
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.fsdp import fsdp2, fully_shard_optimizer
from gradsync.groups.testing import run_distributed, test_device

HOST_READS = ("__bool__", "__float__", "item", "tolist")
"""The tensor methods that read a value on the host (on CUDA: wait for the device)."""


@contextmanager
def host_reads_recorded(events: list[str], names: tuple[str, ...] = HOST_READS) -> Iterator[None]:
    """Each call of one of ``names`` on any tensor appends its name to ``events``: the host reads a CPU
    run can see (sync-debug mode sees CUDA's syncs only)."""
    readers = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name: str) -> Any:
        def read(tensor: torch.Tensor, *args: Any) -> Any:
            events.append(name)
            return readers[name](tensor, *args)

        return read

    for name in readers:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name, reader in readers.items():
            setattr(torch.Tensor, name, reader)


def adam_steps(strategy: str, dtype: torch.dtype, local: bool) -> dict[str, object]:
    """Three AdamW steps, the optimizer wrapped by fully_shard_optimizer (``local``) or stepped on the
    DTensors as a plain optimizer; what the step saw and left behind."""
    main_grads = torch.float32 if dtype == torch.bfloat16 else None
    model = wrap(strategy, dtype=dtype, main_grads_dtype=main_grads)
    # foreach pinned: torch picks foreach kernels only for the exact tensor types it lists (plain CUDA
    # tensors, not a DTensor subclass), and the two kernel families round differently
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    if local:
        fully_shard_optimizer(optimizer)
    seen: list[type] = []
    optimizer.register_step_pre_hook(
        lambda opt, *_: seen.extend(type(p) for g in opt.param_groups for p in g["params"])
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(local_microbatches(step, rank, world, 1)[0]).backward()
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return {
        "weights": full_weights(model),
        "seen_dtensor": any(issubclass(t, DTensor) for t in seen),
        "params_dtensor": all(isinstance(p, DTensor) for p in params),
        "state_keys_are_params": set(map(id, optimizer.state)) <= set(map(id, params)),
        "state_dtensor": all(isinstance(v, DTensor) for v in state if v.dim() > 0),
        "state_tensors": len(state),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_local_step_equals_the_step_on_dtensors(strategy: str, dtype: torch.dtype) -> None:
    plain = run_distributed(adam_steps, 2, args=(strategy, dtype, False))
    local = run_distributed(adam_steps, 2, args=(strategy, dtype, True))
    for rank, (on_dtensors, on_locals) in enumerate(zip(plain, local, strict=True)):
        assert on_dtensors["seen_dtensor"]
        assert not on_locals["seen_dtensor"]
        got, want = on_locals["weights"], on_dtensors["weights"]
        assert isinstance(got, dict)
        assert isinstance(want, dict)
        assert all(torch.equal(got[k], want[k]) for k in want), (strategy, rank)
        for key in ("params_dtensor", "state_keys_are_params", "state_dtensor"):
            assert on_locals[key], key
        assert on_locals["state_tensors"] == on_dtensors["state_tensors"]


def state_created_in_a_local_step() -> list[bool]:
    """State the optimizer creates during a local step (here after the state was dropped) comes back
    as DTensors shaped like the params; an exception inside the step leaves the DTensors in place."""
    model = wrap("optim")
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    model.finish_grad_sync()
    optimizer.state.clear()
    optimizer.step()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stepped = [(p, optimizer.state[p]["momentum_buffer"]) for p in params if p in optimizer.state]
    checks = [bool(stepped), all(isinstance(b, DTensor) and b.shape == p.shape for p, b in stepped)]

    def fail(*_: object) -> None:
        raise RuntimeError("pre-hook failure")

    handle = optimizer.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="pre-hook failure"):
        optimizer.step()
    handle.remove()
    after = [p for g in optimizer.param_groups for p in g["params"]]
    checks.append([id(p) for p in after] == [id(p) for p in params])
    checks.append(all(isinstance(optimizer.state[p]["momentum_buffer"], DTensor) for p in optimizer.state))
    return checks


def test_state_created_during_a_local_step_becomes_dtensors() -> None:
    for checks in run_distributed(state_created_in_a_local_step, 2):
        assert all(checks), checks


def waits_before_the_last_launch(strategy: str) -> int:
    """Reductions waited during the backward before its last reduction was launched, with the in-flight
    bound set to one element."""
    model = wrap(strategy, bucket_size=64)  # several buckets per unit
    model.suggested_RS_queue_capacity = 1
    loss = model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0])
    events: list[str] = []  # from here on: the backward's
    original_wait, launch = collectives.Launched.wait, model._hooks.reductions.launch

    def wait(self: collectives.Launched) -> None:
        events.append("wait")
        original_wait(self)

    def recording_launch(bucket: object) -> None:
        events.append("launch")
        launch(bucket)  # type: ignore[arg-type]

    collectives.Launched.wait = wait  # type: ignore[method-assign]
    model._hooks.reductions.launch = recording_launch  # type: ignore[method-assign]
    try:
        loss.backward()
    finally:
        collectives.Launched.wait = original_wait  # type: ignore[method-assign]
    last_launch = len(events) - events[::-1].index("launch")
    assert events.count("launch") > 2
    return events[:last_launch].count("wait")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_in_flight_bound_applies_to_temporary_grads_only(strategy: str) -> None:
    """no_shard / optim reduce persistent grad buffers: nothing to bound, and a wait would stall the
    backward. ZeRO-2/3's temporary whole-bucket grads stay bounded."""
    for waits in run_distributed(waits_before_the_last_launch, 2, args=(strategy,)):
        if strategy in ("no_shard", "optim"):
            assert waits == 0
        else:
            assert waits > 0


def host_reads_in_a_cycle(strategy: str) -> tuple[int, int]:
    """With the NaN check on, two microbatches: host reads of tensors plus the check's gathers during the
    backwards, and in all once finish_grad_sync returned."""
    model = wrap(strategy, check_for_nan_in_grad=True)
    first, second = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 2)
    events: list[str] = []
    gather = LocalGradNorms.gather

    def counted_gather(self: LocalGradNorms, *args: Any) -> list[list[float]]:
        events.append("gather")
        return gather(self, *args)

    LocalGradNorms.gather = counted_gather  # type: ignore[method-assign]
    try:
        with host_reads_recorded(events):
            with model.no_sync():
                model(first).backward()
            model(second).backward()
            during = len(events)
            model.finish_grad_sync()
    finally:
        LocalGradNorms.gather = gather  # type: ignore[method-assign]
    return during, len(events)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_nan_check_reads_the_host_once_per_cycle(strategy: str) -> None:
    """Device-side norms per bucket: nothing read on the host in the backwards, one gather (whose result
    is read with one .tolist()) at finish_grad_sync, beside the step ballot's read of its CPU count."""
    for during, total in run_distributed(host_reads_in_a_cycle, 2, args=(strategy,)):
        assert during == 0
        assert total == 3  # the gather and its .tolist(); the step's vote count (a CPU tensor even on CUDA)


def step_under_sync_debug(strategy: str) -> None:
    """One training step with every host-device sync an error (finish_grad_sync's NaN check is off: its
    one read per step is by design)."""
    model = wrap(strategy)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    for _ in range(2):  # the first step allocates and warms up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            optimizer.zero_grad()
            model(batch).backward()
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device syncs exist on CUDA only")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_training_step_has_no_host_sync_on_cuda(strategy: str) -> None:
    run_distributed(step_under_sync_debug, 1, args=(strategy,))


def fsdp2_steps_reading_the_host(reshard: bool) -> list[str]:
    """torchtitan's loop over the fsdp2 API (``fully_shard`` on each block, then on the root, torch's own
    optimizer on the DTensors, ``optimizer.zero_grad()``): the host reads of the steps after the first,
    with every host-device sync an error as well on CUDA. The batches are drawn before, outside the
    checked region (moving them to the GPU is a sync of the test's own)."""
    model = TinyTransformer()
    for block in model.blocks:
        fsdp2.fully_shard(block, reshard_after_forward=reshard)
    fsdp2.fully_shard(model)
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [local_microbatches(step, rank, world, 1)[0] for step in range(3)]
    on_cuda = test_device().type == "cuda"
    reads: list[str] = []
    for step, batch in enumerate(batches):  # the first step allocates and warms up
        checked: list[str] = reads if step else []
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            with host_reads_recorded(checked, (*HOST_READS, "__int__")):
                model(batch).backward()  # the forward after a step starts the next cycle
                optimizer.step()
                optimizer.zero_grad()
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
    return reads


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_an_fsdp2_training_step_reads_nothing_on_the_host(reshard: bool) -> None:
    """As MegatronFSDP's steps: the new cycle's start after ``optimizer.step()`` (grads zeroed as torch's
    ``zero_grad()`` does, set to None) is seen on the host, not read from the device. One rank on CUDA,
    as above (on one GPU, two ranks would share it over gloo, whose CUDA collectives stage through the
    host)."""
    world = 1 if test_device().type == "cuda" else 2
    vote = ["tolist"] * 2 if world > 1 else []  # two steps' ballot counts: CPU tensors, no device wait
    for reads in run_distributed(fsdp2_steps_reading_the_host, world, args=(reshard,)):
        assert reads == vote


def recorded_collectives(strategy: str) -> list[tuple[str, int, int]]:
    """The buckets' CommStats after one step's backward and the next forward: (op, bytes, expected)."""
    model = wrap(strategy)
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer.zero_grad()
    model(local_microbatches(0, rank, world, 1)[0]).backward()
    optimizer.step()
    model(local_microbatches(1, rank, world, 1)[0])  # the forward gathers the update (ZeRO-1/2/3)
    return [
        (record.op, record.bytes, bucket.layout.size * 4)
        for bucket in model.buckets
        for record in bucket.stats.records
    ]


@pytest.mark.parametrize(
    ("strategy", "ops"),
    [
        ("no_shard", {"all_reduce"}),
        ("optim", {"reduce_scatter", "all_gather"}),
        ("optim_grads_params", {"reduce_scatter", "all_gather"}),
    ],
)
def test_buckets_account_bytes_in_comm_stats(strategy: str, ops: set[str]) -> None:
    """One byte accounting for both wrappers (gradsync-buffers' CommStats): every collective of a bucket
    is recorded with its op and its payload, the whole fp32 bucket; zero_grad_buffer starts a new step."""
    for records in run_distributed(recorded_collectives, 2, args=(strategy,)):
        assert {op for op, _, _ in records} == ops
        assert all(sent == whole for _, sent, whole in records)
