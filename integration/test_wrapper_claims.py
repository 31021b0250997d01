"""One module, two wrappers of different packages: a MegatronFSDP over a module whose params a live
gradsync-ddp wrapper still holds is refused by name on every rank (it trained nothing before: the DDP
wrapper's hooks took every grad). Once the DDP wrapper is dropped, the module wraps."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.fsdp import fully_shard_model
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed, test_device


def fsdp_over_a_ddp_wrapped_module() -> tuple[str, str]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(test_device())
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), module)
    try:
        fully_shard_model(module, zero_dp_strategy="optim")
        refused = "ok"
    except ValueError as error:
        refused = str(error)
    del ddp
    gc.collect()
    model = fully_shard_model(module, zero_dp_strategy="optim")
    model(torch.ones(2, 8, device=test_device())).sum().backward()
    return refused, f"trained on rank {dist.get_rank()}"


def test_a_ddp_wrapped_module_is_refused_by_megatron_fsdp_until_dropped() -> None:
    for rank, (refused, after) in enumerate(run_distributed(fsdp_over_a_ddp_wrapped_module, 2)):
        assert "MegatronFSDP: param 0.weight is held by a live DistributedDataParallel" in refused, refused
        assert after == f"trained on rank {rank}"
