"""Reassemble the single-process model's parameters from every rank's share (for the parity tests)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.buffers import is_expert_parallel
from gradsync.groups import ProcessGroupCollection
from gradsync.groups.objects import gather_objects

from .model import TIED_COPY, GPTStage
from .parallel_ops import group_rank, group_size

TIED_COPY_KEY = f"{TIED_COPY} (last stage's copy of wte.weight)"


@torch.no_grad()
def gather_full_params(
    stage: GPTStage, groups: ProcessGroupCollection, values: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """A collective over the world: full params keyed by their single-process names, on rank 0 (None
    elsewhere). TP shards are concatenated; each param is taken from its first data-parallel replica.
    ``values`` (by the stage's own names) stand in for params whose module tensors are not whole."""
    kept: dict[str, torch.Tensor] = {}
    for name, param in stage.named_parameters():
        value = (values[name] if values is not None else param.detach()).to(param.device)
        dim = getattr(param, "partition_dim", None)
        if dim is not None and group_size(groups.tp) > 1:
            parts = [torch.empty_like(value) for _ in range(group_size(groups.tp))]
            dist.all_gather(parts, value.contiguous(), group=groups.tp)
            value = torch.cat(parts, dim=dim)
        replica_group = groups.expt_dp if is_expert_parallel(param) else groups.dp_cp
        if group_rank(groups.tp) == 0 and group_rank(replica_group) == 0:
            kept[TIED_COPY_KEY if name == TIED_COPY else name] = value.cpu().clone()
    gathered: list[dict[str, torch.Tensor]] | None = gather_objects(kept, dst=0)
    if gathered is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    return full
