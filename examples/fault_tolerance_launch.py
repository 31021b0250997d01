"""Run a fault-tolerance example on one machine: a torchft lighthouse, three replica groups, and one group
killed mid-run and restarted, as a job scheduler would restart it.

    python examples/fault_tolerance_launch.py examples/fault_tolerance_ddp.py
    python examples/fault_tolerance_launch.py examples/fault_tolerance_fsdp.py --ranks 2

The lighthouse forms a quorum from two groups (``--min_replicas 2``): a majority of three, so that two
groups cut off from each other can never each form a quorum and train apart (a split brain; with
``--min_replicas 1`` either half would go on alone, and a restarted group would start over from step 0
instead of healing). With three groups, one can die and the other two go on.

It starts the groups (each under torchrun, ``--ranks`` ranks), SIGKILLs group ``--kill`` once it has
committed step ``--kill-after``, restarts it at once, waits for every group to commit ``--steps`` steps,
and checks that every group ends with the same step count and bit-identical weights. Each group's output
is in ``--out``/group<N>.log. Needs torchft (torch 2.7 or later).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import torch

from gradsync.groups.testing.replica_groups import kill_tree


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def committed_steps(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(m.group(1)) for m in re.finditer(r"^group \d+ step (\d+) loss", text, re.MULTILINE)]


class Job:
    """The lighthouse and the replica groups, each group's output appended to its log."""

    def __init__(self, example: Path, groups: int, ranks: int, steps: int, out: Path) -> None:
        self.example, self.groups, self.ranks, self.steps, self.out = example, groups, ranks, steps, out
        lighthouse = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).with_name("torchft_lighthouse")
        )
        port = free_port()
        self.address = f"http://127.0.0.1:{port}"
        timeouts = ["--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"]
        self.lighthouse = subprocess.Popen(
            [lighthouse, "--min_replicas", "2", "--bind", f"127.0.0.1:{port}", *timeouts],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, IO[bytes]] = {}

    def log(self, group: int) -> Path:
        return self.out / f"group{group}.log"

    def start(self, group: int) -> None:
        env = {
            **os.environ,
            "REPLICA_GROUP": str(group),
            "NUM_REPLICA_GROUPS": str(self.groups),
            "TORCHFT_LIGHTHOUSE": self.address,
            "CHECKPOINT_DIR": str(self.out),
            "STEPS": str(self.steps),
            "RUST_LOG": "error",
        }
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.ranks}"]
        command = [*launcher, f"--master-port={free_port()}", str(self.example)]
        self.logs[group] = self.log(group).open("ab")
        self.procs[group] = subprocess.Popen(
            command, stdout=self.logs[group], stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def kill(self, group: int) -> None:
        """SIGKILL the group's torchrun and its ranks at once, as a lost node would leave them (torchrun
        starts its ranks in sessions of their own: killing its process group would leave them running)."""
        kill_tree(self.procs[group])

    def wait(self, deadline: float) -> None:
        for group, proc in self.procs.items():
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise SystemExit(f"group {group} exited with {code}; see {self.log(group)}")

    def stop(self) -> None:
        for proc in [*self.procs.values(), self.lighthouse]:
            kill_tree(proc)
        for log in self.logs.values():
            log.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("example", type=Path)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="ranks per replica group")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill", type=int, default=1, help="the replica group killed and restarted")
    parser.add_argument("--kill-after", type=int, default=10, help="once it has committed this step")
    parser.add_argument("--out", type=Path, default=Path("fault_tolerance_run"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in [*args.out.glob("group*.log"), *args.out.glob("group*.pt")]:
        stale.unlink()
    deadline = time.monotonic() + args.timeout
    job = Job(args.example, args.groups, args.ranks, args.steps, args.out)
    try:
        for group in range(args.groups):
            job.start(group)
        while max(committed_steps(job.log(args.kill)), default=-1) < args.kill_after:
            if time.monotonic() > deadline or job.procs[args.kill].poll() is not None:
                raise SystemExit(f"group {args.kill} never committed step {args.kill_after}; see its log")
            time.sleep(0.1)
        job.kill(args.kill)
        before = len(committed_steps(job.log(args.kill)))
        print(f"group {args.kill} killed after step {args.kill_after}; restarted", flush=True)
        job.start(args.kill)
        job.wait(deadline)
        rejoined = committed_steps(job.log(args.kill))[before:]
        print(f"group {args.kill} healed and rejoined at step {rejoined[0] if rejoined else '?'}")
    finally:
        job.stop()
    finals = [torch.load(args.out / f"group{group}.pt") for group in range(args.groups)]
    steps = {final["manager"]["step"] for final in finals}
    same = all(
        torch.equal(final["model"][name], finals[0]["model"][name])
        for final in finals
        for name in finals[0]["model"]
    )
    print(f"every group committed {sorted(steps)} steps; weights bit-identical across groups: {same}")
    if len(steps) != 1 or not same or not rejoined:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
