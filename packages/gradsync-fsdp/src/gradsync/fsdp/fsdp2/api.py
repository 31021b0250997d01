"""``fully_shard`` (torch 2.13's signature) and ``megatron_fsdp_of``.

``fully_shard``'s arguments checked, and what gradsync refuses, each naming the argument and the fix,
before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.buffers.wrapper_claims import live_owner
from gradsync.groups.torch_internals import flatten_mesh

from ..megatron_fsdp import MegatronFSDP
from ..settings import STRATEGY_NAMES, parse_strategy
from .module import _PENDING, FSDPModule, _as_fsdp, _build_root, _is_root, _mark, _marked_inside, _state
from .root import _Call

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


def _checked_mesh(mesh: DeviceMesh | None, dp_mesh_dims: Any) -> DeviceMesh | None:
    if dp_mesh_dims is not None:
        return _data_parallel_mesh(mesh, dp_mesh_dims)
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; give a 1-D (shard) mesh or a "
            "2-D (replicate, shard) mesh for HSDP, sliced from the world mesh, or name its data-parallel "
            "dims with dp_mesh_dims"
        )
    return mesh


def _dim_names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def _data_parallel_mesh(mesh: DeviceMesh | None, dims: Any) -> DeviceMesh:
    """torch 2.15's ``dp_mesh_dims``: ``mesh`` is the whole SPMD mesh and ``dims.shard`` /
    ``dims.replicate`` name its data-parallel dims (several names are flattened into one). The shard mesh,
    or the (replicate, shard) mesh for HSDP, sliced from it. Its other dims must have size 1: gradsync
    shards plain params, not params already split over tensor- or context-parallel dims."""
    shard, replicate = _dim_names(getattr(dims, "shard", None)), _dim_names(getattr(dims, "replicate", None))
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(
            "fully_shard: dp_mesh_dims names dims of mesh=; pass the whole SPMD mesh, with dim names"
        )
    names = mesh.mesh_dim_names
    unknown = [name for name in (*shard, *replicate) if name not in names]
    if unknown or not (shard or replicate):
        raise ValueError(
            f"fully_shard: dp_mesh_dims={dims!r} must name dims of the mesh {names} (unknown: {unknown})"
        )
    if not shard:
        raise NotImplementedError(
            "fully_shard: dp_mesh_dims with replicate dims only is data parallelism without sharding: use "
            "gradsync.ddp's DistributedDataParallel over that group"
        )
    others = [n for i, n in enumerate(names) if n not in (*shard, *replicate) and mesh.size(i) > 1]
    if others:
        raise NotImplementedError(
            f"fully_shard: mesh dims {others} are not data-parallel and have size > 1; gradsync's "
            "fully_shard "
            "shards plain params over data-parallel dims only (not DTensors already split over tensor or "
            "context parallelism): use MegatronFSDP with an FSDPDistributedIndex that names the TP dim"
        )
    shard_mesh = mesh[shard[0]] if len(shard) == 1 else flatten_mesh(mesh[shard], "_".join(shard))
    if not replicate:
        return shard_mesh
    if len(shard) == len(replicate) == 1 and names.index(replicate[0]) < names.index(shard[0]):
        return mesh[replicate[0], shard[0]]
    raise NotImplementedError(
        f"fully_shard: dp_mesh_dims={dims!r}: gradsync's HSDP takes one replicate dim before one shard dim "
        "of the mesh; flatten the others into one dim each when building the mesh"
    )


def _plain_params(module: nn.Module, mesh_given: DeviceMesh | None) -> None:
    """Under ``dp_mesh_dims`` torch's params are DTensors on the SPMD mesh, replicated on every dim
    (the other dims have size 1): each becomes a plain param over its local (whole) tensor, tied params
    staying tied. A param split over a dim is refused by name."""
    plain: dict[torch.Tensor, nn.Parameter] = {}
    for owner_name, owner in module.named_modules():
        for leaf, param in list(owner._parameters.items()):
            if param is None or not isinstance(param, DTensor):
                continue
            if not all(p.is_replicate() for p in param.placements) or param.device_mesh != mesh_given:
                raise NotImplementedError(
                    f"fully_shard: {owner_name + '.' if owner_name else ''}{leaf} is a DTensor placed "
                    f"{param.placements} on mesh {param.device_mesh.mesh_dim_names}; with dp_mesh_dims "
                    "gradsync takes params replicated on the mesh passed to fully_shard (or plain ones)"
                )
            if param not in plain:
                plain[param] = nn.Parameter(param.to_local(), param.requires_grad)
            owner._parameters[leaf] = plain[param]


def _checked_reshard(value: bool | int | None) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise NotImplementedError(
        f"fully_shard: reshard_after_forward={value!r} (resharding to a smaller world after forward) is "
        "not supported by gradsync; pass True (released after forward) or False (kept until backward)"
    )


def _checked_mp_policy(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard: mp_policy={policy!r} must be torch's MixedPrecisionPolicy (re-exported by "
            "gradsync.fsdp.fsdp2); gradsync.fsdp.MixedPrecisionPolicy is MegatronFSDP's own"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"fully_shard: mp_policy.{field}={dtype} must be a floating-point dtype")
    return policy


def _checked_outer(value: str | int, mesh: DeviceMesh | None) -> str:
    outer = parse_strategy(value, "outer_dp_sharding_strategy").name
    if outer not in STRATEGY_NAMES[:2]:
        raise ValueError(
            f"fully_shard: outer_dp_sharding_strategy={value!r}; the outer axis can replicate "
            "('no_shard', torch's HSDP) or shard the optimizer state ('optim')"
        )
    if outer == "optim" and (mesh is None or mesh.ndim != 2):
        raise ValueError(
            "fully_shard: outer_dp_sharding_strategy='optim' shards over the outer axis of a 2-D "
            "(replicate, shard) mesh; pass such a mesh as mesh="
        )
    return outer


def _refuse_offload(policy: OffloadPolicy) -> None:
    if type(policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"fully_shard: offload_policy={policy!r} is not supported: gradsync keeps params, grads and "
            "optimizer state on the mesh's device; drop offload_policy"
        )


def _refuse_unsupported_placements(
    module: nn.Module, placement_fn: Callable[[nn.Parameter], Any] | None, ignored: frozenset[nn.Parameter]
) -> None:
    """gradsync shards every param by rows (dim 0) inside flat buckets, which is torch's default."""
    if placement_fn is None:
        return
    for name, param in module.named_parameters():
        if param in ignored:
            continue
        placement = placement_fn(param)
        if placement is not None and not (isinstance(placement, Shard) and placement.dim == 0):
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned {placement!r} for {name!r}; gradsync shards "
                "every param by rows (Shard(0)) in flat buckets; return None or Shard(0), or drop "
                "shard_placement_fn"
            )


def _refuse_reuse(module: nn.Module) -> None:
    """Each module is passed once, bottom-up, and never after a root holding it was built."""
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: {type(module).__name__} was already passed to fully_shard")
    holders = [m for m in _PENDING if any(sub is module for sub in m.modules())]
    if holders:
        raise ValueError(
            f"fully_shard: {type(holders[0]).__name__}, which holds this {type(module).__name__}, was "
            "already passed to fully_shard; call it bottom-up: on the submodules first, then on the "
            "module that holds them"
        )
    roots = [m for m in module.modules() if isinstance(m, FSDPModule) and _is_root(_state(m))]
    if roots:
        raise NotImplementedError(
            f"fully_shard: {type(roots[0]).__name__}, inside this {type(module).__name__}, is already a "
            "root of its own: it held modules passed to fully_shard before it (gradsync's units do not "
            "nest: pass fully_shard the blocks only, then the root), or it was used (parameters(), a "
            "forward) before a root call covered it (read no params between the calls)"
        )
    if any(live_owner(p) is not None for p in module.parameters()):
        raise ValueError(
            f"fully_shard: {type(module).__name__} belongs to a model that is already sharded; call "
            "fully_shard on the submodules before the root"
        )


def _refuse_disagreement(target: nn.Module, call: _Call) -> NoReturn:
    theirs, ours = _state(target).call.shared(), call.shared()
    field = next(k for k in ours if theirs[k] != ours[k])
    raise ValueError(
        f"fully_shard: the root call's {field}={ours[field]!r} differs from {theirs[field]!r} given for "
        f"its {type(target).__name__} unit; gradsync lays out one root's units together over one mesh "
        "and precision, so pass the same value to every call"
    )
