"""One replica group of MegatronFSDP's fault-tolerance tests: the model sharded over the group's own ranks
(``--strategy``; ``--api``: MegatronFSDP's ``fully_shard``, or the FSDP2-style API with gradsync's
``register_fault_tolerant_hook`` or torchft's all-reduce hook), torchft's manager the outer replication;
run by test_fault_tolerance.py through :class:`gradsync.groups.testing.replica_groups.ReplicaScript`.

Every replica group builds the same weights (the manager's step-0 sync is off: it would pick its source
rank by rank). At the end it writes the whole weights (rank 0) and each rank's shard of the optimizer state.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchft.optim import OptimizerWrapper
from torchft.process_group import ManagedProcessGroup

from gradsync.fsdp import MegatronFSDP, fsdp2, fully_shard
from gradsync.fsdp.fault_tolerance import register_fault_tolerant_hook, replica_state
from gradsync.groups.testing.replica_groups import ReplicaScript

LR = 1e-2


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(replica: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * replica + rank)
    inputs = torch.randn(4, 8, generator=generator)
    return inputs, inputs[:, :4].sin()


def build_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def count_bytes_across_groups(manager: Any) -> list[int]:
    """The bytes of every tensor this rank hands the manager to all-reduce across groups, summed per step
    into the list's last entry."""
    allreduce, sent = manager.allreduce, [0]

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[-1] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted
    return sent


def build_wrapped(api: str, strategy: str) -> tuple[nn.Module, MegatronFSDP, torch.optim.Optimizer]:
    """The model to train, the MegatronFSDP behind it and the inner optimizer: MegatronFSDP's own
    ``fully_shard`` (``megatron``), or the FSDP2-style API's (``fsdp2``, ``fsdp2-hook``: the first layer
    a unit, then the root; ZeRO-3 when ``strategy`` shards the params, else ZeRO-2)."""
    module = build_model()
    if api == "megatron":
        model, inner = fully_shard(
            module, build_optimizer(module.parameters()), zero_dp_strategy=strategy, fsdp_unit_modules=[]
        )
        return model, model, inner
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = strategy == "optim_grads_params"
    fsdp2.fully_shard(module[0], mesh=mesh, reshard_after_forward=reshard)
    fsdp2.fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    return module, fsdp2.megatron_fsdp_of(module), build_optimizer(module.parameters())


def across_groups_by_hook(model: nn.Module, manager: Any) -> None:
    """torchft's FSDP2 pattern (torchtitan's ``maybe_set_all_reduce_hook``): every FSDP module's reduced
    shard averaged across the replica groups through the manager's process group."""
    replicate = ManagedProcessGroup(manager)
    replicate.register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, fsdp2.FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--api", choices=["megatron", "fsdp2", "fsdp2-hook"], default="megatron")
    script = ReplicaScript(parser)
    model, fsdp, inner = build_wrapped(script.args.api, script.args.strategy)
    state_dict, load_state_dict = replica_state(model, inner)
    manager = script.manager(state_dict, load_state_dict, init_sync=False)
    if script.args.api == "fsdp2-hook":
        across_groups_by_hook(model, manager)
    else:
        register_fault_tolerant_hook(model, manager)
    sent = count_bytes_across_groups(manager)
    optimizer = OptimizerWrapper(manager, inner)

    with torch.no_grad():  # an evaluation forward before training: a heal must not leave its weights
        model(batch(script.replica, -1, script.rank)[0])

    script.start_together()
    while True:
        optimizer.zero_grad()  # the quorum first: a heal marks the model stepped
        if script.args.api == "megatron":
            fsdp.zero_grad_buffer()  # (the FSDP2-style API's next forward starts the cycle itself)
        step = manager.current_step()
        inputs, targets = batch(script.replica, step, script.rank)
        inputs.requires_grad_().register_hook(script.backward_hook())  # the last grad: the buckets still wait
        F.mse_loss(model(inputs), targets).backward()  # the buckets reduce as backward ends
        script.reduced(step)
        sent.append(0)  # the next step's bytes
        participants = manager.num_participants()
        optimizer.step()
        committed = manager.current_step() == step + 1
        script.record(step, committed, participants)
        if script.done(committed, manager.current_step(), participants):
            break

    final = {
        "model": fsdp.full_state_dict(),
        "optimizer": state_dict()["optimizer"],
        "manager": manager.state_dict(),
        "sent": sent[:-1],  # bytes this rank sent across groups, step by step
        "rows": sum(b.stepped_grads().numel() * b.stepped_grads().element_size() for b in fsdp.buckets),
        "whole": sum(b.layout.size * b.stepped_grads().element_size() for b in fsdp.buckets),
    }
    torch.save(final, script.out / f"final_{script.replica}_{script.rank}.pt")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
