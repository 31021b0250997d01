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
ranks, then across replica groups, so every replica group holds the same mean. The hook waits for each
bucket's cross-replica reduction before it returns, as torchft's own DDP does: torchft's futures run their
callbacks only when waited, so buckets reduce during backward one at a time, and backward waits for each.

The distributed optimizer cannot join (refused by name): it reduce-scatters every bucket over the
data-parallel group and keeps each rank's optimizer shard only there, so across replica groups the shards
of a replica that dies would be lost with it, and torchft's process groups have no reduce-scatter. It
would take sharding within each replica group only (reduce-scatter inside the group, each shard
all-reduced across replica groups through the manager, which already pairs rank r of every group, and
each rank's own shard sent when healing).

torchft is optional (``pip install "gradsync-ddp[torchft]"``, which needs torch 2.7 or later).
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from .distributed_data_parallel import DistributedDataParallel

# The layout fingerprint's values stay below 2**24, so sums of them and of their squares over any
# realistic number of replica groups are exact in float64.
_FINGERPRINT_RANGE = 1 << 24


def require_torchft() -> ModuleType:
    """torchft, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("torchft")
    except ImportError as error:
        raise ImportError(
            "gradsync's fault tolerance runs on torchft, which is not installed: "
            'pip install "gradsync-ddp[torchft]" (torchft needs torch 2.7 or later)'
        ) from error


def bucket_layout(model: DistributedDataParallel) -> list[int]:
    """What every replica group must agree on: each bucket's size, dtype and params, as small integers."""
    groups = model.grad_buffers.all_bucket_groups
    described = []
    for group in groups:
        for bucket in group.buckets:
            params = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in bucket.params_list)
            described.append(f"{bucket.grad_data.numel()}:{bucket.grad_data.dtype}:{params}")
    buckets = len(described)
    return [buckets % _FINGERPRINT_RANGE, zlib.crc32("|".join(described).encode()) % _FINGERPRINT_RANGE]


@dataclass
class FaultTolerantHookState:
    """The hook's state: torchft's manager, this replica group's own data-parallel group (torch's hooks
    name their group ``process_group``), the layout every replica group must share, and how many buckets a
    step hands over (the first of each step checks the layout)."""

    manager: Any
    process_group: dist.ProcessGroup
    layout: list[int]
    buckets: int
    handed: int = field(default=0)

    def check_layout(self) -> None:
        """Every replica group in the quorum has this layout, else every one raises before a bucket moves.
        Summed with a count, so a replica group that contributes zeros (healing) is left out of the test."""
        own = torch.tensor(self.layout, dtype=torch.float64)
        stats = torch.cat([torch.ones(1, dtype=torch.float64), own, own * own])
        work = self.manager.allreduce(stats, reduce_op=dist.ReduceOp.SUM)
        if not work.wait() or self.manager.errored() is not None:
            return  # the step will not commit; the next one checks again
        count, sums, squares = stats[0], stats[1 : 1 + own.numel()], stats[1 + own.numel() :]
        if count < 1:
            return
        agree = torch.equal(sums, own * count) and torch.equal(squares, own * own * count)
        if not agree:
            raise RuntimeError(
                f"replica groups disagree on the model's buckets: this one has {self.layout[0]} buckets "
                f"(layout {self.layout[1]:#08x}); every replica group must build the same model with the "
                "same DistributedDataParallelConfig (bucket_size, grad_reduce_in_fp32, ...)"
            )


def fault_tolerant_hook(state: FaultTolerantHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over this replica group's data-parallel ranks, then across the replica groups in
    the quorum through the manager (zeros from a replica group that is healing; nothing moves once the
    step has failed, and the step then does not commit)."""
    state.handed = state.handed % state.buckets + 1
    if state.handed == 1:
        state.check_layout()
    buffer = bucket.buffer()
    if state.process_group.size() > 1:
        dist.all_reduce(buffer, group=state.process_group)
        buffer.div_(state.process_group.size())
    # waiting runs the manager's division by the participants (its futures run callbacks only inside
    # wait()); a failed reduction is the manager's to keep: should_commit() then refuses the step
    state.manager.allreduce(buffer).wait()
    reduced: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    reduced.set_result(buffer)
    return reduced


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
    torchft = require_torchft()
    if not isinstance(manager, torchft.Manager):
        raise TypeError(
            f"register_fault_tolerant_hook: manager must be a torchft.Manager, got {type(manager).__name__}"
        )
    if model.ddp_config.use_distributed_optimizer:
        raise NotImplementedError(
            "register_fault_tolerant_hook: use_distributed_optimizer=True keeps each optimizer shard on one "
            "rank of the data-parallel group, so across replica groups a dead replica's shards would be "
            "lost; use use_distributed_optimizer=False (every replica group keeps the whole optimizer state)"
        )
    dp_cp = model.pg_collection.dp_cp
    assert dp_cp is not None  # resolve_process_groups set it
    buckets = sum(len(group.buckets) for group in model.grad_buffers.all_bucket_groups)
    state = FaultTolerantHookState(manager, dp_cp, bucket_layout(model), buckets)
    model.register_comm_hook(state, fault_tolerant_hook)
    return state
