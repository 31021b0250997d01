"""The loop of Megatron-FSDP's own ``test_mfsdp_fully_shard.py``, ported: ``fully_shard`` on a caller's
(outer, shard, tp) mesh, HSDP included, ``report_nan_in_param_grad=True``, fp32 main weights or none;
microbatches accumulate with auto-sync off (no ``no_sync()``) and the last one turns it on; the optimizer's
params have no grads until then, and grads on some rank after it. On top of what that test checks, the
weights after the step equal one process on the same global batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    MeshWrapped,
    TinyTransformer,
    full_weights,
    global_batch,
    local_microbatches,
    max_relative_difference,
    named_weights,
)

from gradsync.fsdp import MixedPrecisionPolicy
from gradsync.groups.testing import run_distributed

MICROBATCHES = 3
LR = 0.1


def reference(world: int) -> dict[str, torch.Tensor]:
    """Grads of every microbatch summed (no division: the loop never divides), one SGD step."""
    model = TinyTransformer()
    for batch in global_batch(0, world, MICROBATCHES).split(world * 2):
        model(batch).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return named_weights(model)


def megatron_style_loop(strategy: int, outer: int | None, main_params: bool) -> dict[str, torch.Tensor]:
    world = dist.get_world_size()
    outer_size = 1 if outer is None else 2
    wrapped = MeshWrapped.build(
        (outer_size, world // outer_size, 1),
        strategy,
        outer,
        lambda params: torch.optim.SGD(params, lr=LR),
        mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32 if main_params else None),
        report_nan_in_param_grad=True,
    )
    model, optimizer, mesh, hybrid = wrapped.model, wrapped.optimizer, wrapped.mesh, wrapped.hybrid
    sharding_group = hybrid if outer == 1 else mesh["shard"].get_group()
    batches = local_microbatches(0, dist.get_rank(), world, MICROBATCHES)
    for step, batch in enumerate(batches):
        last = step == MICROBATCHES - 1
        model.set_model_auto_sync(last)
        model(batch).backward()
        has_grads = any(
            p.grad is not None and p.grad.to_local().count_nonzero().item() > 0 for p in model.parameters()
        )
        anywhere: list[bool] = [False] * sharding_group.size()
        dist.all_gather_object(anywhere, has_grads, group=sharding_group)
        assert any(anywhere) == last, f"grads {'missing' if last else 'present'} after microbatch {step}"
        if last:
            optimizer.step()
            optimizer.zero_grad()
    return full_weights(model)


CASES = [(s, None) for s in range(4)] + [(s, 0) for s in range(4)] + [(3, 1)]


@pytest.mark.parametrize("main_params", [True, False])
@pytest.mark.parametrize(("strategy", "outer"), CASES)
def test_megatron_fsdp_test_loop(strategy: int, outer: int | None, main_params: bool) -> None:
    world = 2 if outer is None else 4
    want = reference(world)
    for rank, weights in enumerate(
        run_distributed(megatron_style_loop, world, args=(strategy, outer, main_params))
    ):
        assert max_relative_difference(weights, want) <= 1e-6, rank
