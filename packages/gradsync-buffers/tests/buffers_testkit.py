"""Shared pieces of the multi-rank buffer tests (imported by spawned ranks, so kept at module level)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, GradBuffers, build_grad_buffers
from gradsync.groups import ProcessGroupCollection, destroy_process_groups, initialize_model_parallel


def toy_model(
    num_layers: int = 4, dim: int = 24, bias: bool = True, dtype: torch.dtype = torch.float32
) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim, bias=bias) for _ in range(num_layers))).to(dtype)


@contextmanager
def model_parallel(**kwargs: int) -> Iterator[ProcessGroupCollection]:
    groups = initialize_model_parallel(**kwargs)
    try:
        yield groups
    finally:
        destroy_process_groups(groups)


def buffers_for(
    model: nn.Module, config: DistributedDataParallelConfig, groups: ProcessGroupCollection, **kwargs: bool
) -> GradBuffers:
    return build_grad_buffers(list(model.named_parameters()), config, groups, **kwargs)


def emulate_backward(
    buffers: GradBuffers, model: nn.Module, value: float = 1.0, skip: frozenset[str] = frozenset()
) -> None:
    """What DDP's hooks do: add each param's grad to main_grad and report it ready, last layer first."""
    params = list(model.named_parameters())
    for name, param in reversed(params):
        if name in skip:
            continue
        param.main_grad.add_(value)  # type: ignore[attr-defined]
        for group in buffers.all_bucket_groups:
            if param in group.params:
                group.register_grad_ready(param)


def finish_first_iteration(buffers: GradBuffers, model: nn.Module) -> None:
    """Run the counting first iteration, so later ones dispatch from readiness."""
    emulate_backward(buffers, model)
    buffers.finish_grad_sync()
    buffers.reset()
