"""Communication hooks on both wrappers' buckets, in torch DDP's protocol: ``hook(state, bucket)`` returns
a ``torch.futures.Future`` of the bucket's reduced (averaged) grads.

The bucket handed to the hook answers what torch's ``dist.GradBucket`` answers (``index()``, ``buffer()``,
``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``), so torch's own hooks run unchanged:
``torch.distributed.algorithms.ddp_comm_hooks``'s ``allreduce_hook``, ``bf16_compress_hook`` and
``powerSGD_hook`` (rank-r compression per matrix, error feedback, warm start) among them. A hook averages
over its group as torch's do, so the grads are handed over scaled by the bucket's scaling factor times the
group size (1 for the default 1/dp factor): the hook's average then equals gradsync's scaled sum.

A hook may chain collectives in its future's callbacks (PowerSGD all-reduces P, then Q), which issue them
whenever the previous one completes. Every rank must issue collectives in the same order, so a bucket is
handed to the hook only once the previous bucket's future has completed: the hooks' collectives never
interleave, at the cost of overlapping one bucket's reduction at a time. The last bucket of a cycle is
waited as soon as it is handed over (in backward, with overlap), so once backward returns no hook's
collective is still to be issued and a collective of the user's may follow at once.

``buffer()`` and ``gradients()`` are in the grad buffer's dtype, which is fp32 where main grads are kept in
fp32 (torch's hand over grads in the param dtype): the hook reduces what gradsync accumulated, with no cast
on the way, and each grad is a view into the buffer as torch's are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

CommHook = Callable[[Any, Any], "torch.futures.Future[Any]"]
"""``hook(state, bucket)``: a future of the bucket's reduced grads (a tensor, or a list of one). The
bucket is a :class:`HookBucket`; typed loosely so torch's hooks, annotated ``dist.GradBucket``, fit."""


def check_hook(owner: str, state: object, hook: object, group: dist.ProcessGroup) -> None:
    """Refuse, at registration, a hook torch would refuse (not callable) and one that would reduce over
    the wrong ranks: torch's hooks take a state (or, for ``allreduce_hook``, the state itself) whose
    process group None means the whole world, which is not the data-parallel ``group`` under tensor,
    pipeline or context parallelism."""
    if not callable(hook):
        raise TypeError(f"{owner}.register_comm_hook: the hook must be callable, got {type(hook).__name__}")
    names_world = state is None or (hasattr(state, "process_group") and state.process_group is None)
    if names_world and group.size() != dist.get_world_size():
        raise ValueError(
            f"{owner}.register_comm_hook: the hook's state names no process group, so it would reduce over "
            f"all {dist.get_world_size()} ranks, but the data-parallel group holds {group.size()}; pass the "
            "wrapper's data-parallel group in the state (process_group=...)"
        )


class HookBucket:
    """One bucket as a comm hook sees it: its flat grads, its params and each param's grad (a view into
    the flat grads). ``index`` numbers the model's buckets from its end (the first is usually reduced
    first: it holds the last layers) and stays the bucket's across steps, as hooks key their state by
    it; ``is_last`` marks the last bucket handed over in a reduction cycle, which ends the iteration."""

    def __init__(
        self,
        buffer: torch.Tensor,
        params: Sequence[torch.nn.Parameter],
        grads: Sequence[torch.Tensor],
        index: int,
    ) -> None:
        self._buffer, self._params, self._grads = buffer, list(params), list(grads)
        self._index = index
        self.last = False  # set by RegisteredHook.launch, which counts the cycle's buckets

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self.last

    def buffer(self) -> torch.Tensor:
        """The bucket's flat grads (padding included: zeros that every hook leaves meaningless)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Each param's grad, a view into :meth:`buffer` (so writing into it writes the bucket)."""
        return list(self._grads)


class HookWork:
    """A hook's future as a collective's work: waiting it lands the reduced grads in the bucket."""

    def __init__(self, future: torch.futures.Future[Any], bucket: torch.Tensor) -> None:
        self.future, self.bucket = future, bucket

    def is_completed(self) -> bool:
        return bool(self.future.done())

    def wait(self) -> None:
        reduced = self.future.wait()
        if isinstance(reduced, list):  # torch's collective futures hold a list of one tensor
            (reduced,) = reduced
        if reduced.data_ptr() != self.bucket.data_ptr():
            self.bucket.copy_(reduced.view_as(self.bucket))  # a cast copy's result is cast back


class RegisteredHook:
    """A wrapper's registered hook: its state, the number of buckets it is handed per reduction cycle
    (each once, in an order that may change between steps), and the future of the last one handed over
    (waited before the next one is)."""

    def __init__(self, state: Any, hook: CommHook, count: int) -> None:
        self.state, self.hook, self.count = state, hook, count
        self._pending: HookWork | None = None
        self._handed = 0  # buckets handed over in this cycle

    def launch(self, bucket: HookBucket) -> HookWork:
        """Hand the hook one bucket, its buffer scaled so the hook's mean is the wanted reduction; waiting
        the work lands the result in that buffer."""
        if self._pending is not None:
            self._pending.future.wait()
        self._handed = (self._handed + 1) % self.count
        bucket.last = self._handed == 0
        # Taken before the hook runs: torch's ``*_compress_wrapper`` hooks swap in a cast copy with
        # ``set_buffer`` and their future holds that copy, so the result must land in the bucket's own.
        own_buffer = bucket.buffer()
        work = HookWork(self.hook(self.state, bucket), own_buffer)
        self._pending = work
        if bucket.last:
            # A hook may chain collectives from its future's callbacks (PowerSGD), issued whenever the
            # previous one completes: the cycle ends only once they have, as torch's backward waits for
            # its hooks, so a collective of the user's after backward cannot interleave with them.
            work.future.wait()
        return work
