"""Fault-tolerant sharded data parallelism: gradsync's FSDP2-style ``fully_shard`` (ZeRO-3) inside each
replica group, torchft across the groups (HSDP's traffic: only each rank's shard crosses groups).

Run it as examples/fault_tolerance_ddp.py says (three groups of two ranks here), or all of it on one
machine, a group killed and restarted on the way:

    python examples/fault_tolerance_launch.py examples/fault_tolerance_fsdp.py --ranks 2

A restarted group heals from a peer, each rank its own shard. The data, manager and loop are in
torchft_loop.py. Needs torchft (``pip install "packages/gradsync-fsdp[torchft]"``, torch 2.7 or later).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchft_loop import LR, build_manager, build_model, save, train

from gradsync.fsdp.fault_tolerance import find_lighthouse, register_fault_tolerant_hook, replica_state
from gradsync.fsdp.fsdp2 import fully_shard, megatron_fsdp_of


def main() -> None:
    dist.init_process_group("gloo")  # the replica group's own world, from torchrun
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # the group's own ranks ("cuda" on GPUs)
    module = build_model()
    for layer in module.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    model = fully_shard(module, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)

    state_dict, load_state_dict = replica_state(model, inner)
    # every group builds the same weights: torchft's step-0 sync would pick a source rank by rank
    manager = build_manager(state_dict, load_state_dict, find_lighthouse(), init_sync=False)
    register_fault_tolerant_hook(model, manager)
    # the next forward starts gradsync's cycle, and the backward's end reduces: no calls around it
    train(model, inner, manager, lambda: None, lambda: None)

    save(manager, megatron_fsdp_of(model).full_state_dict())  # whole on every rank (a collective)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
