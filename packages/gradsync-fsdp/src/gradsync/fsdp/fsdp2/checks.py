"""``fully_shard``'s arguments checked, and what gradsync refuses, each naming the argument and the fix,
before anything is built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from gradsync.buffers.wrapper_claims import live_owner

from ..strategy import STRATEGY_NAMES, parse_strategy
from .module import FSDPModule
from .state import _PENDING, _Call, _is_root, _state


def _checked_mesh(mesh: DeviceMesh | None, dp_mesh_dims: Any) -> DeviceMesh | None:
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard: dp_mesh_dims (params already DTensors on a full SPMD mesh) is not supported by "
            "gradsync, which shards plain params; pass the data-parallel mesh alone as mesh= (e.g. "
            "world_mesh['dp_replicate', 'dp_shard'])"
        )
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; give a 1-D (shard) mesh or a "
            "2-D (replicate, shard) mesh for HSDP, sliced from the world mesh"
        )
    return mesh


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
