"""Bad configs fail at construction, naming the field and the fix, instead of giving silently wrong grads;
and zero_grad_buffer never races with a reduction still in flight."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch.distributed as dist
from ddp_testkit import TinyGPT, local_microbatches

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed


def refused(
    config: Any, ddp_config: DistributedDataParallelConfig, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        DistributedDataParallel(config, ddp_config, TinyGPT())


CASES = [
    (
        ModelParallelConfig(tensor_model_parallel_size=2),
        DistributedDataParallelConfig(),
        ValueError,
        r"tensor_model_parallel_size=2 but no pg_collection was given.*initialize_model_parallel",
    ),
    (
        ModelParallelConfig(pipeline_model_parallel_size=2),
        DistributedDataParallelConfig(),
        ValueError,
        r"pipeline_model_parallel_size=2 but no pg_collection",
    ),
    (
        ModelParallelConfig(),
        DistributedDataParallelConfig(use_megatron_fsdp=True),
        ValueError,
        r"use_megatron_fsdp=True selects Megatron-FSDP.*gradsync.fsdp.MegatronFSDP",
    ),
    (
        ModelParallelConfig(),
        DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads"),
        ValueError,
        r"data_parallel_sharding_strategy='optim_grads' only configure Megatron-FSDP",
    ),
    (
        ModelParallelConfig(),
        DistributedDataParallelConfig(suggested_communication_unit_size=1000, keep_fp8_transpose_cache=True),
        ValueError,
        r"suggested_communication_unit_size=1000, keep_fp8_transpose_cache=True only configure",
    ),
    (
        ModelParallelConfig(),
        DistributedDataParallelConfig(delay_wgrad_compute=True),
        NotImplementedError,
        r"delay_wgrad_compute=True: delayed weight-gradient hooks need Transformer Engine",
    ),
    (
        ModelParallelConfig(),
        DistributedDataParallelConfig(nccl_ub=True),
        NotImplementedError,
        r"nccl_ub=True: NCCL user-buffer allocation",
    ),
]


@pytest.mark.parametrize(("config", "ddp_config", "error", "message"), CASES)
def test_bad_configs_are_refused_by_name(
    config: Any, ddp_config: DistributedDataParallelConfig, error: type[Exception], message: str
) -> None:
    run_distributed(refused, 1, args=(config, ddp_config, error, message))


def zeroing_waits_for_the_reduction_in_flight() -> tuple[bool, float]:
    rank = dist.get_rank()
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600)
    ddp = DistributedDataParallel(ModelParallelConfig(), config, TinyGPT())
    for step in range(2):  # the second iteration dispatches from the hooks
        ddp.zero_grad_buffer()
        ddp(local_microbatches(step, rank, 2, 1)[0]).backward()
        ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    ddp(local_microbatches(2, rank, 2, 1)[0]).backward()  # dispatched; as if an exception came next
    in_flight = any(g.grad_reduce_handle is not None for g in ddp.bucket_groups)
    ddp.zero_grad_buffer()
    left = max(float(b.grad_data.abs().max()) for b in ddp.buffers)
    assert all(g.grad_reduce_handle is None for g in ddp.bucket_groups)
    return in_flight, left


def test_zero_grad_buffer_waits_for_a_reduction_in_flight() -> None:
    for in_flight, left in run_distributed(zeroing_waits_for_the_reduction_in_flight, 2):
        assert in_flight
        assert left == 0.0


def test_no_process_group_names_init_process_group() -> None:
    """The docs' first snippet run without ``init_process_group``: a fresh interpreter (this one's default
    group is not touched by the harness, but a fresh one shows it plainly)."""
    code = (
        "from torch import nn\n"
        "from gradsync.buffers import DistributedDataParallelConfig\n"
        "from gradsync.ddp import DistributedDataParallel\n"
        "from gradsync.groups import ModelParallelConfig\n"
        "try:\n"
        "    DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), nn.Linear(2, 2))\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "torch.distributed is not initialized" in out.stdout, out
    assert "init_process_group(backend) first" in out.stdout, out
