"""NaN/Inf and unexpectedly-large gradient checks, run on the local bucket before its collective.

A NaN reduced into every rank's grads is impossible to trace afterwards; checking the local norm first
names the rank, the bucket and the param that produced it.
"""

from __future__ import annotations

import math
import socket
import warnings
from collections.abc import Sequence

import torch

from .buffer import ParamAndGradBucket

LARGE_GRAD_FACTOR = 10.0
LARGE_GRAD_WARMUP_STEPS = 100


class LargeGradDetector:
    """Records the largest bucket grad norm over the first ``warmup`` checks, then flags norms at or
    above ``factor`` times that."""

    def __init__(self, factor: float = LARGE_GRAD_FACTOR, warmup: int = LARGE_GRAD_WARMUP_STEPS) -> None:
        self.factor, self.warmup = factor, warmup
        self.checks = 0
        self.max_seen = 0.0

    def is_unexpectedly_large(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.checks < self.warmup:
            self.checks += 1
            self.max_seen = max(self.max_seen, abs(value))
            return False
        return abs(value) >= self.factor * self.max_seen


def _first_offending_param(bucket: ParamAndGradBucket, predicate: str) -> str:
    for param in bucket.params_list:
        grad = param.main_grad  # type: ignore[attr-defined]
        bad = torch.isnan(grad) if predicate == "NaN" else torch.isinf(grad)
        if bool(bad.any()):
            return bucket.param_names[param]
    return "(none: only the padding)"


def check_grads(
    buckets: Sequence[ParamAndGradBucket],
    *,
    rank: int,
    check_for_nan_or_inf: bool,
    detector: LargeGradDetector | None,
) -> None:
    """Raise on a NaN/Inf local grad norm; warn on an unexpectedly large one."""
    for bucket in buckets:
        norm = float(bucket.grad_data.float().norm(p=2))
        where = f"Rank {rank}, node {socket.gethostname()}, device {bucket.grad_data.device}"
        if check_for_nan_or_inf:
            for kind, bad in (("NaN", math.isnan(norm)), ("Inf", math.isinf(norm))):
                if bad:
                    raise RuntimeError(
                        f"{where}: Unexpected result {norm} (message='found {kind} in local grad norm for "
                        f"bucket #{bucket.bucket_id} in backward pass before data-parallel communication "
                        f"collective'); first offending param: {_first_offending_param(bucket, kind)}"
                    )
        if detector is not None and detector.is_unexpectedly_large(norm):
            warnings.warn(
                f"{where}: Unexpected result {norm} (message='found unexpected large grads in bucket "
                f"#{bucket.bucket_id} in backward pass before data-parallel communication collective'); "
                f"largest norm seen in the first {detector.warmup} checks: {detector.max_seen}",
                RuntimeWarning,
                stacklevel=3,
            )
