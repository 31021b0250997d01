"""One replica group of the fault-tolerance tests: gradsync DDP under torchft's manager, run as a script
(one process, or each rank under torchrun) by test_fault_tolerance.py.

It trains until the manager has committed ``--steps`` steps with every replica group taking part, and
writes what the test checks: a line per attempted step (committed or not, and with how many replica
groups), the weights it started from, and its final model, optimizer and manager state. With ``--stop``
it stops at a point (``backward:S``: mid-backward at step S, after the first bucket crossed replica groups;
``between:S``: after step S committed) and waits there for the test to kill it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.ddp.fault_tolerance import register_fault_tolerant_hook, replica_state
from gradsync.groups import ModelParallelConfig, initialize_model_parallel

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


def wait_to_be_killed(out: Path, replica: int) -> None:
    (out / f"stopped_{replica}").write_text(str(os.getpid()))
    time.sleep(600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-size", type=int, default=50)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    stop_where, _, stop_step = args.stop.partition(":")

    if "RANK" in os.environ:  # under torchrun: the replica group's own world and store
        dist.init_process_group("gloo")
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        keep_store = None
    else:
        keep_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = "127.0.0.1", keep_store.port
        dist.init_process_group("gloo", store=dist.PrefixStore("replica", keep_store), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()

    pgs = initialize_model_parallel()
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, grad_reduce_in_fp32=True, bucket_size=args.bucket_size
    )
    # replica groups start from different weights: the manager's step-0 sync must make them one
    model = DistributedDataParallel(
        ModelParallelConfig(), ddp_config, build_model(args.replica, dtype), pg_collection=pgs
    )
    inner = build_optimizer(model.parameters())

    state_dict, load_state_dict = replica_state(model, inner)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"replica{args.replica}",
        store_addr=store_addr,
        store_port=store_port,
        rank=rank,
        world_size=world,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=20),
    )
    register_fault_tolerant_hook(model, manager)
    optimizer = OptimizerWrapper(manager, inner)

    first = model.module[0].weight
    stopping: dict[str, int] = {}

    def stop_mid_backward(grad: torch.Tensor) -> torch.Tensor:
        if stopping.get("backward") == manager.current_step() and rank == 0:
            wait_to_be_killed(args.out, args.replica)
        return grad

    first.register_hook(stop_mid_backward)
    if stop_where:
        stopping[stop_where] = int(stop_step)

    # the first lives of all replica groups start together, so the first quorum holds them all (a
    # restarted one finds every mark already there)
    (args.out / f"ready_{args.replica}_{rank}").touch()
    while len(list(args.out.glob("ready_*"))) < args.replicas * world:
        time.sleep(0.05)
    records = (args.out / f"records_{args.replica}_{rank}.jsonl").open("a")
    started = False
    while True:
        step = manager.current_step()
        model.zero_grad_buffer()
        optimizer.zero_grad()  # the quorum: a replica group behind the others heals here
        if not started:
            started = True
            if manager.current_step() == 0 and world > 1:
                # torchft's step-0 sync sends rank r of every group rank r's state from a source chosen
                # per rank, so the ranks of one group may get different groups' weights: make them one
                model.broadcast_params()
            weights = {k: v.clone() for k, v in model.module.state_dict().items()}
            torch.save(
                {"step": manager.current_step(), "model": weights}, args.out / f"start_{args.replica}.pt"
            )
            step = manager.current_step()
        inputs, targets = batch(args.replica, step, rank, dtype)
        F.mse_loss(model(inputs).float(), targets.float()).backward()
        model.finish_grad_sync()
        participants = manager.num_participants()
        optimizer.step()  # applies only if every replica group in the quorum reduced every bucket
        committed = manager.current_step() == step + 1
        records.write(json.dumps({"step": step, "committed": committed, "participants": participants}) + "\n")
        records.flush()
        if committed and stopping.get("between") == step and rank == 0:
            wait_to_be_killed(args.out, args.replica)
        if committed and manager.current_step() >= args.steps and participants == args.replicas:
            break

    if rank == 0:
        final = {**state_dict(), "manager": manager.state_dict()}
        torch.save(final, args.out / f"final_{args.replica}.pt")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
