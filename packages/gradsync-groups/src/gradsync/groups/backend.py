"""Which backend to use, what it can be trusted to do, and where its tensors live.

Upper layers ask :func:`get_backend_capabilities` instead of branching on backend names, so a new backend
is one table entry. The gloo entry was measured with torch 2.13: every collective exists (including
``reduce_scatter_tensor``, ``ReduceOp.AVG`` and the coalescing manager), but reduce-scatter runs at about
a third of all-reduce's bus bandwidth, and gloo's AVG had a reported correctness bug (pytorch#162338), so
AVG is not trusted there: reduce with SUM and divide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BackendCapabilities:
    """What upper layers may rely on for one ``torch.distributed`` backend."""

    name: str
    device_type: str
    """Device type of the tensors this backend's collectives take."""
    avg_trusted: bool
    """``ReduceOp.AVG`` gives correct results; otherwise reduce with SUM and divide."""
    premul_sum: bool
    """``ReduceOp.PREMUL_SUM`` (scale fused into the reduction) is available."""
    reduce_scatter_tensor: bool
    """``reduce_scatter_tensor`` exists; otherwise all-reduce and keep this rank's slice."""
    reduce_scatter_relative_bandwidth: float
    """Bus bandwidth of reduce-scatter relative to all-reduce (1.0 = as fast)."""
    all_gather_into_tensor: bool
    coalescing_manager: bool
    """``torch.distributed._coalescing_manager`` batches collectives into one launch."""
    userbuffers: bool
    """NCCL user-buffer registration (``nccl_ub``) is possible."""
    reduce_scatter_via_all_reduce: bool
    """Reduce-scatter by all-reducing a copy and keeping this rank's shard is faster than the native op."""
    all_gather_via_broadcasts: bool
    """One broadcast per shard, from its owner, is faster than ``all_gather_into_tensor``."""


_CAPABILITIES = {
    "gloo": BackendCapabilities(
        name="gloo",
        device_type="cpu",
        avg_trusted=False,
        premul_sum=False,
        reduce_scatter_tensor=True,
        reduce_scatter_relative_bandwidth=0.33,
        all_gather_into_tensor=True,
        coalescing_manager=True,
        userbuffers=False,
        # Measured with torch 2.13 on 2 cores, 2 and 4 ranks, 1M-16M fp32 elements, times relative to an
        # all_reduce of the bucket: reduce_scatter 1.8-2.6x, all_reduce + slice 1.6-2.4x (no consistent
        # win, and it needs a bucket-sized copy), all_gather_into_tensor 1.2-2.8x, broadcasts 0.4-0.6x.
        reduce_scatter_via_all_reduce=False,
        all_gather_via_broadcasts=True,
    ),
    "nccl": BackendCapabilities(
        name="nccl",
        device_type="cuda",
        avg_trusted=True,
        premul_sum=True,
        reduce_scatter_tensor=True,
        reduce_scatter_relative_bandwidth=1.0,
        all_gather_into_tensor=True,
        coalescing_manager=True,
        userbuffers=True,
        reduce_scatter_via_all_reduce=False,
        all_gather_via_broadcasts=False,
    ),
}


def _conservative(name: str) -> BackendCapabilities:
    """An unknown backend gets only what every backend is required to provide."""
    device_types = dist.Backend.backend_capability.get(name, ["cpu"])
    return BackendCapabilities(
        name=name,
        device_type=device_types[0],
        avg_trusted=False,
        premul_sum=False,
        reduce_scatter_tensor=False,
        reduce_scatter_relative_bandwidth=0.0,
        all_gather_into_tensor=False,
        coalescing_manager=False,
        userbuffers=False,
        reduce_scatter_via_all_reduce=True,
        all_gather_via_broadcasts=True,
    )


def capabilities_of(backend: str) -> BackendCapabilities:
    """The capability entry of a backend name (``"gloo"``, ``"nccl"``, ...)."""
    name = str(backend).lower()
    return _CAPABILITIES.get(name) or _conservative(name)


def get_backend_capabilities(group: dist.ProcessGroup | None = None) -> BackendCapabilities:
    """Capabilities of the backend behind ``group`` (the default group when None)."""
    return capabilities_of(str(dist.get_backend(group)))


def default_backend(local_world_size: int = 1) -> str:
    """``"nccl"`` when every local rank can have its own CUDA device, else ``"gloo"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def device_for_group(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device collectives on ``group`` take tensors on: the current accelerator for NCCL-like
    backends, the CPU otherwise."""
    device_type = get_backend_capabilities(group).device_type
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())
