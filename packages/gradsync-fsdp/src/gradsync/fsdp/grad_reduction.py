"""A bucket's grad reductions: scale, reduce over the group (or hand to a comm hook), land the result.

The inner stage reduce-scatters into the shard (ZeRO-1/2/3; ZeRO-2/3 add it to the accumulated shard) or
all-reduces the whole buffer (no_shard); HSDP's outer stage then reduces what this rank's optimizer steps
over the outer group. Grads reduced earlier in the cycle and set aside (accumulation without
``no_sync()``) are added back when the last stage ends.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from gradsync.buffers.collectives import Launched
from gradsync.buffers.comm_hook import HookBucket
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.low_precision_reduce import reduce_bucket

from .flat_views import item_views

if TYPE_CHECKING:
    from .bucket import FlatParamBucket, GradReduction


class GradReducer:
    """Reduces one bucket's grads into its grad buffer, with the reduction settings the bucket holds."""

    def __init__(self, bucket: FlatParamBucket) -> None:
        self._bucket = weakref.ref(bucket)
        self._reduced_earlier: torch.Tensor | None = None  # see set_aside

    @property
    def bucket(self) -> FlatParamBucket:
        """The bucket, held weakly: it owns its reducer, and a dropped bucket (with its buffers) is freed
        by reference counting, without waiting for the cycle collector."""
        bucket = self._bucket()
        assert bucket is not None, "the bucket was dropped"
        return bucket

    def launch(self, reduction: GradReduction, norms: LocalGradNorms | None) -> Launched:
        """The inner stage. ``norms``: record the local grads' norm first, on the device (the NaN check
        reads it at ``finish_grad_sync``)."""
        bucket = self.bucket
        assert bucket.grad is not None
        if bucket.sharding.shard_grads:
            wire = bucket.unreduced.buffer()  # zeros when no param of the bucket got a grad
        else:
            grad = bucket.grad
            wire = grad if bucket.comm_dtype == bucket.grad_dtype else grad.to(bucket.comm_dtype)
        if norms is not None:
            norms.record(bucket.bucket_id, wire)
        if bucket.comm_hook is not None:
            launched = self._launch_hook(wire, reduction)
            bucket.record("all_reduce", wire, bucket.group)
        else:
            factor = reduction.factor_for(bucket)
            if factor != 1.0:
                wire.mul_(factor)
            scatter = bucket.sharding.shard_main
            launched, sent = reduce_bucket(
                wire, bucket.group, bucket.grad_comm, bucket.bucket_id, scatter=scatter,
                average=reduction.average, cuts=bucket.ranges.inner_cuts, label=bucket.label,
            )  # fmt: skip
            bucket.record("reduce_scatter" if scatter else "all_reduce", wire, bucket.group, sent)
        launched.after.append(lambda: self.finish(wire))
        return launched

    def _launch_hook(self, wire: torch.Tensor, reduction: GradReduction) -> Launched:
        """Hand the whole-bucket ``wire`` to the comm hook, which averages it over the group (as torch's
        hooks do): scaled first so that mean is the reduction asked for. Sharded strategies then keep
        their shard of the all-reduced bucket."""
        bucket = self.bucket
        assert bucket.comm_hook is not None
        scale = reduction.factor_for(bucket) * (1 if reduction.average else bucket.group.size())
        if scale != 1.0:
            wire.mul_(scale)
        views = item_views(wire, bucket.layout.items)  # each param's grads, as the hook sees them
        hooked = HookBucket(wire, bucket.spec.params, views, bucket.hook_index)
        work = bucket.comm_hook.launch(hooked)
        return Launched([work]).record("all_reduce", f"{bucket.label}.hook", wire, bucket.group)

    def finish(self, wire: torch.Tensor) -> None:
        """Land the reduced ``wire`` (the bucket's grads on the wire) in the grad buffer."""
        bucket = self.bucket
        assert bucket.grad is not None
        if bucket.sharding.shard_grads:
            self.finish_shard(wire[bucket.ranges.shard_lo : bucket.ranges.shard_hi])
            return
        if wire is not bucket.grad:
            bucket.grad.copy_(wire)
        if bucket.outer is None:  # otherwise the outer stage ends the reduction
            self._add_back_reduced()

    def finish_shard(self, shard: torch.Tensor) -> None:
        """Land this rank's reduced shard (a reduce-scatter's result) in the grad buffer."""
        bucket = self.bucket
        assert bucket.grad is not None
        if bucket.sharding.shard_grads:
            bucket.grad.add_(shard)
            bucket.unreduced.drop()
        else:
            bucket.grad[bucket.ranges.shard_lo : bucket.ranges.shard_hi].copy_(shard)
        if bucket.outer is None:
            self._add_back_reduced()

    def launch_outer(self, reduction: GradReduction) -> Launched:
        """The cycle's outer stage: all-reduce the grads this rank's optimizer steps over the outer group
        (outer ``no_shard``), or reduce-scatter the inner grad shard into this rank's piece (``optim``).
        The inner stage already applied the scaling factor."""
        bucket, outer = self.bucket, self.bucket.outer
        assert outer is not None
        assert bucket.grad is not None
        region = bucket.grad if outer.shard else self._stepped_grads()
        wire = region if bucket.comm_dtype == region.dtype else region.to(bucket.comm_dtype)
        launched, sent = reduce_bucket(
            wire, outer.group, bucket.grad_comm, (bucket.bucket_id, "outer"), scatter=outer.shard,
            average=reduction.average, cuts=bucket.ranges.outer_cuts, label=f"{bucket.label}.outer",
        )  # fmt: skip
        if wire is not region:

            def copy_back() -> None:
                region.copy_(wire)

            launched.after.append(copy_back)
        launched.after.append(self._add_back_reduced)
        bucket.record("reduce_scatter" if outer.shard else "all_reduce", wire, outer.group, sent)
        return launched

    def set_aside(self) -> None:
        """A grad arrives after this cycle's final reduction (accumulation without ``no_sync()``): keep the
        reduced grads the optimizer reads apart and zero the buffer, so the next reduction sees only new
        grads; it adds them back when it ends. The sum of reduced grads is what ZeRO-2/3 accumulate."""
        assert self.bucket.grad is not None
        assert self._reduced_earlier is None, "set aside twice without a reduction in between"
        self._reduced_earlier = self._stepped_grads().clone()
        self.bucket.grad.zero_()

    def forget_set_aside(self) -> None:
        """The grads were zeroed: what was set aside is gone with them."""
        self._reduced_earlier = None

    def _add_back_reduced(self) -> None:
        if self._reduced_earlier is not None:
            self._stepped_grads().add_(self._reduced_earlier)
            self._reduced_earlier = None

    def _stepped_grads(self) -> torch.Tensor:
        """The part of the grad buffer this rank's optimizer steps."""
        grad = self.bucket.grad
        assert grad is not None
        lo, hi = self.bucket.ranges.main
        base = self.bucket.ranges.grad[0]
        return grad[lo - base : hi - base]
