"""The capability table, checked against what the active backend really does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync.groups import (
    capabilities_of,
    default_backend,
    device_for_group,
    get_backend_capabilities,
)
from gradsync.groups.testing import run_distributed


def test_table_entries() -> None:
    gloo = capabilities_of("gloo")
    nccl = capabilities_of("nccl")
    assert capabilities_of("GLOO") == gloo
    assert (gloo.device_type, gloo.avg_trusted, gloo.userbuffers) == ("cpu", False, False)
    assert gloo.reduce_scatter_relative_bandwidth < 1.0
    assert (nccl.device_type, nccl.avg_trusted, nccl.premul_sum) == ("cuda", True, True)


def test_unknown_backend_gets_only_the_guaranteed_collectives() -> None:
    caps = capabilities_of("mpi")
    assert not caps.avg_trusted
    assert not caps.reduce_scatter_tensor
    assert caps.device_type == "cpu"


def test_default_backend_follows_the_devices() -> None:
    expected = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    assert default_backend(2) == expected
    if not torch.cuda.is_available():
        assert default_backend(1) == "gloo"


def exercise_the_claimed_collectives() -> None:
    caps = get_backend_capabilities()
    device = device_for_group()
    assert device.type == caps.device_type
    world, rank = dist.get_world_size(), dist.get_rank()
    if caps.reduce_scatter_tensor:
        inp = torch.arange(2 * world, dtype=torch.float32, device=device) + rank
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, inp)
        base = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * world
        assert torch.equal(out.cpu(), base + sum(range(world)))
    if caps.all_gather_into_tensor:
        gathered = torch.empty(world, device=device)
        dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)], device=device))
        assert gathered.tolist() == [float(r) for r in range(world)]
    if caps.coalescing_manager:
        a, b = torch.ones(3, device=device), torch.ones(2, device=device)
        with dist._coalescing_manager(async_ops=True) as handles:
            dist.all_reduce(a)
            dist.all_reduce(b)
        handles.wait()
        assert a.tolist() == [float(world)] * 3
        assert b.tolist() == [float(world)] * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_claimed_collectives_work_on_the_active_backend(world_size: int) -> None:
    run_distributed(exercise_the_claimed_collectives, world_size)
