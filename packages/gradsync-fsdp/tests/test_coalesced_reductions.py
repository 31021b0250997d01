"""Coalesced grad reductions on 2 gloo ranks: consecutive buckets (one per unit) reduce in one collective
per group of at most ``bucket_size`` elements (no_shard by an in-place all-reduce, ZeRO-1/2 by one
reduce-scatter of a rank-major wire); ZeRO-3, HSDP and double-buffered grads keep one per bucket. The
reduced grads equal one process's on the global batch, in fp32 and bf16, whatever the grouping. (Training
parity of every strategy with default sizes, which coalesce, is test_parity's; a unit without grads on one
rank, test_schedules'.) ZeRO-1/2 gather their weights after a step by one collective per group too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    TinyTransformer,
    Trainer,
    local_microbatches,
    max_relative_difference,
    reference_training,
    wrap,
)

from gradsync.buffers import collectives
from gradsync.buffers.step_ballot import is_vote_group
from gradsync.groups import get_backend_capabilities
from gradsync.groups.testing import run_distributed, test_device

REDUCTIONS = {  # where gradsync's grad reductions call torch (collectives looks its reduce-scatter up late;
    # on gloo it reduce-scatters CPU tensors through an all-to-all)
    dist: ("all_reduce", "reduce", "all_to_all_single"),
    collectives: ("dist_reduce_scatter_func",),
}


def reduce_once(strategy: str, dtype: torch.dtype, **config: Any) -> dict[str, Any]:
    """One backward and finish_grad_sync with every grad reduction counted; the grads and the groups."""
    model = wrap(strategy, dtype=dtype, layers=4, **config)
    calls: list[str] = []
    originals = [(home, name, getattr(home, name)) for home, names in REDUCTIONS.items() for name in names]

    def counted(name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not is_vote_group(kwargs.get("group")):  # the step's vote carries no grads
                calls.append(name)
            return original(*args, **kwargs)

        return call

    for home, name, original in originals:
        setattr(home, name, counted(name, original))
    try:
        model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
        model.finish_grad_sync()
    finally:
        for home, name, original in originals:
            setattr(home, name, original)
    groups = model._hooks.reductions.groups
    return {
        "calls": calls,
        "members": [len(group.buckets) for group in groups if group.buckets[0].spec.requires_grad],
        "sizes": [group.size for group in groups if len(group.buckets) > 1],
        "grads": {
            name.removeprefix("module."): param.grad.full_tensor().float().cpu()
            for name, param in model.named_parameters()
            if param.grad is not None
        },
    }


def reference_grads(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The mean of the two ranks' local grads, each computed in ``dtype`` by one process."""
    model = TinyTransformer(layers=4).to(dtype)
    total: dict[str, torch.Tensor] = {}
    for rank in range(2):
        model.zero_grad()
        model(local_microbatches(0, rank, 2, 1)[0]).backward()
        for name, param in model.named_parameters():
            total[name] = total.get(name, 0) + param.grad.float().cpu() / 2
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_one_collective_per_group_and_the_grads_of_one_process(strategy: str, dtype: torch.dtype) -> None:
    whole = run_distributed(reduce_once, 2, args=(strategy, dtype))
    unit = TinyTransformer().blocks[0]
    unit_size = sum(p.numel() for p in unit.parameters())
    parted = run_distributed(reduce_once, 2, args=(strategy, dtype), kwargs={"bucket_size": 2 * unit_size})
    want = reference_grads(dtype)
    for rank, (one, several) in enumerate(zip(whole, parted, strict=True)):
        assert one["members"] == [sum(several["members"])]  # default bucket size: every bucket together
        assert len(one["calls"]) == 1, one["calls"]
        assert len(several["members"]) > 1
        assert len(several["calls"]) == len(several["members"]), several["calls"]
        assert all(size <= 2 * unit_size for size in several["sizes"]), several["sizes"]
        for got in (one["grads"], several["grads"]):
            assert got.keys() == want.keys()
            for name, grad in got.items():
                # bf16: one rounding of each rank's grad on the wire, relative to the largest grad
                atol = 1e-6 if dtype == torch.float32 else 1e-2 * float(want[name].abs().max())
                torch.testing.assert_close(
                    grad, want[name], rtol=1e-5, atol=atol, msg=f"{name} on rank {rank}"
                )


def groups_of(strategy: str, **config: Any) -> list[int]:
    model = wrap(strategy, layers=4, **config)
    return [len(group.buckets) for group in model._hooks.reductions.groups]


@pytest.mark.parametrize(
    ("strategy", "config"),
    [
        ("optim_grads_params", {}),
        ("optim_grads", {"fsdp_double_buffer": True}),
        ("no_shard", {"outer": 2}),
    ],
    ids=["zero3", "double-buffered-zero2", "hsdp"],
)
def test_buckets_that_reduce_alone(strategy: str, config: dict[str, Any]) -> None:
    world = 4 if "outer" in config else 2
    for members in run_distributed(groups_of, world, args=(strategy,), kwargs=config):
        assert len(members) > 1
        assert set(members) == {1}, members


def gathers_after_a_step(strategy: str, dtype: torch.dtype) -> tuple[int, int, int, dict[str, torch.Tensor]]:
    """One training step, then a forward: the gather collectives it issued, the groups, the collectives
    one gather takes here, and the compute weights it gathered."""
    trainer = Trainer.build(strategy, dtype=dtype)
    trainer.step(0, 1)
    model = trainer.model
    caps = get_backend_capabilities(model.gather_group, test_device())
    per_gather = model.gather_group.size() if caps.all_gather_via_broadcasts else 1
    calls = 0
    originals = [(dist, "broadcast", dist.broadcast)]
    originals.append((collectives, "dist_all_gather_func", collectives.dist_all_gather_func))

    def counted(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        return call

    for home, name, original in originals:
        setattr(home, name, counted(original))
    try:
        with torch.no_grad():
            model(local_microbatches(1, dist.get_rank(), dist.get_world_size(), 1)[0])
    finally:
        for home, name, original in originals:
            setattr(home, name, original)
    weights = {r.name: r.compute.detach().float().cpu().clone() for r in model.params}
    return calls, len(model._hooks.reductions.groups), per_gather, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_zero12_weights_are_gathered_by_one_collective_per_group(strategy: str, dtype: torch.dtype) -> None:
    """bf16: bf16 weights over fp32 main weights, within test_mixed_precision's bound."""
    want = reference_training(2, 1, 1, dtype)
    bound = 1e-6 if dtype == torch.float32 else 6e-3
    results = run_distributed(gathers_after_a_step, 2, args=(strategy, dtype))
    for calls, groups, per_gather, weights in results:
        assert groups == 1
        assert calls == per_gather
        assert max_relative_difference(weights, want) <= bound
