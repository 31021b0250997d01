"""The multi-rank harness itself: results, failures with their rank, hangs with stacks, pooling."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradsync.groups.testing import (
    RankFailure,
    RankTimeout,
    distributed_test,
    run_distributed,
    test_device,
)


def rank_and_world(offset: int) -> tuple[int, int]:
    return dist.get_rank() + offset, dist.get_world_size()


def raise_on_rank_3() -> None:
    if dist.get_rank() == 3:
        raise ValueError("boom on rank 3")


def hang_on_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)


def die_on_rank_0() -> None:
    if dist.get_rank() == 0:
        os._exit(3)


def pid() -> int:
    return os.getpid()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_distributed(rank_and_world, world_size, args=(100,))
    assert results == [(100 + r, world_size) for r in range(world_size)]


def test_exception_on_rank_3_of_4_is_reraised_with_rank_and_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        run_distributed(raise_on_rank_3, 4, reuse=False)
    failure = info.value
    assert failure.rank == 3
    assert "rank 3 of 4 failed" in str(failure)
    assert "raise_on_rank_3" in failure.traceback_text
    assert isinstance(failure.exception, ValueError)
    assert str(failure.exception) == "boom on rank 3"


def test_a_hanging_rank_fails_within_the_timeout_with_every_stack() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_distributed(hang_on_rank_1, 2, timeout=3, reuse=False)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    message = str(info.value)
    assert "did not finish within 3.0s" in message
    assert 1 in info.value.pending
    assert "--- rank 0 ---" in message
    assert "--- rank 1 ---" in message
    assert "hang_on_rank_1" in message


def test_a_rank_that_dies_is_reported() -> None:
    with pytest.raises(RankFailure, match="rank 0 of 2 failed:\nthe process exited with code 3"):
        run_distributed(die_on_rank_0, 2, reuse=False)


def test_ranks_are_reused_until_a_failure() -> None:
    first = run_distributed(pid, 2)
    assert run_distributed(pid, 2) == first
    with pytest.raises(RankFailure):
        run_distributed(raise_on_rank_1_of_2, 2)
    assert set(run_distributed(pid, 2)).isdisjoint(first)


def raise_on_rank_1_of_2() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("expected")


GLOO_MESH_RACE = (
    "Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:40599. This is typically caused by a remote worker crashing."
)


def fail_on_rank_1(marker: str, times: int, message: str) -> int:
    """Raises ``message`` on rank 1 for the first ``times`` calls (counted in ``marker``)."""
    dist.barrier()  # both ranks read the count before either bumps it
    seen = len(Path(marker).read_text()) if os.path.exists(marker) else 0
    dist.barrier()
    if dist.get_rank() == 1:
        with open(marker, "a") as f:
            f.write("x")
        if seen < times:
            raise RuntimeError(message)
    return seen


def test_a_gloo_mesh_race_runs_the_call_once_more_on_fresh_ranks(tmp_path: Path) -> None:
    marker = str(tmp_path / "calls")
    with pytest.warns(RuntimeWarning, match="gloo's mesh setup failed on rank 1"):
        assert run_distributed(fail_on_rank_1, 2, args=(marker, 1, GLOO_MESH_RACE)) == [1, 1]


def test_a_mesh_race_that_repeats_fails_the_test(tmp_path: Path) -> None:
    marker = str(tmp_path / "calls")
    with pytest.warns(RuntimeWarning), pytest.raises(RankFailure, match="connectFullMesh failed"):
        run_distributed(fail_on_rank_1, 2, args=(marker, 2, GLOO_MESH_RACE))
    assert Path(marker).read_text() == "xx"  # once, then once more: no third try


def test_any_other_failure_is_not_run_again(tmp_path: Path) -> None:
    marker = str(tmp_path / "calls")
    with pytest.raises(RankFailure, match="a real fault"):
        run_distributed(fail_on_rank_1, 2, args=(marker, 1, "a real fault"))
    assert Path(marker).read_text() == "x"


class HoldsItsGroup:
    """Like a DDP wrapper: keeps its process group and sits in a reference cycle."""

    def __init__(self) -> None:
        self.group = dist.new_group(list(range(dist.get_world_size())))
        self.cycle = self


def group_in_a_cycle_then_thread_count() -> int:
    dist.destroy_process_group(HoldsItsGroup().group)
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_pooled_rank_does_not_pile_up_threads_of_dead_groups() -> None:
    """Each gloo group runs a polling TCP thread until it is freed: a rank that ran many tests must not
    keep them all, or the idle pools eat the cores the running test needs."""
    counts = [run_distributed(group_in_a_cycle_then_thread_count, 2, reuse=True)[0] for _ in range(8)]
    assert counts[-1] <= counts[1] + 2, counts


def test_tcp_rendezvous() -> None:
    assert run_distributed(rank_and_world, 2, args=(0,), rendezvous="tcp", reuse=False) == [
        (0, 2),
        (1, 2),
    ]


@distributed_test(world_sizes=[2, 4])
def test_decorated_body_runs_on_every_rank() -> None:
    t = torch.ones(1, device=test_device())
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


# --- the test device ------------------------------------------------------------------------------------


def device_seen_by_the_rank() -> tuple[str, str]:
    return str(test_device()), os.environ["GRADSYNC_TEST_DEVICE"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_rank_builds_on_the_requested_device(world_size: int) -> None:
    requested = test_device()  # outside a rank: what GRADSYNC_TEST_DEVICE asks for
    if requested.type == "cpu":
        expected = [("cpu", "cpu")] * world_size
    else:
        count = torch.cuda.device_count()
        expected = [(f"cuda:{r % count}", "cuda") for r in range(world_size)]
    assert run_distributed(device_seen_by_the_rank, world_size) == expected


def test_the_device_keyword_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSYNC_TEST_DEVICE", "cuda")
    assert test_device() == torch.device("cuda")
    assert run_distributed(device_seen_by_the_rank, 2, device="cpu") == [("cpu", "cpu")] * 2


def test_an_unknown_test_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSYNC_TEST_DEVICE", "tpu")
    with pytest.raises(
        ValueError, match="GRADSYNC_TEST_DEVICE='tpu' is not a test device: use one of cpu, cuda"
    ):
        run_distributed(pid, 2)
    with pytest.raises(ValueError, match="device='gpu' is not a test device"):
        run_distributed(pid, 2, device="gpu")


def test_nccl_on_cpu_tensors_is_refused_before_spawning() -> None:
    with pytest.raises(ValueError, match="backend='nccl' takes CUDA tensors"):
        run_distributed(pid, 2, backend="nccl", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_fails_before_spawning() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"asked to run on CUDA .* torch\.cuda\.is_available\(\) is False"):
        run_distributed(pid, 2, device="cuda")
    assert time.monotonic() - start < 1.0  # no rank was started


def test_the_backend_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradsync.groups.testing.devices import backend_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [backend_for("cpu", n) for n in (1, 8)] == ["gloo", "gloo"]
    assert [backend_for("cuda", n) for n in (1, 4, 8)] == ["nccl", "nccl", "gloo"]
