"""Communication telemetry covers MegatronFSDP too (it collects through gradsync.buffers.collectives): every
bucket's gathers and reductions, labelled by bucket, in the step that issued them, with the bytes that
reached torch.distributed; HSDP's outer stage is labelled apart."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from fsdp_testkit import Trainer

from gradsync.buffers import disable_telemetry, enable_telemetry
from gradsync.buffers.testing import issued_collectives
from gradsync.groups.testing import run_distributed


def traced(outer: int, outer_strategy: str) -> tuple[list[int], list[int], set[str]]:
    trainer = Trainer.build("optim_grads_params", outer=outer, outer_dp_sharding_strategy=outer_strategy)
    recorder = enable_telemetry()
    counted = []
    for step in range(3):
        with issued_collectives() as seen:
            trainer.step(step, 2)
        counted.append(sum(c.nbytes for c in seen))  # a broadcast-based gather's shards add up
    disable_telemetry()
    summary = recorder.summary()
    recorded = [sum(e["bytes"] for kinds in summary[s].values() for e in kinds.values()) for s in range(3)]
    dist.barrier()
    return counted, recorded, {label for labels in summary.values() for label in labels}


@pytest.mark.parametrize(("outer", "outer_strategy"), [(1, "no_shard"), (2, "no_shard"), (2, "optim")])
def test_every_bucket_collective_is_recorded(outer: int, outer_strategy: str) -> None:
    """Against the bytes handed to torch.distributed, counted by a spy."""
    for counted, recorded, labels in run_distributed(traced, 4, args=(outer, outer_strategy)):
        assert recorded == counted
        assert all(label.startswith("fsdp.bucket") for label in labels)
        assert any(label.endswith(".outer") for label in labels) == (outer > 1)
