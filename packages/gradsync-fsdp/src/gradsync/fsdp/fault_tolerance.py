"""MegatronFSDP under torchft: each replica group shards the model over its own ranks (no_shard, ZeRO-1/2/3),
and torchft's ``Manager`` is the outer replication across replica groups, whose membership changes step by
step: a group that dies is dropped, a restarted one heals from a healthy peer.

This is HSDP with torchft's process group as the outer dimension, and it moves what HSDP moves: each bucket
is reduced inside the group first, as without torchft (reduce-scatter into each rank's shard under
ZeRO-1/2/3, overlapped with the backward), and then only the rows each rank's optimizer steps are averaged
across the groups through the manager, once per cycle, in one all-reduce per grad dtype. The manager pairs
rank r of every group, which holds the same rows everywhere (the layout check proves it at every step), so
a group of G ranks sends 1/G of the model's grads across groups, where a whole-bucket hook would send all
of them. (no_shard's rows are the whole buckets: it sends everything, as it must.) Healing likewise sends
each rank its own shard of the weights and of the optimizer state, never a gathered copy.

A heal copies into the shards in place and marks the model stepped, so the next forward installs the
weights on every rank of the group; the quorum (``OptimizerWrapper.zero_grad()``) therefore comes before
``zero_grad_buffer()``. Every rank of a healing group heals at once (all are behind), but torchft's step-0
sync picks its source rank by rank, so build every replica group from the same weights and give the
manager ``init_sync=False``.

torchft is optional (``pip install "gradsync-fsdp[torchft]"``, which needs torch 2.7 or later).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import torch

from gradsync.buffers.fault_tolerance import (
    FaultTolerantHookState,
    check_manager,
    find_lighthouse,
    layout_fingerprint,
)
from gradsync.buffers.torch_internals import local_tensor

from .fsdp2.api import megatron_fsdp_of
from .fsdp2.module import FSDPModule
from .megatron_fsdp import MegatronFSDP

__all__ = ["find_lighthouse", "register_fault_tolerant_hook", "replica_state"]

OWNER = "register_fault_tolerant_hook"


def register_fault_tolerant_hook(model: MegatronFSDP | FSDPModule, manager: Any) -> FaultTolerantHookState:
    """Average ``model``'s reduced grads across replica groups through torchft's ``manager``. Call it
    once, before the first backward, on every rank of every replica group. ``model``: a MegatronFSDP, or
    the root module of the FSDP2-style API's ``fully_shard`` calls."""
    model = _megatron_fsdp(model)
    check_manager(OWNER, "gradsync-fsdp", manager)
    if model.outer is not None:
        raise NotImplementedError(
            f"{OWNER}: under torchft the replica groups are the outer replication; build the model without "
            "an outer data-parallel group (shard over the replica group's own ranks only)"
        )
    if model._step.across_replicas is not None:
        raise RuntimeError(f"{OWNER}: the model already reduces across replica groups; register once")
    reducing = [bucket for bucket in model.buckets if bucket.grad is not None]
    layout = [(bucket.grad, bucket.spec.params) for bucket in reducing if bucket.grad is not None]
    group = model.dist_index.get_fsdp_group()
    # rank r of every group must hold the same rows: the group's size and this rank's rows are checked too
    where = repr([(group.size(), bucket.ranges.main) for bucket in reducing]).encode()
    state = FaultTolerantHookState(manager, group, [*layout_fingerprint(layout), zlib.crc32(where) >> 8])
    rows = [bucket.stepped_grads() for bucket in reducing]
    model._step.across_replicas = functools.partial(average_across_replicas, state, FlatRows(rows))
    return state


class FlatRows:
    """This rank's reduced rows of every bucket, gathered per dtype into one flat buffer built once (the
    rows are views of the persistent grad buffers), so the cross-group stage is one all-reduce per dtype
    with no allocation per step."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in rows:
            if tensor.numel():
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
        self.groups = []  # (the rows, the flat buffer, its pieces shaped as the rows)
        for tensors in by_dtype.values():
            flat = torch.empty(
                sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device
            )
            self.groups.append((tensors, flat, list(torch.split(flat, [t.numel() for t in tensors]))))


def average_across_replicas(state: FaultTolerantHookState, rows: FlatRows) -> None:
    """Average ``rows`` (this rank's reduced rows of each bucket) across the replica groups in the quorum:
    the layout checked first (every group raises before a byte moves if one differs), then one all-reduce
    per dtype of the flat buffer, waited (torchft's futures divide by the participants only inside
    ``wait()``; a failed reduction is the manager's to keep: ``should_commit()`` then refuses the step,
    and a healing group contributes zeros)."""
    state.check_layout()
    for tensors, _, pieces in rows.groups:
        torch._foreach_copy_(pieces, tensors)
    works = [state.manager.allreduce(flat) for _, flat, _ in rows.groups]
    for work in works:
        work.wait()
    for tensors, _, pieces in rows.groups:
        torch._foreach_copy_(tensors, pieces)


def replica_state(
    model: MegatronFSDP | FSDPModule, optimizer: torch.optim.Optimizer
) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """The manager's ``state_dict`` and ``load_state_dict``: this rank's shard of every param (the
    optimizer's main weights) and of the optimizer's state, as local tensors; loading copies them into
    the shards in place and marks the model stepped (the next forward installs the weights). ``model``:
    as :func:`register_fault_tolerant_hook` takes it."""
    model = _megatron_fsdp(model)
    params = list(model.parameters())
    ordered = [p for group in optimizer.param_groups for p in group["params"]]

    def state_dict() -> dict[str, Any]:
        optimizer_state = optimizer.state_dict()
        shards = {
            index: {key: _plain(value) for key, value in entry.items()}
            for index, entry in optimizer_state["state"].items()
        }
        sharded = {
            index: sorted(key for key, value in entry.items() if value is not local_tensor(value))
            for index, entry in optimizer_state["state"].items()
        }
        return {
            "params": [_plain(p) for p in params],
            "optimizer": {
                "state": shards,
                "sharded": sharded,
                "param_groups": optimizer_state["param_groups"],
            },
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        for param, shard in zip(params, state["params"], strict=True):
            local_tensor(param).copy_(shard)
        received = state["optimizer"]
        rebuilt = {}
        for index, entry in received["state"].items():
            param = ordered[index]
            rebuilt[index] = {
                key: _like(param, key, value) if key in received["sharded"][index] else value
                for key, value in entry.items()
            }
        optimizer.load_state_dict({"state": rebuilt, "param_groups": received["param_groups"]})
        model.mark_stepped()

    return state_dict, load_state_dict


def _megatron_fsdp(model: MegatronFSDP | FSDPModule) -> MegatronFSDP:
    """The MegatronFSDP behind ``model``: itself, or the one the root ``fully_shard`` call built."""
    if isinstance(model, MegatronFSDP):
        return model
    if isinstance(model, FSDPModule):
        fsdp = megatron_fsdp_of(model)
        if fsdp.module is not model:
            raise ValueError(
                f"{OWNER}: {type(model).__name__} is one unit of a fully_shard model; pass its root module "
                "(the last fully_shard call), which holds every unit"
            )
        return fsdp
    raise TypeError(
        f"{OWNER}: model must be a MegatronFSDP or a fully_shard root, got {type(model).__name__}"
    )


def _plain(value: Any) -> Any:
    """A DTensor's local tensor as a plain tensor over the same storage (no copy), without the attributes
    gradsync keeps on its params, which torchft's transport would try to pickle."""
    local = local_tensor(value)
    return local.detach() if isinstance(local, torch.Tensor) else local


def _like(param: torch.Tensor, key: str, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` as a DTensor laid out as ``param`` (the optimizer's state is sharded as its param)."""
    state = torch.zeros_like(param)
    local = local_tensor(state)
    if local.shape != shard.shape:
        raise NotImplementedError(
            f"{OWNER}: optimizer state {key!r} of shape {tuple(shard.shape)} is not laid out as its param's "
            f"shard {tuple(local.shape)}; only state shaped as the params heals"
        )
    local.copy_(shard)
    return state
