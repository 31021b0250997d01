"""A bucket group's NaN/Inf and large-grad checks, deferred to the end of its reduction.

Reading a norm on the host at each launch would stall the backward, so each launch only records the
buckets' local norms on the device, and ``finish_grad_sync`` reads every rank's at once (one all-gather,
one host read): every rank then raises alike, naming the ranks whose grads were bad.
"""

from __future__ import annotations

import torch.distributed as dist

from .buffer import ParamAndGradBucket
from .config import DistributedDataParallelConfig
from .grad_checks import LargeGradDetector, LocalGradNorms, non_finite_ranks, report_grad_norms


class DeferredGradChecks:
    """The local norms of one bucket group's buckets, recorded at each reduction and reported once."""

    def __init__(self, buckets: list[ParamAndGradBucket], ddp_config: DistributedDataParallelConfig) -> None:
        self.buckets, self.ddp_config = buckets, ddp_config
        self.norms = LocalGradNorms(len(buckets), buckets[0].grad_data.device)
        self._recorded = False

    def record(self) -> None:
        """Add the buckets' local norms before their reduction (on the device: no host sync)."""
        for position, bucket in enumerate(self.buckets):
            self.norms.record(position, bucket.grad_data)
        self._recorded = True

    def reset(self) -> None:
        """Forget a cycle whose grads were zeroed before it was reported."""
        self.norms.reset()
        self._recorded = False

    def report(self, group: dist.ProcessGroup, label: str, detector: LargeGradDetector | None) -> None:
        """The checks of this cycle's reductions, on every rank of ``group``: one all-gather of the local
        norms, one host read. Nothing to do when no reduction was recorded since the last report. The
        ``detector`` warns only while the config asks for the large-grad check."""
        if not self._recorded:
            return
        self._recorded = False
        table = self.norms.gather(group, f"{label}.grad_norms")
        report_grad_norms(
            self.buckets,
            table[group.rank()],
            rank=dist.get_rank(),
            check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
            detector=detector if self.ddp_config.check_for_large_grads else None,
            bad_elsewhere=non_finite_ranks(table, group),
        )
