"""One replica group of the fault-tolerance tests: gradsync DDP under torchft's manager, run as a script
(one process, or each rank under torchrun) by test_fault_tolerance.py, through
:class:`gradsync.groups.testing.replica_groups.ReplicaScript` (its arguments, stops and records).

It trains until the manager has committed ``--steps`` steps with every replica group taking part, and
writes the weights it started from and its final model, optimizer and manager state.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchft.optim import OptimizerWrapper

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.ddp.fault_tolerance import register_fault_tolerant_hook, replica_state
from gradsync.groups import ModelParallelConfig, initialize_model_parallel
from gradsync.groups.testing.replica_groups import ReplicaScript

LR = 1e-2
ROWS = 4


def build_model(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batch(replica: int, step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * replica + rank)
    inputs = torch.randn(ROWS, 8, generator=generator)
    return inputs.to(dtype), inputs[:, :4].sin().to(dtype)


def build_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-size", type=int, default=50)
    script = ReplicaScript(parser)
    args, dtype = script.args, getattr(torch, script.args.dtype)

    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, grad_reduce_in_fp32=True, bucket_size=args.bucket_size
    )
    # replica groups start from different weights: the manager's step-0 sync must make them one
    module = build_model(script.replica, dtype)
    pgs = initialize_model_parallel()
    model = DistributedDataParallel(ModelParallelConfig(), ddp_config, module, pg_collection=pgs)
    inner = build_optimizer(model.parameters())
    state_dict, load_state_dict = replica_state(model, inner)
    manager = script.manager(state_dict, load_state_dict)
    register_fault_tolerant_hook(model, manager)
    optimizer = OptimizerWrapper(manager, inner)

    module[0].weight.register_hook(script.backward_hook())  # its grad comes last

    script.start_together()
    started = False
    while True:
        model.zero_grad_buffer()
        optimizer.zero_grad()  # the quorum: a replica group behind the others heals here
        step = manager.current_step()  # (after the quorum: a heal moves it)
        if not started:
            started = True
            if step == 0 and script.world > 1:
                # torchft's step-0 sync sends rank r of every group rank r's state from a source chosen
                # per rank, so the ranks of one group may get different groups' weights: make them one
                model.broadcast_params()
            start = args.out / f"start_{script.replica}.pt"
            if not start.exists():  # the first life's (a restarted one starts from a heal, or fails to)
                weights = {k: v.clone() for k, v in model.module.state_dict().items()}
                torch.save({"step": step, "model": weights}, start)
        inputs, targets = batch(script.replica, step, script.rank, dtype)
        F.mse_loss(model(inputs).float(), targets.float()).backward()
        model.finish_grad_sync()
        script.reduced(step)
        participants = manager.num_participants()
        optimizer.step()  # applies only if every replica group in the quorum reduced every bucket
        committed = manager.current_step() == step + 1
        script.record(step, committed, participants)
        if script.done(committed, manager.current_step(), participants):
            break

    if script.rank == 0:
        final = {**state_dict(), "manager": manager.state_dict()}
        torch.save(final, args.out / f"final_{script.replica}.pt")
    manager.shutdown(wait=False)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
