"""Fault-tolerant data parallelism: gradsync DDP inside each replica group, torchft across the groups.

One invocation is one replica group (its ranks started by torchrun). A group that dies is dropped from
the quorum while the others train on; restarted, it heals from a peer and rejoins. The data, manager and
loop are in torchft_loop.py.

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 &
    REPLICA_GROUP=0 NUM_REPLICA_GROUPS=3 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
        torchrun --nproc-per-node 1 --master-port 29600 examples/fault_tolerance_ddp.py
    # ... groups 1 and 2 the same, each with its own --master-port

``python examples/fault_tolerance_launch.py examples/fault_tolerance_ddp.py`` does all of it on one
machine and kills and restarts a group on the way. Needs torchft (``pip install
"packages/gradsync-ddp[torchft]"``, torch 2.7 or later).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchft_loop import LR, build_manager, build_model, save, train

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.ddp.fault_tolerance import find_lighthouse, register_fault_tolerant_hook, replica_state
from gradsync.groups import ModelParallelConfig, initialize_model_parallel


def main() -> None:
    dist.init_process_group("gloo")  # the replica group's own world, from torchrun
    pgs = initialize_model_parallel(tensor_model_parallel_size=1)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    model = DistributedDataParallel(ModelParallelConfig(), ddp_config, build_model(), pg_collection=pgs)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)

    state_dict, load_state_dict = replica_state(model, inner)
    manager = build_manager(state_dict, load_state_dict, find_lighthouse())  # TORCHFT_LIGHTHOUSE
    register_fault_tolerant_hook(model, manager)
    train(model, inner, manager, model.zero_grad_buffer, model.finish_grad_sync)

    save(manager, model.module.state_dict())
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
