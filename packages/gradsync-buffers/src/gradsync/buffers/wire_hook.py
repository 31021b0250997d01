"""The low-precision grad wire (``grad_comm_dtype``) as a comm hook, for code that composes hooks or
registers them on torch's own DDP as well: ``register_comm_hook(LowPrecisionHookState(group, dtype),
low_precision_hook)`` reduces each bucket as the config field does (an all-to-all of packed pieces, fp32
sums, an all-gather of the packed sums), with or without error feedback, and lands the same bits, since
a hook's scaling by the group size is exact for the power-of-two group sizes.

torch's DDP rebuilds its buckets after the first iteration (in the order grads became ready), so a
bucket's index names other params from then on. The residuals are therefore kept by param, not by index:
when an index comes with other params than before, each param's residual moves to its new place.

The hook's signature is left unstringified (no postponed annotations in this module): torch's
``register_comm_hook`` compares the ``bucket`` annotation with ``dist.GradBucket`` itself.
"""

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .low_precision_reduce import LowPrecisionReduction
from .wire_format import WireFormat, wire_problem

if TYPE_CHECKING:
    Bucket = Any  # torch's stubs do not export GradBucket; gradsync's HookBucket answers the same calls
else:
    Bucket = dist.GradBucket  # the annotation torch's register_comm_hook accepts


class LowPrecisionHookState:
    """What :func:`low_precision_hook` needs: the group (None: the default group), the wire dtype and its
    fp8 block size, and with ``error_feedback`` each bucket's residual (see :class:`ParamResiduals`)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        block_size: int = 32,
        error_feedback: bool = False,
    ) -> None:
        problem = wire_problem(dtype, block_size, "dtype", "block_size")
        if problem is not None:
            raise ValueError(f"LowPrecisionHookState: {problem}")
        self.process_group = process_group
        self.wire = WireFormat(dtype, block_size)
        self.residuals = ParamResiduals() if error_feedback else None
        self.pending: torch.futures.Future[torch.Tensor] | None = None
        """The last bucket's future: on gloo its all-gather is issued from the all-to-all's callback, so
        the next bucket waits for it (torch's DDP hands buckets over in one order on every rank, but
        callbacks run whenever a collective completes)."""


class ParamResiduals:
    """Error-feedback residuals of hook buckets, each a flat tensor shaped like its bucket's buffer,
    with a record of where each param's grads lie in it (so a rebuilt bucket takes over its params')."""

    def __init__(self) -> None:
        self._by_index: dict[int, tuple[list[Any], torch.Tensor]] = {}
        self._place: dict[int, tuple[torch.Tensor, int]] = {}  # id(param): (its bucket's residual, offset)

    def of(self, bucket: Bucket) -> torch.Tensor:
        """The residual of ``bucket`` (a ``HookBucket`` or torch's ``dist.GradBucket``)."""
        params, buffer = bucket.parameters(), bucket.buffer()
        known = self._by_index.get(bucket.index())
        if known is not None and len(known[0]) == len(params) and all(map(_same, known[0], params)):
            return known[1]
        residual = torch.zeros_like(buffer)
        for param, offset in zip(params, _offsets(bucket), strict=True):
            old = self._place.get(id(param))
            if old is not None:
                residual[offset : offset + param.numel()] = old[0][old[1] : old[1] + param.numel()]
            self._place[id(param)] = (residual, offset)
        self._by_index[bucket.index()] = (params, residual)
        return residual

    def of_param(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s residual, flat (zeros before its first reduction): what the next reduction adds."""
        place = self._place.get(id(param))
        if place is None:
            return torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
        residual, offset = place
        return residual[offset : offset + param.numel()]


def _same(a: object, b: object) -> bool:
    return a is b


def _offsets(bucket: Bucket) -> list[int]:
    """Where each param's grads start in the bucket's buffer: its gradients are views into the buffer, as
    torch's ``GradBucket`` and gradsync's ``HookBucket`` both make them."""
    buffer = bucket.buffer()
    offsets = []
    for grad in bucket.gradients():
        offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        if grad.dtype != buffer.dtype or not 0 <= offset <= buffer.numel() - grad.numel():
            raise RuntimeError(
                "low_precision_hook: error feedback needs the bucket's gradients() to be views into its "
                "buffer(), as torch's and gradsync's buckets give them; a hook wrapped around it changed that"
            )
        offsets.append(offset)
    return offsets


def low_precision_hook(state: LowPrecisionHookState, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the state's group through the low-precision wire: a future of the bucket's
    buffer, which holds the mean once it completes (identical on every rank). ``bucket`` is torch's
    ``dist.GradBucket`` or gradsync's ``HookBucket``, which answers the same calls."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    assert group is not None, "torch.distributed is not initialized"
    if state.pending is not None:
        state.pending.wait()
    buffer = bucket.buffer()
    residual = None if state.residuals is None else state.residuals.of(bucket)
    reduction = LowPrecisionReduction(buffer, group, state.wire, average=True, residual=residual)
    state.pending = reduction.all_reduce("comm_hook").future(buffer)
    return state.pending
