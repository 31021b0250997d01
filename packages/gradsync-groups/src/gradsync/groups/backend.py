"""Which backend to use, what it can be trusted to do, and where its tensors live.

Upper layers ask :func:`get_backend_capabilities` instead of branching on backend names, so a new backend
is one table entry. The gloo entry was measured with torch 2.13: every collective exists (including
``reduce_scatter_tensor``, ``ReduceOp.AVG`` and the coalescing manager), but reduce-scatter runs at about
a third of all-reduce's bus bandwidth, and gloo's AVG is not trusted: it had a reported correctness bug
(pytorch#162338), it still raises on integer tensors in 2.13, and earlier releases had no AVG in gloo's
reduce functions at all. So reduce with SUM and divide.

A process group may hold one backend per device type: ``init_process_group("cpu:gloo,cuda:nccl")`` (or
no backend at all, which torch resolves per device lazily) runs CPU tensors over gloo and CUDA tensors
over NCCL. The question "what can this group do" therefore only has an answer for a device, which is why
the functions here take the tensor's device.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .torch_internals import default_group

_UNDEFINED = "undefined"
"""What ``dist.get_backend`` reports for a group created without a backend: torch then resolves one per
device type, and only ``dist.get_backend_config`` says which."""


@dataclass(frozen=True)
class BackendCapabilities:
    """What upper layers may rely on for one ``torch.distributed`` backend serving one device type."""

    name: str
    device_type: str
    """Device type of the tensors this entry is about: the one the backend serves for the caller (gloo
    serves both ``cpu`` and ``cuda`` tensors)."""
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
    reduce_scatter_via_all_to_all: bool
    """Reduce-scatter by an all-to-all (every rank receives each rank's copy of its own shard) and a local
    sum is faster than the native op."""
    all_gather_via_broadcasts: bool
    """One broadcast per shard, from its owner, is faster than ``all_gather_into_tensor``."""
    stream_ordered_wait: bool
    """``Work.wait()`` only makes the current device stream wait for the collective and returns at once
    (NCCL), so a second collective can be chained after a first inside a backward hook without stalling
    the host. False when ``wait()`` blocks the calling thread until the collective is done (gloo, and any
    backend we know nothing about)."""


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
        # Re-measured on 2 ranks (bench-buffers, 2026-11-23, three runs): all_reduce + slice won at 1M-4M
        # elements (1.17-1.37x against 1.43-1.89x), tied at 16M (2.09-2.59x against 2.11-2.39x) and lost
        # at 256K (2.08-3.47x against 1.30-1.47x): a band, not a rule worth a size-dependent switch.
        reduce_scatter_via_all_reduce=False,
        # Measured with torch 2.13 on 2 cores, 2/4/8 ranks, 256K-16M fp32 elements (2026-11-28): an
        # all-to-all and a local sum took 0.22-0.74x the native reduce-scatter's time (2 ranks 0.30-0.74x, 4
        # ranks 0.31-0.55x, 8 ranks 0.22-0.48x), and 0.63-1.0x an all-reduce of the bucket; through
        # gradsync's collectives (bench-buffers, 2 and 4 ranks, 256K-16M) 0.47-0.88x the native op.
        reduce_scatter_via_all_to_all=True,
        all_gather_via_broadcasts=True,
        # Gloo runs each collective on its own worker thread; wait() joins it on the host.
        stream_ordered_wait=False,
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
        reduce_scatter_via_all_to_all=False,
        all_gather_via_broadcasts=False,
        stream_ordered_wait=True,
    ),
}


def _on_device(caps: BackendCapabilities, device_type: str) -> BackendCapabilities:
    """The entry of a table backend serving ``device_type`` instead of its home device."""
    if device_type == caps.device_type:
        return caps
    if caps.name == "gloo":
        # Gloo takes CUDA tensors by staging them through pinned host memory, collective by collective,
        # but ProcessGroupGloo::allreduce_coalesced (what the coalescing manager calls for all-reduces)
        # rejects any device but the CPU in the torch sources read for this; not yet run on a GPU here.
        # The all-to-all reduce-scatter was measured on CPU tensors only: CUDA tensors keep the native op.
        return dataclasses.replace(
            caps, device_type=device_type, coalescing_manager=False, reduce_scatter_via_all_to_all=False
        )
    return dataclasses.replace(caps, device_type=device_type)


def _conservative(name: str, device_type: str) -> BackendCapabilities:
    """An unknown backend gets only what every backend is required to provide."""
    return BackendCapabilities(
        name=name,
        device_type=device_type,
        avg_trusted=False,
        premul_sum=False,
        reduce_scatter_tensor=False,
        reduce_scatter_relative_bandwidth=0.0,
        all_gather_into_tensor=False,
        coalescing_manager=False,
        userbuffers=False,
        reduce_scatter_via_all_reduce=True,
        reduce_scatter_via_all_to_all=False,
        all_gather_via_broadcasts=True,
        stream_ordered_wait=False,
    )


def _served_device_types(name: str) -> list[str]:
    """Device types a plain backend name serves, home device first (torch's own table; a backend torch
    does not know is assumed to serve the CPU only)."""
    return list(dist.Backend.backend_capability.get(name, ["cpu"]))


def _device_backends(backend: str) -> dict[str, str]:
    """``{device type: backend name}`` of a plain name (``"gloo"``) or a compound string
    (``"cpu:gloo,cuda:nccl"``), in the order the string (or torch's table) lists them."""
    text = str(backend).strip().lower()
    if ":" not in text:
        return dict.fromkeys(_served_device_types(text), text)
    served: dict[str, str] = {}
    for pair in text.split(","):
        device_type, _, name = (part.strip() for part in pair.partition(":"))
        if not device_type or not name or ":" in name or device_type in served:
            raise ValueError(
                f"Cannot read the backend string {backend!r}: expected one 'device_type:backend' pair per "
                "device type, separated by commas, as in 'cpu:gloo,cuda:nccl'"
            )
        served[device_type] = name
    return served


def _current_accelerator_type() -> str | None:
    """The device type of the machine's accelerator when one is usable, else None."""
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else accelerator.type


def _normalize_device_type(device_type: str) -> str:
    return str(device_type).strip().lower().partition(":")[0]


def capabilities_of(backend: str, device_type: str | None = None) -> BackendCapabilities:
    """The capability entry of the backend that serves ``device_type`` in ``backend``.

    ``backend`` is a plain name (``"gloo"``, ``"nccl"``, ...) or a compound string as
    ``dist.get_backend_config`` reports it (``"cpu:gloo,cuda:nccl"``). With ``device_type`` None, a plain
    name is taken on its home device (gloo: ``cpu``, nccl: ``cuda``) and a compound string on the current
    accelerator's device type when it serves one, else on ``cpu``. A device type the string does not serve
    raises ``ValueError``: running those tensors on that group would fail in the first collective.
    """
    served = _device_backends(backend)
    if device_type is None:
        if ":" in str(backend):
            accelerator = _current_accelerator_type()
            if accelerator in served:
                device_type = accelerator
            elif "cpu" in served:
                device_type = "cpu"
        if device_type is None:
            device_type = next(iter(served))
    else:
        device_type = _normalize_device_type(device_type)
    if device_type not in served:
        raise ValueError(
            f"The process-group backend {backend!r} has no backend for {device_type!r} tensors (it serves: "
            f"{', '.join(served)}). Move the tensors to a served device, or create the group with a backend "
            f"for {device_type!r}, as in init_process_group('cpu:gloo,cuda:nccl')."
        )
    name = served[device_type]
    entry = _CAPABILITIES.get(name)
    if entry is None:
        return _conservative(name, device_type)
    return _on_device(entry, device_type)


def _backend_string(group: dist.ProcessGroup | None) -> str:
    """The group's backend: its plain name when it has one, else its per-device map."""
    name = str(dist.get_backend(group))
    if ":" in name or name == _UNDEFINED:
        return dist.get_backend_config(group)
    return name


_BY_GROUP: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str | None, BackendCapabilities]] = (
    weakref.WeakKeyDictionary()
)
"""Answers by group object (a group's backend never changes; a collective asks once per launch, and
reading the backend off the group costs as much as a small collective's launch)."""


def get_backend_capabilities(
    group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
) -> BackendCapabilities:
    """Capabilities of the backend that serves ``device`` on ``group`` (the default group when None).

    Pass the device of the tensors the collectives will take: on a ``"cpu:gloo,cuda:nccl"`` group the
    answer for CUDA tensors is NCCL's. With ``device`` None, the group's default device decides (see
    :func:`capabilities_of`).
    """
    device_type = None if device is None else torch.device(device).type
    known = _BY_GROUP.setdefault(default_group() if group is None else group, {})
    if device_type not in known:
        known[device_type] = capabilities_of(_backend_string(group), device_type)
    return known[device_type]


def default_backend(local_world_size: int = 1) -> str:
    """``"nccl"`` when every local rank can have its own CUDA device, else ``"gloo"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def device_for_group(
    group: dist.ProcessGroup | None = None, preferred: torch.device | str | None = None
) -> torch.device:
    """The device collectives on ``group`` take tensors on.

    ``preferred`` (say, the device the model lives on) is returned when the group serves its device type,
    so a gloo group used with CUDA tensors keeps them on the GPU. Otherwise the group's default device:
    the current accelerator for NCCL-like backends, the CPU otherwise.
    """
    backend = _backend_string(group)
    if preferred is not None:
        preferred = torch.device(preferred)
        if preferred.type in _device_backends(backend):
            return preferred
    return current_device(capabilities_of(backend).device_type)


def current_device(device_type: str) -> torch.device:
    """The device of ``device_type`` this process computes on: the CPU, or the current accelerator."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())
