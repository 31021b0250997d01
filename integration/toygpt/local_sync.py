"""DiLoCo runs for train.py (``--grad-comm diloco-h*``): every data-parallel rank trains its own replica
(the wrapper's data-parallel group is that rank alone, so no grad crosses ranks), and gradsync-ddp's
``DiLoCo`` averages the replicas' moves over the real data-parallel group every H steps, where an outer
Nesterov SGD applies them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.ddp import DiLoCo
from gradsync.groups import ProcessGroupCollection

from .strategies import STRATEGIES


@dataclass(frozen=True)
class LocalSync:
    sync_every: int
    wire_dtype: torch.dtype | None = None
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0

    def describe(self) -> str:
        """The run in a phrase, for the report."""
        if self.fragments == 1:
            return f"DiLoCo, the replicas' moves averaged every {self.sync_every} steps"
        overlap = (
            f", each sync landing {self.delay} steps later and mixed in at alpha {self.alpha}"
            if self.delay
            else ""
        )
        return (
            f"Streaming DiLoCo, {self.fragments} fragments, each averaged every {self.sync_every} steps "
            f"in turn{overlap}"
        )


DILOCO = {
    "diloco-h8": LocalSync(8),
    "diloco-h8-bf16": LocalSync(8, torch.bfloat16),
    "diloco-h32": LocalSync(32),
    "diloco-h8-f4": LocalSync(8, fragments=4),
    "diloco-h8-f4-overlap": LocalSync(8, fragments=4, delay=2, alpha=0.5),
}
"""``--grad-comm`` choices that train with DiLoCo: sync every H steps, the moves in fp32 or bf16 (summed
in fp32); the outer step is DiLoCo's (lr 0.7, Nesterov momentum 0.9). ``-f4``: Streaming DiLoCo, the
model in 4 fragments synced in turn (one every 2 steps), ``-overlap`` with each sync landing 2 steps late
and half the local weights kept."""


def check_layout(choice: str, strategy: str, model_parallel: int, checkpoints: bool) -> None:
    """Refuse what a DiLoCo run cannot do, by flag, before any group is made."""
    flag = f"--grad-comm {choice}"
    if model_parallel > 1:
        raise ValueError(f"{flag}: each replica is one data-parallel rank; use --tp/--pp/--ep 1")
    if STRATEGIES[strategy].wrapper != "ddp":
        raise ValueError(f"{flag}: needs a ddp strategy (DiLoCo steps gradsync-ddp's wrapper)")
    if checkpoints:
        raise ValueError(f"{flag}: DiLoCo runs write no checkpoints; drop --save-every and --resume")


def replica_groups(groups: ProcessGroupCollection) -> ProcessGroupCollection:
    """The collection the wrapper gets: ``groups`` with a data-parallel group of this rank alone. Every
    rank creates every rank's group (torch.distributed asks that of ``new_group``)."""
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    return ProcessGroupCollection(dp=alone, dp_cp=alone, tp=groups.tp, pp=groups.pp)


def local_sync(choice: str, model: Any, inner_optimizer: Any, groups: ProcessGroupCollection) -> DiLoCo:
    """DiLoCo over the data-parallel group, stepping ``inner_optimizer`` on each replica."""
    spec = DILOCO[choice]
    return DiLoCo(
        model.parameters(),
        inner_optimizer,
        spec.sync_every,
        group=groups.dp_cp,
        wire_dtype=spec.wire_dtype,
        fragments=spec.fragments,
        fragment_sync_delay=spec.delay,
        fragment_update_alpha=spec.alpha,
    )
