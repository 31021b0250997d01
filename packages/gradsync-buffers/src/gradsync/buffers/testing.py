"""A test helper: every collective that :mod:`gradsync.buffers.collectives` asks torch.distributed for,
recorded as torch sees it, so tests can check gradsync's own accounting (telemetry, byte counters,
which group a stage uses) against something computed another way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import collectives
from .step_ballot import is_vote_group

ABANDONED_BY_RANK_ONE = {
    "raised": "its backward raised part-way (an exception caught around loss.backward()) and "
    "zero_grad_buffer()",
    "loss_raised": "its forward ran in training mode with grad enabled, then zero_grad_buffer() came "
    "with no backward",
    "no_backward": "finish_grad_sync() on rank 1 with no backward since zero_grad_buffer()",
    "no_forward": "finish_grad_sync() on rank 1 with no backward since zero_grad_buffer()",
    "step_without_backward": "its forward ran in training mode with grad enabled, then an optimizer step "
    "came with no backward",
}
"""How each wrapper's message on rank 1 starts its reason, for each way
``gradsync.groups.testing.step_abandoned_on_rank_one`` abandons a step (written out, not taken from the
messages' constants, so a test reads what the user reads)."""


@dataclass(frozen=True)
class IssuedCollective:
    """One call into torch.distributed: its kind, its group and the bytes this rank handed over (the
    bucket; for one broadcast of a broadcast-based gather, that shard)."""

    kind: str
    group: dist.ProcessGroup | None
    nbytes: int


_PAYLOADS: dict[tuple[Any, str], tuple[str, Callable[[tuple[Any, ...]], torch.Tensor]]] = {
    (dist, "all_reduce"): ("all_reduce", lambda args: args[0]),
    (dist, "broadcast"): ("broadcast", lambda args: args[0]),
    (dist, "all_to_all_single"): ("all_to_all", lambda args: args[1]),
    (collectives, "dist_reduce_scatter_func"): ("reduce_scatter", lambda args: args[1]),
    (collectives, "dist_all_gather_func"): ("all_gather", lambda args: args[0]),
}


@contextlib.contextmanager
def issued_collectives() -> Iterator[list[IssuedCollective]]:
    """Record, while open, every collective issued on this rank through gradsync's collectives."""
    seen: list[IssuedCollective] = []
    originals = {key: getattr(*key) for key in _PAYLOADS}

    def spy(
        original: Callable[..., Any], kind: str, payload: Callable[..., torch.Tensor]
    ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor, group = payload(args), kwargs.get("group")
            if not is_vote_group(group):  # a step's vote (:mod:`.step_ballot`) carries no data
                seen.append(IssuedCollective(kind, group, tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)

        return call

    for (owner, name), (kind, payload) in _PAYLOADS.items():
        setattr(owner, name, spy(originals[(owner, name)], kind, payload))
    try:
        yield seen
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
