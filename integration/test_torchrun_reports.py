"""The main job's report, beyond its core (test_torchrun.py): the trace, and the runs it puts side by side
(Muon against AdamW, each grad wire against fp32, torch's PowerSGD hook, DiLoCo). Only CI runs these
(`nox -s tests-ci`): each trains the job two or three times."""

from __future__ import annotations

import json
from pathlib import Path

from test_torchrun import report_rows, torchrun, trained


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
    the grads every step, and the loss still falls. Streaming DiLoCo (diloco-h8-f4) sends the same bytes
    in a quarter of the model every 2 steps. An fsdp strategy is refused by flag."""
    trained(tmp_path, "--steps", "16", "--strategy", "ddp", "--grad-comm", "diloco-h8,diloco-h8-f4")
    fp32, diloco, streaming = report_rows(tmp_path, "ddp sgd")  # the reference first
    assert [fp32[1], diloco[1], streaming[1]] == [
        "ddp sgd fp32 wire",
        "ddp sgd diloco-h8 wire",
        "ddp sgd diloco-h8-f4 wire",
    ]
    assert diloco[3] == fp32[3] == streaming[3]
    assert float(diloco[4]) < 0.9 * float(diloco[3])
    assert float(streaming[4]) < 0.9 * float(streaming[3])
    # the mean over steps 2-16 of two syncs, each the weights' fp32 bytes: 2/15 of a grad all-reduce's;
    # streaming: eight syncs of a fragment each, every fragment twice
    assert abs(float(diloco[-2]) - 2 / 15 * float(fp32[-2])) <= 0.01
    assert abs(float(streaming[-2]) - float(diloco[-2])) <= 0.01
    assert "Streaming DiLoCo, 4 fragments" in (tmp_path / "report.md").read_text()
    refused = torchrun(2, "--steps", "2", "--strategy", "fsdp-optim", "--grad-comm", "diloco-h8")
    assert refused.returncode != 0
    assert "--grad-comm diloco-h8: needs a ddp strategy" in refused.stderr
