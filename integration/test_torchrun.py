"""The training script under real torchrun launches: a run with its report (and its trace), bit-exact
checkpoint resume, and a killed rank. Every launch is bounded, so a hang fails the test instead of
freezing CI."""

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


def test_trace_writes_a_chrome_trace_linked_from_the_report(tmp_path: Path) -> None:
    """``--trace``: one track group per rank, every phase of every step, the collectives labelled by
    bucket group, and the report links the file."""
    result = torchrun(
        2,
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--strategy",
        "ddp+overlap",
        "--trace",
        "--out-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        phases = [
            e["name"]
            for e in sorted(spans, key=lambda e: e["ts"])
            if e["pid"] == rank and e["cat"] == "compute"
        ]
        assert phases == ["forward", "backward", "finalize", "optimizer"] * 3
        assert any(e["pid"] == rank and e["name"].startswith("bucket_group0 all_reduce") for e in spans)
    assert "[trace.json](trace.json)" in (tmp_path / "report.md").read_text()


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


def test_muon_report_compares_the_loss_curve_with_adamw(tmp_path: Path) -> None:
    """--optimizer muon trains the same model, data and steps with AdamW first and reports both."""
    trained(tmp_path, "--steps", "4", "--optimizer", "muon", "--strategy", "fsdp-optim_grads_params")
    rows = report_rows(tmp_path, "fsdp-optim_grads_params")
    assert [row[1] for row in rows] == ["fsdp-optim_grads_params adamw", "fsdp-optim_grads_params muon"]
    first_losses, last_losses = ({row[i] for row in rows} for i in (3, 4))
    assert len(first_losses) == 1  # the same model and data
    assert len(last_losses) == 2  # different optimizers


def test_grad_comm_report_puts_each_wire_beside_the_fp32_one(tmp_path: Path) -> None:
    """--grad-comm bf16,fp8-e4m3-ef trains with the fp32 wire, then each low-precision one, on the same
    model and data; the report's rows show smaller wires and losses near the fp32 wire's."""
    trained(tmp_path, "--steps", "4", "--strategy", "ddp+distopt", "--grad-comm", "bf16,fp8-e4m3-ef")
    rows = report_rows(tmp_path, "ddp+distopt sgd")
    assert [row[1] for row in rows] == [
        "ddp+distopt sgd fp32 wire",
        "ddp+distopt sgd bf16 wire",
        "ddp+distopt sgd fp8-e4m3-ef wire",
    ]
    first_losses, last_losses = ([float(row[i]) for row in rows] for i in (3, 4))
    assert len(set(first_losses)) == 1  # the same model and data: the first loss comes before any sync
    assert all(abs(loss - last_losses[0]) <= 0.01 * last_losses[0] for loss in last_losses)
    # Per step: the grads' reduce-scatter, then the params' all-gather (fp32 on every wire).
    fp32, bf16, fp8 = (float(row[-2]) for row in rows)
    assert fp8 < bf16 <= 0.76 * fp32


def test_grad_comm_powersgd_trains_with_torchs_hook(tmp_path: Path) -> None:
    """--grad-comm powersgd-r4 registers torch's PowerSGD hook on gradsync's DDP after an fp32 run of the
    same job: the same losses while the hook all-reduces plainly (its first 10 steps), different ones once
    it sends rank-4 factors, and within 1 % of the fp32 run's; the report counts the factors' bytes."""
    result = trained(tmp_path, "--steps", "20", "--strategy", "ddp+overlap", "--grad-comm", "powersgd-r4")
    losses = [
        float(line.split("|")[1].split()[1]) for line in result.stdout.splitlines() if line.startswith("step")
    ]
    plain, compressed = losses[:20], losses[20:]
    assert compressed[:11] == plain[:11]  # step 11's loss comes before the first compressed reduction
    assert compressed[11:] != plain[11:]
    assert all(abs(c - p) <= 0.01 * p for c, p in zip(compressed, plain, strict=True))
    fp32, hooked = report_rows(tmp_path, "ddp+overlap sgd")  # the reference first
    assert [fp32[1], hooked[1]] == ["ddp+overlap sgd fp32 wire", "ddp+overlap sgd powersgd-r4 wire"]
    assert float(hooked[-2]) < 0.75 * float(fp32[-2])  # PowerSGD's own count, from step 11 on


def test_grad_comm_diloco_syncs_every_h_steps(tmp_path: Path) -> None:
    """--grad-comm diloco-h8 trains each rank as its own replica, averaging the replicas' moves every 8
    steps: the first loss is the fp32 run's, the wire carries the weights twice in 16 steps instead of
    the grads every step, and the loss still falls; an fsdp strategy is refused by flag."""
    trained(tmp_path, "--steps", "16", "--strategy", "ddp", "--grad-comm", "diloco-h8")
    fp32, diloco = report_rows(tmp_path, "ddp sgd")  # the reference first
    assert [fp32[1], diloco[1]] == ["ddp sgd fp32 wire", "ddp sgd diloco-h8 wire"]
    assert diloco[3] == fp32[3]
    assert float(diloco[4]) < 0.9 * float(diloco[3])
    # the mean over steps 2-16 of two syncs, each the weights' fp32 bytes: 2/15 of a grad all-reduce's
    assert abs(float(diloco[-2]) - 2 / 15 * float(fp32[-2])) <= 0.01
    refused = torchrun(2, "--steps", "2", "--strategy", "fsdp-optim", "--grad-comm", "diloco-h8")
    assert refused.returncode != 0
    assert "--grad-comm diloco-h8: needs a ddp strategy" in refused.stderr
