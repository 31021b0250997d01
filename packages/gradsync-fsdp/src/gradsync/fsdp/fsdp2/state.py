"""What ``fully_shard`` records: each call's arguments, each module's state and the root's flags."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.buffers.torch_internals import local_tensor

from ..megatron_fsdp import MegatronFSDP

STATE_ATTR = "_gradsync_fsdp2"
"""Where a module passed to ``fully_shard`` keeps its :class:`State`."""


@dataclasses.dataclass(frozen=True)
class _Call:
    """One ``fully_shard`` call's arguments, after the refusals."""

    mesh: DeviceMesh | None
    reshard_after_forward: bool | None
    mp_policy: MixedPrecisionPolicy
    ignored_params: frozenset[nn.Parameter]
    outer_dp_sharding_strategy: str
    shard_alignment: ShardAlignmentSpec = None

    def shared(self) -> dict[str, object]:
        """What every call of one root must agree on: it shapes the buckets all units share."""
        return {
            "mesh": self.mesh,
            "mp_policy.param_dtype": self.mp_policy.param_dtype,
            "mp_policy.reduce_dtype": self.mp_policy.reduce_dtype,
            "outer_dp_sharding_strategy": self.outer_dp_sharding_strategy,
        }


class _Root:
    """The MegatronFSDP of a root call and the FSDP2 flags that decide where an accumulation cycle ends."""

    def __init__(self, fsdp: MegatronFSDP, ignored: frozenset[nn.Parameter]) -> None:
        self.fsdp = fsdp
        self.ignored = ignored
        self.requires_gradient_sync = True
        self.is_last_backward = True
        self.manual_finalization = False
        self.post_optim_event: Any = None
        self.apply_flags()

    def apply_flags(self) -> None:
        """Without gradient sync the backward defers what it can (``no_sync``); a backward with sync that
        is also the last one reduces everything and gives the DTensors their grads (auto-sync), unless
        the caller finalizes (``finalize_backward()``)."""
        self.fsdp.is_last_microbatch = self.requires_gradient_sync
        ends = self.requires_gradient_sync and self.is_last_backward and not self.manual_finalization
        self.fsdp.set_model_auto_sync(ends)

    def wait_post_optim_event(self, module: nn.Module, args: Any) -> None:
        """The event given by ``set_post_optim_event``: the current stream (on which gradsync's gathers
        are issued) waits for it once, at the next forward."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:
            event.wait()

    def start_cycle_after_step(self, module: nn.Module, args: Any) -> None:
        """A forward after an optimizer step starts a new cycle: torch users zero the DTensors' grads
        (``optimizer.zero_grad()``), gradsync must zero its grad buffers too. So does a forward after a
        step that raised (a backward or a loss that raised on this rank, which then abandons the step
        as ``zero_grad_buffer()`` does, so every rank raises; or the vote that named another rank).
        Grads still set (not zeroed) would be summed into the next step in torch; the buffers hold one
        cycle, so refuse.

        Grads set to None (torch's ``zero_grad()``) are seen on the host: then nothing is read from the
        device and the step has no host sync, as MegatronFSDP's. Only grads still set (zeroed in place
        by ``zero_grad(set_to_none=False)``, or never zeroed) have their values checked, with one host
        read. Whether grads are set is the same on every rank: each rank holds a grad for every trained
        param, an empty one where it owns no rows (the record's ``optimizer_grad``), so every rank takes
        the same branch and posts the same collectives."""
        if not self.fsdp.steps.grads_consumed:
            if self.fsdp.step_left_broken:  # the last step raised (here or elsewhere): settle it now
                self.fsdp.zero_grad_buffer()
            return
        named = [(n, local_tensor(p.grad)) for n, p in self.fsdp.named_parameters() if p.grad is not None]
        if named:
            self._refuse_grads_carried_over(named)
        self.fsdp.zero_grad_buffer()

    def _refuse_grads_carried_over(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise on every rank when any rank's grads are not all zero."""
        norms = torch._foreach_norm([grad for _, grad in named])
        # one all-reduced flag: every rank refuses alike (a rank whose shards are all empty would
        # otherwise go on into the forward's gathers), and one host read per step, not one per param
        kept = torch.stack(list(norms)).sum()
        dist.all_reduce(kept, op=dist.ReduceOp.MAX, group=self.fsdp.dist_index.get_dp_group())
        if float(kept) > 0:
            first = next((n for (n, _), norm in zip(named, norms, strict=True) if float(norm) > 0), "?")
            raise RuntimeError(
                "fully_shard: a forward after optimizer.step() found grads still set (first "
                f"{first.removeprefix('module.')!r} here, or on another rank): gradsync's grad buffers hold "
                "one accumulation cycle, so grads cannot carry over to the next step; call "
                "optimizer.zero_grad() after optimizer.step()"
            )


@dataclasses.dataclass
class _State:
    """What ``fully_shard`` recorded on a module: its call, and once built, its root and unit id (None
    for the root itself). ``building`` while a MegatronFSDP is being laid out over it."""

    call: _Call
    root: _Root | None = None
    unit_id: int | None = None
    building: bool = False


_PENDING: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Marked modules no root call has covered yet."""


def _state(module: nn.Module) -> _State:
    state = module.__dict__.get(STATE_ATTR)
    assert isinstance(state, _State), "a module fully_shard recorded"
    return state


def _is_root(state: _State) -> bool:
    return state.root is not None and state.unit_id is None
