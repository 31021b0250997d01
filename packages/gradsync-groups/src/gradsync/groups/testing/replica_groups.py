"""Fault-tolerance jobs for tests: a torchft lighthouse and replica groups, each its own process group of
processes (one rank, or several under torchrun), that a test kills whole with SIGKILL and restarts.

A replica script (the test's own) takes ``--replica``, ``--replicas``, ``--lighthouse``, ``--steps``,
``--out`` and ``--stop`` (where to stop and wait to be killed), plus any options the test adds. It
reports through files in ``--out``: ``stopped_<replica>`` once it stopped where told, and
``records_<replica>_<rank>.jsonl``: per attempted step, a line once its grads are reduced and one with
its outcome (``committed``, ``participants``). Every process and port stays on 127.0.0.1; the lighthouse
is torchft's ``torchft_lighthouse``, found beside the running Python.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# How long groups left too few for a quorum may still run once another group has ended (its last step and
# final save), where they would otherwise wait out the quorum timeout.
STRANDED_GRACE = 15.0
# Quick to notice a death and to form a quorum: a test's steps take milliseconds.
LIGHTHOUSE_FLAGS = ("--join_timeout_ms", "500", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc (torchrun's workers start sessions of their own, so
    a process group does not hold them)."""
    parents: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(fields[1])].append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and all its descendants at once (found before any dies, as orphans lose their
    parent), then reap it; nothing if it already ended (its pid may be another process's by now)."""
    if proc.poll() is not None:
        return
    for pid in process_tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


class ReplicaJob:
    """A lighthouse (a quorum needs two groups, or one where the job has one) and ``replicas`` groups of
    ``ranks`` ranks running ``script`` with ``options``."""

    def __init__(
        self, out: Path, script: Path, replicas: int, ranks: int, steps: int, **options: object
    ) -> None:
        self.out, self.script, self.replicas, self.ranks, self.steps = out, script, replicas, ranks, steps
        self.options = options
        port = free_port()
        self.address = f"http://127.0.0.1:{port}"
        lighthouse = Path(sys.executable).with_name("torchft_lighthouse")
        self.min_replicas = min(2, replicas)
        quorum = ("--min_replicas", str(self.min_replicas))
        self.lighthouse = subprocess.Popen(
            [str(lighthouse), *quorum, "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_FLAGS],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def launch(self, replica: int, stop: str = "", **options: object) -> None:
        """Start (or restart) a replica group; ``options`` override the job's for this launch."""
        given = {**self.options, **options, "replica": replica, "replicas": self.replicas}
        given |= {"lighthouse": self.address, "steps": self.steps, "out": self.out, "stop": stop}
        args = [f"--{name.replace('_', '-')}={value}" for name, value in given.items()]
        command = [sys.executable, str(self.script), *args]
        if self.ranks > 1:
            launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={self.ranks}"]
            command = [sys.executable, *launcher, f"--master-port={free_port()}", str(self.script), *args]
        log = (self.out / f"log_{replica}.txt").open("a")
        path = os.pathsep.join(p for p in (str(self.script.parent), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "RUST_LOG": "error", "PYTHONPATH": path}
        self.procs[replica] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def kill_when_stopped(self, *candidates: int, timeout: float = 120) -> int:
        """SIGKILL every process of the first of ``candidates`` to report it stopped where told (torchrun
        and its workers alike)."""
        deadline = time.monotonic() + timeout
        while True:
            stopped = [r for r in candidates if (self.out / f"stopped_{r}").exists()]
            if stopped:
                break
            for replica in candidates:
                assert self.procs[replica].poll() is None, self.log(replica)
            assert time.monotonic() < deadline, f"none of replica groups {candidates} stopped"
            time.sleep(0.05)
        replica = stopped[0]
        kill_tree(self.procs[replica])
        (self.out / f"stopped_{replica}").unlink()
        return replica

    def finish(self, timeout: float = 240, expect: int = 0) -> None:
        """Every replica group ends with ``expect`` within ``timeout`` seconds. The first to end otherwise
        fails the job at once, with its own log: the others would only wait out torchft's quorum timeout
        for it, and their timeouts would hide the cause. Groups step in lockstep, so they end within moments
        of one another; groups left too few for a quorum once others have ended fail after
        ``STRANDED_GRACE`` seconds, not after the quorum timeout."""
        deadline = time.monotonic() + timeout
        running = dict(self.procs)
        first_end: float | None = None
        while running:
            for replica, proc in list(running.items()):
                code = proc.poll()
                if code is not None:
                    assert code == expect, f"replica group {replica} ended with {code}\n{self.log(replica)}"
                    del running[replica]
                    first_end = first_end or time.monotonic()
            late = ", ".join(map(str, running))
            assert not running or time.monotonic() < deadline, (
                f"replica groups {late} still run after {timeout} s"
            )
            if first_end is not None and 0 < len(running) < self.min_replicas:
                assert time.monotonic() - first_end < STRANDED_GRACE, (
                    f"replica groups {late} still run {STRANDED_GRACE} s after the others ended, too few "
                    "for a quorum\n" + "\n".join(self.log(r) for r in running)
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Kill whatever of the job is still running (a failed test's groups, the lighthouse)."""
        for proc in [*self.procs.values(), self.lighthouse]:
            kill_tree(proc)

    def __enter__(self) -> ReplicaJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, replica: int) -> str:
        return "\n".join((self.out / f"log_{replica}.txt").read_text().splitlines()[-40:])

    def records(self, rank: int = 0) -> dict[int, list[dict[str, Any]]]:
        """Each replica group's attempts, in order (all its lives), from one rank."""
        found = {}
        for replica in range(self.replicas):
            lines = (self.out / f"records_{replica}_{rank}.jsonl").read_text().splitlines()
            found[replica] = [json.loads(line) for line in lines if line]
        return found

    def committed(self) -> dict[int, list[int]]:
        """Each committed step's replica groups: those that committed it, and any that reduced it and died
        before committing (torchft counts them: their batch is in the step), checked to be as many as
        each group that committed it counted."""
        committers: dict[int, list[tuple[int, int]]] = defaultdict(list)
        died_after_reducing: dict[int, list[int]] = defaultdict(list)
        for replica, lines in self.records().items():
            for index, line in enumerate(lines):
                after = lines[index + 1] if index + 1 < len(lines) else None
                if line.get("committed"):
                    committers[line["step"]].append((replica, line["participants"]))
                if line.get("reduced") and (after is None or after["life"] != line["life"]):
                    died_after_reducing[line["step"]].append(replica)
        takers = {}
        for step, pairs in sorted(committers.items()):
            (count,) = {count for _, count in pairs}
            replicas = sorted(r for r, _ in pairs)
            if len(replicas) < count:
                replicas = sorted(replicas + died_after_reducing[step])
            assert len(replicas) == count, (step, pairs, died_after_reducing[step])
            takers[step] = replicas
        return takers

    def replay(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_of: Callable[[torch.nn.Module, int, int, int], torch.Tensor],
    ) -> list[int]:
        """One process replays the committed steps: each applies the mean of the grads (summed in fp32, as
        main grads are) of ``loss_of(model, replica, step, rank)`` over the groups that committed it and
        their ranks. Returns the steps replayed."""
        params = [p for p in model.parameters() if p.requires_grad]
        takers = self.committed()
        for step, replicas in takers.items():
            total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
            for replica in replicas:
                for rank in range(self.ranks):
                    model.zero_grad()
                    loss_of(model, replica, step, rank).backward()  # type: ignore[no-untyped-call]
                    for summed, p in zip(total, params, strict=True):
                        assert p.grad is not None
                        summed.add_(p.grad.float())
            for p, summed in zip(params, total, strict=True):
                p.grad = (summed / (len(replicas) * self.ranks)).to(p.dtype)
            optimizer.step()
        return list(takers)

    def check_killed_steps_retried(self, killed: dict[int, int]) -> None:
        """A step a group died in (``killed``: group to step) was committed by no other group at that
        attempt: each retried it (with the restarted group, if it healed in time)."""
        records = self.records()
        for replica, step in killed.items():
            for other, lines in records.items():
                if other != replica:
                    tries = [a for a in lines if a["step"] == step and "committed" in a]
                    assert tries, (other, step)
                    assert not tries[0]["committed"], (other, tries)
                    assert tries[-1]["committed"], (other, tries)


class ReplicaScript:
    """The replica script's side of a :class:`ReplicaJob`: its arguments, its own world (one rank, or the
    ranks torchrun started), the start every first life waits for, where it stops, and its records.

    ``--stop`` names where it stops and waits to be killed: ``backward:S`` mid-backward at step S (after
    the buckets reduced before that point crossed replica groups), ``between:S`` after step S committed,
    ``sending:S`` when, from step S on, torchft asks it for its state to heal another group (until the
    test writes ``source_killed``); ``slow:S`` only sleeps 3 s mid-backward at step S."""

    def __init__(self, parser: argparse.ArgumentParser | None = None) -> None:
        parser = parser or argparse.ArgumentParser()
        parser.add_argument("--replica", type=int, required=True)
        parser.add_argument("--replicas", type=int, required=True)
        parser.add_argument("--lighthouse", required=True)
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--stop", default="")
        self.args = parser.parse_args()
        self.replica, self.out = self.args.replica, self.args.out
        where, _, at = self.args.stop.partition(":")
        self.stop_where, self.stop_step = where, int(at) if at else -1
        self.serving = True
        self._manager: Any = None
        if "RANK" in os.environ:  # under torchrun: the replica group's own world and store
            dist.init_process_group("gloo")
            self.store_addr, self.store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
            self.store_addr, self.store_port = "127.0.0.1", int(self.store.port)
            prefixed = dist.PrefixStore("replica", self.store)  # type: ignore[attr-defined]
            dist.init_process_group("gloo", store=prefixed, rank=0, world_size=1)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._records = (self.out / f"records_{self.replica}_{self.rank}.jsonl").open("a")

    def manager(
        self,
        state_dict: Callable[[], dict[str, Any]] | None,
        load_state_dict: Callable[[dict[str, Any]], None] | None,
        **options: Any,
    ) -> Any:
        """torchft's ``Manager`` for this rank (imported here: the harness runs without torchft): its
        group, store and lighthouse, a quorum at each step's start (a heal completes before the step),
        timeouts short enough for a test, and ``state_dict`` served through :meth:`serve` (None: the
        script registers its state with the manager itself); ``options`` are passed on (e.g.
        ``init_sync``)."""
        torchft = importlib.import_module("torchft")
        seconds = timedelta(seconds=20)
        self._manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=seconds),
            load_state_dict=load_state_dict,
            state_dict=None if state_dict is None else self.serve(state_dict),
            min_replica_size=1,
            use_async_quorum=False,
            timeout=seconds,
            quorum_timeout=timedelta(seconds=60),
            connect_timeout=seconds,
            replica_id=f"replica{self.replica}",
            store_addr=self.store_addr,
            store_port=self.store_port,
            rank=self.rank,
            world_size=self.world,
            lighthouse_addr=self.args.lighthouse,
            hostname="127.0.0.1",
            **options,
        )
        return self._manager

    def start_together(self) -> None:
        """The first lives of every replica group start at once, so the first quorum holds them all (a
        restarted one finds every mark already there)."""
        (self.out / f"ready_{self.replica}_{self.rank}").touch()
        while len(list(self.out.glob("ready_*"))) < self.args.replicas * self.world:
            time.sleep(0.05)

    def _wait_to_be_killed(self) -> None:
        (self.out / f"stopped_{self.replica}").write_text(str(os.getpid()))
        time.sleep(600)

    def backward_hook(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A grad hook that stops (or sleeps) there at the step ``--stop`` names: register it on the
        tensor whose grad comes last, so every bucket but that one's has crossed replica groups."""

        def in_backward(grad: torch.Tensor) -> torch.Tensor:
            if self._manager.current_step() == self.stop_step and self.rank == 0:
                if self.stop_where == "backward":
                    self._wait_to_be_killed()
                if self.stop_where == "slow":
                    time.sleep(3)  # the others wait in the bucket's reduction; nothing fails
            return grad

        return in_backward

    def serve(self, state_dict: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        """``state_dict`` as torchft asks for it to heal another group: it stops there as ``--stop`` says
        (the step is read from the manager :meth:`manager` built)."""

        def served() -> dict[str, Any]:
            asked = self.serving and not (self.out / "source_killed").exists()
            step = self._manager.current_step() if self._manager is not None else 0
            if self.stop_where == "sending" and asked and step >= self.stop_step and self.rank == 0:
                self._wait_to_be_killed()  # (torchft's thread: training may go on until the kill)
            return state_dict()

        return served

    def reduced(self, step: int) -> None:
        """The step's grads are reduced (before the commit): a group that dies now is in the step."""
        self._write({"step": step, "reduced": True})

    def record(self, step: int, committed: bool, participants: int, **facts: Any) -> None:
        """One attempted step's outcome (and the script's own ``facts`` about it); stops after it if
        ``--stop`` says so."""
        self._write({"step": step, "committed": committed, "participants": participants, **facts})
        if participants < self.args.replicas:
            time.sleep(0.1)  # a group is down: go on, but not through thousands of steps to replay
        if committed and self.stop_where == "between" and step == self.stop_step and self.rank == 0:
            self._wait_to_be_killed()

    def _write(self, line: dict[str, Any]) -> None:
        self._records.write(json.dumps({**line, "life": os.getpid()}) + "\n")
        self._records.flush()

    def done(self, committed: bool, step: int, participants: int) -> bool:
        """The job is over: ``--steps`` steps committed, the last by every replica group (and state is no
        longer served: what follows reads it for the test)."""
        over = committed and step >= self.args.steps and participants == self.args.replicas
        if over:
            self.serving = False
        return over
