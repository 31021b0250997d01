"""The α-β cost of one collective: α seconds per message step, β seconds per byte a rank moves.

Ring algorithms (gloo; NCCL's reduce-scatter and all-gather): a reduce-scatter or all-gather over p ranks
takes p-1 steps, each moving n/p bytes, so ``(p-1)·α + (p-1)/p·n·β``; an all-reduce is both,
``2(p-1)·α + 2(p-1)/p·n·β``. NCCL also has a tree all-reduce, ``2·log2(p)·α + 2·n·β`` (both halves move
the whole message once), and picks the faster: the planner does the same where ``tree`` is set.
β is the inverse of the per-rank *bus* bandwidth that nccl-tests reports (busbw), which is defined so
that it compares across collectives and rank counts with exactly these factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class LinkCosts:
    """α (s) and β (s/byte) per collective kind, and where they come from."""

    name: str
    alpha: dict[str, float]
    beta: dict[str, float]
    source: str
    tree_all_reduce: bool = False

    @classmethod
    def uniform(
        cls, name: str, alpha: float, busbw_gbps: float, source: str, tree_all_reduce: bool = False
    ) -> LinkCosts:
        """The same α and a bus bandwidth in GB/s for every kind."""
        beta = 1.0 / (busbw_gbps * 1e9)
        return cls(name, dict.fromkeys(KINDS, alpha), dict.fromkeys(KINDS, beta), source, tree_all_reduce)

    def time(self, kind: str, nbytes: float, ranks: int) -> float:
        """Seconds for one ``kind`` collective of ``nbytes`` (the whole bucket) over ``ranks``."""
        if ranks <= 1:
            return 0.0
        latency, bandwidth = self.terms(kind, nbytes, ranks)
        return latency + bandwidth

    def terms(self, kind: str, nbytes: float, ranks: int) -> tuple[float, float]:
        """(latency term, bandwidth term) of :meth:`time`."""
        a, b, p = self.alpha[kind], self.beta[kind], ranks
        steps, share = (2 * (p - 1), 2 * (p - 1) / p) if kind == "all_reduce" else (p - 1, (p - 1) / p)
        ring = (steps * a, share * nbytes * b)
        if kind == "all_reduce" and self.tree_all_reduce:
            tree = (2 * math.log2(p) * a, 2 * nbytes * b)
            return min(ring, tree, key=sum)
        return ring


# Published large-message bus bandwidths (nccl-tests busbw). alpha is not published alongside them: it is an
# assumption of the order NCCL's small-message times show (a few microseconds per step); set your own.
PUBLISHED = {
    "nccl-h100-nvlink": LinkCosts.uniform(
        "nccl-h100-nvlink",
        alpha=5e-6,
        busbw_gbps=470.0,
        source="busbw 460-480 GB/s, 8x H100 SXM5 NVLink (docs.alayanew.com/en/docs/tech-blog/"
        "2026-05-06-nccl-tests); alpha 5 us assumed",
        tree_all_reduce=True,
    ),
    "nccl-h100-ib": LinkCosts.uniform(
        "nccl-h100-ib",
        alpha=10e-6,
        busbw_gbps=45.0,
        source="one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s line rate), about 90 % of it as busbw "
        "across nodes (saturncloud.io/blog/crusoe-nccl-cluster-validation gives the node-level "
        "figures); alpha 10 us assumed",
        tree_all_reduce=True,
    ),
    "nccl-100g": LinkCosts.uniform(
        "nccl-100g",
        alpha=10e-6,
        busbw_gbps=11.25,
        source="one 100 Gb/s NIC per GPU (12.5 GB/s line rate), 90 % of it as busbw, as nccl-h100-ib assumes "
        "of its 400 Gb/s NIC; alpha 10 us assumed",
        tree_all_reduce=True,
    ),
}
