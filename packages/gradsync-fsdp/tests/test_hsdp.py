"""Hybrid sharding on 4 gloo ranks, 2 outer replicas x 2 shard ranks.

Outer ``no_shard`` (HSDP, every inner strategy) and outer ``optim`` (HFSDP, inner ZeRO-3) train like one
process on the global batch (fp32: max relative difference <= 1e-6; bf16 within the recipe's bound),
with and without gradient accumulation. The outer stage is watched at the collectives: it runs once per
cycle, in the last microbatch's backward (or at finish_grad_sync when that one ran under no_sync), never
during earlier microbatches; HFSDP gathers the outer pieces once per optimizer step.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    TinyTransformer,
    Trainer,
    full_weights,
    local_microbatches,
    max_relative_difference,
    reference_training,
    shard_index,
)

from gradsync.buffers import DistributedDataParallelConfig, collectives
from gradsync.buffers.testing import issued_collectives
from gradsync.fsdp import MegatronFSDP
from gradsync.groups.testing import run_distributed

WORLD, OUTER, STEPS = 4, 2, 8


@functools.lru_cache(maxsize=4)
def reference(micro: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return reference_training(WORLD, micro, STEPS, dtype)


def train(
    strategy: str, outer_strategy: str, micro: int, accumulation: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(strategy, outer=OUTER, outer_dp_sharding_strategy=outer_strategy, dtype=dtype)
    for step in range(STEPS):
        trainer.step(step, micro, accumulation)
    return full_weights(trainer.model)


CASES = [(inner, "no_shard") for inner in STRATEGIES] + [("optim_grads_params", "optim")]


@pytest.mark.parametrize(("strategy", "outer_strategy"), CASES)
def test_matches_single_process(strategy: str, outer_strategy: str) -> None:
    results = run_distributed(train, WORLD, args=(strategy, outer_strategy, 1, "no_sync", torch.float32))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(1)) <= 1e-6, rank


@pytest.mark.parametrize("accumulation", ["no_sync", "deferred", "auto", "always_sync"])
@pytest.mark.parametrize(("strategy", "outer_strategy"), [CASES[1], CASES[3], CASES[4]])
def test_gradient_accumulation(strategy: str, outer_strategy: str, accumulation: str) -> None:
    results = run_distributed(train, WORLD, args=(strategy, outer_strategy, 3, accumulation, torch.float32))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(3)) <= 1e-6, rank


@pytest.mark.parametrize("outer_strategy", ["no_shard", "optim"])
def test_bf16_matches_the_same_recipe(outer_strategy: str) -> None:
    """bf16 compute weights, fp32 main weights and grads; bound as in test_mixed_precision (each rank's
    quarter-batch forward rounds differently from the whole-batch reference)."""
    args = ("optim_grads_params", outer_strategy, 1, "no_sync", torch.bfloat16)
    for rank, weights in enumerate(run_distributed(train, WORLD, args=args)):
        assert max_relative_difference(weights, reference(1, torch.bfloat16)) <= 1e-2, rank


def train_with_bf16_reductions(strategy: str, outer_strategy: str) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(
        strategy, outer=OUTER, outer_dp_sharding_strategy=outer_strategy, grad_comm_dtype=torch.bfloat16
    )
    for step in range(STEPS):
        trainer.step(step, 1)
    return full_weights(trainer.model)


@pytest.mark.parametrize(("strategy", "outer_strategy"), [CASES[0], CASES[3], CASES[4]])
def test_bf16_reductions_in_both_stages(strategy: str, outer_strategy: str) -> None:
    """fp32 weights and grads, reduced in bf16 by the inner and the outer stage (grad_comm_dtype): within
    bf16's rounding of the reference (measured below 3e-3)."""
    results = run_distributed(train_with_bf16_reductions, WORLD, args=(strategy, outer_strategy))
    for rank, weights in enumerate(results):
        difference = max_relative_difference(weights, reference(1))
        assert 0 < difference <= 1e-2, rank  # not 0: the reductions did round to bf16


# --- the outer stage, seen at the collectives ---------------------------------------------------------


@contextlib.contextmanager
def outer_collectives(outer_group: dist.ProcessGroup) -> Iterator[Counter[str]]:
    """Count collectives issued over ``outer_group``, by kind (a gather's broadcasts count as a gather),
    while the context is open."""
    counts: Counter[str] = Counter()
    with issued_collectives() as seen:
        yield counts
    gathers = {"broadcast", "all_gather"}
    counts.update("gather" if c.kind in gathers else c.kind for c in seen if c.group is outer_group)


Phases = list[tuple[str, dict[str, int]]]


def outer_stage_per_phase(outer_strategy: str, last_under_no_sync: bool) -> tuple[Phases, int, str]:
    """The outer collectives of each forward, backward and finish_grad_sync over two steps of three
    microbatches, how many buckets have grads, and the kind of collective the outer stage reduces with
    (gloo reduce-scatters CPU tensors through an all-to-all)."""
    trainer = Trainer.build("optim_grads_params", outer=OUTER, outer_dp_sharding_strategy=outer_strategy)
    model = trainer.model
    outer_group = model.dist_index.get_outer_fsdp_group()
    assert outer_group is not None
    phases: Phases = []

    def phase(name: str, run: Callable[[], Any]) -> None:
        with outer_collectives(outer_group) as seen:
            run()
        phases.append((name, dict(seen)))

    for step in range(2):
        model.zero_grad_buffer()
        batches = local_microbatches(step, dist.get_rank(), WORLD, 3)
        for i, batch in enumerate(batches):
            deferred = i < len(batches) - 1 or last_under_no_sync
            with model.no_sync() if deferred else contextlib.nullcontext():
                losses: list[torch.Tensor] = []
                phase(f"forward {i}", lambda b=batch, out=losses: out.append(model(b) / 3))
                phase(f"backward {i}", losses[0].backward)
        phase("finish_grad_sync", model.finish_grad_sync)
        trainer.optimizer.step()
        model.install_optimized_model_weights()
    scatter = {"native": "reduce_scatter", "all_to_all": "all_to_all", "all_reduce": "all_reduce"}
    path = collectives.reduce_scatter_path(outer_group, model.buckets[0].weight.device)
    kind = scatter[path] if outer_strategy == "optim" else "all_reduce"
    return phases, sum(bucket.spec.requires_grad for bucket in model.buckets), kind


@pytest.mark.parametrize("last_under_no_sync", [False, True])
@pytest.mark.parametrize("outer_strategy", ["no_shard", "optim"])
def test_the_outer_reduction_waits_for_the_last_microbatch(
    outer_strategy: str, last_under_no_sync: bool
) -> None:
    results = run_distributed(outer_stage_per_phase, WORLD, args=(outer_strategy, last_under_no_sync))
    where = "finish_grad_sync" if last_under_no_sync else "backward 2"
    for phases, grad_buckets, reduce_kind in results:
        by_name = dict(phases)
        per_step = [name for name, seen in phases for _ in range(seen.get(reduce_kind, 0))]
        assert per_step == [where] * grad_buckets * 2, phases  # one per bucket per step, all in `where`
        gathers = [name for name, seen in phases if seen.get("gather")]
        if outer_strategy == "optim":  # the pieces are gathered once, in the first forward after a step
            assert gathers == ["forward 0"], phases
        else:
            assert gathers == [], phases
        assert by_name["forward 1"] == {}


# --- refusals -------------------------------------------------------------------------------------------


def refusal(strategy: str, outer_strategy: str, outer: int, index_outer_strategy: str) -> str:
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer_strategy,
    )
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy") as caught:
        MegatronFSDP(TinyTransformer(), shard_index(outer, index_outer_strategy), config)
    return str(caught.value)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("optim_grads", "optim", 2, "optim"), "needs data_parallel_sharding_strategy='optim_grads_params'"),
        (("optim_grads_params", "optim", 1, "no_shard"), "needs hybrid sharding"),
        (("optim_grads_params", "optim", 2, "no_shard"), "hsdp_outer_dp_shard=True"),
    ],
)
def test_unsupported_outer_strategies_are_named(args: tuple[Any, ...], expected: str) -> None:
    for message in run_distributed(refusal, WORLD, args=args):
        assert expected in message
