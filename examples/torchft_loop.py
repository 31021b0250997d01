"""The torchft side of the two fault-tolerance examples (fault_tolerance_ddp.py, fault_tolerance_fsdp.py):
the replica group's model and data, torchft's manager, and the training loop, whatever wraps the model.

Each group trains on its own shard of the data (torchft's sampler: groups x ranks shards). The loop prints
every committed step's loss on rank 0 of each group and, at the end, saves the manager's state (its step
count, which belongs in every checkpoint of a torchft job) beside the whole weights.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchft import Manager, ProcessGroupGloo
from torchft.data import DistributedSampler
from torchft.optim import OptimizerWrapper

STEPS, ROWS, LR = int(os.environ.get("STEPS", "40")), 8, 1e-2


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every group starts from the same weights
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))


def replica_group() -> tuple[int, int]:
    """This replica group's number and how many the job has (the launcher's environment)."""
    return int(os.environ["REPLICA_GROUP"]), int(os.environ["NUM_REPLICA_GROUPS"])


def build_manager(
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    lighthouse: str,
    **options: Any,
) -> Manager:
    """torchft's manager for this rank: its store is torchrun's (MASTER_ADDR, MASTER_PORT)."""
    replica, _ = replica_group()
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,  # what a step needs to commit; the lighthouse's --min_replicas forms quorums
        use_async_quorum=False,
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=20),
        **options,
    )


def train(
    model: nn.Module,
    inner: torch.optim.Optimizer,
    manager: Manager,
    start_cycle: Callable[[], None],
    end_cycle: Callable[[], None],
) -> None:
    """Train until ``STEPS`` steps committed and every group is in the quorum (a restarted group heals
    and rejoins before the job ends); ``start_cycle`` / ``end_cycle`` are the wrapper's own calls around a
    backward (Megatron's ``zero_grad_buffer()`` / ``finish_grad_sync()``; nothing for FSDP2)."""
    rank = dist.get_rank()
    replica, groups = replica_group()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 16, generator=generator)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(data, replica_rank=replica, num_replica_groups=groups, group_rank=rank)
    loader = DataLoader(data, batch_size=ROWS, sampler=sampler)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    optimizer = OptimizerWrapper(manager, inner)  # zero_grad() joins the quorum, step() commits or not
    while manager.current_step() < STEPS or manager.num_participants() < groups:
        inputs, targets = next(batches)
        start_cycle()
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        end_cycle()
        step = manager.current_step()
        optimizer.step()
        if rank == 0 and manager.current_step() == step + 1:  # committed
            groups_in = manager.num_participants()
            print(
                f"group {replica} step {step} loss {float(loss.detach()):.6f} groups {groups_in}", flush=True
            )


def save(manager: Manager, weights: dict[str, torch.Tensor]) -> None:
    """Rank 0 of the group writes the manager's state and the whole weights to ``CHECKPOINT_DIR``."""
    replica, _ = replica_group()
    if dist.get_rank() == 0:
        out = Path(os.environ.get("CHECKPOINT_DIR", "checkpoints"))
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"manager": manager.state_dict(), "model": weights}, out / f"group{replica}.pt")
