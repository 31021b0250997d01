"""The global grad norm and clip coefficient are Megatron-Core's, bit for bit.

Megatron (clip_grads.py ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32``): the local 2-norm in
fp32 (the norm of the per-tensor norms), squared in fp32, summed over ranks by an fp32 all-reduce, read
back as a Python float and rooted in double; the coefficient ``max_norm / (norm + 1e-6)`` is a Python
double, applied to the fp32 grads only when below 1. Rooting in fp32 (gradsync before) moves the
coefficient by about 1e-7 relative. The ranks get different data, so the norm is a true sum over ranks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import Trainer, global_batch

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups.testing import run_distributed, test_device


def reference_norm(grads: list[torch.Tensor]) -> float:
    """Megatron's order, written out: per-tensor norms, their norm, squared, summed, rooted in double."""
    local = torch.zeros((), dtype=torch.float32, device=test_device())
    if grads:  # unsharded, only DP rank 0 counts the replicated grads
        per_tensor = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        local = torch.linalg.vector_norm(per_tensor).to(torch.float32) ** 2
    dist.all_reduce(local)
    return float(float(local.item()) ** 0.5)


def fp32_rooted_coefficient(sum_of_squares: float, max_norm: float) -> float:
    """What gradsync did before: the root and the division in fp32."""
    total = torch.tensor(sum_of_squares, dtype=torch.float32).sqrt()
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


def clip_once(sharded: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(use_distributed_optimizer=sharded, overlap_grad_reduce=True)
    trainer = Trainer.build(config, "sgd")
    opt = trainer.optimizer
    if not sharded:  # the unsharded recipe goes through the same optimizer class
        from gradsync.ddp import DistributedOptimizer

        opt = DistributedOptimizer(opt, trainer.ddp)
    trainer.ddp.zero_grad_buffer()
    trainer.ddp(global_batch(0, world, 2).chunk(world)[rank]).backward()
    trainer.ddp.finish_grad_sync()

    opt._ensure_grads_loaded()
    counted = [g.clone() for g in opt._norm_grads]
    norm = reference_norm(counted)
    # A max_norm whose coefficient the fp32 root gets wrong (most do; search a few to be sure).
    max_norm = next(
        m
        for m in (norm * f for f in (0.5, 0.3, 0.7, 0.11, 0.9, 0.37, 0.61, 0.23))
        if torch.tensor(m / (norm + 1e-6), dtype=torch.float32)
        != torch.tensor(fp32_rooted_coefficient(norm**2, m), dtype=torch.float32)
    )
    coefficient = max_norm / (norm + 1e-6)
    before = [shard.grad.clone() for shard in opt.shards]
    returned = opt.clip_grad_norm(max_norm)
    after = [shard.grad.clone() for shard in opt.shards]
    return {
        "returned": returned,
        "norm": norm,
        "grads_equal": all(torch.equal(a, b * coefficient) for a, b in zip(after, before, strict=True)),
        "counted": len(counted),
    }


@pytest.mark.parametrize("sharded", [True, False])
def test_norm_and_clip_coefficient_are_megatrons(sharded: bool) -> None:
    results = run_distributed(clip_once, 2, args=(sharded,))
    assert results[0]["counted"] > 0
    for result in results:
        assert result["returned"] == result["norm"]  # the root in double: equal, not approximately
        assert result["grads_equal"]  # scaled by the double coefficient, exactly
    assert results[0]["norm"] == results[1]["norm"]


def test_no_scaling_when_the_coefficient_is_not_below_one() -> None:
    from gradsync.ddp.grad_norm import clip_coefficient

    assert clip_coefficient(2.0, 1.0) > 1.0
    assert clip_coefficient(1.0, 1.0) < 1.0  # the 1e-6 keeps it just below 1 at max_norm == norm
    assert clip_coefficient(1.0, 1.0) == 1.0 / (1.0 + 1.0e-6)
    assert not math.isnan(clip_coefficient(1.0, 0.0))
