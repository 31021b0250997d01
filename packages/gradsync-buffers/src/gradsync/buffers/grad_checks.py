"""NaN/Inf and unexpectedly-large gradient checks on each bucket's local grads, before its collective.

A NaN reduced into every rank's grads is impossible to trace afterwards; the local norm taken before the
reduction names the rank, the bucket and the param that produced it. Reading a norm on the host per
bucket per microbatch would stall the backward (and, on CUDA, sync the host with the device), so both
wrappers keep the norms on the device (:class:`LocalGradNorms`) and read every rank's once per step, at
``finish_grad_sync``, after one small all-gather through :mod:`gradsync.buffers.collectives` (which
telemetry and the hang watchdog see). Every rank then raises alike, none is left waiting in a collective.
"""

from __future__ import annotations

import math
import socket
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .buffer import ParamAndGradBucket
from .collectives import all_gather_shards

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


class LocalGradNorms:
    """Each bucket's local grad norm before its reduction, summed over the cycle's reductions, on the
    grads' device: recording costs no host sync. A sum keeps NaN and Inf (x + NaN is NaN)."""

    def __init__(self, buckets: int, device: torch.device) -> None:
        self.norms = torch.zeros(buckets, dtype=torch.float32, device=device)

    def record(self, bucket: int, grads: torch.Tensor) -> None:
        self.norms[bucket] += torch.linalg.vector_norm(grads, dtype=torch.float32)

    def reset(self) -> None:
        """Forget a cycle that was never finished (its grads were zeroed)."""
        self.norms.zero_()

    def gather(self, group: dist.ProcessGroup, label: str) -> list[list[float]]:
        """Every rank of ``group``'s norms (one row per group rank), then zero: one all-gather and one
        host read per call."""
        world, count = group.size(), self.norms.numel()
        everyone = torch.zeros(world * count, dtype=self.norms.dtype, device=self.norms.device)
        everyone[group.rank() * count : (group.rank() + 1) * count] = self.norms
        all_gather_shards(everyone, group, label=label).wait()
        self.reset()
        return everyone.view(world, count).tolist()


def non_finite_ranks(table: list[list[float]], group: dist.ProcessGroup) -> dict[int, list[int]]:
    """Per bucket whose norm is NaN or Inf on some rank: those ranks (global numbers)."""
    bad: dict[int, list[int]] = {}
    for rank, norms in enumerate(table):
        for bucket, norm in enumerate(norms):
            if not math.isfinite(norm):
                bad.setdefault(bucket, []).append(dist.get_global_rank(group, rank))
    return bad


def first_non_finite(names: Sequence[str], grads: Sequence[torch.Tensor]) -> str:
    """The first of ``names`` whose grad holds NaN or Inf (a reduction carries them to the same
    elements, so this finds it after the collective too)."""
    for name, grad in zip(names, grads, strict=True):
        if not bool(torch.isfinite(grad).all()):
            return name
    return "(none: only the padding)"


def _first_offending_param(bucket: ParamAndGradBucket) -> str:
    params = bucket.params_list
    return first_non_finite([bucket.param_names[p] for p in params], [p.main_grad for p in params])  # type: ignore[attr-defined]


def check_grads(
    buckets: Sequence[ParamAndGradBucket],
    *,
    rank: int,
    check_for_nan_or_inf: bool,
    detector: LargeGradDetector | None,
) -> None:
    """Raise on a NaN/Inf local grad norm; warn on an unexpectedly large one (norms read now)."""
    norms = [float(bucket.grad_data.float().norm(p=2)) for bucket in buckets]
    report_grad_norms(buckets, norms, rank=rank, check_for_nan_or_inf=check_for_nan_or_inf, detector=detector)


def report_grad_norms(
    buckets: Sequence[ParamAndGradBucket],
    norms: Sequence[float],
    *,
    rank: int,
    check_for_nan_or_inf: bool,
    detector: LargeGradDetector | None,
    bad_elsewhere: dict[int, list[int]] | None = None,
) -> None:
    """Raise on a NaN/Inf among this rank's local norms (naming the first offending param) or, with
    ``bad_elsewhere`` (bucket position -> ranks), on another rank's; warn on an unexpectedly large one."""
    for position, (bucket, norm) in enumerate(zip(buckets, norms, strict=True)):
        where = f"Rank {rank}, node {socket.gethostname()}, device {bucket.grad_data.device}"
        before = "in backward pass before data-parallel communication collective"
        if check_for_nan_or_inf:
            for kind, bad in (("NaN", math.isnan(norm)), ("Inf", math.isinf(norm))):
                if bad:
                    raise RuntimeError(
                        f"{where}: Unexpected result {norm} (message='found {kind} in local grad norm for "
                        f"bucket #{bucket.bucket_id} {before}'); first offending param: "
                        f"{_first_offending_param(bucket)}"
                    )
            ranks = (bad_elsewhere or {}).get(position)
            if ranks:
                raise RuntimeError(
                    f"{where}: rank(s) {ranks} found NaN or Inf in their local grad norm for bucket "
                    f"#{bucket.bucket_id} {before}; the reduced grads carry it to every rank"
                )
        if detector is not None and detector.is_unexpectedly_large(norm):
            warnings.warn(
                f"{where}: Unexpected result {norm} (message='found unexpected large grads in bucket "
                f"#{bucket.bucket_id} {before}'); largest norm seen in the first {detector.warmup} checks: "
                f"{detector.max_seen}",
                RuntimeWarning,
                stacklevel=3,
            )
