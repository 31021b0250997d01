"""MegatronFSDP's state dict: params as the optimizer's DTensor shards, loaded from shards or whole tensors.

Neither direction runs a collective. Each rank knows from the layout which rows of every param it owns,
so a whole tensor (from an unwrapped model, or gathered) is loaded by copying those rows, and a DTensor
saved by the same layout by copying its local shard.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .bucket import FlatParamBucket


def param_keys(module: nn.Module, prefix: str = "module.") -> dict[str, nn.Parameter]:
    """Every name of every param of ``module`` (tied aliases included), as ``prefix + name``."""
    keys = {}
    for module_name, owner in module.named_modules():
        for leaf, param in owner.named_parameters(recurse=False):
            keys[f"{prefix}{module_name}{'.' if module_name else ''}{leaf}"] = param
    return keys


def load_param(
    key: str, bucket: FlatParamBucket, index: int, target: nn.Parameter, value: torch.Tensor
) -> None:
    """Copy ``value`` (the whole param, or a DTensor shard of the same layout) into the rows of ``target``
    (an optimizer param of ``bucket``) that this rank owns."""
    local = target.to_local() if isinstance(target, DTensor) else target
    shape = bucket.layout.items[index].shape
    if isinstance(value, DTensor):
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
    with torch.no_grad():
        local.copy_(source.reshape(local.shape))
