"""MegatronFSDP's state dict: params as the optimizer's DTensor shards, loaded from shards or whole tensors,
and the whole model gathered for export.

The sharded state dict runs no collective, in either direction. Each rank knows from the layout which rows
of every param it owns, so a whole tensor (from an unwrapped model, or gathered) is loaded by copying those
rows, and a DTensor saved by the same layout by copying its local shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .bucket import FlatParamBucket
from .dcp import describe_shard
from .ragged import split_of
from .registration import ParamRegistry
from .sharded_param import ShardedParams
from .torch_internals import detach_for_saving


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
    if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
        value = value.to_local()  # whole on every rank (a load pre-hook's merge of whole pieces)
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


def add_sharded_params(
    destination: dict[str, Any], module: nn.Module, params: ShardedParams, prefix: str, keep_vars: bool
) -> None:
    """Put every param of ``module`` (tied aliases included) into ``destination`` as the optimizer's
    DTensor shard, described for ``torch.distributed.checkpoint``."""
    for key, param in param_keys(module, prefix).items():
        record = params.of(param)
        value = record.sharded if keep_vars else detach_for_saving(record.sharded)
        first_row = record.first_row
        destination[key] = value if first_row is None else describe_shard(value, first_row)


def load_sharded_params(module: nn.Module, params: ShardedParams, state_dict: dict[str, Any]) -> None:
    """Copy the rows this rank owns of every param of ``module`` that ``state_dict`` holds (DTensor shards
    of the same layout, or whole tensors: plain, or DTensors replicated everywhere), each checked before
    any is copied. Keys are ``module.``-prefixed."""
    keys = param_keys(module)
    copies = []
    for key, param in keys.items():
        if key in state_dict:
            record = params.of(param)
            copies.append(param_loader(key, record.bucket, record.index, record.sharded, state_dict[key]))
    for copy in copies:  # every param checked first: a refused state dict changes nothing
        copy()


def gather_full_state_dict(
    module: nn.Module,
    registry: ParamRegistry,
    buckets: Sequence[FlatParamBucket],
    *,
    release: bool,
    keep: bool,
) -> dict[str, Any]:
    """Every param whole, gathered one bucket at a time (as double buffers require), as plain CPU tensors
    keyed like ``module``'s own state dict; an empty dict where not ``keep``. ``release``: ZeRO-3 drops
    each bucket's gathered weights after copying them."""
    with registry.compute_shown():
        state = module.state_dict(keep_vars=True)
    names_of: dict[torch.Tensor, list[str]] = {}
    copied: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            names_of.setdefault(value, []).append(name)
        else:  # extra state (Megatron's layers give None): kept as it is
            copied[name] = value
    for bucket in buckets:
        bucket.wait_exact_gather()
        for param in bucket.spec.params:
            for name in names_of.pop(param, []) if keep else []:
                copied[name] = param.detach().cpu().clone()
        if release:
            bucket.release()
    if not keep:
        return {}
    for tensor, names in names_of.items():  # buffers
        copied.update({name: tensor.detach().cpu().clone() for name in names})
    return {name: copied[name] for name in state}
