"""``fully_shard`` (torch 2.13's signature) and ``megatron_fsdp_of``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from gradsync.buffers.shard_alignment import ShardAlignmentSpec

from ..megatron_fsdp import MegatronFSDP
from .checks import (
    _checked_mesh,
    _checked_mp_policy,
    _checked_outer,
    _checked_reshard,
    _plain_params,
    _refuse_disagreement,
    _refuse_offload,
    _refuse_reuse,
    _refuse_unsupported_placements,
)
from .module import FSDPModule
from .root import _as_fsdp, _build_root, _mark, _marked_inside
from .state import _Call, _state

_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any = ...,
    outer_dp_sharding_strategy: str | int = ...,
    shard_alignment: ShardAlignmentSpec = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any = ...,
    outer_dp_sharding_strategy: str | int = ...,
    shard_alignment: ShardAlignmentSpec = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    outer_dp_sharding_strategy: str | int = "no_shard",
    shard_alignment: ShardAlignmentSpec = None,
) -> FSDPModule | list[FSDPModule]:
    """torch 2.13's ``fully_shard`` signature, in place. A module holding no marked module becomes a
    unit; the module holding marked ones (called last, as torch requires) becomes the root and is sharded
    now. A list marks each module as its own unit. ``outer_dp_sharding_strategy`` (gradsync's, 2-D meshes
    only): ``"no_shard"`` replicates over the outer axis (torch's HSDP), ``"optim"`` also shards the
    optimizer state over it (ZeRO-1 outside, ZeRO-3 inside). ``shard_alignment`` (gradsync's, read from
    the root call, names relative to the root): where shards may cut each param, as
    :class:`MegatronFSDP`'s (``"chunk"`` gives torch's own ``Shard(0)`` shards). ``dp_mesh_dims`` (torch
    2.15's): ``mesh`` is the whole SPMD mesh, these its data-parallel dims; its other dims must have size
    1, and params may be DTensors replicated on it (they become plain params first)."""
    modules = module if isinstance(module, list) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            f"fully_shard: module must be an nn.Module or a non-empty list of them, not {module!r}"
        )
    call = _Call(
        mesh=_checked_mesh(mesh, dp_mesh_dims),
        reshard_after_forward=_checked_reshard(reshard_after_forward),
        mp_policy=_checked_mp_policy(mp_policy),
        ignored_params=frozenset(ignored_params or ()),
        outer_dp_sharding_strategy=_checked_outer(outer_dp_sharding_strategy, mesh),
        shard_alignment=shard_alignment,
    )
    _refuse_offload(offload_policy)
    for target in modules if dp_mesh_dims is not None else ():
        _plain_params(target, mesh)
    for target in modules:
        _refuse_unsupported_placements(target, shard_placement_fn, call.ignored_params)
        _refuse_reuse(target)
    marked = [_marked_inside(target) for target in modules]
    if isinstance(module, list):
        if any(marked):
            raise ValueError(
                "fully_shard: a list groups units, but it holds modules already passed to fully_shard; "
                "call fully_shard on the root module alone"
            )
        for target in module:
            _mark(target, call)
        return [_as_fsdp(target) for target in module]
    if not marked[0]:
        _mark(module, call)
        return _as_fsdp(module)
    for target in marked[0]:
        if _state(target).call.shared() != call.shared():
            _refuse_disagreement(target, call)
    _build_root(module, call, marked[0])
    return _as_fsdp(module)


def megatron_fsdp_of(module: nn.Module) -> MegatronFSDP:
    """The MegatronFSDP behind a root or unit built by :func:`fully_shard`, for gradsync's own API
    (``full_state_dict()``, ``memory_stats()``, ``suggested_AG_prefetch_size``, ...)."""
    if not isinstance(module, FSDPModule):
        raise ValueError(f"megatron_fsdp_of: {type(module).__name__} was not passed to fully_shard")
    return module._fsdp2_root().fsdp
