"""The torchft side both wrappers share: a comm hook that reduces each bucket within a replica group and
then across replica groups through torchft's ``Manager``, checking first, at every step, that every group
in the quorum has the same bucket layout.

torchft (``torchft`` on PyPI, torch 2.7 or later) is imported only when asked for, so the packages run
without it; asking for it where it is missing raises an ImportError that names the install.

The hook waits for each bucket's cross-group reduction before it returns: torchft's futures run their
callbacks (the manager's division by the groups in the quorum) only when waited, and torchft's own DDP
waits the same way. So buckets reduce during backward one at a time, and backward waits for each.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

# The layout fingerprint's values stay below 2**24, so sums of them and of their squares over any
# realistic number of replica groups are exact in float64.
_FINGERPRINT_RANGE = 1 << 24


def require_torchft(package: str) -> ModuleType:
    """torchft, or an ImportError that says how to get it with ``package`` (the wrapper's)."""
    try:
        return importlib.import_module("torchft")
    except ImportError as error:
        raise ImportError(
            "gradsync's fault tolerance runs on torchft, which is not installed: "
            f'pip install "{package}[torchft]" (torchft needs torch 2.7 or later)'
        ) from error


def check_manager(owner: str, package: str, manager: object) -> None:
    """Refuse, before anything is registered, a manager that is not torchft's."""
    torchft = require_torchft(package)
    if not isinstance(manager, torchft.Manager):
        raise TypeError(f"{owner}: manager must be a torchft.Manager, got {type(manager).__name__}")


def find_lighthouse(address: str | None = None, timeout: float = 5.0) -> str:
    """The lighthouse's address (``address``, else ``TORCHFT_LIGHTHOUSE``), once something answers there
    (within ``timeout`` seconds).

    Pass it to torchft's ``Manager(lighthouse_addr=...)``: without one, the manager raises a bare
    ``KeyError('TORCHFT_LIGHTHOUSE')``, and with a dead one it retries for ``connect_timeout`` (a minute
    by default) before it says so."""
    address = address or os.environ.get("TORCHFT_LIGHTHOUSE")
    start = (
        "start one with `torchft_lighthouse --min_replicas M --bind 0.0.0.0:29510` (M a majority of the "
        "replica groups, e.g. 2 of 3, so two groups cannot train apart; 1 for a single group)"
    )
    if not address:
        raise ValueError(
            f"no torchft lighthouse given: {start}, then pass its address "
            "(http://HOST:29510) or set TORCHFT_LIGHTHOUSE to it (see "
            "docs/troubleshooting.md#quorum-and-lighthouse-settings)"
        )
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"torchft lighthouse address {address!r} must read http://HOST:PORT")
    deadline = time.monotonic() + timeout
    while True:  # a launcher may start the lighthouse beside the replica groups: give it ``timeout``
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=timeout).close()
            return address
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"no torchft lighthouse answers at {address} within {timeout:g} s ({error}): {start} "
                    "on that host and port before the replica groups, or fix the address "
                    "(TORCHFT_LIGHTHOUSE; see docs/troubleshooting.md#quorum-and-lighthouse-settings)"
                ) from error
            time.sleep(0.1)


def layout_fingerprint(buckets: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> list[int]:
    """What every replica group must agree on, as small integers: the number of buckets, and a checksum
    of each one's size and dtype (its flat grads) and its params' shapes and dtypes."""
    described = []
    for flat, params in buckets:
        shapes = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
        described.append(f"{flat.numel()}:{flat.dtype}:{shapes}")
    checksum = zlib.crc32("|".join(described).encode())
    return [len(described) % _FINGERPRINT_RANGE, checksum % _FINGERPRINT_RANGE]


@dataclass
class FaultTolerantHookState:
    """The hook's state: torchft's manager, this replica group's own data-parallel group (torch's hooks
    name their group ``process_group``) and the layout every replica group must share."""

    manager: Any
    process_group: dist.ProcessGroup
    layout: list[int]

    def __post_init__(self) -> None:
        own = torch.tensor(self.layout, dtype=torch.float64)
        self._own = own
        self._stats = torch.cat([torch.ones(1, dtype=torch.float64), own, own * own])
        """What this group adds to the check: a count of one, the layout and its squares (built once)."""

    def check_layout(self) -> None:
        """Every replica group in the quorum has this layout, else every one raises before a bucket moves.
        Summed with a count, so a replica group that contributes zeros (healing) is left out of the test."""
        own, stats = self._own, self._stats.clone()
        work = self.manager.allreduce(stats, reduce_op=dist.ReduceOp.SUM)
        if not work.wait() or self.manager.errored() is not None:
            return  # the step will not commit; the next one checks again
        count, sums, squares = stats[0], stats[1 : 1 + own.numel()], stats[1 + own.numel() :]
        if count < 1:
            return
        agree = torch.equal(sums, own * count) and torch.equal(squares, own * own * count)
        if not agree:
            raise RuntimeError(
                f"replica groups disagree on the model's buckets: this one has {self.layout[0]} buckets "
                f"(layout {self.layout[1]:#08x}); every replica group must build the same model with the "
                "same DistributedDataParallelConfig (bucket_size, grad_reduce_in_fp32, ...), and a sharded "
                "model over as many ranks in each group (see docs/troubleshooting.md#under-torchft)"
            )


def fault_tolerant_hook(state: FaultTolerantHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over this replica group's data-parallel ranks, then across the replica groups in
    the quorum through the manager (zeros from a replica group that is healing; nothing moves once the
    step has failed, and the step then does not commit)."""
    if bucket.index() == 0:  # once a step, at the same bucket on every replica group (whatever came before)
        state.check_layout()
    buffer = bucket.buffer()
    if state.process_group.size() > 1:
        dist.all_reduce(buffer, group=state.process_group)
        buffer.div_(state.process_group.size())
    # waiting runs the manager's division by the participants (its futures run callbacks only inside
    # wait()); a failed reduction is the manager's to keep: should_commit() then refuses the step
    state.manager.allreduce(buffer).wait()
    reduced: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    reduced.set_result(buffer)
    return reduced
