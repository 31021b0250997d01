"""Bucket groups: buckets whose grads are reduced, and params gathered, as one asynchronous step.

A group tracks which of its params have their grad for this iteration (:mod:`.grad_arrivals`, the
mechanism MegatronFSDP's buckets use too). The first iteration only counts ("golden" counts, so params used
several times in one backward are handled); from the second on, the group dispatches its reduction the
moment its counts match, overlapping it with the rest of backward. With the
distributed optimizer grads are reduce-scattered (each rank owns one shard of every bucket) and params are
gathered back, group by group, ahead of the forward pass that needs them.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.distributed as dist
from torch.nn import Parameter

from . import collectives
from .bucket_group_collectives import BucketGroupCollectives
from .buffer import ParamAndGradBucket, ParamAndGradBuffer
from .comm_hook import RegisteredHook
from .config import DistributedDataParallelConfig
from .deferred_grad_checks import DeferredGradChecks
from .foreign_config import as_ddp_config
from .grad_arrivals import GradArrivals
from .grad_checks import LargeGradDetector, LocalGradNorms, check_grads
from .low_precision_reduce import GradCommWire
from .stats import CommStats


class ParamAndGradBucketGroup:
    """Buckets communicated together over one (intra-instance) data-parallel group."""

    def __init__(
        self,
        buckets: list[ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        collective_group: dist.ProcessGroup,
        collective_group_size: int,
        *,
        inter_distributed_optimizer_instance_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.buckets = buckets
        self.ddp_config = ddp_config = as_ddp_config(ddp_config)
        self.collective_group = collective_group
        self.collective_group_size = collective_group_size
        self.collective_group_rank = collective_group.rank()
        # Megatron-Core's names for the same group (it sets the first three with the distributed
        # optimizer or param gather overlap, the last without the distributed optimizer).
        self.intra_distributed_optimizer_instance_group = collective_group
        self.intra_distributed_optimizer_instance_size = collective_group_size
        self.intra_distributed_optimizer_instance_rank = self.collective_group_rank
        self.data_parallel_group = collective_group
        if (
            ddp_config.num_distributed_optimizer_instances > 1
            and inter_distributed_optimizer_instance_group is None
        ):
            raise ValueError(
                f"num_distributed_optimizer_instances={ddp_config.num_distributed_optimizer_instances} needs "
                "the inter-instance group: pass pg_collection.inter_dist_opt"
            )
        self.inter_distributed_optimizer_instance_group = inter_distributed_optimizer_instance_group
        self.param_to_bucket = {p: b for b in buckets for p in b.params_list}
        self.params = set(self.param_to_bucket)
        self.param_names = {p: name for b in buckets for p, name in b.param_names.items()}
        self.next_param_gather_bucket_group: ParamAndGradBucketGroup | None = None
        self.previous_grad_reduce_bucket_group: ParamAndGradBucketGroup | None = None
        self.grad_clock = itertools.count()  # GradBuffers shares one among a model's groups
        self.readied_at = 0
        """When this group's last grad arrived in the first iteration, on ``grad_clock``: the order the
        backward readies the groups in, and so launches their reductions in every later iteration."""

        self.grad_arrivals: GradArrivals[Parameter] = GradArrivals({})
        """Grads counted per param this iteration, against the golden counts of the first one."""
        self.is_last_microbatch = True
        self.is_first_batch = True
        self.grad_reduce_handle: collectives.Launched | None = None
        self.grad_reduce_dispatched = False
        self.grad_reduce_finished = False
        self.param_gather_handle: collectives.Launched | None = None
        self.param_gather_dispatched = False
        self.stats = CommStats()
        self.label = "bucket_group"
        """The group's name in telemetry (GradBuffers numbers its groups)."""
        self.large_grad_detector = LargeGradDetector() if ddp_config.check_for_large_grads else None
        self._grad_checks: DeferredGradChecks | None = None
        if ddp_config.check_for_nan_in_grad or ddp_config.check_for_large_grads:
            self._grad_checks = DeferredGradChecks(buckets, ddp_config)
        self.grad_comm_wire = GradCommWire.from_config(ddp_config)
        """The low-precision wire (``grad_comm_dtype``) the reductions send, if any."""
        self.comm_hook: RegisteredHook | None = None
        """A torch-DDP-style comm hook that reduces each bucket instead."""
        self.hook_bucket_offset = 0  # the index the hook sees for this group's first bucket
        self._collectives = BucketGroupCollectives(
            buckets,
            ddp_config,
            collective_group,
            collective_group_size,
            inter_distributed_optimizer_instance_group,
            self.grad_comm_wire,
            self.stats,
        )

    @property
    def golden_per_param_grad_ready_counts(self) -> dict[Parameter, int]:
        """How many grads each param got in the first iteration: what every later one waits for."""
        return self.grad_arrivals.expected

    @property
    def per_param_grad_ready_counts(self) -> dict[Parameter, int]:
        """How many grads each param has had in this iteration."""
        return self.grad_arrivals.counts

    @property
    def grad_norms(self) -> LocalGradNorms | None:
        """The NaN/Inf and large-grad checks' local norms, read at finish_grad_sync (None without them)."""
        return None if self._grad_checks is None else self._grad_checks.norms

    # --- iteration state -------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new iteration; after the first one, record the golden readiness counts."""
        if self.is_first_batch and self.per_param_grad_ready_counts:
            missing = self.params_without_grad()
            if missing:
                raise RuntimeError(
                    f"{len(missing)} of {len(self.params)} params of a bucket group got no grad in the first "
                    f"iteration: {', '.join(missing)}. Every param must receive a grad in every iteration; "
                    "freeze unused params (requires_grad=False) before wrapping."
                )
            self.grad_arrivals.restart(expected=dict(self.per_param_grad_ready_counts))
            self.is_first_batch = False
        else:
            self.grad_arrivals.restart()
        if self._grad_checks is not None:
            self._grad_checks.reset()
        self.is_last_microbatch = True
        self.grad_reduce_finished = False
        self.grad_reduce_dispatched = False
        self.stats.reset()

    def params_without_grad(self) -> list[str]:
        """Names of the params that have reported no grad in this iteration."""
        return sorted(self.param_names[p] for p in self.grad_arrivals.missing(self.params))

    def register_grad_ready(self, param: Parameter, force_all_reduce: bool = False) -> None:
        """Count one grad of ``param``; dispatch the reduction once every count matches the golden one."""
        if not self.ddp_config.overlap_grad_reduce:
            raise RuntimeError("register_grad_ready() should only be called when overlap_grad_reduce is True")
        if not self.is_last_microbatch:
            return
        if param not in self.params:
            raise ValueError(f"Param is not in the bucket group: {getattr(param, 'shape', param)}")
        if self.grad_reduce_dispatched and not self.is_first_batch:
            self._refuse_late_grad(param)
        complete = self.grad_arrivals.arrive(param)
        if self.is_first_batch:
            self.readied_at = next(self.grad_clock)
        elif complete:
            self.start_grad_sync(force_all_reduce)

    def _refuse_late_grad(self, param: Parameter) -> None:
        """A grad after this group's reduction launched: it landed in a buffer already on the wire, so it
        would be lost or counted on one rank only. The first iteration's counts decide when a group is
        complete; a module run through more backwards than then (a chunked loss with more chunks) ends
        here instead of dropping the extra grads."""
        name = self.param_names[param]
        raise RuntimeError(
            f"param {name} got a grad after its bucket group's reduction was launched: "
            f"{self.per_param_grad_ready_counts.get(param, 0) + 1} grads in this iteration against "
            f"{self.golden_per_param_grad_ready_counts.get(param, 0)} in the first, whose counts every later "
            "iteration waits for. A module must run through the same number of backwards every iteration "
            "(a chunked loss: the same number of chunks); otherwise set overlap_grad_reduce=False, which "
            "reduces once, at finish_grad_sync()"
        )

    # --- gradient reduction ----------------------------------------------------------------------

    def check_grads(self, check_for_nan_or_inf: bool, check_for_large: bool) -> None:
        """Raise on a NaN/Inf local grad norm and, when asked, warn on an unexpectedly large one."""
        if check_for_large and self.large_grad_detector is None:
            self.large_grad_detector = LargeGradDetector()
        check_grads(
            self.buckets,
            rank=dist.get_rank(),
            check_for_nan_or_inf=check_for_nan_or_inf,
            detector=self.large_grad_detector if check_for_large else None,
        )

    def _uses_reduce_scatter(self, force_all_reduce: bool) -> bool:
        return self.ddp_config.use_distributed_optimizer and not force_all_reduce

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Scale and launch the reduction of every bucket (async with overlap_grad_reduce)."""
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # already dispatched explicitly in the first iteration
        previous = self.previous_grad_reduce_bucket_group
        if previous is not None and previous.grad_reduce_handle is not None:
            previous.finish_grad_sync(force_all_reduce)  # bound live fp32-accumulation scratch
        if self.grad_reduce_handle is not None:
            raise RuntimeError("Should not have multiple communication calls outstanding at once")
        self._copy_extra_main_grads_into_buffer()
        if self._grad_checks is not None:  # read at finish_grad_sync, on every rank alike
            self._grad_checks.record()
        # A comm hook averages (as torch's do): hand it the grads that make its mean gradsync's scaled sum.
        to_mean = (
            self.collective_group_size if self.comm_hook and not self.ddp_config.average_in_collective else 1
        )
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor * to_mean != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor * to_mean

        launched = self._collectives.reduce_grads(
            self._uses_reduce_scatter(force_all_reduce), self.label, self.comm_hook, self.hook_bucket_offset
        )
        self.grad_reduce_dispatched = True
        if self.ddp_config.overlap_grad_reduce:
            self.grad_reduce_handle = launched
        else:
            launched.wait()

    def drain_in_flight(self) -> None:
        """Wait for this group's reduction and gather if they are still in flight (and keep no handle),
        so the buffers can be reused safely, for instance after an exception in the middle of a step."""
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        self.free_overlap_buffers()

    def free_overlap_buffers(self) -> None:
        """Finish a param all-gather still in flight, drop its handle and every bucket's
        ``layerwise_gather_list`` (Megatron-Core's hook for freeing the memory its layer-wise gather holds
        before an async checkpoint save; gradsync gathers straight into the param buffer and leaves that
        list empty, so this only releases what a caller staged there)."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
        for bucket in self.buckets:
            bucket.layerwise_gather_list = None

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Wait for (or, without overlap, run) the reduction of this group."""
        self.param_gather_dispatched = False  # the next forward must gather the updated params
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(force_all_reduce)
            self._copy_back_extra_main_grads()
            self._report_grad_checks()
            return
        if self.grad_reduce_finished:
            return
        if self.is_first_batch and not self.grad_reduce_dispatched:
            self.start_grad_sync(force_all_reduce)
        if not self.grad_reduce_dispatched:
            counts, golden = self.per_param_grad_ready_counts, self.golden_per_param_grad_ready_counts
            short = [
                f"{self.param_names[p]} ({counts.get(p, 0)} of {n})"
                for p, n in golden.items()
                if counts.get(p, 0) < n
            ]
            none_missing = f"(none; fewer grads than in the first iteration: {', '.join(sorted(short))})"
            raise RuntimeError(
                f"Communication call has not been issued for this bucket "
                f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad available). "
                f"Params that never got a grad: {', '.join(self.params_without_grad()) or none_missing}"
            )
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        self._copy_back_extra_main_grads()
        self.grad_reduce_finished = True
        self._report_grad_checks()

    def _report_grad_checks(self) -> None:
        if self._grad_checks is not None:
            self._grad_checks.report(self.collective_group, self.label, self.large_grad_detector)

    def _copy_extra_main_grads_into_buffer(self) -> None:
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)  # type: ignore[attr-defined]

    def _copy_back_extra_main_grads(self) -> None:
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                param.main_grad.copy_(param.main_grad_copy_in_grad_buffer)  # type: ignore[attr-defined]

    # --- parameter all-gather (distributed optimizer) --------------------------------------------

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Gather every bucket's param shards from their owners (async with overlap_param_gather)."""
        if not (self.ddp_config.use_distributed_optimizer or self.ddp_config.overlap_param_gather):
            raise RuntimeError("start_param_sync needs use_distributed_optimizer or overlap_param_gather")
        if force_sync and self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            return
        if self.param_gather_handle is not None:
            raise RuntimeError("A param all-gather is already in flight for this bucket group")
        launched = self._collectives.gather_params(self.label)
        if self.ddp_config.overlap_param_gather and not force_sync:
            self.param_gather_handle = launched
        else:
            launched.wait()
        self.param_gather_dispatched = True

    def _post_param_sync(self) -> None:
        """Megatron's hook for work after a group's param all-gather (casting fp8 / MXFP8 params from the
        gathered buffer). gradsync gathers into ``param.data`` views and refuses quantized params, so
        there is nothing to do; Megatron's ``DistributedDataParallel._start_bucket_group_param_sync``
        (which Megatron's DistributedOptimizer drives) calls it after a synchronous gather."""

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Wait for this group's gather, then start the next group's so it overlaps with compute."""
        if not self.ddp_config.overlap_param_gather:
            raise RuntimeError("finish_param_sync() should only be called when overlap_param_gather is True")
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        following = self.next_param_gather_bucket_group
        if following is not None and not skip_next_bucket_dispatch:
            if following.param_gather_dispatched:
                warnings.warn(
                    "The next bucket's parameter all-gather operation has already been dispatched. This may "
                    "be caused by a mismatch between the order of parameter registration and forward pass "
                    "execution, which will hurt the communication-computation overlap performance.",
                    stacklevel=2,
                )
            else:
                following.start_param_sync()


def partition_buckets(
    buffers: Sequence[ParamAndGradBuffer],
    force_single_bucket_group: bool = False,
    reduce_scatter_with_fp32_accumulation: bool = False,
    *,
    inter_distributed_optimizer_instance_group: dist.ProcessGroup | None = None,
) -> list[ParamAndGradBucketGroup]:
    """One group per bucket (buffers in order, buckets in order), or every bucket in one group.

    Groups are chained so that the param gather runs from the last group (the model's first layers)
    towards group 0, and so that a group can drain its predecessor's reduction. Each group reads
    ``reduce_scatter_with_fp32_accumulation`` from its buffers' config; Megatron's argument of that name
    must agree with it.
    """
    if not buffers:
        return []
    disagreeing = [
        i
        for i, b in enumerate(buffers)
        if b.ddp_config.reduce_scatter_with_fp32_accumulation != reduce_scatter_with_fp32_accumulation
    ]
    if disagreeing:
        raise ValueError(
            f"partition_buckets(reduce_scatter_with_fp32_accumulation={reduce_scatter_with_fp32_accumulation})"
            f" but buffers {disagreeing} were built with the opposite in their config; pass their "
            "ddp_config.reduce_scatter_with_fp32_accumulation"
        )
    if force_single_bucket_group:
        first = buffers[0]
        for other in buffers[1:]:
            if (
                other.data_parallel_group is not first.data_parallel_group
                or other.ddp_config != first.ddp_config
            ):
                raise ValueError(
                    "buffers in one bucket group must share their config and data-parallel group"
                )
        bucket_lists = [[b for buffer in buffers for b in buffer.buckets]]
        owners = [first]
    else:
        bucket_lists = [[b] for buffer in buffers for b in buffer.buckets]
        owners = [buffer for buffer in buffers for _ in buffer.buckets]
    groups = [
        ParamAndGradBucketGroup(
            buckets,
            owner.ddp_config,
            owner.data_parallel_group,
            owner.data_parallel_world_size,
            inter_distributed_optimizer_instance_group=inter_distributed_optimizer_instance_group,
        )
        for buckets, owner in zip(bucket_lists, owners, strict=True)
    ]
    for earlier, later in pairwise(groups):
        later.next_param_gather_bucket_group = earlier
        if later.ddp_config.reduce_scatter_with_fp32_accumulation:
            later.previous_grad_reduce_bucket_group = earlier
    return groups
