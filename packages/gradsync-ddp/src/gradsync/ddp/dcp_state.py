"""DistributedOptimizer state through ``torch.distributed.checkpoint`` (DCP), resharding across DP sizes.

Every param's state is saved as a flat tensor of the param's numel elements (the distributed optimizer
shards buckets by element, not by row). With the distributed optimizer each rank's piece of it is a
``Shard(0)`` DTensor over the buffer's data-parallel group whose chunk is the piece's true element range
(:func:`gradsync.buffers.checkpointing.describe_chunk`); without it the whole param is a plain tensor,
replicated across DP, which DCP writes once. Either way a checkpoint loads at any DP size, sharded or not.

The state dict's tensors are the optimizer's own (views of the fp32 main params, the state tensors), so
``dcp.load`` fills them in place. Keys are param names, prefixed with the model-parallel position where
values differ between positions: ``tp<r>.pp<r>.`` for dense params, ``ep<r>.etp<r>.pp<r>.`` for experts
(only the dimensions larger than one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gradsync.buffers import is_expert_parallel
from gradsync.buffers.checkpointing import describe_chunk, materialize_optimizer_state

from .main_shards import ShardPiece
from .optimizer_state import (
    MAIN_PARAM_KEY,
    apply_hyperparams,
    hyperparams,
    is_elementwise,
    refuse_structured_state,
)

if TYPE_CHECKING:
    from .distributed_optimizer import DistributedOptimizer


def _position(opt: DistributedOptimizer, piece: ShardPiece) -> str:
    """The key prefix naming where this param's values live in the model-parallel layout."""
    pg = opt.model_chunks[0].pg_collection
    axes = (
        (("ep", pg.ep), ("etp", pg.expt_tp), ("pp", pg.pp))
        if is_expert_parallel(piece.param)
        else (("tp", pg.tp), ("pp", pg.pp))
    )
    return "".join(f"{n}{g.rank()}." for n, g in axes if g is not None and g.size() > 1)


def dcp_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """``{"param_groups": [...], "state": {key: {"param": ..., "exp_avg": ..., "step": ...}}}`` for
    ``dcp.save`` / ``dcp.load``, with this rank's pieces (materialising the state if nothing has stepped)."""
    if not opt.optimizer.state:  # nothing stepped yet: give the load tensors to fill
        materialize_optimizer_state(opt.optimizer)
    refuse_structured_state(opt)
    meshes: dict[dist.ProcessGroup, DeviceMesh] = {}
    state: dict[str, dict[str, Any]] = {}
    for piece in opt.pieces:
        values = {MAIN_PARAM_KEY: piece.main.detach(), **opt.optimizer.state.get(piece.main, {})}
        entry: dict[str, Any] = {}
        for key, value in values.items():
            if is_elementwise(value, piece.main.numel()):
                entry[key] = _flat_global(opt, piece, value.view(-1), meshes)
            else:
                entry[key] = value
        state[_position(opt, piece) + piece.name] = entry
    return {"param_groups": hyperparams(opt), "state": state}


def _flat_global(
    opt: DistributedOptimizer,
    piece: ShardPiece,
    local: torch.Tensor,
    meshes: dict[dist.ProcessGroup, DeviceMesh],
) -> torch.Tensor:
    """``local`` (this rank's piece) as part of the flattened param: itself when it is the whole param,
    else a DTensor shard at the piece's offset."""
    if not opt.sharded:
        return local
    if piece.group not in meshes:
        meshes[piece.group] = DeviceMesh.from_group(piece.group, local.device.type)
    numel = piece.param.numel()
    global_tensor = DTensor.from_local(
        local, meshes[piece.group], [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
    )
    return describe_chunk(global_tensor, [piece.param_range[0]])


def load_dcp_state(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """Adopt a state dict that ``dcp.load`` filled (one built by :func:`dcp_state`): hyper-parameters,
    the state's non-tensor values, and any tensor that is not already the optimizer's own."""
    apply_hyperparams(opt, state_dict["param_groups"])
    for piece in opt.pieces:
        key = _position(opt, piece) + piece.name
        if key not in state_dict["state"]:
            raise ValueError(
                f"load_dcp_state_dict: no optimizer state for {key!r}; pass the dict dcp_state_dict() "
                "returned, after dcp.load filled it"
            )
        current = opt.optimizer.state.setdefault(piece.main, {})
        for name, value in state_dict["state"][key].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            target = piece.main.detach() if name == MAIN_PARAM_KEY else current.get(name)
            if isinstance(target, torch.Tensor) and isinstance(local, torch.Tensor):
                if local.data_ptr() != target.data_ptr():
                    with torch.no_grad():
                        target.copy_(local.view_as(target))
            else:
                current[name] = value
