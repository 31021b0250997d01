"""A wrapper's life: dropping a MegatronFSDP (with its module and optimizer) frees it and its buffers, and a
param the user keeps loses the wrapper's hooks; wrapping many models does not pile up process groups or
their threads; after ``destroy_process_group()`` and a new ``init_process_group()`` (test suites,
notebooks, elastic restarts) a new wrap trains exactly as in a fresh process: nothing cached (gather
lanes, meshes) outlives its world."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    Block,
    TinyTransformer,
    Trainer,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
)

from gradsync.fsdp import fully_shard, fully_shard_model
from gradsync.groups.testing import run_distributed


def dropped_wrapper_is_collected(strategy: str) -> tuple[bool, bool, bool]:
    module = TinyTransformer()
    model, optimizer = fully_shard(
        module, make_optimizer(module.parameters()), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    optimizer.step()
    optimizer.zero_grad()
    # a param the user still holds loses its grad hooks
    kept = next(r.compute for r in model.params if r.name == "blocks.0.up.weight")
    wrapper = weakref.ref(model)
    grads = [weakref.ref(bucket.grad) for bucket in model.buckets if bucket.grad is not None]
    del model, optimizer, module
    gc.collect()
    hooks = kept._post_accumulate_grad_hooks
    return (
        wrapper() is None,
        all(grad() is None for grad in grads),
        not hooks and not hasattr(kept, "main_grad"),
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dropped_wrapper_is_collected_with_its_buffers(strategy: str) -> None:
    assert run_distributed(dropped_wrapper_is_collected, 2, args=(strategy,)) == [(True, True, True)] * 2


def threads_after_wrapping(models: int) -> int:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    fully_shard_model(TinyTransformer())  # the first wrap may build the shared mesh
    before = threads()
    for _ in range(models):
        fully_shard_model(TinyTransformer(), fsdp_unit_modules=[Block])
    gc.collect()
    return threads() - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_wrapping_many_models_adds_no_groups_or_threads() -> None:
    assert all(grown <= 1 for grown in run_distributed(threads_after_wrapping, 2, args=(6,)))


def trained_in_a_second_world(strategy: str, outer: int, rendezvous: str) -> dict[str, torch.Tensor]:
    first = Trainer.build(strategy, outer=outer)
    for step in range(2):
        first.step(step, 1, "no_sync")
    backend, rank, world = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()  # the wrapper above still alive, as in a test suite between cases
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    second = Trainer.build(strategy, outer=outer)
    for step in range(3):
        second.step(step, 1, "no_sync")
    return full_weights(second.model)


@pytest.mark.parametrize(
    ("strategy", "world", "outer"),
    [*((s, 2, 1) for s in STRATEGIES), ("optim_grads_params", 4, 2)],
    ids=[*STRATEGIES, "hsdp-2x2"],
)
def test_a_new_world_wraps_and_trains_as_a_fresh_process(
    strategy: str, world: int, outer: int, tmp_path: Path
) -> None:
    results = run_distributed(
        trained_in_a_second_world, world, args=(strategy, outer, str(tmp_path / "rdv")), reuse=False
    )
    want = reference_training(world, 1, 3)
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, want) <= 1e-6, rank
