"""Communication telemetry on 2 gloo ranks: the Chrome trace parses, each rank has its tracks, compute
phases follow each other, every collective's span starts at its launch (a gradient reduction inside the
backward that launched it, with overlap) and its exposed wait lies after the launch; the bytes in the
trace and in the summary equal what was handed to torch.distributed, counted by a spy."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
from ddp_testkit import Trainer, local_microbatches

from gradsync.buffers import (
    DistributedDataParallelConfig,
    disable_telemetry,
    enable_telemetry,
    telemetry,
)
from gradsync.buffers.testing import issued_collectives
from gradsync.groups.testing import run_distributed

CONFIGS = {
    "ddp-overlap": DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600),
    "distopt-overlap-gather": DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=600
    ),
}


def traced_training(
    config: DistributedDataParallelConfig, path: str
) -> tuple[dict[int, int], dict[int, int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "adam" if not config.use_distributed_optimizer else "adamw")
    recorder = enable_telemetry()
    issued: dict[int, int] = {}
    for step in range(3):
        with issued_collectives() as seen:
            trainer.ddp.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            (batch,) = local_microbatches(step, rank, world, 1)
            with telemetry.phase("forward"):
                loss = trainer.ddp(batch)
            with telemetry.phase("backward"):
                loss.backward()
            with telemetry.phase("optimizer"):
                trainer.ddp.finish_grad_sync()
                trainer.optimizer.step()
        issued[step] = sum(c.nbytes for c in seen)
    with issued_collectives() as seen:
        trainer.full_params()  # the last gather (distributed optimizer), in step 2's record
    issued[2] += sum(c.nbytes for c in seen)
    recorder.write_chrome_trace(path)
    disable_telemetry()
    summary = recorder.summary()
    entries = [e for labels in summary.values() for kinds in labels.values() for e in kinds.values()]
    assert all(e["seconds"] > 0 and e["exposed_seconds"] >= 0 and e["count"] > 0 for e in entries)
    recorded = {
        step: sum(e["bytes"] for kinds in labels.values() for e in kinds.values())
        for step, labels in recorder.summary().items()
    }
    return issued, recorded


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_trace_and_summary_match_the_collectives_issued(
    config: DistributedDataParallelConfig, tmp_path: Path
) -> None:
    path = tmp_path / "trace.json"
    results = run_distributed(traced_training, 2, args=(config, str(path)))
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank, (issued, recorded) in enumerate(results):
        mine = [e for e in spans if e["pid"] == rank]
        phases = sorted((e for e in mine if e["cat"] == "compute"), key=lambda e: e["ts"])
        assert [p["name"] for p in phases] == ["forward", "backward", "optimizer"] * 3
        for earlier, later in itertools.pairwise(phases):
            assert earlier["ts"] + earlier["dur"] <= later["ts"] + 1e-3  # one after the other
        comm = [e for e in mine if e["cat"] == "comm"]
        assert comm
        assert any(e["cat"] == "exposed" for e in mine)
        for span in comm:
            assert span["dur"] >= 0
        for wait in (e for e in mine if e["cat"] == "exposed"):
            launch = min(
                c["ts"]
                for c in comm
                if c["args"]["label"] == wait["args"]["label"] and c["args"]["step"] == wait["args"]["step"]
            )
            assert wait["ts"] >= launch - 1e-3  # waited after it was launched
        reductions = [
            c for c in comm if c["args"]["kind"] in ("all_reduce", "reduce_scatter") and c["args"]["step"] > 0
        ]
        assert reductions
        for reduction in reductions:  # overlap (after the first step, which counts the grads): launched
            # by a grad hook, inside that step's backward
            backward = phases[3 * reduction["args"]["step"] + 1]
            assert backward["ts"] <= reduction["ts"] <= backward["ts"] + backward["dur"]
        trace_bytes = Counter[int]()
        for span in comm:
            trace_bytes[span["args"]["step"]] += span["args"]["bytes"]
        assert recorded == dict(trace_bytes) == issued
