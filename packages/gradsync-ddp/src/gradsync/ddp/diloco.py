"""DiLoCo (local SGD with an outer optimizer): replicas that synchronise every few steps, not every step.

Each replica steps its own inner optimizer on its own data for ``sync_every`` steps; no grad crosses the
replicas' group in between. Then the replicas average how far each moved from the last synced weights
(the pseudo-gradient: synced minus local), and an outer optimizer (SGD with Nesterov momentum, as the
DiLoCo paper's) applies that average to the synced weights, which every replica then takes. One
all-reduce of the weights every ``sync_every`` steps replaces a grad reduction every step.

The inner optimizer may be anything that steps the params: a torch optimizer on a plain module, or on a
gradsync ``DistributedDataParallel`` (with or without its ``DistributedOptimizer``) whose data-parallel
group lies inside each replica. DiLoCo's ``group`` then joins the replicas: the ranks that hold the same
piece of the model in different replicas (HSDP's outer group).

Under torchft (``manager=``, a ``torchft.Manager``), the replicas are torchft's replica groups and each
sync is one fault-tolerant step of the manager: a quorum, one all-reduce of the moves, and the outer step
only if the manager commits it. A replica that dies between syncs takes its round's inner steps with it;
the survivors' sync averages the moves of the replicas that made them. A restarted replica joins at the
next sync: it heals from a peer (the synced weights, both optimizers' state) and adds no move of its own
to that sync, so the outer step is the mean over the replicas that trained the round. A sync that does
not commit leaves the synced weights as they were, and every replica restarts the round from them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import ensure_params_ready
from gradsync.buffers.collectives import Launched
from gradsync.buffers.fault_tolerance import check_manager
from gradsync.buffers.low_precision_reduce import GradCommWire, reduce_bucket
from gradsync.buffers.wire_format import WireFormat, wire_problem


class DiLoCo:
    """Steps ``inner_optimizer`` every call, and every ``sync_every`` calls averages the replicas' moves
    over ``group`` (the default group when None) and applies the outer step. Construction broadcasts the
    group's first rank's weights (a collective), so the replicas start from one point.

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
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
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
            self.synced = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.synced, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )
        self.local_steps = 0
        self.communicated_bytes = 0
        """Bytes this rank has put on the wire in its syncs: the all-reduce's payload, or the low-precision
        wire's packed all-to-all (as the wrappers count their reductions)."""
        self.round_steps = 0
        """Inner steps since the last sync (or heal) under a manager: a replica with none adds no move."""
        self.trained_replicas = 0
        """How many replicas' moves the last sync under a manager averaged (those that trained its round)."""
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
        self._set_weights(torch.split(flat, [p.numel() for p in self.params]))

    def _set_weights(self, values: Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.params, values, strict=True):
                param.copy_(value.view_as(param))
        reload = getattr(self.inner_optimizer, "reload_model_params", None)
        if reload is not None:  # gradsync's DistributedOptimizer: its fp32 main params follow the weights
            reload()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One inner step; every ``sync_every``-th also synchronises the replicas (a collective)."""
        self.inner_optimizer.step()
        self.local_steps += 1
        self.round_steps += 1
        if self.local_steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """Average the replicas' pseudo-gradients over the group, step the synced weights with the outer
        optimizer, and give every replica the result."""
        if self.manager is not None:
            self._sync_under_manager()
            return
        ensure_params_ready(self.params)  # a distributed optimizer may still be gathering them
        with torch.no_grad():
            moves = self._moves()
            self._average(moves).wait()
            self._outer_step(moves)

    def _moves(self) -> torch.Tensor:
        """The pseudo-gradient, flat: how far this replica moved from the synced weights."""
        return torch.cat([(s - p.float()).reshape(-1) for s, p in zip(self.synced, self.params, strict=True)])

    def _outer_step(self, moves: torch.Tensor) -> None:
        sizes = [s.numel() for s in self.synced]
        for synced, move in zip(self.synced, torch.split(moves, sizes), strict=True):
            synced.grad = move.view_as(synced)
        self.outer_optimizer.step()
        self._set_weights(self.synced)

    def _sync_under_manager(self) -> None:
        """One fault-tolerant step of the manager: the quorum (which may heal this replica), the moves
        summed with a count of the replicas that made them, and the outer step by their mean if the
        manager commits; else, or when no replica trained, the replicas go back to the synced weights."""
        ensure_params_ready(self.params)
        self.manager.start_quorum()  # a replica behind the others heals here (:meth:`_heal`)
        trained, self.round_steps = self.round_steps > 0, 0
        device = self.synced[0].device
        with torch.no_grad():
            moves = (
                self._moves() if trained else torch.zeros(sum(s.numel() for s in self.synced), device=device)
            )
            summed = torch.cat([moves, torch.full((1,), float(trained), device=device)])
            self.manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM).wait()
            self.communicated_bytes += summed.numel() * summed.element_size()
        # a failed all-reduce may leave the sum corrupt (torchft's rule): read it only once committed
        committed = self.manager.should_commit()
        self.trained_replicas = int(summed[-1].item()) if committed else 0
        if self.trained_replicas > 0:
            with torch.no_grad():
                self._outer_step(summed[:-1] / self.trained_replicas)
        else:
            self._set_weights(self.synced)

    def _heal(self, state: dict[str, Any]) -> None:
        """The manager's load callable: a peer's state; the round's inner steps, if any, are not this
        replica's to add (the sync then sets its weights, as every replica's)."""
        self.load_state_dict(state)
        self.round_steps = 0

    def _average(self, moves: torch.Tensor) -> Launched:
        assert self.group is not None
        launched, sent = reduce_bucket(
            moves, self.group, self.wire, "diloco", scatter=False, average=True, label="diloco"
        )
        self.communicated_bytes += sent
        return launched

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the outer optimizer's (its momentum), the synced weights and the
        step count: what a resumed run needs to take the same steps."""
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


def refuse_under_manager(group: dist.ProcessGroup | None, wire_dtype: torch.dtype | None) -> None:
    """What a torchft manager replaces, refused by name when given beside it."""
    if group is not None:
        raise ValueError("DiLoCo: pass manager= or group=, not both: the manager's quorum joins the replicas")
    if wire_dtype is not None:
        raise ValueError(
            "DiLoCo: wire_dtype is not available under a manager (torchft's all-reduce sums the fp32 moves); "
            "pass wire_dtype=None"
        )
