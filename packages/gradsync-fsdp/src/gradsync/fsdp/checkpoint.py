"""MegatronFSDP's state dict: params as the optimizer's DTensor shards, loaded from shards or whole tensors.

Neither direction runs a collective. Each rank knows from the layout which rows of every param it owns,
so a whole tensor (from an unwrapped model, or gathered) is loaded by copying those rows, and a DTensor
saved by the same layout by copying its local shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .bucket import FlatParamBucket
from .ragged import split_of


def param_keys(module: nn.Module, prefix: str = "module.") -> dict[str, nn.Parameter]:
    """Every name of every param of ``module`` (tied aliases included), as ``prefix + name``."""
    keys = {}
    for module_name, owner in module.named_modules():
        for leaf, param in owner.named_parameters(recurse=False):
            keys[f"{prefix}{module_name}{'.' if module_name else ''}{leaf}"] = param
    return keys


def param_loader(
    key: str, bucket: FlatParamBucket, index: int, target: nn.Parameter, value: torch.Tensor
) -> Callable[[], None]:
    """Check ``value`` (the whole param, or a DTensor shard of the same layout) against ``target`` (an
    optimizer param of ``bucket``) and return the copy of it into the rows this rank owns: a state dict is
    checked whole before any param changes. A split that differs is refused first: every rank sees it, so
    every rank refuses alike."""
    local = target.to_local() if isinstance(target, DTensor) else target
    shape = bucket.layout.items[index].shape
    if isinstance(value, DTensor):
        if isinstance(target, DTensor) and split_of(value) != split_of(target):
            raise ValueError(
                f"load_state_dict: {key!r} is split over the ranks as {split_of(value)}, this model's param "
                f"as {split_of(target)}: the buckets were laid out differently (gradsync-fsdp up to 0.3.0 "
                "kept every bucket in module order); load through torch.distributed.checkpoint, which "
                "reshards, or load whole tensors"
            )
        source = value.to_local()
        if tuple(value.shape) != tuple(shape) or source.shape != local.shape:
            raise ValueError(
                f"load_state_dict: {key!r} is a DTensor of shape {list(value.shape)} with a local shard of "
                f"{list(source.shape)}, but this model's shard is {list(local.shape)} of {list(shape)}: "
                "load shards saved with the same strategy and world size, or whole tensors"
            )
    else:
        if tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"load_state_dict: {key!r} has shape {list(value.shape)}, the param {list(shape)}"
            )
        first, last = bucket.owned_rows(index)
        source = value.reshape(shape)[first:last] if len(shape) else value

    def copy() -> None:
        with torch.no_grad():
            local.copy_(source.reshape(local.shape))

    return copy
