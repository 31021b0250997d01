"""The training script under real torchrun launches: a run with its report, bit-exact checkpoint resume,
and a killed rank (the report's optional parts: test_torchrun_reports.py). Every launch is bounded, so a
hang fails the test instead of freezing CI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
SMALL = [
    "--global-batch", "8", "--seq-len", "16", "--d-model", "32", "--n-layer", "2",
    "--corpus-bytes", str(256 << 10), "--bucket-size", "3000", "--optimizer", "sgd", "--lr", "0.2",
]  # fmt: skip


def torchrun(nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*command, str(HERE / "train.py"), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def trained(out_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A 2-rank run of ``args`` that must succeed, its report under ``out_dir``."""
    result = torchrun(2, *args, "--out-dir", str(out_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def report_rows(out_dir: Path, prefix: str) -> list[list[str]]:
    """The cells of the report's rows whose run name starts with ``prefix``."""
    report = (out_dir / "report.md").read_text()
    return [
        [cell.strip() for cell in line.split("|")]
        for line in report.splitlines()
        if line.startswith(f"| {prefix}")
    ]


def test_a_run_prints_progress_and_writes_its_report(tmp_path: Path) -> None:
    result = torchrun(
        2, "--steps", "4", "--eval-every", "2", "--strategy", "ddp+overlap", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4
    assert all(field in progress[1] for field in ("loss", "val", "tok/s", "comm", "exposed comm"))
    assert f"report: {tmp_path / 'report.md'}" in result.stdout
    report = (tmp_path / "report.md").read_text()
    assert "| ddp+overlap | 4 |" in report
    assert len(json.loads((tmp_path / "metrics.json").read_text())) == 4


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    """8 steps straight vs 4 steps, a checkpoint, and 4 more after a restart: same losses, same files."""
    layout = ["--pp", "2", "--microbatches", "2", "--strategy", "ddp+distopt+overlap-param-gather"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = torchrun(4, *layout, "--steps", "8", "--save-every", "4", "--out-dir", str(straight))
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.copytree(straight / "checkpoints" / "step000004", resumed / "checkpoints" / "step000004")
    second = torchrun(4, *layout, "--steps", "8", "--save-every", "4", "--resume", "--out-dir", str(resumed))
    assert second.returncode == 0, second.stdout + second.stderr
    losses = [
        [r["loss"] for r in json.loads((run / "metrics.json").read_text())] for run in (straight, resumed)
    ]
    assert losses[0][4:] == losses[1]
    for rank in range(4):
        a, b = (
            torch.load(run / "checkpoints" / "step000008" / f"rank{rank:05d}.pt")
            for run in (straight, resumed)
        )
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        pieces = zip(a["optimizer"]["pieces"], b["optimizer"]["pieces"], strict=True)
        assert all(
            torch.equal(x["state"][key], y["state"][key])
            for x, y in pieces
            for key in ("param", "momentum_buffer")
        )


def test_fsdp_resumes_at_another_data_parallel_size(tmp_path: Path) -> None:
    """ZeRO-3 through torch.distributed.checkpoint: 8 steps on 4 ranks vs 4 steps there, a checkpoint, and
    4 more on 2 ranks (the same global batches): the same losses, up to the changed reduction order."""
    layout = ["--strategy", "fsdp-optim_grads_params", "--steps", "8", "--save-every", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = torchrun(4, *layout, "--out-dir", str(straight))
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.copytree(straight / "checkpoints" / "step000004", resumed / "checkpoints" / "step000004")
    second = torchrun(2, *layout, "--resume", "--out-dir", str(resumed))
    assert second.returncode == 0, second.stdout + second.stderr
    losses = [
        [r["loss"] for r in json.loads((run / "metrics.json").read_text())] for run in (straight, resumed)
    ]
    assert len(losses[1]) == 4
    for got, want in zip(losses[1], losses[0][4:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses[1], losses[0][4:])


def test_resume_under_another_layout_is_refused(tmp_path: Path) -> None:
    first = torchrun(2, "--steps", "2", "--save-every", "2", "--out-dir", str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    second = torchrun(2, "--steps", "4", "--tp", "2", "--resume", "--out-dir", str(tmp_path))
    assert second.returncode != 0
    assert "resume with the same strategy and layout" in second.stderr


def test_a_killed_rank_stops_the_job_with_an_error(tmp_path: Path) -> None:
    start = time.monotonic()
    result = torchrun(
        4, "--steps", "50", "--kill-rank", "2", "--kill-at-step", "3", "--timeout-s", "60", timeout=150
    )
    assert result.returncode != 0
    assert time.monotonic() - start < 150
    assert "rank      : 2" in result.stderr or "rank: 2" in result.stderr, result.stderr[-3000:]
    assert "Signal 9 (SIGKILL)" in result.stderr, result.stderr[-3000:]
