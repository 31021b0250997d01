"""On CUDA, the wrapper's part of a training step (forwards, backwards, grad sync, the next forward's param
gather) has no host-device sync, for every DDP strategy (the NaN check's one read per step, at
finish_grad_sync, is off here; Megatron's optimizer step reads its grad norm by design). Skipped without
a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import Trainer, local_microbatches

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups.testing import run_distributed

CONFIGS = {
    "ddp": {},
    "ddp+overlap": {"overlap_grad_reduce": True},
    "distopt": {"use_distributed_optimizer": True},
    "distopt+overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
}


def steps_under_sync_debug(name: str) -> None:
    """Only the wrapper runs with syncs an error: the batches are drawn before (on the CPU, then moved
    to the GPU: a sync of the test's own), the optimizer steps after."""
    trainer = Trainer.build(DistributedDataParallelConfig(**CONFIGS[name]), "adam")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [local_microbatches(step, rank, world, 2) for step in range(3)]
    for step, (first, second) in enumerate(batches):  # the first step allocates, records golden counts
        trainer.ddp.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            with trainer.ddp.no_sync():
                trainer.ddp(first).backward()
            trainer.ddp(second).backward()
            trainer.ddp.finish_grad_sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        trainer.optimizer.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device syncs exist on CUDA only")
@pytest.mark.parametrize("name", CONFIGS)
def test_a_training_step_has_no_host_sync_on_cuda(name: str) -> None:
    run_distributed(steps_under_sync_debug, 1, args=(name,))
