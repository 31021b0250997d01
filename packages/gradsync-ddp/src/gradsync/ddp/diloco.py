"""DiLoCo (local SGD with an outer optimizer): replicas that synchronise every few steps, not every step,
and Streaming DiLoCo, which syncs the model one fragment at a time.

Each replica steps its own inner optimizer on its own data for ``sync_every`` steps; no grad crosses the
replicas' group in between. Then the replicas average how far each moved from the last synced weights
(the pseudo-gradient: synced minus local), and an outer optimizer (SGD with Nesterov momentum, as the
DiLoCo paper's) applies that average to the synced weights, which every replica then takes. One
all-reduce of the weights every ``sync_every`` steps replaces a grad reduction every step.

Streaming DiLoCo (Douillard et al., 2025) splits the model into F fragments. Fragment f syncs every
``sync_every`` steps too, but at offset f * sync_every / F, so each sync sends about 1/F of the weights and
the link is busy at F evenly spaced steps instead of one. A fragment's all-reduce may land
``fragment_sync_delay`` inner steps after it starts, overlapped with them; the replica then keeps
``fragment_update_alpha`` of its local weights and takes the rest from the new synced weights. Each
fragment has its own outer momentum (one outer optimizer, a param group per fragment). With one fragment,
no delay and alpha 0 this is DiLoCo.

The inner optimizer may be anything that steps the params: a torch optimizer on a plain module, or on a
gradsync ``DistributedDataParallel`` (with or without its ``DistributedOptimizer``) whose data-parallel
group lies inside each replica. DiLoCo's ``group`` then joins the replicas: the ranks that hold the same
piece of the model in different replicas (HSDP's outer group).

Under torchft (``manager=``, a ``torchft.Manager``), the replicas are torchft's replica groups and each
sync (of one fragment) is one fault-tolerant step of the manager: a quorum, one all-reduce of the moves,
and the outer step only if the manager commits it. A replica that dies between syncs takes its inner steps
with it; the survivors' sync averages the moves of the replicas that made them. A restarted replica joins
at the next sync: it heals from a peer (every fragment's synced weights, both optimizers' state), takes the
synced weights as its local ones, and adds no move of its own to that sync, so the outer step is the mean
over the replicas that trained since. A sync that does not commit leaves its fragment's synced weights as
they were, and every replica restarts that fragment from them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import ensure_params_ready
from gradsync.buffers.collectives import Launched
from gradsync.buffers.fault_tolerance import check_manager
from gradsync.buffers.low_precision_reduce import GradCommWire, reduce_bucket
from gradsync.buffers.wire_format import WireFormat, wire_problem


@dataclass
class Fragment:
    """A piece of the model that syncs on its own schedule: its params, their synced fp32 copies (the
    outer optimizer's params) and the step, modulo ``sync_every``, after which its sync starts."""

    index: int
    params: list[nn.Parameter]
    synced: list[nn.Parameter]
    offset: int
    round_steps: int = 0
    """Inner steps since this fragment's last sync started (or the replica healed): with none, a replica
    under a manager adds no move."""


@dataclass
class InFlight:
    """A fragment's sync between its start and its landing: the moves being summed or averaged in place,
    and what completes them."""

    fragments: list[Fragment]
    payload: torch.Tensor
    lands_after: int
    """The inner step (``local_steps``) after which the sync lands."""
    launched: Launched | None = None
    work: Any = None


class DiLoCo:
    """Steps ``inner_optimizer`` every call, and syncs each fragment every ``sync_every`` calls: averages
    the replicas' moves over ``group`` (the default group when None) and applies the outer step.
    Construction broadcasts the group's first rank's weights (a collective), so the replicas start from
    one point.

    ``fragments``: Streaming DiLoCo's F (module docstring). An int splits the params, in order, into that
    many runs of about equal size; a sequence of param iterables gives the fragments (disjoint, covering
    every trainable param). ``fragment_sync_delay``: inner steps each fragment's all-reduce overlaps before
    it lands (at most ``sync_every // F``, so one sync is in flight at a time). ``fragment_update_alpha``:
    the share of its local weights a replica keeps when a fragment lands (0: it takes the synced weights).

    ``wire_dtype``: send the pseudo-gradients in bf16, fp16 or fp8 (blocks of ``wire_block_size`` values
    with one fp32 scale), summed in fp32 as ``grad_comm_dtype`` does; None sends fp32.

    ``manager``: a ``torchft.Manager`` joins the replicas instead of ``group`` (module docstring); its state
    is registered with it under ``"diloco"``, and construction takes one sync step with the other replica
    groups (torchft's step-0 sync, or a restarted replica's heal), adding no move of its own."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        inner_optimizer: Any,
        sync_every: int,
        *,
        group: dist.ProcessGroup | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        wire_dtype: torch.dtype | None = None,
        wire_block_size: int = 32,
        manager: Any = None,
        fragments: int | Sequence[Iterable[nn.Parameter]] = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if manager is not None:
            refuse_under_manager(group, wire_dtype)
            check_manager("DiLoCo", "gradsync-ddp", manager)
        if sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every must be at least 1 step, got {sync_every}")
        problem = (
            None
            if wire_dtype is None
            else wire_problem(wire_dtype, wire_block_size, "wire_dtype", "wire_block_size")
        )
        if problem is not None:
            raise ValueError(f"DiLoCo: {problem}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo: no trainable params given")
        pieces = split_fragments(self.params, fragments)
        check_schedule(sync_every, len(pieces), fragment_sync_delay, fragment_update_alpha)
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = fragment_update_alpha
        world = dist.group.WORLD if group is None else group
        if world is None and manager is None:
            raise RuntimeError("DiLoCo: call torch.distributed.init_process_group() first (or pass group=)")
        self.group: dist.ProcessGroup | None = world if manager is None else None  # the manager's quorum
        self.manager = manager
        self.wire = (
            GradCommWire(WireFormat(wire_dtype, wire_block_size), error_feedback=False)
            if wire_dtype is not None
            else None
        )
        with torch.no_grad():
            ensure_params_ready(self.params)
            if manager is None:
                self._take_first_replicas_weights()
            self.fragments = [
                Fragment(f, piece, [nn.Parameter(p.detach().float().clone()) for p in piece],
                         f * sync_every // len(pieces))
                for f, piece in enumerate(pieces)
            ]  # fmt: skip
        self.synced = [s for fragment in self.fragments for s in fragment.synced]
        """Every fragment's synced weights, in the order of ``params``."""
        self.outer_optimizer = torch.optim.SGD(
            [{"params": fragment.synced} for fragment in self.fragments],
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=nesterov and outer_momentum > 0,
        )
        self.local_steps = 0
        self.communicated_bytes = 0
        """Bytes this rank has put on the wire in its syncs: the all-reduce's payload, or the low-precision
        wire's packed all-to-all (as the wrappers count their reductions)."""
        self.peak_sync_bytes = 0
        """The most bytes one sync has sent: about 1/F of DiLoCo's with F fragments."""
        self.trained_replicas = 0
        """How many replicas' moves the last sync under a manager averaged (those that trained since)."""
        self.in_flight: InFlight | None = None
        """The sync started and not landed yet (only with ``fragment_sync_delay``)."""
        self._healed = False
        """Set when the manager's quorum has just healed this replica (:meth:`_start` reads it)."""
        if manager is not None:
            manager.register_state_dict_fn("diloco", self._heal, self.state_dict)
            self.sync()  # the first quorum: every replica starts from one point (it moved nothing yet)

    def _take_first_replicas_weights(self) -> None:
        """Every replica starts from the group's first rank's weights, as torch DDP's replicas do: the
        outer step moves the synced weights by the averaged moves, so replicas that started apart would
        stay apart by their first difference after every sync."""
        assert self.group is not None
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._set_weights(self.params, torch.split(flat, [p.numel() for p in self.params]))

    def _set_weights(self, params: Sequence[nn.Parameter], values: Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(params, values, strict=True):
                param.copy_(value.view_as(param))
        reload = getattr(self.inner_optimizer, "reload_model_params", None)
        if reload is not None:  # gradsync's DistributedOptimizer: its fp32 main params follow the weights
            reload()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One inner step; then the sync in flight lands if it is due, and a fragment whose turn it is
        starts its sync (collectives)."""
        self.inner_optimizer.step()
        self.local_steps += 1
        for fragment in self.fragments:
            fragment.round_steps += 1
        if self.in_flight is not None and self.local_steps >= self.in_flight.lands_after:
            self._land()
        turn = self.local_steps % self.sync_every
        for fragment in self.fragments:
            if fragment.offset == turn:
                self._start([fragment], lands_after=self.local_steps + self.fragment_sync_delay)
                if self.fragment_sync_delay == 0:
                    self._land()

    def sync(self) -> None:
        """Sync every fragment now, as one sync: average the replicas' moves over the group (or sum them
        through the manager), step the synced weights with the outer optimizer, and give every replica
        the result. A sync in flight lands first. Under a manager, a replica that heals in the quorum
        joins the sync the others are taking instead (that is how a restarted one starts)."""
        if self.in_flight is not None:
            self._land()
        self._start(self.fragments, lands_after=self.local_steps)
        if self.in_flight is not None and self.in_flight.lands_after <= self.local_steps:
            self._land()

    def _start(self, fragments: list[Fragment], lands_after: int) -> None:
        """Launch the all-reduce of ``fragments``' moves; under a manager, after its quorum. A replica
        behind the others heals there (:meth:`_heal`) and then joins the sync they are taking: that of
        the fragments whose turn it is at their step count, landing when theirs does."""
        ensure_params_ready(self.params)  # a distributed optimizer may still be gathering them
        if self.manager is not None:
            self._healed = False
            self.manager.start_quorum()
            if self._healed and self.local_steps > 0:  # (at 0 every replica takes the first sync)
                turn = self.local_steps % self.sync_every
                fragments = [f for f in self.fragments if f.offset == turn] or self.fragments  # else sync()
                lands_after = self.local_steps + self.fragment_sync_delay
        trained = any(fragment.round_steps > 0 for fragment in fragments)
        for fragment in fragments:
            fragment.round_steps = 0
        with torch.no_grad():
            moves = torch.cat([(s - p.float()).reshape(-1) for fragment in fragments
                               for s, p in zip(fragment.synced, fragment.params, strict=True)])  # fmt: skip
            flight = InFlight(fragments, moves, lands_after)
            if self.manager is None:
                assert self.group is not None
                key = ("diloco", fragments[0].index, len(fragments))
                flight.launched, sent = reduce_bucket(
                    moves, self.group, self.wire, key, scatter=False, average=True, label="diloco"
                )
            else:
                if not trained:
                    moves.zero_()
                device = moves.device
                flight.payload = torch.cat([moves, torch.full((1,), float(trained), device=device)])
                flight.work = self.manager.allreduce(flight.payload, reduce_op=dist.ReduceOp.SUM)
                sent = flight.payload.numel() * flight.payload.element_size()
        self.communicated_bytes += sent
        self.peak_sync_bytes = max(self.peak_sync_bytes, sent)
        self.in_flight = flight

    def _land(self) -> None:
        """Complete the sync in flight: the outer step of its fragments by the mean move, then each
        replica's weights of those fragments from the synced ones. Under a manager only a committed sum
        is read (a failed all-reduce may leave it corrupt, torchft's rule), and with no replica that
        trained, or no commit, the replicas go back to the synced weights."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        if flight.launched is not None:
            flight.launched.wait()
            mean: torch.Tensor | None = flight.payload
        else:
            flight.work.wait()
            committed = self.manager.should_commit()
            self.trained_replicas = int(flight.payload[-1].item()) if committed else 0
            mean = flight.payload[:-1] / self.trained_replicas if self.trained_replicas > 0 else None
        ensure_params_ready(self.params)
        with torch.no_grad():
            synced = [s for fragment in flight.fragments for s in fragment.synced]
            params = [p for fragment in flight.fragments for p in fragment.params]
            if mean is not None:
                for weight, move in zip(synced, torch.split(mean, [s.numel() for s in synced]), strict=True):
                    weight.grad = move.view_as(weight)
                self.outer_optimizer.step()
                for weight in synced:
                    weight.grad = None  # the next fragment's outer step leaves this one alone
            alpha = self.fragment_update_alpha if mean is not None else 0.0  # no sync: back to synced
            values = synced if alpha == 0 else [torch.lerp(p.float(), s, 1 - alpha) for s, p in
                                                zip(synced, params, strict=True)]  # fmt: skip
            self._set_weights(params, values)

    def _heal(self, state: dict[str, Any]) -> None:
        """The manager's load callable: a peer's state. This replica's inner steps since its last syncs
        are not its to add: every fragment takes the peer's synced weights as its local ones."""
        self.load_state_dict(state)
        self._healed = True
        for fragment in self.fragments:
            fragment.round_steps = 0
        self._set_weights(self.params, self.synced)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the outer optimizer's (its momentum), the synced weights and the
        step count: what a resumed run needs to take the same steps. Refused while a sync is in flight
        (its moves are half-summed): save right after a step with ``in_flight`` None."""
        if self.in_flight is not None:
            raise RuntimeError(
                f"DiLoCo.state_dict: fragment {self.in_flight.fragments[0].index}'s sync is in flight "
                f"until step {self.in_flight.lands_after}; save after a step where DiLoCo.in_flight is None"
            )
        return {
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "synced": [s.detach().clone() for s in self.synced],
            "local_steps": self.local_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["synced"]) != len(self.synced):
            raise ValueError(
                f"DiLoCo: the state holds {len(state['synced'])} synced weights for {len(self.synced)} params"
            )
        self.inner_optimizer.load_state_dict(state["inner"])
        self.outer_optimizer.load_state_dict(state["outer"])
        with torch.no_grad():
            for synced, saved in zip(self.synced, state["synced"], strict=True):
                synced.copy_(saved)
        self.local_steps = int(state["local_steps"])
        self.in_flight = None


def split_fragments(
    params: list[nn.Parameter], fragments: int | Sequence[Iterable[nn.Parameter]]
) -> list[list[nn.Parameter]]:
    """The params of each fragment. An int F cuts the params, in order, where the running size comes
    nearest to each k/F of the whole, one param at least per fragment."""
    if not isinstance(fragments, int):
        pieces = [[p for p in piece if p.requires_grad] for piece in fragments]
        listed = [id(p) for piece in pieces for p in piece]
        if sorted(listed) != sorted(id(p) for p in params) or not all(pieces):
            raise ValueError(
                "DiLoCo: fragments must be non-empty, disjoint and hold every trainable param of params "
                f"exactly once ({len(listed)} listed for {len(params)} params)"
            )
        order = {id(p): i for i, p in enumerate(params)}
        return [sorted(piece, key=lambda p: order[id(p)]) for piece in pieces]
    if not 1 <= fragments <= len(params):
        raise ValueError(f"DiLoCo: fragments must be between 1 and the {len(params)} params, got {fragments}")
    running = list(accumulate((p.numel() for p in params), initial=0))
    cuts = [0]
    for k in range(1, fragments):
        goal = k * running[-1] / fragments
        allowed = range(cuts[-1] + 1, len(params) - (fragments - k) + 1)  # a param left for each to come
        cuts.append(min(allowed, key=lambda cut: abs(running[cut] - goal)))
    cuts.append(len(params))
    return [params[a:b] for a, b in pairwise(cuts)]


def check_schedule(sync_every: int, fragments: int, delay: int, alpha: float) -> None:
    if fragments > sync_every:
        raise ValueError(
            f"DiLoCo: {fragments} fragments need sync_every of at least {fragments} steps (one start per "
            f"step at most), got {sync_every}"
        )
    if not 0 <= delay <= sync_every // fragments:
        raise ValueError(
            f"DiLoCo: fragment_sync_delay must be between 0 and sync_every // fragments = "
            f"{sync_every // fragments} steps (one sync in flight at a time), got {delay}"
        )
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"DiLoCo: fragment_update_alpha must be in [0, 1), got {alpha}")


def refuse_under_manager(group: dist.ProcessGroup | None, wire_dtype: torch.dtype | None) -> None:
    """What a torchft manager replaces, refused by name when given beside it."""
    if group is not None:
        raise ValueError("DiLoCo: pass manager= or group=, not both: the manager's quorum joins the replicas")
    if wire_dtype is not None:
        raise ValueError(
            "DiLoCo: wire_dtype is not available under a manager (torchft's all-reduce sums the fp32 moves); "
            "pass wire_dtype=None"
        )
