"""gradsync DDP under torchft: replica groups die by SIGKILL mid-step and between steps; the others commit
no partial step and go on; the killed one restarts, heals from a peer and rejoins; at the end every
replica group holds bit-identical weights and optimizer state, equal to a single process that replays
the committed steps (each the mean of its participating replica groups' batches)."""

from __future__ import annotations

import itertools
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is an optional extra (torch >= 2.7)")

import ft_replica  # (after the skip: it imports torchft)

from gradsync.groups.testing import run_distributed
from gradsync.groups.testing.replica_groups import ReplicaJob, free_port

SCRIPT = Path(__file__).with_name("ft_replica.py")
DILOCO_SCRIPT = Path(__file__).with_name("ft_diloco_replica.py")


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
    with start_job(job_dir, replicas=3, ranks=1, stops={0: "slow:1", 1: "backward:2", 2: "between:4"}) as job:
        killed = [job.kill_when_stopped(1), job.kill_when_stopped(2)]
        for replica in killed:
            job.launch(replica)  # a fresh process, as a job scheduler restarts it
        job.finish()
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
    with start_job(job_dir, replicas=3, ranks=1, stops=stops) as job:
        job.launch(job.kill_when_stopped(1))
        source = job.kill_when_stopped(0, 2)
        (job_dir / "source_killed").touch()
        job.launch(source)
        job.finish()
    check_outcome(job, killed={1: 2})


@pytest.mark.timeout(420)
def test_bf16_replica_groups_of_two_ranks_survive_a_group_killed_mid_backward(job_dir: Path) -> None:
    """Each replica group is two ranks under torchrun (averaged among themselves, then across groups), in
    bf16 with fp32 main grads; the whole of one group is killed mid-backward and restarted."""
    with start_job(job_dir, replicas=3, ranks=2, stops={2: "backward:3"}, steps=5, dtype="bfloat16") as job:
        job.launch(job.kill_when_stopped(2))
        job.finish()
    check_outcome(job, killed={2: 3})


@pytest.mark.timeout(180)
def test_replica_groups_with_different_buckets_all_raise_before_any_bucket_moves(job_dir: Path) -> None:
    with ReplicaJob(job_dir, SCRIPT, replicas=2, ranks=1, steps=3, dtype="float32", bucket_size=50) as job:
        job.launch(0)
        job.launch(1, bucket_size=1000)
        job.finish(expect=1)
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


def test_a_missing_lighthouse_is_named_with_its_fix(monkeypatch: pytest.MonkeyPatch, job_dir: Path) -> None:
    from gradsync.ddp.fault_tolerance import find_lighthouse

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="no torchft lighthouse given: start one with `torchft_lighthouse"):
        find_lighthouse()
    with pytest.raises(ValueError, match="must read http://HOST:PORT"):
        find_lighthouse("lighthouse-without-port")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectionError, match=f"no torchft lighthouse answers at {dead} within 0.3 s"):
        find_lighthouse(dead, timeout=0.3)
    with ReplicaJob(job_dir, SCRIPT, 2, 1, 1) as job:  # a real lighthouse, started beside the call
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", job.address)
        assert find_lighthouse(timeout=30) == job.address


def trained_rounds(job: ReplicaJob) -> dict[int, list[int]]:
    """Each committed DiLoCo round's replicas whose moves its sync averaged: those that trained the round
    (a ``reduced`` line) and then committed it in the same life, as many as each committer counted."""
    trained: dict[int, list[int]] = defaultdict(list)
    counted: dict[int, set[int]] = defaultdict(set)
    for replica, lines in job.records().items():
        for before, line in itertools.pairwise(lines):
            if not line.get("committed"):
                continue
            counted[line["step"]].add(line["trained"])
            if before.get("reduced") and (before["step"], before["life"]) == (line["step"], line["life"]):
                trained[line["step"]].append(replica)
    for round_, counts in counted.items():
        assert counts == {len(trained[round_])}, (round_, counts, trained[round_])
    return trained


def replay_diloco(start: list[torch.Tensor], rounds: dict[int, list[int]], last: int) -> tuple[Any, Any]:
    """The synced weights and the outer momentum, by hand: each round, every replica that trained it takes
    its inner SGD steps from the synced weights; their moves' mean steps Nesterov SGD."""
    import ft_diloco_replica as script

    synced, momentum = [t.clone() for t in start], None
    for round_ in range(1, last):
        moves = []
        for replica in rounds.get(round_, []):
            model = script.build_model(0)
            with torch.no_grad():
                for param, value in zip(model.parameters(), synced, strict=True):
                    param.copy_(value)
            inner = torch.optim.SGD(model.parameters(), lr=script.INNER_LR)
            for inner_step in range(script.INNER_STEPS):
                inner.zero_grad()
                inputs, targets = script.batch(replica, round_, inner_step)
                torch.nn.functional.mse_loss(model(inputs), targets).backward()
                inner.step()
            moves.append([s - p.detach() for s, p in zip(synced, model.parameters(), strict=True)])
        if not moves:
            continue
        mean = [sum(move[i] for move in moves) / len(moves) for i in range(len(synced))]
        if momentum is None:
            momentum = [g.clone() for g in mean]
        else:
            momentum = [script.OUTER_MOMENTUM * b + g for b, g in zip(momentum, mean, strict=True)]
        nesterov = [g + script.OUTER_MOMENTUM * b for g, b in zip(mean, momentum, strict=True)]
        synced = [s - script.OUTER_LR * n for s, n in zip(synced, nesterov, strict=True)]
    return synced, momentum


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fragments", [1, 2], ids=["diloco", "streaming"])
def test_diloco_under_torchft_steps_by_the_mean_move_of_the_replicas_that_trained_each_round(
    job_dir: Path, fragments: int
) -> None:
    """Replica 1 dies mid-round 2, replica 2 just after round 4's sync; each restarts and heals at the next
    sync (adding no move). Every replica ends bit-identical, and DiLoCo equal to a hand-computed replay.
    Streaming DiLoCo (2 fragments, one synced per round in turn) heals the same way, and each sync sends
    one fragment (the plain-group tests replay its schedule by hand)."""
    with ReplicaJob(job_dir, DILOCO_SCRIPT, replicas=3, ranks=1, steps=7, fragments=fragments) as job:
        job.launch(0)
        job.launch(1, "backward:2")
        job.launch(2, "between:4")
        job.launch(job.kill_when_stopped(1))
        job.launch(job.kill_when_stopped(2))
        job.finish()
    finals = [torch.load(job_dir / f"final_{r}.pt") for r in range(3)]
    for final in finals[1:]:
        assert final["step"] == finals[0]["step"]
        for key in ("synced", "momentum"):
            for mine, theirs in zip(final[key], finals[0][key], strict=True):
                assert torch.equal(mine, theirs), key
        for name, tensor in finals[0]["model"].items():  # streaming: the fragment not synced last differs
            synced_last = fragments == 1 or (name == "0.weight") == (final["last_synced"] == 0)
            assert torch.equal(final["model"][name], tensor) == synced_last, name
    rounds = trained_rounds(job)
    assert sorted(rounds[2]) == [0, 2], rounds[2]  # replica 1 died in round 2: only the others' moves
    assert 2 not in rounds[5], rounds[5]  # replica 2 died after round 4's sync
    assert all(rounds[r] for r in range(1, finals[0]["step"])), rounds  # every round but the first trained
    start = torch.load(job_dir / "start_0.pt")  # after the first sync (torchft's step-0 sync)
    assert start["step"] == 1
    if fragments == 2:  # the fragments: the first layer's weight (128), the rest (84); each with a count
        # the first sync sends both (replica 0 lived through the job); a restarted replica heals in the
        # quorum of the others' sync, and joins it: one fragment, as every sync after the first
        assert [final["peak_sync_bytes"] for final in finals] == [
            4 * (128 + 84 + 1),
            4 * (128 + 1),
            4 * (128 + 1),
        ]
        return
    synced, momentum = replay_diloco(start["synced"], rounds, finals[0]["step"])
    for key, replayed in (("synced", synced), ("momentum", momentum)):
        for mine, expected in zip(finals[0][key], replayed, strict=True):
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_diloco_refuses_what_a_manager_replaces_by_name() -> None:
    import torchft

    from gradsync.ddp import DiLoCo

    params = list(torch.nn.Linear(2, 2).parameters())
    inner = torch.optim.SGD(params, lr=0.1)
    manager = object.__new__(torchft.Manager)  # refused before it is used
    with pytest.raises(ValueError, match="pass manager= or group=, not both"):
        DiLoCo(params, inner, 2, manager=manager, group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wire_dtype is not available under a manager"):
        DiLoCo(params, inner, 2, manager=manager, wire_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"DiLoCo: manager must be a torchft\.Manager, got object"):
        DiLoCo(params, inner, 2, manager=object())


ENDS_AT_ONCE = """import sys, time
replica = int(next(a for a in sys.argv if a.startswith("--replica=")).split("=")[1])
sys.exit({0: 0, 1: 3}[replica]) if replica in ENDS else time.sleep(600)
"""


@pytest.mark.parametrize(
    ("ends", "wanted"),
    [
        ({1}, "replica group 1 ended with 3"),  # a failure, while the others wait for it
        ({0}, "replica groups 1 still run 1.0 s after the others ended, too few for a quorum"),
    ],
    ids=["failed", "stranded"],
)
def test_finish_fails_fast_where_groups_left_running_could_only_wait_out_the_quorum_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: set[int], wanted: str
) -> None:
    from gradsync.groups.testing import replica_groups

    monkeypatch.setattr(replica_groups, "STRANDED_GRACE", 1.0)
    script = tmp_path / "ends_at_once.py"
    script.write_text(ENDS_AT_ONCE.replace("ENDS", str(ends)))
    with ReplicaJob(tmp_path, script, replicas=2, ranks=1, steps=1) as job:
        for replica in range(2):
            job.launch(replica)
        with pytest.raises(AssertionError, match=wanted):
            job.finish(timeout=60)
        assert job.procs[1 - min(ends)].poll() is None  # failed while the other still ran
