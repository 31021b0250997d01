"""The gather lane (:mod:`gradsync.fsdp.collectives`): param all-gathers on a group of their own over the shard
group's ranks, grad reductions on the shard group.

What one group means on gloo (ProcessGroupGloo, measured with torch 2.13): a group's collectives pair up
across ranks by their issue order in that group, and run from one FIFO queue served by two worker
threads, so a gather issued after two reductions in flight starts only once one of them has ended. With
every rank issuing in the same order that is a delay, not a deadlock, and how long depends on the
machine; what one group cannot do at all is complete a gather while reductions launched before it are
still held back by a rank that has not launched them: the test below hangs without the lane (its
gather times out), and passes with it. The other tests: which group every collective takes, for every
strategy that gathers and for HFSDP; training the same, bit for bit, with and without the lane, and as
one process.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    Block,
    TinyTransformer,
    Trainer,
    full_weights,
    max_relative_difference,
    reference_training,
    wrap,
)

from gradsync.buffers import (
    CollectiveHangError,
    DistributedDataParallelConfig,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from gradsync.buffers.collectives import Launched
from gradsync.buffers.testing import issued_collectives
from gradsync.fsdp import MegatronFSDP
from gradsync.fsdp.bucket import FlatParamBucket, GradReduction
from gradsync.fsdp.collectives import LANE_DESC
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed, test_device

GATHERS = {"all_gather", "broadcast"}  # a gather on gloo is one broadcast per shard
GATHERING = [("optim", 1), ("optim_grads", 1), ("optim_grads_params", 1), ("optim_grads_params", 2)]
"""(strategy, outer replicas): outer 2 is HFSDP (outer ``optim``) on 4 ranks."""


def hybrid(outer: int) -> dict[str, Any]:
    return {"outer": outer, "outer_dp_sharding_strategy": "optim"} if outer > 1 else {}


def groups_taken(strategy: str, outer: int) -> dict[str, object]:
    """Two steps of two microbatches and a gather of the whole model: the group each collective took."""
    trainer = Trainer.build(strategy, **hybrid(outer))
    model = trainer.model
    shard, lane = model.dist_index.get_fsdp_group(), model.gather_group
    outer_group = model.dist_index.get_outer_fsdp_group()
    with issued_collectives() as seen:
        for step in range(2):
            trainer.step(step, 2)
        full_weights(model)
    inner = [c for c in seen if c.group is not outer_group]
    gathers = [c.group for c in inner if c.kind in GATHERS]
    reductions = [c.group for c in inner if c.kind not in GATHERS]
    return {
        "lane_is_shard_group": lane is shard,
        "lane_desc": lane.group_desc,
        "lane_ranks": dist.get_process_group_ranks(lane),
        "shard_ranks": dist.get_process_group_ranks(shard),
        "gathers": len(gathers),
        "gathers_elsewhere": sum(g is not lane for g in gathers),
        "reductions": len(reductions),
        "reductions_elsewhere": sum(g is not shard for g in reductions),
        "outer_gathers": sum(c.kind in GATHERS for c in seen if c.group is outer_group),
        "outer_reductions": sum(c.kind not in GATHERS for c in seen if c.group is outer_group),
        "reused": wrap(strategy, **hybrid(outer)).gather_group is lane,
    }


@pytest.mark.parametrize(("strategy", "outer"), GATHERING)
def test_gathers_take_the_lane_and_reductions_the_shard_group(strategy: str, outer: int) -> None:
    for rank, taken in enumerate(run_distributed(groups_taken, 2 * outer, args=(strategy, outer))):
        assert not taken["lane_is_shard_group"], rank
        assert taken["lane_desc"] == LANE_DESC
        assert taken["lane_ranks"] == taken["shard_ranks"]
        assert taken["gathers"], taken
        assert not taken["gathers_elsewhere"], taken
        assert taken["reductions"], taken
        assert not taken["reductions_elsewhere"], taken
        assert bool(taken["outer_gathers"]) == (outer > 1), taken  # HFSDP's outer stage: its own group
        assert bool(taken["outer_reductions"]) == (outer > 1), taken
        assert taken["reused"], "a second wrap over the same shard group built another lane"


def lanes_not_built() -> list[bool]:
    """no_shard gathers nothing, and ``gather_lane=False`` asks for no lane: both keep the shard group."""
    no_shard, switched_off = wrap("no_shard"), wrap("optim", gather_lane=False)
    return [
        no_shard.gather_group is no_shard.dist_index.get_fsdp_group(),
        switched_off.gather_group is switched_off.dist_index.get_fsdp_group(),
    ]


def test_no_lane_without_gathers_or_when_switched_off() -> None:
    for checks in run_distributed(lanes_not_built, 2):
        assert all(checks), checks


class Completions:
    """Waits each collective's works on a thread of its own and records the order they complete in
    (polling cannot tell: gloo's reduce-scatter work never reports ``is_completed()``)."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.threads: dict[str, threading.Thread] = {}

    def watch(self, name: str, launched: Launched) -> None:
        def wait() -> None:
            for work in launched.works:
                if work is not None:
                    work.wait()
            self.order.append(name)

        self.threads[name] = threading.Thread(target=wait, name=name, daemon=True)
        self.threads[name].start()

    def join(self, name: str, timeout_s: float = 20.0) -> None:
        """Wait for ``name`` to complete; a collective that cannot complete fails instead of hanging."""
        self.threads[name].join(timeout_s)
        if self.threads[name].is_alive():
            raise AssertionError(f"rank {dist.get_rank()}: {name} did not complete in {timeout_s} s")


def unit_buckets(model: MegatronFSDP, unit: int) -> list[FlatParamBucket]:
    return [b for b in model.buckets if b.spec.unit_id == unit]


def launch_gather(bucket: FlatParamBucket) -> Launched:
    bucket.launch_gather()
    assert bucket._gather is not None
    return bucket._gather


def gather_before_held_back_reductions(gather_lane: bool) -> dict[str, object]:
    """Rank 0 launches the reduction of every bucket but unit 0's (two or more: both gloo workers of the
    shard group busy), then unit 0's gather; rank 1 launches the gather first and its reductions only
    after rank 0 saw the gather complete, so they are held back all along. On one group this hangs: the
    ranks' collectives would pair up by issue order (a reduction with a gather)."""
    model = wrap("optim_grads_params", gather_lane=gather_lane)  # ZeRO-3: every bucket starts released
    handshake = dist.new_group(backend="gloo")  # neither the shard group nor the lane
    rank = dist.get_rank()
    (gathered,) = unit_buckets(model, 0)
    reduced = [b for b in model.buckets if b is not gathered]
    for record in model.params:
        if record.bucket is not gathered:
            record.bucket.unreduced.views()[record.index].add_(torch.full_like(record.compute, rank + 1.0))

    def reduce() -> list[Launched]:
        return [b.reducer.launch(GradReduction(1.0, average_in_collective=False), None) for b in reduced]

    completions = Completions()
    reductions = reduce() if rank == 0 else []
    for i, reduction in enumerate(reductions):
        completions.watch(f"reduction {i}", reduction)
    completions.watch("gather", launch_gather(gathered))
    completions.join("gather")
    completed_first = list(completions.order)
    dist.barrier(group=handshake)
    if rank == 0:
        for i in range(len(reductions)):
            completions.join(f"reduction {i}")  # before waiting them here: one waiter at a time
    else:
        reductions = reduce()
    for reduction in reductions:
        reduction.wait()
    gathered.wait_gather()
    views = [b.grad_view(i) for b in reduced for i in range(len(b.spec.params))]
    return {
        "reductions": len(reduced),
        "completed_first": completed_first,
        "reduced": sorted(set(torch.cat([v.reshape(-1) for v in views if v is not None]).tolist())),  # 1 + 2
        "gathered": {
            n: p.detach().cpu() for n, p in zip(gathered.spec.names, gathered.spec.params, strict=True)
        },
    }


def test_a_gather_completes_while_reductions_launched_before_it_are_held_back() -> None:
    ranks = run_distributed(gather_before_held_back_reductions, 2, args=(True,), reuse=False, timeout=120)
    assert ranks[0]["reductions"] >= 2  # both of the shard group's gloo workers are taken
    assert ranks[0]["completed_first"] == ["gather"]  # the reductions launched before it still in flight
    reference = {name: p.detach().cpu() for name, p in TinyTransformer().named_parameters()}
    for result in ranks:
        assert result["reduced"] == [3.0]
        gathered = result["gathered"]
        assert isinstance(gathered, dict)
        assert all(torch.equal(gathered[n], reference[n]) for n in gathered)


THRESHOLD = 1.5


def reduction_skipped_by_a_gathering_rank() -> str:
    """Rank 1 skips a reduction rank 0 waits in, but launches a gather on the lane: the watchdog counts
    each group apart (counted by ranks alone, rank 1's gather would stand in for the reduction and no
    culprit would be named)."""
    rank = dist.get_rank()
    # a group of its own: the hang must not block the harness
    index = FSDPDistributedIndex.from_group(dist.new_group(), device_type=test_device().type)
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = MegatronFSDP(TinyTransformer(), index, config, fsdp_unit_modules=[Block])
    guard = start_hang_watchdog(THRESHOLD, models=[model])
    (reduced,), (gathered,) = unit_buckets(model, 1), unit_buckets(model, 0)
    if rank == 1:
        gathered.launch_gather()  # never completes: rank 0 does not take part
        deadline = time.monotonic() + THRESHOLD + 20
        while guard.hang is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_hang_watchdog()
        return guard.hang or ""
    try:
        reduced.reducer.launch(GradReduction(1.0, average_in_collective=False), None).wait()
    except CollectiveHangError as error:
        stop_hang_watchdog()
        return str(error)
    raise AssertionError("rank 0 finished a reduction rank 1 never launched")


def test_the_watchdog_counts_the_lane_apart_from_the_shard_group() -> None:
    report, seen = run_distributed(reduction_skipped_by_a_gathering_rank, 2, reuse=False, timeout=90)
    assert "Culprit rank(s) [1]: they have not launched it (last launched: rank 1 #0)" in report, report
    assert "fsdp.bucket" in report
    assert seen == report


STEPS = 6


def train(strategy: str, outer: int, gather_lane: bool) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(strategy, gather_lane=gather_lane, **hybrid(outer))
    for step in range(STEPS):
        trainer.step(step, 2)
    return full_weights(trainer.model)


@pytest.mark.parametrize(("strategy", "outer"), GATHERING)
def test_training_is_the_same_with_and_without_the_lane_and_as_one_process(strategy: str, outer: int) -> None:
    world = 2 * outer
    with_lane = run_distributed(train, world, args=(strategy, outer, True))
    without = run_distributed(train, world, args=(strategy, outer, False))
    one_process = reference_training(world, 2, STEPS)
    for rank, (got, want) in enumerate(zip(with_lane, without, strict=True)):
        assert all(torch.equal(got[name], want[name]) for name in want), rank
        assert max_relative_difference(got, one_process) <= 1e-6, rank
