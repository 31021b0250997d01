"""The main job under torchft (train_ft.py), short: three replica groups, one SIGKILLed mid-backward and
restarted; its report against the same job with no fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is an optional extra (torch >= 2.7)")

import train_ft  # (after the skip: its replica groups import torchft)

KILL_AT = 4


@pytest.mark.timeout(300)
def test_the_main_job_goes_on_through_a_killed_replica_group_and_reports_it(tmp_path: Path) -> None:
    train_ft.main(
        ["--steps=12", f"--kill-at-step={KILL_AT}", f"--out-dir={tmp_path}", "--corpus-bytes=262144"]
    )
    runs = json.loads((tmp_path / "metrics.json").read_text())
    clean, fault = runs["no_fault"], runs["fault"]
    assert set(clean["quorum"].values()) == {3}
    assert not clean["discarded"]
    # the survivors' attempt at the killed step is discarded, and retried: no step is missing
    assert sorted(map(tuple, fault["discarded"])) == [(0, KILL_AT), (2, KILL_AT)]
    steps = [int(s) for s in fault["losses"]]
    assert steps == list(range(len(steps)))
    assert len(steps) >= 12
    quorum = {int(s): size for s, size in fault["quorum"].items()}
    assert all(quorum[s] == 3 for s in range(KILL_AT))
    assert quorum[KILL_AT] == 2
    assert quorum[steps[-1]] == 3  # the restarted group rejoined
    assert len(fault["heal_s"]) == 1
    assert len(fault["rejoin_s"]) == 1
    # until the fault both jobs take the same steps on the same data
    assert all(fault["losses"][str(s)] == clean["losses"][str(s)] for s in range(KILL_AT))
    assert fault["losses"][str(KILL_AT)] != clean["losses"][str(KILL_AT)]  # two groups' rows, not three
    report = (tmp_path / "report.md").read_text()
    assert f"steps committed by a quorum of 2 | {KILL_AT}-" in report
    assert f"before the fault (steps 0-{KILL_AT - 1}) | bit-identical" in report
    assert "steps never committed, below the last one | none |" in report
