"""Checkpoints, in the wrapper's format.

DDP strategies: one file per rank, so saving needs no communication and resuming is bit-exact. A file
holds this rank's model chunk, its optimizer state (this rank's shard with the distributed optimizer) and
the layout it was saved under; resuming under another layout is refused by name.

FSDP strategies: torch.distributed.checkpoint of the sharded model and optimizer state, which reshards, so
a run may resume at another data-parallel size; the rest of the layout must match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .strategies import Wrapped


def _rank_file(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step{step:06d}" / f"rank{rank:05d}.pt"


def save(
    directory: Path, step: int, wrapped: Wrapped, stage: torch.nn.Module, layout: dict[str, Any]
) -> Path:
    """Write this rank's part of the state after ``step`` steps."""
    if wrapped.checkpoint_format == "dcp":
        return _save_dcp(directory / f"step{step:06d}", step, wrapped, layout)
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
    if wrapped.checkpoint_format == "dcp":
        return _load_dcp(directory / f"step{step:06d}", wrapped, layout)
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


META = "gradsync.json"


def _save_dcp(path: Path, step: int, wrapped: Wrapped, layout: dict[str, Any]) -> Path:
    state = {"model": wrapped.model.state_dict(), "optim": wrapped.optimizer.state_dict()}
    dcp_save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (path / META).write_text(json.dumps({"step": step, "layout": layout}))
    dist.barrier()
    return path


def _without_world(layout: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in layout.items() if k != "world"}


def _load_dcp(path: Path, wrapped: Wrapped, layout: dict[str, Any]) -> int:
    meta = json.loads((path / META).read_text())
    if _without_world(meta["layout"]) != _without_world(layout):
        raise ValueError(
            f"--resume: the checkpoint at {path} was saved with {meta['layout']}, this run is {layout}; "
            "resume with the same strategy and layout (only the data-parallel size may change)"
        )
    state = {"model": wrapped.model.state_dict(), "optim": wrapped.optimizer.state_dict()}
    dcp_load(state, checkpoint_id=str(path))
    wrapped.model.load_state_dict(state["model"])
    wrapped.optimizer.load_state_dict(state["optim"])
    return int(meta["step"])
