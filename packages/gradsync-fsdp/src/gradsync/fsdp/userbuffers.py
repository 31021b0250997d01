"""NCCL user buffers (``nccl_ub``): communication buffers allocated from an NCCL memory pool and
registered with the communicators that use them, so NCCL reads and writes them without staging copies
(and, registered symmetrically, with its symmetric-memory kernels). Built on torch's own API:
``ProcessGroupNCCL.mem_allocator`` (ncclMemAlloc), ``torch.cuda.MemPool`` / ``use_mem_pool`` and
``ProcessGroupNCCL.register_mem_pool``. Where torch's NCCL cannot allocate on the device (it wants
multicast support, absent on a lone GPU in a VM), local registration uses cudaMalloc memory from the
caching allocator and symmetric registration is refused. CUDA with NCCL only; refused with the reason
everywhere else.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


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
