"""gradsync DDP under torchft: replica groups die by SIGKILL mid-step and between steps; the others commit
no partial step and go on; the killed one restarts, heals from a peer and rejoins; at the end every
replica group holds bit-identical weights and optimizer state, equal to a single process that replays
the committed steps (each the mean of its participating replica groups' batches)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is an optional extra (torch >= 2.7)")

import ft_replica  # (after the skip: it imports torchft)

from gradsync.groups.testing import run_distributed
from gradsync.groups.testing.replica_groups import ReplicaJob

SCRIPT = Path(__file__).with_name("ft_replica.py")


def replay(job: ReplicaJob) -> dict[str, Any]:
    """One process, from the weights the first quorum started from, through the committed steps."""
    starts = [torch.load(p) for p in sorted(job.out.glob("start_*.pt"))]
    (start,) = [s for s in starts if s["step"] == 0][:1]
    dtype = getattr(torch, str(job.options["dtype"]))
    model = ft_replica.build_model(0, dtype)
    model.load_state_dict(start["model"])
    optimizer = ft_replica.build_optimizer(model.parameters())

    def loss_of(model: torch.nn.Module, replica: int, step: int, rank: int) -> torch.Tensor:
        inputs, targets = ft_replica.batch(replica, step, rank, dtype)
        return torch.nn.functional.mse_loss(model(inputs).float(), targets.float())

    steps = job.replay(model, optimizer, loss_of)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": steps}


def check_outcome(job: ReplicaJob, killed: dict[int, int]) -> None:
    finals = {r: torch.load(job.out / f"final_{r}.pt") for r in range(job.replicas)}
    # every replica group: the same step count, bit-identical weights and optimizer state
    reference = finals[0]
    for replica, final in finals.items():
        assert final["manager"]["step"] == reference["manager"]["step"]
        for name, tensor in reference["model"].items():
            assert torch.equal(final["model"][name], tensor), (replica, name)
        for index, state in reference["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(final["optimizer"]["state"][index][key], value), (replica, index, key)
    job.check_killed_steps_retried(killed)
    # the replay of the committed steps lands on the same state
    replayed = replay(job)
    assert replayed["steps"] == list(range(reference["manager"]["step"]))
    fp32 = job.options["dtype"] == "float32"
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if fp32 else {"rtol": 2e-2, "atol": 2e-3}
    for name, tensor in replayed["model"].items():
        torch.testing.assert_close(reference["model"][name], tensor, **tolerance)
    for index, state in replayed["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(reference["optimizer"]["state"][index][key], value, **tolerance)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    return tmp_path


def start_job(
    out: Path, replicas: int, ranks: int, stops: dict[int, str], steps: int = 6, dtype: str = "float32"
) -> ReplicaJob:
    job = ReplicaJob(out, SCRIPT, replicas, ranks, steps, dtype=dtype, bucket_size=50)
    for replica in range(replicas):
        job.launch(replica, stops.get(replica, ""))
    return job


@pytest.mark.timeout(420)
def test_groups_killed_mid_backward_and_between_steps_in_a_row_heal_and_match_a_replay(job_dir: Path) -> None:
    """Group 0 is slow at step 1 (nothing fails); group 1 dies mid-backward at step 2 and group 2 between
    steps at 4, both down at once (group 0 alone makes no quorum and waits); then both restart."""
    job = start_job(job_dir, replicas=3, ranks=1, stops={0: "slow:1", 1: "backward:2", 2: "between:4"})
    try:
        killed = [job.kill_when_stopped(1), job.kill_when_stopped(2)]
        for replica in killed:
            job.launch(replica)  # a fresh process, as a job scheduler restarts it
        job.finish()
    finally:
        job.close()
    check_outcome(job, killed={1: 2})
    slow = [
        (a["committed"], a["participants"]) for a in job.records()[0] if a["step"] == 1 and "committed" in a
    ]
    assert slow == [(True, 3)], slow


@pytest.mark.timeout(420)
def test_a_heal_source_killed_while_sending_leaves_the_healing_group_to_another(job_dir: Path) -> None:
    """Group 1 dies mid-backward and restarts; the group torchft picks to heal it dies as it is asked for
    its state; the restarted group heals from the last one, and the killed source restarts too."""
    stops = {0: "sending:1", 1: "backward:2", 2: "sending:1"}
    job = start_job(job_dir, replicas=3, ranks=1, stops=stops)
    try:
        job.launch(job.kill_when_stopped(1))
        source = job.kill_when_stopped(0, 2)
        (job_dir / "source_killed").touch()
        job.launch(source)
        job.finish()
    finally:
        job.close()
    check_outcome(job, killed={1: 2})


@pytest.mark.timeout(420)
def test_bf16_replica_groups_of_two_ranks_survive_a_group_killed_mid_backward(job_dir: Path) -> None:
    """Each replica group is two ranks under torchrun (averaged among themselves, then across groups), in
    bf16 with fp32 main grads; the whole of one group is killed mid-backward and restarted."""
    job = start_job(job_dir, replicas=3, ranks=2, stops={2: "backward:3"}, steps=5, dtype="bfloat16")
    try:
        job.launch(job.kill_when_stopped(2))
        job.finish()
    finally:
        job.close()
    check_outcome(job, killed={2: 3})


@pytest.mark.timeout(180)
def test_replica_groups_with_different_buckets_all_raise_before_any_bucket_moves(job_dir: Path) -> None:
    job = ReplicaJob(job_dir, SCRIPT, replicas=2, ranks=1, steps=3, dtype="float32", bucket_size=50)
    try:
        job.launch(0)
        job.launch(1, bucket_size=1000)
        job.finish(expect=1)
    finally:
        job.close()
    for replica in range(2):
        assert "replica groups disagree on the model's buckets" in job.log(replica), job.log(replica)
        assert "same DistributedDataParallelConfig" in job.log(replica)
    assert not job.committed()


def refusals() -> list[str]:
    import torchft

    from gradsync.buffers import DistributedDataParallelConfig
    from gradsync.ddp import DistributedDataParallel
    from gradsync.ddp.fault_tolerance import register_fault_tolerant_hook
    from gradsync.groups import ModelParallelConfig, initialize_model_parallel

    pgs = initialize_model_parallel()
    messages = []
    for config, manager in [
        (DistributedDataParallelConfig(), object()),
        (DistributedDataParallelConfig(use_distributed_optimizer=True), object.__new__(torchft.Manager)),
    ]:
        model = DistributedDataParallel(
            ModelParallelConfig(), config, torch.nn.Linear(2, 2), pg_collection=pgs
        )
        try:
            register_fault_tolerant_hook(model, manager)
        except (TypeError, NotImplementedError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_what_cannot_run_under_torchft_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    (messages,) = run_distributed(refusals, 1)
    assert len(messages) == 2, messages
    assert messages[0].startswith(
        "TypeError: register_fault_tolerant_hook: manager must be a torchft.Manager"
    )
    assert messages[1].startswith(
        "NotImplementedError: register_fault_tolerant_hook: use_distributed_optimizer"
    )
    assert "use use_distributed_optimizer=False" in messages[1]
    from gradsync.buffers.fault_tolerance import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r'pip install "gradsync-ddp\[torchft\]"'):
        require_torchft("gradsync-ddp")
