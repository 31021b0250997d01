"""DDP's side of the param-readiness protocol (:func:`gradsync.buffers.ensure_params_ready`).

With ``overlap_param_gather`` each bucket group's params carry one :class:`BucketParamReadyCallback`.
Called before weights are read outside the forward pre-hooks, it finishes the group's gather in flight,
or, while the wrapper's pre-hooks own the schedule, starts and finishes one. It holds the wrapper and
the group weakly, so a param outliving its wrapper keeps neither alive.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from gradsync.buffers.bucket_group import ParamAndGradBucketGroup

if TYPE_CHECKING:
    from .distributed_data_parallel import DistributedDataParallel


class BucketParamReadyCallback:
    """Makes one bucket group's params current when called (Megatron-Core's _BucketParamReadyCallback)."""

    def __init__(self, ddp: DistributedDataParallel, bucket_group: ParamAndGradBucketGroup) -> None:
        self._ddp = weakref.ref(ddp)
        self._group = weakref.ref(bucket_group)

    def __call__(self) -> None:
        group = self._group()
        if group is None:
            return
        if group.param_gather_dispatched and group.param_gather_handle is None:
            return  # gathered already: the common case, kept cheap
        ddp = self._ddp()
        if ddp is None:
            return
        owns_schedule = bool(ddp.remove_forward_pre_hook_handles)
        if group.param_gather_handle is not None:
            if owns_schedule:
                ddp._finish_param_sync_for_bucket_group(group)
            else:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
        elif owns_schedule:
            ddp._finish_param_sync_for_bucket_group(group)  # starts the gather and waits for it
