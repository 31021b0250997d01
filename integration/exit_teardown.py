"""One rank of a short training run that ends as the examples end (``destroy_process_group``, then the
interpreter exits), reporting how many gloo worker threads are still alive once gradsync's exit release
has run: each is a group that outlives the interpreter's finalization, where a worker freeing its last
collective aborts the process (``gradsync.groups.teardown``). Run by ``test_exit.py``.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python integration/exit_teardown.py ddp

and the same with RANK=1.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any


def gloo_workers() -> int:
    """gloo's worker threads in this process (Linux names them ``pt_gloo_runloop``)."""
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for task in os.listdir(tasks):
        with open(f"{tasks}/{task}/comm") as comm:
            names.append(comm.read().strip())
    return names.count("pt_gloo_runloop")


def report() -> None:
    print(f"gloo workers at exit: {gloo_workers()}", flush=True)


# registered before gradsync is imported, so it runs after gradsync's exit release (atexit runs last-in first)
atexit.register(report)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from gradsync.buffers import DistributedDataParallelConfig  # noqa: E402
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer  # noqa: E402
from gradsync.fsdp import MegatronFSDP  # noqa: E402
from gradsync.fsdp.fsdp2 import fully_shard  # noqa: E402
from gradsync.groups import FSDPDistributedIndex, ModelParallelConfig, initialize_model_parallel  # noqa: E402


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 1))


def train(wrapper: str) -> None:
    """``wrapper``: ``ddp`` (with the distributed optimizer), ``megatron_fsdp`` (ZeRO-3), ``fully_shard``."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if wrapper == "ddp":
        groups = initialize_model_parallel(tensor_model_parallel_size=1)
        config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=64,
        )
        model: Any = DistributedDataParallel(ModelParallelConfig(), config, build(), pg_collection=groups)
        optimizer: Any = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, None)
    elif wrapper == "fully_shard":
        model = build()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        )
        index = FSDPDistributedIndex.from_sizes(dist.get_world_size(), 1, device_type="cpu")
        module = build()
        model = MegatronFSDP(module, index, config, fsdp_unit_modules=[nn.Linear])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + rank)
        inputs = torch.randn(4, 8, generator=generator)
        if wrapper == "fully_shard":  # FSDP2's loop: the wrapper syncs by itself
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            continue
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        model.finish_grad_sync()
        optimizer.step()
        if isinstance(model, MegatronFSDP):
            model.install_optimized_model_weights()
    loss = model(inputs).square().mean().detach()
    dist.all_reduce(loss)  # the examples' last collective: a blocking all-reduce on the default group
    dist.destroy_process_group()


if __name__ == "__main__":
    train(sys.argv[1])
