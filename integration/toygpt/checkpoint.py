"""Checkpoints: one file per rank, so saving needs no communication and resuming is bit-exact.

A file holds this rank's model chunk, its optimizer state (this rank's shard with the distributed
optimizer) and the layout it was saved under; resuming under another layout is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .strategies import Wrapped


def _rank_file(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step{step:06d}" / f"rank{rank:05d}.pt"


def save(
    directory: Path, step: int, wrapped: Wrapped, stage: torch.nn.Module, layout: dict[str, Any]
) -> Path:
    """Write this rank's file for the state after ``step`` steps."""
    wrapped.settle_params()
    optimizer = wrapped.optimizer
    path = _rank_file(directory, step, dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": step,
        "layout": layout,
        "model": stage.state_dict(),
        "optimizer": optimizer.sharded_state_dict() if wrapped.sharded_optimizer else optimizer.state_dict(),
    }
    torch.save(payload, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # never leave a torn file behind
    dist.barrier()
    return path.parent


def latest_step(directory: Path) -> int | None:
    steps = sorted(int(p.name.removeprefix("step")) for p in directory.glob("step*") if p.is_dir())
    return steps[-1] if steps else None


def load(
    directory: Path, wrapped: Wrapped, stage: torch.nn.Module, layout: dict[str, Any], dp_group: Any
) -> int:
    """Restore the latest checkpoint under ``directory``; returns the number of steps it had done."""
    step = latest_step(directory)
    if step is None:
        raise FileNotFoundError(f"--resume: no step*/ checkpoint directory under {directory}")
    mine = torch.load(_rank_file(directory, step, dist.get_rank()), weights_only=False)
    if mine["layout"] != layout:
        raise ValueError(
            f"--resume: the checkpoint at {directory} was saved with {mine['layout']}, this run is {layout}; "
            "resume with the same strategy and layout"
        )
    stage.load_state_dict(mine["model"])
    if wrapped.sharded_optimizer:
        # Every piece this rank owns is in the shards of its data-parallel peers (itself included).
        peers = dist.get_process_group_ranks(dp_group)
        shards = [torch.load(_rank_file(directory, step, r), weights_only=False)["optimizer"] for r in peers]
        wrapped.optimizer.load_sharded_state_dict(shards)
    else:
        wrapped.optimizer.load_state_dict(mine["optimizer"])
    return int(mine["step"])
