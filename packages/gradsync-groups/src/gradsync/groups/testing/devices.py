"""Which device multi-rank tests build their tensors on, and the backend that follows from it.

The device is an explicit choice, never inferred from the machine: a suite whose tests build CPU tensors
must not switch to NCCL because the machine happens to have GPUs. ``GRADSYNC_TEST_DEVICE`` (``cpu``, the
default, or ``cuda``) sets it for a whole run, and ``run_distributed(..., device=...)`` for one call. Each
rank is told the choice before its first task, and tests ask :func:`test_device` where to put tensors and
models.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "GRADSYNC_TEST_DEVICE"
TEST_DEVICES = ("cpu", "cuda")


class _ThisRank:
    """This process as a harness rank: ``device`` is set by the worker before any task, None elsewhere."""

    device: torch.device | None = None


def requested_device(device: str | None = None) -> str:
    """``device`` when given, else ``GRADSYNC_TEST_DEVICE``, else ``"cpu"``; anything else is an error."""
    choice = (device if device is not None else os.environ.get(DEVICE_ENV, "") or "cpu").strip().lower()
    if choice not in TEST_DEVICES:
        source = "device=" if device is not None else f"{DEVICE_ENV}="
        raise ValueError(f"{source}{choice!r} is not a test device: use one of {', '.join(TEST_DEVICES)}")
    return choice


def backend_for(device: str, world_size: int) -> str:
    """The backend ranks on ``device`` use: gloo on the CPU; on CUDA, NCCL when each rank can have its own
    GPU (NCCL refuses two ranks on one device), else gloo with CUDA tensors on shared GPUs."""
    if device == "cpu":
        return "gloo"
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"Multi-rank tests were asked to run on CUDA ({DEVICE_ENV}=cuda or device='cuda'), but "
            "torch.cuda.is_available() is False on this machine (no GPU, or a CPU-only torch build). "
            f"Unset {DEVICE_ENV} (or set it to cpu) to run them on the CPU over gloo."
        )
    return "nccl" if world_size <= torch.cuda.device_count() else "gloo"


def enter_rank(device: str, rank: int) -> torch.device:
    """Make this spawned rank's device current and remember it (called once, before the process group).

    With CUDA, rank ``r`` takes GPU ``r % device_count``: one GPU per rank under NCCL, shared GPUs when
    there are more ranks than GPUs (gloo). The choice is exported in ``GRADSYNC_TEST_DEVICE`` as well, so
    anything the task starts sees it.
    """
    os.environ[DEVICE_ENV] = device
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        _ThisRank.device = torch.device("cuda", torch.cuda.current_device())
    else:
        _ThisRank.device = torch.device(device)
    return _ThisRank.device


def test_device() -> torch.device:
    """The device tests must build tensors and models on.

    Inside a rank, the rank's own device (``cuda:<its GPU>`` or ``cpu``). Outside a rank, what
    ``GRADSYNC_TEST_DEVICE`` asks for, without an index (nothing is initialised in the test process).
    """
    if _ThisRank.device is not None:
        return _ThisRank.device
    return torch.device(requested_device())


test_device.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test, where tests import it
