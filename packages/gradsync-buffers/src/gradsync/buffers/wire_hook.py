"""The low-precision grad wire (``grad_comm_dtype``) as a comm hook, for code that composes hooks or
registers them on torch's own DDP as well: ``register_comm_hook(LowPrecisionHookState(None, dtype),
low_precision_hook)`` reduces each bucket as the config field does (an all-to-all of packed pieces, fp32
sums, an all-gather of the packed sums), with or without error feedback, and lands the same bits, since
a hook's scaling by the group size is exact for the power-of-two group sizes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_hook import HookBucket
from .low_precision_reduce import GradCommWire, LowPrecisionReduction
from .wire_format import WireFormat


class LowPrecisionHookState:
    """What :func:`low_precision_hook` needs: the group (None: the default group), the wire dtype and its
    fp8 block size, and with ``error_feedback`` each bucket's residual, keyed by the bucket's index."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        block_size: int = 32,
        error_feedback: bool = False,
    ) -> None:
        self.process_group = process_group
        self.wire = GradCommWire(WireFormat(dtype, block_size), error_feedback)


def low_precision_hook(
    state: LowPrecisionHookState, bucket: HookBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the state's group through the low-precision wire: a future of the bucket's
    buffer, which holds the mean once it completes (identical on every rank)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    assert group is not None, "torch.distributed is not initialized"
    buffer = bucket.buffer()
    reduction = LowPrecisionReduction(
        buffer, group, state.wire.wire, average=True, residual=state.wire.residual(bucket.index(), buffer)
    )
    return reduction.all_reduce("comm_hook").future(buffer)
