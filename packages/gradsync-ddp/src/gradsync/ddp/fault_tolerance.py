"""gradsync's DistributedDataParallel under torchft: per-step fault tolerance across replica groups.

Each replica group (one or more ranks, its own ``torch.distributed`` world) keeps gradsync's buffers,
buckets and process groups. Across replica groups, each bucket's reduction goes through torchft's
``Manager``: it averages over the replica groups in the step's quorum, drops one that died, heals a
restarted one from a healthy peer, and tells the optimizer whether the step may commit
(``torchft.optim.OptimizerWrapper`` gates ``step()`` on ``should_commit()``).

What torchft asks of a wrapper, and how this one meets it:

- buckets that never rebuild: gradsync lays its buckets out once, at construction, in the params' order,
  so every replica group that builds the same model with the same config issues the same reductions. The
  hook checks that at every step, through the manager, before any bucket moves (a replica group that
  joins with another layout would otherwise reduce mismatched buffers);
- state synced at step 0 and on every heal: the manager's ``state_dict``/``load_state_dict`` callables
  carry the model's and the optimizer's state (``init_sync``: the replica groups start from the first
  one's weights);
- a commit gate: a step whose reductions failed (a replica died mid-step) is not applied anywhere.

Within a replica group of several ranks, a bucket is first averaged over the group's own data-parallel
ranks, then across replica groups (:mod:`gradsync.buffers.fault_tolerance`, the hook both wrappers use).

The distributed optimizer cannot join (refused by name): it reduce-scatters every bucket over the
data-parallel group and keeps each rank's optimizer shard only there, so across replica groups the shards
of a replica that dies would be lost with it, and torchft's process groups have no reduce-scatter. It
would take sharding within each replica group only (reduce-scatter inside the group, each shard
all-reduced across replica groups through the manager, which already pairs rank r of every group, and
each rank's own shard sent when healing).

torchft is optional (``pip install "gradsync-ddp[torchft]"``, which needs torch 2.7 or later).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradsync.buffers.fault_tolerance import (
    FaultTolerantHookState,
    check_manager,
    fault_tolerant_hook,
    find_lighthouse,
    layout_fingerprint,
)

from .distributed_data_parallel import DistributedDataParallel

__all__ = ["find_lighthouse", "register_fault_tolerant_hook", "replica_state"]


def replica_state(
    model: DistributedDataParallel, optimizer: torch.optim.Optimizer
) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """The manager's ``state_dict`` and ``load_state_dict``: what a healing replica group takes from a
    healthy one, each rank from the same rank there (the module's weights and the whole optimizer state;
    the grad buffers are not sent, as a step's grads are made afresh). The manager sends the tensors as they
    are between the quorum and the commit, so nothing may change them in place in between."""

    def state_dict() -> dict[str, Any]:
        return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return state_dict, load_state_dict


def register_fault_tolerant_hook(model: DistributedDataParallel, manager: Any) -> FaultTolerantHookState:
    """Reduce ``model``'s buckets across replica groups through torchft's ``manager``. Call it once,
    before the first backward, on every rank of every replica group."""
    check_manager("register_fault_tolerant_hook", "gradsync-ddp", manager)
    if model.ddp_config.use_distributed_optimizer:
        raise NotImplementedError(
            "register_fault_tolerant_hook: use_distributed_optimizer=True keeps each optimizer shard on one "
            "rank of the data-parallel group, so across replica groups a dead replica's shards would be "
            "lost; use use_distributed_optimizer=False (every replica group keeps the whole optimizer state)"
        )
    dp_cp = model.pg_collection.dp_cp
    assert dp_cp is not None  # resolve_process_groups set it
    layout = [(b.grad_data, b.params_list) for g in model.grad_buffers.all_bucket_groups for b in g.buckets]
    state = FaultTolerantHookState(manager, dp_cp, layout_fingerprint(layout))
    model.register_comm_hook(state, fault_tolerant_hook)
    return state
