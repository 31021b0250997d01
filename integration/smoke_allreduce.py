"""2-rank smoke job for torchrun: build the process groups, all-reduce over each, tear down.

torchrun --standalone --nproc-per-node=2 integration/smoke_allreduce.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gradsync.groups import (
    default_backend,
    destroy_process_groups,
    device_for_group,
    initialize_model_parallel,
)


def main() -> None:
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    backend = default_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = initialize_model_parallel(tensor_model_parallel_size=1)
    device = device_for_group(groups.dp)
    for name in ("dp", "dp_cp", "tp", "pp", "intra_dist_opt"):
        group = getattr(groups, name)
        t = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(t, group=group)
        expected = sum(r + 1 for r in dist.get_process_group_ranks(group))
        if t.item() != expected:
            raise SystemExit(f"rank {rank}: all_reduce over {name} gave {t.item()}, expected {expected}")
    if rank == 0:
        print(f"smoke ok: world {world}, backend {backend}, {groups!r}")
    destroy_process_groups(groups)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
