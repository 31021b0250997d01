"""DistributedOptimizer checkpoints: gathered (full tensors by param name) and sharded (this rank's pieces).

Both forms are keyed by param name and full-param positions, not by rank or bucket, so they load at any
DP size: loading slices each rank's new pieces out of the full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .distributed_optimizer import DistributedOptimizer

MAIN_PARAM_KEY = "param"


def _is_elementwise(value: Any, numel: int) -> bool:
    """A state tensor with one entry per param element (exp_avg), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _hyperparams(opt: DistributedOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]


def gather_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """Every rank gets the full state: each element has exactly one owner, so a SUM assembles it."""
    state: dict[str, dict[str, Any]] = {}
    for key, buffer in enumerate(opt.buffers):
        pieces = [p for p in opt.pieces if p.buffer_key == key]
        group = buffer.data_parallel_group
        local_kinds = {
            k: _is_elementwise(v, piece.main.numel())
            for piece in pieces
            for k, v in opt.optimizer.state.get(piece.main, {}).items()
        }
        everyone: list[dict[str, bool] | None] = [None] * group.size()
        dist.all_gather_object(everyone, local_kinds, group=group)
        kinds = {k: v for d in everyone if d for k, v in d.items()}
        for name in [MAIN_PARAM_KEY, *sorted(k for k, elementwise in kinds.items() if elementwise)]:
            flat = torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.device)
            for piece in pieces:
                value = piece.main if name == MAIN_PARAM_KEY else opt.optimizer.state[piece.main][name]
                start = buffer.param_index_map[piece.param][0] + piece.param_range[0]
                flat[start : start + piece.main.numel()] = value.detach()
            dist.all_reduce(flat, group=group)
            for param in buffer.params:
                start, end, _ = buffer.param_index_map[param]
                state.setdefault(opt.param_names[param], {})[name] = flat[start:end].view(param.shape).clone()
        scalars = {
            piece.name: {
                k: v for k, v in opt.optimizer.state.get(piece.main, {}).items() if not kinds.get(k, False)
            }
            for piece in pieces
        }
        gathered: list[dict[str, dict[str, Any]] | None] = [None] * group.size()
        dist.all_gather_object(gathered, scalars, group=group)
        for part in gathered:
            for param_name, values in (part or {}).items():
                state[param_name].update(values)
    return {"format": "gathered", "param_groups": _hyperparams(opt), "state": state}


def shard_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's pieces: for each, the full param's shape, the piece's range and its state."""
    pieces = []
    for piece in opt.pieces:
        values = {MAIN_PARAM_KEY: piece.main.detach().clone()}
        values.update(opt.optimizer.state.get(piece.main, {}))
        pieces.append(
            {
                "name": piece.name,
                "shape": tuple(piece.param.shape),
                "range": piece.param_range,
                "state": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()},
            }
        )
    return {"format": "sharded", "param_groups": _hyperparams(opt), "pieces": pieces}


def merge_shards(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Assemble every rank's sharded state dict into the gathered form."""
    state: dict[str, dict[str, Any]] = {}
    covered: dict[str, int] = {}
    for shard in shards:
        if shard.get("format") != "sharded":
            raise ValueError("merge_shards takes the dicts returned by sharded_state_dict()")
        for piece in shard["pieces"]:
            start, end = piece["range"]
            numel = int(torch.Size(piece["shape"]).numel())
            entry = state.setdefault(piece["name"], {})
            covered[piece["name"]] = covered.get(piece["name"], 0) + end - start
            for key, value in piece["state"].items():
                if _is_elementwise(value, end - start):
                    full = entry.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                    full[start:end] = value
                else:
                    entry[key] = value
    for name, entry in state.items():
        shape = next(s["shape"] for shard in shards for s in shard["pieces"] if s["name"] == name)
        if covered[name] != torch.Size(shape).numel():
            raise ValueError(
                f"the shards cover {covered[name]} of {torch.Size(shape).numel()} elements of {name}"
            )
        for key, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == 1
                and value.numel() == torch.Size(shape).numel()
            ):
                entry[key] = value.view(shape)
    return {"format": "gathered", "param_groups": shards[0]["param_groups"], "state": state}


def load_state(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """Slice this rank's pieces out of a gathered state dict."""
    if state_dict.get("format") != "gathered":
        raise ValueError(
            "load_state_dict takes a gathered state dict; use load_sharded_state_dict for shards"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
            f"{len(opt.optimizer.param_groups)}"
        )
    for group, saved in zip(opt.optimizer.param_groups, saved_groups, strict=True):
        group.update(saved)
    for piece in opt.pieces:
        if piece.name not in state_dict["state"]:
            raise ValueError(f"the checkpoint has no optimizer state for {piece.name}")
        saved = state_dict["state"][piece.name]
        start, end = piece.param_range
        restored: dict[str, Any] = {}
        for key, value in saved.items():
            if _is_elementwise(value, piece.param.numel()):
                sliced = value.reshape(-1)[start:end].to(piece.main.device)
                if key == MAIN_PARAM_KEY:
                    with torch.no_grad():
                        piece.main.copy_(sliced)
                    continue
                restored[key] = sliced.clone()
            else:
                restored[key] = value.clone() if isinstance(value, torch.Tensor) else value
        if restored:
            opt.optimizer.state[piece.main] = restored
