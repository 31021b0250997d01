"""Accounting a bucket's collectives in its step's :class:`~gradsync.buffers.stats.CommStats`: one rule
for the bytes a collective counts, whichever of the bucket's jobs (gathers, reductions) launches it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.buffers.stats import CommStats


def record_collective(
    stats: CommStats, op: str, payload: torch.Tensor, group: dist.ProcessGroup, sent: int | None = None
) -> None:
    """Begin ``op``'s record (``sent``: the bytes on the wire, when they are not ``payload``'s own)."""
    nbytes = payload.numel() * payload.element_size() if sent is None else sent
    stats.begin(op, nbytes, group.size(), payload.device)
