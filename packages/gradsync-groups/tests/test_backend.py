"""Backend capabilities: per-device resolution of compound backends, and the table's claims checked
against what the backend really does."""

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
from gradsync.groups.testing import run_distributed, test_device

# --- resolving a backend string for a device type ----------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "device_type", "name"),
    [
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cuda:nccl,cpu:gloo", "cpu", "gloo"),
        ("CPU:GLOO, CUDA:NCCL", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "nccl"),
    ],
)
def test_compound_string_resolves_to_the_backend_serving_the_device(
    backend: str, device_type: str, name: str
) -> None:
    caps = capabilities_of(backend, device_type)
    assert (caps.name, caps.device_type) == (name, device_type.partition(":")[0])
    assert caps == capabilities_of(name, device_type)


def test_gloo_serving_cuda_tensors_stays_gloo_on_cuda() -> None:
    for backend in ("gloo", "cpu:gloo,cuda:gloo"):
        caps = capabilities_of(backend, "cuda")
        assert (caps.name, caps.device_type) == ("gloo", "cuda")
        assert not caps.stream_ordered_wait
        assert not caps.reduce_scatter_via_all_to_all  # measured on CPU tensors only
    assert capabilities_of("gloo", "cpu").reduce_scatter_via_all_to_all


def test_plain_names_default_to_their_home_device() -> None:
    assert capabilities_of("gloo").device_type == "cpu"
    assert capabilities_of("GLOO") == capabilities_of("gloo", "cpu")
    assert capabilities_of("nccl").device_type == "cuda"


def test_compound_string_without_device_follows_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert capabilities_of("cuda:nccl,cpu:gloo").name == "gloo"
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert capabilities_of("cpu:gloo,cuda:nccl").name == "nccl"
    # An accelerator the string does not serve falls back to the CPU's backend.
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
    assert capabilities_of("cpu:gloo,cuda:nccl").name == "gloo"


@pytest.mark.parametrize(("backend", "device_type"), [("cpu:gloo", "cuda"), ("nccl", "cpu")])
def test_an_unserved_device_type_is_refused_with_the_fix(backend: str, device_type: str) -> None:
    with pytest.raises(ValueError, match=rf"'{backend}' has no backend for '{device_type}' tensors") as info:
        capabilities_of(backend, device_type)
    assert "init_process_group('cpu:gloo,cuda:nccl')" in str(info.value)


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda", "cpu:gloo,cpu:gloo", "cpu:gloo,:nccl"])
def test_a_malformed_compound_string_is_refused(backend: str) -> None:
    with pytest.raises(ValueError, match="Cannot read the backend string"):
        capabilities_of(backend)


@pytest.mark.parametrize(("backend", "device_type"), [("mpi", None), ("cpu:gloo,cuda:custom", "cuda")])
def test_unknown_backends_get_the_conservative_entry(backend: str, device_type: str | None) -> None:
    caps = capabilities_of(backend, device_type)
    assert caps.name == backend.rpartition(":")[2]
    promises = {
        "avg_trusted": caps.avg_trusted,
        "premul_sum": caps.premul_sum,
        "userbuffers": caps.userbuffers,
        "stream_ordered_wait": caps.stream_ordered_wait,
        "reduce_scatter_tensor": caps.reduce_scatter_tensor,
        "all_gather_into_tensor": caps.all_gather_into_tensor,
        "coalescing_manager": caps.coalescing_manager,
    }
    assert not any(promises.values()), promises
    # ... so the collective paths fall back to the ops every backend has.
    assert (caps.reduce_scatter_via_all_reduce, caps.all_gather_via_broadcasts) == (True, True)
    assert not caps.reduce_scatter_via_all_to_all


def test_default_backend_wants_a_cuda_device_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [default_backend(n) for n in (1, 2, 3)] == ["nccl", "nccl", "gloo"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend(1) == "gloo"


# --- on real process groups ---------------------------------------------------------------------------


def capabilities_on_a_gloo_group() -> None:
    assert str(dist.get_backend()) == "gloo"
    caps = get_backend_capabilities(device="cpu")
    assert (caps.name, caps.device_type) == ("gloo", "cpu")
    assert get_backend_capabilities(device=torch.device("cuda", 0)).device_type == "cuda"
    assert device_for_group() == torch.device("cpu")
    assert device_for_group(preferred=torch.device("cuda", 1)) == torch.device("cuda", 1)
    # A group that serves the CPU only: CUDA tensors are refused by name, and the device falls back.
    cpu_only = dist.new_group(list(range(dist.get_world_size())), backend="cpu:gloo")
    assert get_backend_capabilities(cpu_only, "cpu").name == "gloo"
    with pytest.raises(ValueError, match="'cpu:gloo' has no backend for 'cuda' tensors"):
        get_backend_capabilities(cpu_only, "cuda")
    assert device_for_group(cpu_only, preferred=torch.device("cuda", 0)) == torch.device("cpu")
    dist.destroy_process_group(cpu_only)


def test_capabilities_of_a_real_gloo_group() -> None:
    run_distributed(capabilities_on_a_gloo_group, 2, device="cpu")


def capabilities_without_a_backend() -> str:
    return get_backend_capabilities(device="cpu").name


@pytest.mark.skipif(torch.accelerator.is_available(), reason="torch gives the accelerator's backend only")
def test_a_group_created_without_a_backend_resolves_per_device() -> None:
    # dist.get_backend() says "undefined" for such a group; the per-device map says gloo serves the CPU.
    assert (
        run_distributed(capabilities_without_a_backend, 2, backend="undefined", reuse=False) == ["gloo"] * 2
    )


def avg_is_exact(device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """ReduceOp.AVG gives the exact mean of a float and of an integer tensor (chosen so that the integer
    mean is whole), without raising."""
    world, rank = dist.get_world_size(), dist.get_rank()
    floats = torch.full((3,), float(rank + 1), device=device)
    ints = torch.full((3,), 2 * rank, dtype=torch.int64, device=device)
    try:
        dist.all_reduce(floats, op=dist.ReduceOp.AVG, group=group)
        dist.all_reduce(ints, op=dist.ReduceOp.AVG, group=group)
    except RuntimeError:
        return False
    return floats.tolist() == [(world + 1) / 2] * 3 and ints.tolist() == [world - 1] * 3


def premul_sum_works(device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.full((2,), float(rank + 1), device=device)
    try:
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=group)
    except RuntimeError:
        return False
    return t.tolist() == [0.5 * world * (world + 1) / 2] * 2


def gloo_claims_against_observation() -> None:
    cpu = torch.device("cpu")
    caps = get_backend_capabilities(device=cpu)
    assert caps.name == "gloo"
    # A failed gloo work stays in its group's queue and re-raises in the group's next barrier: fail on a
    # group of its own, then drop it.
    probe = dist.new_group(list(range(dist.get_world_size())))
    observed = avg_is_exact(cpu, probe), premul_sum_works(cpu, probe)
    dist.destroy_process_group(probe)
    assert caps.avg_trusted == observed[0], "AVG on gloo: the table disagrees with what gloo does"
    assert caps.premul_sum == observed[1], "PREMUL_SUM on gloo: the table disagrees with gloo"


def test_gloo_is_trusted_with_exactly_the_reductions_it_gets_right() -> None:
    """Gloo's AVG still raises on integer tensors (torch 2.13), and PREMUL_SUM does not exist there. If a
    torch release fixes either, this fails, and the table entry should be reconsidered."""
    run_distributed(gloo_claims_against_observation, 2, device="cpu", reuse=False)


def exercise_the_claimed_collectives() -> None:
    device = test_device()
    caps = get_backend_capabilities(device=device)
    assert caps.device_type == device.type
    assert device_for_group(preferred=device) == device
    world, rank = dist.get_world_size(), dist.get_rank()
    if caps.avg_trusted:
        assert avg_is_exact(device)
    if caps.premul_sum:
        assert premul_sum_works(device)
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
