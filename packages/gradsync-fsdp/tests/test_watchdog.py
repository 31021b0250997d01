"""The hang watchdog joins MegatronFSDP through the same collectives: under ZeRO-3, one rank that skips its
backward leaves the other waiting in a gather or reduction, and the report names it and the FSDP bucket."""

from __future__ import annotations

import contextlib
import re
import time

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import Block, TinyTransformer, local_microbatches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from gradsync.buffers import (
    CollectiveHangError,
    DistributedDataParallelConfig,
    HangWatchdog,
    collectives,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from gradsync.fsdp import MegatronFSDP, fsdp2
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed, test_device

THRESHOLD = 2.0


def watched_model(strategy: str, threshold: float = THRESHOLD) -> tuple[MegatronFSDP, HangWatchdog]:
    """A MegatronFSDP over a group of its own (a hanging collective must not block the harness's barrier)
    and a running watchdog that has seen every rank's progress."""
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    model = MegatronFSDP(
        TinyTransformer(),
        FSDPDistributedIndex.from_group(dist.new_group(), device_type=test_device().type),
        config,
        fsdp_unit_modules=[Block],
    )
    return model, watching(model, threshold)


def watched_fsdp2_model() -> tuple[nn.Module, HangWatchdog]:
    """A TinyTransformer sharded by the FSDP2-style API (a unit per block) over a mesh of its own, and a
    running watchdog."""
    model = TinyTransformer()
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model, watching(fsdp2.megatron_fsdp_of(model), THRESHOLD)


def watching(model: MegatronFSDP, threshold: float) -> HangWatchdog:
    guard = start_hang_watchdog(threshold, models=[model])
    time.sleep(3 * guard.interval_s)
    return guard


def report_seen(guard: HangWatchdog) -> str:
    """The hang the watchdog published, once it has (this rank waits in no collective), then stop it."""
    deadline = time.monotonic() + THRESHOLD + 20
    while guard.hang is None and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_hang_watchdog()
    return guard.hang or ""


def skipped_backward() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, guard = watched_model("optim_grads_params")
    (batch,) = local_microbatches(0, rank, world, 1)
    loss = model(batch)
    if rank == 1:
        return report_seen(guard)
    try:
        loss.backward()
        model.finish_grad_sync()
    except CollectiveHangError as error:
        stop_hang_watchdog()
        return str(error)
    raise AssertionError("rank 0 finished a step rank 1 never took part in")


def test_a_skipped_backward_is_named_with_its_fsdp_bucket() -> None:
    report, seen = run_distributed(skipped_backward, 2, reuse=False, timeout=90)
    assert "Culprit rank(s) [1]" in report
    assert "fsdp.bucket" in report
    assert seen == report


def healthy_steps(strategy: str, path: collectives.ReduceScatterPath | None) -> tuple[str, float]:
    """Two ordinary steps with the watchdog on: no rank hangs, so nothing may be reported (gloo's native
    reduce-scatter work never reports itself complete; a wait that polled it was declared hung). ``path``:
    the reduce-scatter path to take (None: the backend's choice; gloo's CPU tensors go through an
    all-to-all)."""
    chosen = collectives.reduce_scatter_path

    def forced(group: dist.ProcessGroup, device: torch.device) -> collectives.ReduceScatterPath:
        return chosen(group, device) if path is None else path

    collectives.reduce_scatter_path = forced
    try:
        return _healthy_steps(strategy)
    finally:
        collectives.reduce_scatter_path = chosen


def _healthy_steps(strategy: str) -> tuple[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = watched_model(strategy, threshold=1.0)
    started = time.monotonic()
    try:
        for step in range(2):
            model.zero_grad_buffer()
            (batch,) = local_microbatches(step, rank, world, 1)
            model(batch).backward()
            model.finish_grad_sync()
            model.install_optimized_model_weights()
    except CollectiveHangError as error:
        return str(error), time.monotonic() - started
    finally:
        stop_hang_watchdog()
    return "", time.monotonic() - started


@pytest.mark.parametrize("path", [None, "native"])
def test_healthy_steps_raise_nothing(path: collectives.ReduceScatterPath | None) -> None:
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        for report, _ in run_distributed(healthy_steps, 2, args=(strategy, path), reuse=False, timeout=90):
            assert report == "", report


def uneven_accumulation(strategy: str) -> str:
    """Rank 0 accumulates three microbatches, rank 1 two (all but the last under no_sync(), or through the
    FSDP2-style API with gradient sync off). Under ZeRO-2 and ZeRO-3 each microbatch communicates, so rank 0's third one waits for a rank that went on to
    finish_grad_sync(), whose vote waits for rank 0. No rank can know before: only a collective per
    microbatch would tell the others how many are left. What each rank raised, or its reduced grads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = watched_fsdp2_model()[0] if strategy == "fsdp2" else watched_model(strategy)[0]
    micro = 3 - rank
    try:
        for index, batch in enumerate(local_microbatches(0, rank, world, micro)):
            if isinstance(model, MegatronFSDP):
                with model.no_sync() if index < micro - 1 else contextlib.nullcontext():
                    (model(batch) / micro).backward()
            else:  # a torch-style loop: the last backward syncs
                model.set_requires_gradient_sync(index == micro - 1)  # type: ignore[operator]
                (model(batch) / micro).backward()
        if isinstance(model, MegatronFSDP):
            model.finish_grad_sync()
    except CollectiveHangError as error:
        return str(error)
    finally:
        stop_hang_watchdog()
    if strategy != "no_shard":  # ZeRO-1 reduces each rank's own rows only
        return "finished"
    return repr([bucket.grad.sum().item() for bucket in model.buckets if bucket.grad is not None])


def names_the_hang(report: str, waiting: int, missing: int, its_wait: str) -> bool:
    """Whether ``report`` is rank ``waiting``'s diagnosis: it waits for rank ``missing``, itself waiting in
    ``its_wait``."""
    return (
        f"rank {waiting} has waited" in report
        and f"Culprit rank(s) [{missing}]" in report
        and f"Rank {missing} is itself waiting in collective #" in report
        and its_wait in report.split("is itself waiting")[1]
    )


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params", "fsdp2"])
def test_uneven_accumulation_names_both_ranks_and_what_they_wait_in(strategy: str) -> None:
    """The hang is named on both ranks, each waiting for the other: rank 0 still accumulating, in a
    reduction, and rank 1 in the step's vote (the vote's wait is watched as the data collectives' are, so
    that rank raises too). Whichever rank's wait passes the threshold first publishes its diagnosis, and a
    rank whose own wait has not passed it yet raises that one (on a loaded machine, rank 1's vote can
    start a heartbeat round or more before rank 0's reduction), so each rank raises one of the two."""
    reports = run_distributed(uneven_accumulation, 2, args=(strategy,), reuse=False, timeout=90)
    diagnoses = ((0, 1, "step_ballot.vote"), (1, 0, "fsdp.bucket"))
    for report in reports:
        assert any(names_the_hang(report, *diagnosis) for diagnosis in diagnoses), report


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_uneven_accumulation_without_a_collective_per_microbatch_syncs_once(strategy: str) -> None:
    """no_shard and ZeRO-1 communicate once per cycle: each rank's grads, weighed as its loss scaling
    says, are reduced together (as under torch DDP's no_sync()); no_shard's replicas hold the same grads."""
    more, fewer = run_distributed(uneven_accumulation, 2, args=(strategy,), reuse=False, timeout=90)
    assert not more.startswith("gradsync hang watchdog"), more
    assert more == fewer


def collective_called_on_rank_zero(call: str) -> str:
    """Rank 0 alone calls a collective API (``full_state_dict()``, or an evaluation forward under ZeRO-3,
    MegatronFSDP's or the FSDP2-style API's); rank 1 waits for the watchdog's report. What rank 0 raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, guard = (
        watched_fsdp2_model() if call == "fsdp2_eval_forward" else watched_model("optim_grads_params")
    )
    if rank == 1:
        report_seen(guard)
        return ""
    try:
        if call == "full_state_dict":
            model.full_state_dict()  # type: ignore[operator]
        else:
            model.eval()
            with torch.no_grad():
                model(local_microbatches(0, rank, world, 1)[0])
    except CollectiveHangError as error:
        return str(error)
    finally:
        stop_hang_watchdog()
    raise AssertionError(f"{call} on rank 0 alone returned")


@pytest.mark.parametrize("call", ["full_state_dict", "eval_forward", "fsdp2_eval_forward"])
def test_a_collective_api_called_on_one_rank_names_the_gather_and_the_missing_rank(call: str) -> None:
    report, _ = run_distributed(collective_called_on_rank_zero, 2, args=(call,), reuse=False, timeout=90)
    assert re.search(r"in collective #\d+ \(fsdp\.bucket\d+ all_gather\)", report), report
    assert "Culprit rank(s) [1]: they have not launched it" in report, report
