"""The fault-job harness's own parts that need no torchft: killing a process tree whose children left its
session, and reading which replica groups took each committed step from their records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.groups.testing.replica_groups import ReplicaJob, kill_tree

SLEEPER = "import subprocess, sys, time; print(subprocess.Popen({child}, start_new_session=True).pid, flush=True); time.sleep(60)"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_tree_takes_the_children_that_started_sessions_of_their_own() -> None:
    child = [sys.executable, "-c", "import time; time.sleep(60)"]
    parent = subprocess.Popen(
        [sys.executable, "-c", SLEEPER.format(child=child)], stdout=subprocess.PIPE, start_new_session=True
    )
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    assert os.getsid(grandchild) != os.getsid(parent.pid)  # killing the parent's group would miss it
    kill_tree(parent)
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
    assert parent.returncode == -9


def write_records(out: Path, replica: int, lines: list[dict[str, object]]) -> None:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (out / f"records_{replica}_0.jsonl").write_text(text)


def job_reading(out: Path) -> ReplicaJob:
    """A job object over records already written (no lighthouse, no processes)."""
    job = object.__new__(ReplicaJob)
    job.out, job.replicas, job.ranks = out, 3, 1
    return job


def test_a_group_that_died_after_reducing_a_step_is_counted_in_it(tmp_path: Path) -> None:
    # group 0 reduced step 4 and died before its commit (its next life starts at 9); 1 and 2 committed
    # step 4 counting three groups; step 5 went on without group 0
    write_records(tmp_path, 0, [
        {"step": 4, "reduced": True, "life": 10},
        {"step": 9, "reduced": True, "life": 11}, {"step": 9, "committed": True, "participants": 3, "life": 11},
    ])  # fmt: skip
    for replica in (1, 2):
        write_records(tmp_path, replica, [
            {"step": 4, "reduced": True, "life": replica}, {"step": 4, "committed": True, "participants": 3, "life": replica},
            {"step": 5, "reduced": True, "life": replica}, {"step": 5, "committed": True, "participants": 2, "life": replica},
            {"step": 9, "reduced": True, "life": replica}, {"step": 9, "committed": True, "participants": 3, "life": replica},
        ])  # fmt: skip
    assert job_reading(tmp_path).committed() == {4: [0, 1, 2], 5: [1, 2], 9: [0, 1, 2]}


def test_committed_steps_whose_counts_disagree_are_refused(tmp_path: Path) -> None:
    write_records(tmp_path, 0, [{"step": 1, "committed": True, "participants": 3, "life": 1}])
    write_records(tmp_path, 1, [{"step": 1, "committed": True, "participants": 3, "life": 2}])
    write_records(tmp_path, 2, [{"step": 1, "committed": False, "participants": 3, "life": 3}])
    with pytest.raises(AssertionError):
        job_reading(tmp_path).committed()
