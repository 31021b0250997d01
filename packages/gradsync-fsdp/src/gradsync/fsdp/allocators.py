"""Where a bucket's temporary communication buffers come from, NCCL user buffers included.

Where a bucket's temporary communication buffers come from.

A bucket asks its allocator for a whole-bucket buffer when it needs one (ZeRO-3's gathered weights,
ZeRO-2/3's unreduced grads) and gives it back when done. The policies:

- :class:`TemporaryBucketAllocator` allocates a fresh tensor per use and frees it after;
- :class:`StorageResizeBucketAllocator` keeps one tensor object per bucket and resizes its storage to 0
  and back, so views taken once (the module's params) follow it;
- :class:`DoubleBufferAllocator` (``fsdp_double_buffer``) holds two persistent slot groups shaped like
  the most common unit and hands them to units in turn: no allocation at all after construction;
- :class:`MaxPoolDoubleBufferAllocator` (``megatron_fsdp_max_pool_double_buffer``) sizes the two slot
  groups by the largest bucket at each position over every unit, so every unit fits in them;
- :class:`PersistentBucketAllocator` (``fsdp_db_use_persist_buf_on_alloc_fail``) is the double buffers'
  fallback for buckets that do not fit them: a buffer per bucket allocated once and kept for good.

Every allocator counts allocations and live / peak bytes (:class:`AllocatorStats`), so tests and
benchmarks read what each policy costs instead of guessing it from RSS.

NCCL user buffers (``nccl_ub``): communication buffers allocated from an NCCL memory pool and
registered with the communicators that use them, so NCCL reads and writes them without staging copies
(and, registered symmetrically, with its symmetric-memory kernels). Built on torch's own API:
``ProcessGroupNCCL.mem_allocator`` (ncclMemAlloc), ``torch.cuda.MemPool`` / ``use_mem_pool`` and
``ProcessGroupNCCL.register_mem_pool``. Where torch's NCCL cannot allocate on the device (it wants
multicast support, absent on a lone GPU in a VM), local registration uses cudaMalloc memory from the
caching allocator and symmetric registration is refused. CUDA with NCCL only; refused with the reason
everywhere else.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MemoryContext = Callable[[], AbstractContextManager[object]]
"""Wraps every allocation (an NCCL memory pool, or nothing)."""


@dataclass
class AllocatorStats:
    """Allocations made, bytes held now and the most bytes ever held at once."""

    allocations: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0

    def grew(self, nbytes: int) -> None:
        self.allocations += 1
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def shrank(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


@dataclass(frozen=True)
class BufferRequest:
    """What a bucket needs: ``size`` elements of ``dtype`` on ``device``."""

    size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class BucketAllocator(ABC):
    """Hands out one whole-bucket buffer per bucket id until it is freed."""

    kind: str

    def __init__(self, memory_context: MemoryContext = contextlib.nullcontext) -> None:
        self.stats = AllocatorStats()
        self._memory_context = memory_context

    @abstractmethod
    def allocate(self, bucket_id: int, request: BufferRequest) -> torch.Tensor:
        """The bucket's buffer (the same one until :meth:`free`); its contents are undefined."""

    @abstractmethod
    def free(self, bucket_id: int) -> None:
        """Give the bucket's buffer back (a no-op when it holds none)."""

    def can_allocate(self, bucket_id: int) -> bool:
        """Whether :meth:`allocate` would succeed now (pools can run out; dynamic allocators cannot)."""
        return True

    def forget_assignments(self) -> None:  # noqa: B027 (dynamic allocators pin nothing: a no-op)
        """Forget which buffers buckets had (pools pin them once assigned)."""

    def all_stats(self) -> dict[str, AllocatorStats]:
        return {self.kind: self.stats}

    def _new(self, request: BufferRequest) -> torch.Tensor:
        with self._memory_context():
            tensor = torch.empty(request.size, dtype=request.dtype, device=request.device)
        self.stats.grew(request.nbytes)
        return tensor


class TemporaryBucketAllocator(BucketAllocator):
    """A new tensor for every use; freeing drops its storage even if views of it survive."""

    kind = "temporary"

    def __init__(self, memory_context: MemoryContext = contextlib.nullcontext) -> None:
        super().__init__(memory_context)
        self._held: dict[int, torch.Tensor] = {}

    def allocate(self, bucket_id: int, request: BufferRequest) -> torch.Tensor:
        if bucket_id not in self._held:
            self._held[bucket_id] = self._new(request)
        return self._held[bucket_id]

    def free(self, bucket_id: int) -> None:
        tensor = self._held.pop(bucket_id, None)
        if tensor is not None:
            self.stats.shrank(tensor.untyped_storage().nbytes())
            tensor.untyped_storage().resize_(0)


class StorageResizeBucketAllocator(BucketAllocator):
    """One tensor object per bucket for good: storage resized to 0 when freed and back when allocated,
    so views of it (the params) stay valid whenever the bucket holds its buffer."""

    kind = "storage_resize"

    def __init__(self, memory_context: MemoryContext = contextlib.nullcontext) -> None:
        super().__init__(memory_context)
        self._tensors: dict[int, torch.Tensor] = {}

    def allocate(self, bucket_id: int, request: BufferRequest) -> torch.Tensor:
        tensor = self._tensors.get(bucket_id)
        if tensor is None:
            tensor = self._tensors[bucket_id] = self._new(request)
        elif tensor.untyped_storage().nbytes() == 0:
            with self._memory_context():
                tensor.untyped_storage().resize_(request.nbytes)
            self.stats.grew(request.nbytes)
        return tensor

    def free(self, bucket_id: int) -> None:
        tensor = self._tensors.get(bucket_id)
        if tensor is not None and tensor.untyped_storage().nbytes():
            self.stats.shrank(tensor.untyped_storage().nbytes())
            tensor.untyped_storage().resize_(0)


class PersistentBucketAllocator(BucketAllocator):
    """A buffer per bucket, allocated at its first use and kept for good (:meth:`free` keeps it): what
    ``fsdp_db_use_persist_buf_on_alloc_fail`` gives the buckets that do not fit a double buffer, instead
    of a temporary one per use. It trades memory for no allocation after the first step; the tensor
    object never changes, so views of it (the params) stay valid."""

    kind = "persistent"

    def __init__(self, memory_context: MemoryContext = contextlib.nullcontext) -> None:
        super().__init__(memory_context)
        self._tensors: dict[int, torch.Tensor] = {}

    def allocate(self, bucket_id: int, request: BufferRequest) -> torch.Tensor:
        tensor = self._tensors.get(bucket_id)
        if tensor is not None and (tensor.numel(), tensor.dtype, tensor.device) == (
            request.size,
            request.dtype,
            request.device,
        ):
            return tensor
        if tensor is not None:  # the bucket now needs another buffer: the old one goes
            self.stats.shrank(tensor.untyped_storage().nbytes())
        tensor = self._tensors[bucket_id] = self._new(request)
        return tensor

    def free(self, bucket_id: int) -> None:
        """Kept: the next :meth:`allocate` of the bucket returns the same tensor."""


@dataclass(frozen=True)
class UnitBuckets:
    """The buckets of one FSDP unit in order, and the buffer each needs."""

    unit_id: int
    bucket_ids: tuple[int, ...]
    requests: tuple[BufferRequest, ...]


class DoubleBufferAllocator(BucketAllocator):
    """Two persistent slot groups shaped like the most common unit ("mode" of the units' bucket
    signatures; the first such unit wins ties), lent to one unit at a time.

    A unit keeps the group it got first (since :meth:`forget_assignments`) for good: autograd keeps views
    of a unit's weights from its forward for its backward, so the backward must find them in the same
    slot. Units gathered in turn (each forward prefetches the next) get alternate groups, and a backward
    in reverse order then finds each unit's group idle. A unit whose group another unit holds, or a new
    unit while two hold both, is refused with the holders named. Buckets of other units and outside units
    go to ``fallback``. Double buffering pays off for depth-symmetric models; for others most buckets end
    in the fallback.
    """

    kind = "double_buffer"
    GROUPS = 2

    def __init__(
        self,
        what: str,
        units: Sequence[UnitBuckets],
        fallback: BucketAllocator,
        memory_context: MemoryContext = contextlib.nullcontext,
    ) -> None:
        super().__init__(memory_context)
        if not units:
            raise ValueError(
                f"MegatronFSDP (fsdp_double_buffer): no FSDP units to double-buffer {what}s for; pass "
                "fsdp_unit_modules, or turn fsdp_double_buffer (and nccl_ub) off"
            )
        self.what, self.fallback = what, fallback
        self.slot_requests, self._offset_of = self._plan(units)
        self.slots = [[self._new(r) for r in self.slot_requests] for _ in range(self.GROUPS)]
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}  # (group, offset, size): a slot's head
        self._holder: list[int | None] = [None] * self.GROUPS  # unit id per group
        self._in_use: list[set[int]] = [set() for _ in range(self.GROUPS)]  # offsets per group
        self._home: dict[int, int] = {}  # a unit's group for good

    @staticmethod
    def _plan(units: Sequence[UnitBuckets]) -> tuple[tuple[BufferRequest, ...], dict[int, tuple[int, int]]]:
        """The slots of one group, and each pooled bucket's (unit id, slot offset): the mode's buckets."""
        signatures = Counter(u.requests for u in units)
        mode, _ = max(signatures.items(), key=lambda item: item[1])  # first-seen wins ties
        offset_of = {
            bucket_id: (u.unit_id, offset)
            for u in units
            if u.requests == mode
            for offset, bucket_id in enumerate(u.bucket_ids)
        }
        return mode, offset_of

    def pooled(self, bucket_id: int) -> bool:
        return bucket_id in self._offset_of

    def allocate(self, bucket_id: int, request: BufferRequest) -> torch.Tensor:
        if not self.pooled(bucket_id):
            return self.fallback.allocate(bucket_id, request)
        unit_id, offset = self._offset_of[bucket_id]
        group = self._group_for(unit_id)
        if group is None:
            home = self._home.get(unit_id)
            if home is not None:
                raise RuntimeError(
                    f"MegatronFSDP (fsdp_double_buffer): FSDP unit #{unit_id} needs its {self.what} buffer "
                    f"group {home} (a unit keeps its group, since its backward reads the weights its forward "
                    f"saved), but unit #{self._holder[home]} holds it. Double buffering needs units used "
                    "in one order and its reverse; turn fsdp_double_buffer off for other schedules"
                )
            raise RuntimeError(
                f"MegatronFSDP (fsdp_double_buffer): FSDP unit #{unit_id} needs a {self.what} buffer, but "
                f"units #{self._holder[0]} and #{self._holder[1]} hold both; double buffering keeps at most "
                "two units' buffers at once. A unit gives its weights back after its forward and "
                "backward and its grads once they are reduced; turn fsdp_double_buffer off for schedules "
                "that hold more"
            )
        slot = self._slot(group, offset, bucket_id, request)
        self._holder[group] = unit_id
        self._home.setdefault(unit_id, group)
        self._in_use[group].add(offset)
        return slot

    def _slot(self, group: int, offset: int, bucket_id: int, request: BufferRequest) -> torch.Tensor:
        """The slot itself, or (max-pool slots) the same view of its first ``request.size`` elements."""
        slot = self.slots[group][offset]
        if request.size == slot.numel() and request.dtype == slot.dtype:
            return slot
        if request.size > slot.numel() or request.dtype != slot.dtype or request.device != slot.device:
            raise RuntimeError(
                f"MegatronFSDP ({self.kind}): bucket {bucket_id} asks for {request.size} {request.dtype} "
                f"elements on {request.device}, but its {self.what} slot holds {slot.numel()} "
                f"{slot.dtype} on {slot.device}"
            )
        key = (group, offset, request.size)
        view = self._views.get(key)
        if view is None:  # one tensor object per use, so params viewing it are not re-pointed each time
            view = self._views[key] = slot[: request.size]
        return view

    def free(self, bucket_id: int) -> None:
        if not self.pooled(bucket_id):
            self.fallback.free(bucket_id)
            return
        unit_id, offset = self._offset_of[bucket_id]
        for group, holder in enumerate(self._holder):
            if holder == unit_id:
                self._in_use[group].discard(offset)
                if not self._in_use[group]:
                    self._holder[group] = None

    def can_allocate(self, bucket_id: int) -> bool:
        if not self.pooled(bucket_id):
            return self.fallback.can_allocate(bucket_id)
        return self._group_for(self._offset_of[bucket_id][0]) is not None

    def _group_for(self, unit_id: int) -> int | None:
        if unit_id in self._holder:
            return self._holder.index(unit_id)
        home = self._home.get(unit_id)
        if home is not None:
            return home if self._holder[home] is None else None
        idle = [g for g, holder in enumerate(self._holder) if holder is None]
        return idle[0] if idle else None

    def forget_assignments(self) -> None:
        """Let units take groups afresh (after the buckets' construction, before the first forward)."""
        self._home.clear()

    def all_stats(self) -> dict[str, AllocatorStats]:
        return {self.kind: self.stats, **self.fallback.all_stats()}


class MaxPoolDoubleBufferAllocator(DoubleBufferAllocator):
    """``megatron_fsdp_max_pool_double_buffer``: two slot groups that every unit fits, for models whose
    units differ (hybrids, first and last layers of other shapes).

    Per dtype, each unit's buckets are taken largest first and matched by position to the slots of that
    dtype; a slot is as large as the largest bucket ever matched to it, and there are as many slots of a
    dtype as the unit with most buckets of it has. A bucket gets the first ``size`` elements of its slot
    (the same view every time it holds that slot). Every unit bucket is pooled; only buckets outside units
    go to ``fallback``. Lending, pinning and refusals are the double buffer's: at most two units at once,
    each in the group it got first.
    """

    kind = "max_pool_double_buffer"

    @staticmethod
    def _plan(units: Sequence[UnitBuckets]) -> tuple[tuple[BufferRequest, ...], dict[int, tuple[int, int]]]:
        sizes: dict[tuple[torch.dtype, torch.device], list[int]] = {}  # per dtype: slot sizes by position
        position: dict[int, tuple[tuple[torch.dtype, torch.device], int]] = {}  # bucket -> (dtype, position)
        unit_of: dict[int, int] = {}
        for unit in units:
            by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[int, int]]] = {}
            for bucket_id, request in zip(unit.bucket_ids, unit.requests, strict=True):
                by_dtype.setdefault((request.dtype, request.device), []).append((request.size, bucket_id))
                unit_of[bucket_id] = unit.unit_id
            for key, buckets in by_dtype.items():
                maxima = sizes.setdefault(key, [])
                buckets.sort(key=lambda b: -b[0])  # largest first; ties keep the unit's order
                maxima.extend([0] * (len(buckets) - len(maxima)))
                for index, (size, bucket_id) in enumerate(buckets):
                    maxima[index] = max(maxima[index], size)
                    position[bucket_id] = (key, index)
        first: dict[tuple[torch.dtype, torch.device], int] = {}  # each dtype's first offset in a group
        slots: list[BufferRequest] = []
        for (dtype, device), maxima in sizes.items():
            first[(dtype, device)] = len(slots)
            slots += [BufferRequest(size, dtype, device) for size in maxima]
        offset_of = {
            bucket_id: (unit_of[bucket_id], first[key] + index)
            for bucket_id, (key, index) in position.items()
        }
        return tuple(slots), offset_of


class NcclUserBufferPool:
    """One NCCL memory pool for a model's double buffers, registered on ``groups`` once filled."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], device: torch.device, symmetric: bool) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"MegatronFSDP: nccl_ub=True needs CUDA tensors on an NCCL group, but the model is on "
                f"{device}; set nccl_ub back to False"
            )
        self.device, self.symmetric = device, symmetric
        self.groups = list(groups)
        self.backends = [_nccl_backend(group, device) for group in groups]
        # ncclMemAlloc (cuMem memory, what symmetric windows and NVLS need) where torch's NCCL offers it
        # on this device; else cudaMalloc memory from the caching allocator, which NCCL registers locally.
        self.nccl_memory = bool(self.backends[0].supports_tensor_alloc(device))
        if symmetric and not self.nccl_memory:
            raise NotImplementedError(
                f"MegatronFSDP: symmetric NCCL registration needs ncclMemAlloc memory, which torch's NCCL "
                f"does not offer on {device} (it needs multicast support); pass "
                "disable_symmetric_registration=True for local registration"
            )
        allocator = self.backends[0].mem_allocator if self.nccl_memory else None
        self.pool = torch.cuda.MemPool(allocator)
        self.registered = False

    @contextmanager
    def allocating(self) -> Iterator[object]:
        """Route CUDA allocations inside the block to the pool."""
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            yield self.pool

    def register(self) -> None:
        """Register every segment of the pool with each communicator (after the buffers exist)."""
        if self.registered:
            return
        for group in self.groups:  # NCCL makes a communicator at the first collective; registering needs one
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        torch.cuda.synchronize(self.device)
        for backend in self.backends:
            if self.symmetric:
                try:
                    backend.register_mem_pool(self.pool, symm=True)
                except TypeError as error:
                    raise NotImplementedError(
                        f"MegatronFSDP: this torch ({torch.__version__}) cannot register an NCCL memory "
                        "pool symmetrically (ProcessGroupNCCL.register_mem_pool takes no symm argument); "
                        "pass disable_symmetric_registration=True"
                    ) from error
            else:
                backend.register_mem_pool(self.pool)
        self.registered = True

    def segments(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of every segment the pool holds (what registration covers)."""
        snapshot: list[dict[str, int]] = self.pool.snapshot()  # type: ignore[no-untyped-call]
        return [(segment["address"], segment["total_size"]) for segment in snapshot]


def _nccl_backend(group: dist.ProcessGroup, device: torch.device) -> Any:
    try:
        backend = group._get_backend(device)
    except RuntimeError as error:
        raise ValueError(
            f"MegatronFSDP: nccl_ub=True needs an NCCL backend for {device.type} tensors, but the group "
            f"({dist.get_backend(group)!r}) has none; init_process_group('cpu:gloo,cuda:nccl') or set "
            "nccl_ub back to False"
        ) from error
    if type(backend).__name__ != "ProcessGroupNCCL":
        raise ValueError(
            f"MegatronFSDP: nccl_ub=True needs NCCL, but the group serves {device.type} tensors with "
            f"{type(backend).__name__}; use an NCCL group or set nccl_ub back to False"
        )
    return backend
