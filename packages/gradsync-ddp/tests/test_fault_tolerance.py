"""gradsync DDP under torchft: replica groups die by SIGKILL mid-step and between steps; the others commit
no partial step and go on; the killed one restarts, heals from a peer and rejoins; at the end every
replica group holds bit-identical weights and optimizer state, equal to a single process that replays
the committed steps (each the mean of its participating replica groups' batches)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is an optional extra (torch >= 2.7)")

import ft_replica  # (after the skip: it imports torchft)

from gradsync.groups.testing import run_distributed

SCRIPT = Path(__file__).with_name("ft_replica.py")
LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Job:
    """A lighthouse and replica groups, each a process group of its own (killed whole)."""

    out: Path
    replicas: int
    ranks: int
    steps: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        port = free_port()
        self.address = f"http://127.0.0.1:{port}"
        self.lighthouse = subprocess.Popen(
            [str(LIGHTHOUSE), "--min_replicas", str(min(2, self.replicas)), "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "500",
             "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def launch(self, replica: int, stop: str = "", bucket_size: int = 50) -> None:
        args = [f"--bucket-size={bucket_size}", f"--replica={replica}", f"--replicas={self.replicas}", f"--lighthouse={self.address}",
                f"--steps={self.steps}", f"--out={self.out}", f"--stop={stop}", f"--dtype={self.dtype}"]  # fmt: skip
        if self.ranks == 1:
            command = [sys.executable, str(SCRIPT), *args]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.ranks}",
                       f"--master-port={free_port()}", str(SCRIPT), *args]  # fmt: skip
        log = (self.out / f"log_{replica}.txt").open("a")
        path = os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "RUST_LOG": "error", "PYTHONPATH": path}
        self.procs[replica] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def kill_when_stopped(self, replica: int, timeout: float = 120) -> None:
        """SIGKILL every process of the replica group once it reports it stopped where told."""
        marker = self.out / f"stopped_{replica}"
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert self.procs[replica].poll() is None, self.log(replica)
            assert time.monotonic() < deadline, f"replica {replica} never stopped\n{self.log(replica)}"
            time.sleep(0.05)
        os.killpg(self.procs[replica].pid, signal.SIGKILL)
        self.procs[replica].wait()
        marker.unlink()

    def finish(self, timeout: float = 240, expect: int = 0) -> None:
        deadline = time.monotonic() + timeout
        for replica, proc in self.procs.items():
            try:
                code = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            assert code == expect, f"replica {replica} ended with {code}\n{self.log(replica)}"

    def close(self) -> None:
        for proc in [*self.procs.values(), self.lighthouse]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def log(self, replica: int) -> str:
        return "\n".join((self.out / f"log_{replica}.txt").read_text().splitlines()[-40:])

    def records(self) -> dict[int, list[dict[str, Any]]]:
        """Each replica group's attempts, in order (all its lives), from its rank 0."""
        return {
            r: [json.loads(line) for line in (self.out / f"records_{r}_0.jsonl").read_text().splitlines()]
            for r in range(self.replicas)
        }


def replay(job: Job, records: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """One process: from the weights the first quorum started from, each committed step applies the mean
    of the grads of the replica groups (and their ranks) that committed it."""
    takers: dict[int, list[int]] = defaultdict(list)
    for replica, attempts in records.items():
        for attempt in attempts:
            if attempt["committed"]:
                takers[attempt["step"]].append(replica)
    starts = [torch.load(p) for p in sorted(job.out.glob("start_*.pt"))]
    (start,) = [s for s in starts if s["step"] == 0][:1]
    dtype = getattr(torch, job.dtype)
    model = ft_replica.build_model(0, dtype)
    model.load_state_dict(start["model"])
    params = list(model.parameters())
    optimizer = ft_replica.build_optimizer(params)
    for step in sorted(takers):
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]  # fp32, as the main grads
        for replica in takers[step]:
            for rank in range(job.ranks):
                model.zero_grad()
                inputs, targets = ft_replica.batch(replica, step, rank, dtype)
                torch.nn.functional.mse_loss(model(inputs).float(), targets.float()).backward()
                for summed, p in zip(total, params, strict=True):
                    summed.add_(p.grad.float())  # type: ignore[union-attr]
        count = len(takers[step]) * job.ranks
        for p, t in zip(params, total, strict=True):
            p.grad = (t / count).to(p.dtype)
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": sorted(takers)}


def check_outcome(job: Job, killed: dict[int, int]) -> None:
    records = job.records()
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
    # a step a replica group died in is committed by nobody at that attempt: the others retried it (with
    # the restarted one, if it healed in time)
    for replica, step in killed.items():
        for other, attempts in records.items():
            if other != replica:
                tries = [a for a in attempts if a["step"] == step]
                assert tries, (other, step)
                assert not tries[0]["committed"], (other, tries)
                assert tries[-1]["committed"], (other, tries)
    # the committed steps each took the replica groups that say so, and the replay lands on the same state
    committed = defaultdict(set)
    for replica, attempts in records.items():
        for attempt in attempts:
            if attempt["committed"]:
                committed[attempt["step"]].add((replica, attempt["participants"]))
    for step, takers in committed.items():
        assert {count for _, count in takers} == {len(takers)}, (step, takers)
    replayed = replay(job, records)
    assert replayed["steps"] == list(range(reference["manager"]["step"]))
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if job.dtype == "float32" else {"rtol": 2e-2, "atol": 2e-3}
    for name, tensor in replayed["model"].items():
        torch.testing.assert_close(reference["model"][name], tensor, **tolerance)
    for index, state in replayed["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(reference["optimizer"]["state"][index][key], value, **tolerance)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    return tmp_path


def run_job(
    out: Path, replicas: int, ranks: int, stops: dict[int, str], steps: int = 6, dtype: str = "float32"
) -> Job:
    job = Job(out, replicas, ranks, steps, dtype)
    try:
        for replica in range(replicas):
            job.launch(replica, stops.get(replica, ""))
        for replica in stops:
            job.kill_when_stopped(replica)
            job.launch(replica)  # a fresh process, as a job scheduler restarts it
        job.finish()
    finally:
        job.close()
    return job


@pytest.mark.timeout(420)
def test_a_replica_killed_mid_backward_and_one_between_steps_heal_and_match_a_replay(job_dir: Path) -> None:
    job = run_job(job_dir, replicas=3, ranks=1, stops={1: "backward:2", 2: "between:4"})
    check_outcome(job, killed={1: 2})


@pytest.mark.timeout(420)
def test_bf16_replica_groups_of_two_ranks_survive_a_group_killed_mid_backward(job_dir: Path) -> None:
    """Each replica group is two ranks under torchrun (averaged among themselves, then across groups), in
    bf16 with fp32 main grads; the whole of one group is killed mid-backward and restarted."""
    job = run_job(job_dir, replicas=3, ranks=2, stops={2: "backward:3"}, steps=5, dtype="bfloat16")
    check_outcome(job, killed={2: 3})


@pytest.mark.timeout(180)
def test_replica_groups_with_different_buckets_all_raise_before_any_bucket_moves(job_dir: Path) -> None:
    job = Job(job_dir, replicas=2, ranks=1, steps=3)
    try:
        job.launch(0)
        job.launch(1, bucket_size=1000)
        job.finish(expect=1)
    finally:
        job.close()
    for replica in range(2):
        assert "replica groups disagree on the model's buckets" in job.log(replica), job.log(replica)
        assert "same DistributedDataParallelConfig" in job.log(replica)
    assert not any(json.loads(line)["committed"] for r in range(2) for line in
                   (job_dir / f"records_{r}_0.jsonl").read_text().splitlines() if line)  # fmt: skip


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
    from gradsync.ddp.fault_tolerance import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r'pip install "gradsync-ddp\[torchft\]"'):
        require_torchft()
