"""What Muon adds to a step, by rank: the Newton-Schulz matmuls of the matrices each rank owns whole.

Under ZeRO with ``shard_alignment='tensor'`` each matrix is orthogonalised by the one rank that holds it,
so Muon's extra compute per step is the busiest rank's share: at least the largest matrix's, at least the
total over the ranks. Matrices are assigned largest first to the least loaded rank (gradsync's packer
spreads whole params the same way, by size). A step of ``steps`` quintic iterations on an ``m x n``
matrix (``m`` the short side, the Gram matrix taken there) costs ``2 m^2 n`` for ``X X^T``, ``2 m^3`` for
``A A`` and ``2 m^2 n`` for ``(b A + c A A) X``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["busiest_rank_flops", "newton_schulz_flops"]


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a param viewed as ``(shape[0], -1)``."""
    rows, cols = shape[0], math.prod(shape[1:])
    short, long = min(rows, cols), max(rows, cols)
    return float(steps * (4 * short * short * long + 2 * short**3))


def busiest_rank_flops(shapes: Sequence[Sequence[int]], dp: int, steps: int = 5) -> float:
    """The Newton-Schulz FLOPs of the busiest of ``dp`` ranks, each matrix (2+ dims) whole on one rank,
    assigned largest first to the least loaded rank."""
    if dp < 1:
        raise ValueError(f"busiest_rank_flops: dp must be at least 1, got {dp}")
    costs = sorted((newton_schulz_flops(s, steps) for s in shapes if len(s) >= 2), reverse=True)
    loads = [0.0] * min(dp, max(len(costs), 1))
    for cost in costs:
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)
