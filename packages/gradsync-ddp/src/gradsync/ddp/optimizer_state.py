"""DistributedOptimizer checkpoints: gathered (full tensors by param name) and sharded (this rank's pieces).

Both forms are keyed by param name and full-param positions, not by rank or bucket, so they load at any
DP size: loading slices each rank's new pieces out of the full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync.groups.objects import all_gather_objects, gather_objects

if TYPE_CHECKING:
    from .distributed_optimizer import DistributedOptimizer

MAIN_PARAM_KEY = "param"


def is_elementwise(value: Any, numel: int) -> bool:
    """A state tensor with one entry per param element (exp_avg), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def refuse_structured_state(opt: DistributedOptimizer) -> None:
    """Checkpoints hold per-element state (shaped like its main param) and scalars; anything else (block
    Shampoo's per-tile statistics, one set per rank's piece) has no place in a per-param entry and would
    be merged wrongly, so it is refused before any collective. Every rank raises alike: the state's
    kinds come from the optimizer's class, the same on every rank."""
    for piece in opt.pieces:
        for key, value in opt.optimizer.state.get(piece.main, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != piece.main.shape:
                raise ValueError(
                    f"DistributedOptimizer checkpoints: {type(opt.optimizer).__name__}'s state {key!r} of "
                    f"{piece.name} has shape {tuple(value.shape)}, neither one value per element of its "
                    f"main param {tuple(piece.main.shape)} nor a scalar; gradsync-ddp cannot reshard it. "
                    "Checkpoint such optimizers under gradsync-fsdp with torch.distributed.checkpoint"
                )


def hyperparams(opt: DistributedOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]


def _elementwise_keys(opt: DistributedOptimizer, buffer_key: int, group: dist.ProcessGroup) -> list[str]:
    """The per-element state keys (exp_avg, ...) any rank of ``group`` holds for this buffer; every rank
    must agree on them before the per-key collectives."""
    local = {
        k
        for piece in opt.pieces
        if piece.buffer_key == buffer_key
        for k, v in opt.optimizer.state.get(piece.main, {}).items()
        if is_elementwise(v, piece.main.numel())
    }
    return sorted(set().union(*all_gather_objects(local, group)))


def _value(opt: DistributedOptimizer, piece: Any, key: str) -> torch.Tensor:
    if key == MAIN_PARAM_KEY:
        return piece.main.detach()  # type: ignore[no-any-return]
    return opt.optimizer.state[piece.main][key]  # type: ignore[no-any-return]


def _gather_bucket(
    opt: DistributedOptimizer, buffer_key: int, bucket: int, key: str, saver: int
) -> torch.Tensor | None:
    """This bucket's values of ``key`` on the saving rank (None elsewhere): each rank sends its shard."""
    buffer = opt.buffers[buffer_key]
    group = buffer.data_parallel_group
    start, end = buffer.bucket_indices[bucket]
    size = (end - start) // group.size()
    mine = start + group.rank() * size
    shard = torch.zeros(size, dtype=torch.float32, device=buffer.device)
    for piece in opt.pieces:
        if piece.buffer_key == buffer_key and buffer.param_to_bucket[piece.param].bucket_id == bucket:
            offset = buffer.param_index_map[piece.param][0] + piece.param_range[0] - mine
            shard[offset : offset + piece.main.numel()] = _value(opt, piece, key).reshape(-1)
    receiving = group.rank() == 0
    parts = [torch.empty_like(shard) for _ in range(group.size())] if receiving else None
    dist.gather(shard, parts, dst=saver, group=group)
    return torch.cat(parts) if parts is not None else None


def gather_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """The state of each buffer's params on rank 0 of its group, streamed one bucket at a time, so no
    rank ever holds more than one bucket per key beyond what it saves. Tensors come back on the CPU."""
    refuse_structured_state(opt)
    state: dict[str, dict[str, Any]] = {}
    for key, buffer in enumerate(opt.buffers):
        group = buffer.data_parallel_group
        if opt.sharded:
            saver = dist.get_global_rank(group, 0)
            for name in [MAIN_PARAM_KEY, *_elementwise_keys(opt, key, group)]:
                for bucket in buffer.buckets:
                    flat = _gather_bucket(opt, key, bucket.bucket_id, name, saver)
                    if flat is None:
                        continue
                    for param in bucket.params_list:
                        start, end = bucket.param_to_index[param]
                        entry = state.setdefault(opt.param_names[param], {})
                        entry[name] = flat[start:end].view(param.shape).cpu()
        else:
            for piece in (p for p in opt.pieces if p.buffer_key == key):
                entry = state.setdefault(
                    piece.name, {MAIN_PARAM_KEY: piece.main.detach().view(piece.param.shape).cpu()}
                )
                for name, value in opt.optimizer.state.get(piece.main, {}).items():
                    if is_elementwise(value, piece.main.numel()):
                        entry[name] = value.view(piece.param.shape).cpu()
        scalars = {  # on the CPU before pickling: a CUDA tensor would unpickle onto the sender's device
            piece.name: {
                k: v.cpu() if isinstance(v, torch.Tensor) else v
                for k, v in opt.optimizer.state.get(piece.main, {}).items()
                if not is_elementwise(v, piece.main.numel())
            }
            for piece in opt.pieces
            if piece.buffer_key == key
        }
        parts: list[dict[str, dict[str, Any]]] = [scalars]
        if opt.sharded:
            parts = gather_objects(scalars, dist.get_global_rank(group, 0), group) or []
        for part in parts:
            for param_name, values in part.items():
                state[param_name].update(values)
    return {"format": "gathered", "param_groups": hyperparams(opt), "state": state}


def shard_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's pieces: for each, the full param's shape, the piece's range and its state."""
    refuse_structured_state(opt)
    pieces = []
    for piece in opt.pieces:
        values = {MAIN_PARAM_KEY: piece.main.detach().clone()}
        values.update(opt.optimizer.state.get(piece.main, {}))
        pieces.append(
            {
                "name": piece.name,
                "shape": tuple(piece.param.shape),
                "range": piece.param_range,
                "state": {
                    k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()
                },
            }
        )
    return {"format": "sharded", "param_groups": hyperparams(opt), "pieces": pieces}


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
                if is_elementwise(value, end - start):
                    full = entry.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                    full[start:end] = value.reshape(-1)  # shaped pieces (shard_alignment) too
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


def apply_hyperparams(opt: DistributedOptimizer, saved_groups: Sequence[dict[str, Any]]) -> None:
    """Set every param group's hyper-parameters from a checkpoint's (the groups are index-aligned)."""
    if len(saved_groups) != len(opt.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
            f"{len(opt.optimizer.param_groups)}"
        )
    for group, saved in zip(opt.optimizer.param_groups, saved_groups, strict=True):
        group.update(saved)


def load_state(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """Slice this rank's pieces out of a gathered state dict."""
    if state_dict.get("format") != "gathered":
        raise ValueError(
            "load_state_dict takes a gathered state dict; use load_sharded_state_dict for shards"
        )
    apply_hyperparams(opt, state_dict["param_groups"])
    for piece in opt.pieces:
        if piece.name not in state_dict["state"]:
            raise ValueError(f"the checkpoint has no optimizer state for {piece.name}")
        saved = state_dict["state"][piece.name]
        start, end = piece.param_range
        restored: dict[str, Any] = {}
        for key, value in saved.items():
            if is_elementwise(value, piece.param.numel()):
                sliced = value.reshape(-1)[start:end].to(piece.main.device).view(piece.shape)
                if key == MAIN_PARAM_KEY:
                    with torch.no_grad():
                        piece.main.copy_(sliced)
                    continue
                restored[key] = sliced.clone()
            else:
                restored[key] = (
                    value.clone() if isinstance(value, torch.Tensor) else value
                )  # keeps its device
        if restored:
            opt.optimizer.state[piece.main] = restored
