"""Marks and roots: a call on a module that holds no marked module marks it as a unit (its class swapped
to ``FSDP<Class>``); the call on the module holding marked ones builds one MegatronFSDP over them all."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from gradsync.buffers import DistributedDataParallelConfig, check_params_match_across_ranks
from gradsync.groups import FSDPDistributedIndex

from ..device_choice import choose_device
from ..hooks import outside_compile
from ..megatron_fsdp import MegatronFSDP
from ..torch_internals import detach_for_saving, flatten_mesh
from . import module as _module
from .precision import _cast_at_boundaries, _cast_for_compute, _params_hidden
from .state import _PENDING, STATE_ATTR, _Call, _Root, _State, _state

_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _as_fsdp(module: nn.Module) -> _module.FSDPModule:
    assert isinstance(module, _module.FSDPModule)
    return module


def _swap_class(module: nn.Module) -> None:
    """``FSDP<Class>``: _module.FSDPModule's methods first, then the module's own, as torch does."""
    cls = type(module)
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (_module.FSDPModule, cls), {"__module__": cls.__module__})
        _FSDP_CLASSES[cls] = fsdp_cls
    module.__class__ = fsdp_cls


def _mark(module: nn.Module, call: _Call) -> None:
    module.__dict__[STATE_ATTR] = _State(call)
    _swap_class(module)
    _PENDING.add(module)


def _marked_inside(module: nn.Module) -> list[_module.FSDPModule]:
    return [m for m in module.modules() if m is not module and isinstance(m, _module.FSDPModule)]


def _resolve_alone(module: nn.Module, *, forward: bool) -> _Root:
    """A marked module used before any call covered it: a root of its own, as in torch (whose first
    forward picks the root). A forward while other marks wait is refused: the usual cause is a
    forgotten root call, and an optimizer built meanwhile holds the unsharded params."""
    waiting = [m for m in _PENDING if m is not module]
    if forward and waiting:
        raise RuntimeError(
            f"fully_shard: {type(module).__name__} runs forward while {len(waiting)} other module(s) passed "
            f"to fully_shard (first {type(waiting[0]).__name__}) wait for a root call; call fully_shard on "
            "the module that holds them all, last, and build the optimizer after it (for separate models, "
            "read each one's parameters() before its first forward)"
        )
    _build_root(module, _state(module).call, [])
    root = _state(module).root
    assert root is not None
    return root


def _build_root(module: nn.Module, call: _Call, units: list[_module.FSDPModule]) -> None:
    """One MegatronFSDP over ``module`` with ``units``; then ``module`` is an _module.FSDPModule root."""
    ignored = call.ignored_params.union(*(_state(u).call.ignored_params for u in units))
    states = [_state(m) for m in [*units, module] if isinstance(m, _module.FSDPModule)]
    for state in states:  # their named_parameters() must not resolve them meanwhile
        state.building = True
    try:
        fsdp = _megatron_fsdp(module, call, units, ignored)
    finally:
        for state in states:
            state.building = False
    root = _Root(fsdp, ignored)
    if not isinstance(module, _module.FSDPModule):
        _mark(module, call)
    _state(module).root = root
    for unit_id, unit in enumerate(fsdp.units):
        _state(unit).root, _state(unit).unit_id = root, unit_id
    for member in [*units, module]:
        _PENDING.discard(member)
        _cast_at_boundaries(member, _state(member).call.mp_policy)
    module.register_forward_pre_hook(outside_compile(root.start_cycle_after_step), prepend=True)  # first
    module.register_forward_pre_hook(outside_compile(root.wait_post_optim_event), prepend=True)  # before it
    module.register_state_dict_post_hook(_picklable_dtensors)  # type: ignore[no-untyped-call]


def _picklable_dtensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
    """The state dict's DTensors as ``torch.save`` can pickle them (:func:`detach_for_saving`); params
    (``keep_vars=True``) stay as they are."""
    for key, value in state_dict.items():
        if isinstance(value, DTensor) and not isinstance(value, nn.Parameter):
            state_dict[key] = detach_for_saving(value)


def _megatron_fsdp(
    module: nn.Module, call: _Call, units: list[_module.FSDPModule], ignored: frozenset[nn.Parameter]
) -> MegatronFSDP:
    managed = [(n, p) for n, p in module.named_parameters() if p not in ignored]
    on_meta = any(p.is_meta for _, p in managed)
    # the mesh's device, as torch moves the module there; without a mesh, the params' (meta params: the
    # accelerator's, else the CPU, as torch's default mesh)
    mesh_type = call.mesh.device_type if call.mesh else _default_device_type() if on_meta else None
    device = choose_device(None, (p for _, p in managed), mesh_type)
    index = _index(call, device)
    # In the caller's terms, before MegatronFSDP checks what they became (its strategy, its precision),
    # and before any refusal that depends on them (a rank raising alone would leave the others here)
    check_params_match_across_ranks(
        managed, index.get_dp_group(), who="fully_shard", settings=_arguments(call, units)
    )
    strategy = _strategy(call, [_state(u).call for u in units])
    if call.outer_dp_sharding_strategy == "optim" and strategy != "optim_grads_params":
        raise ValueError(
            "fully_shard: outer_dp_sharding_strategy='optim' (ZeRO-1 over the outer axis) needs ZeRO-3 "
            "inside: pass reshard_after_forward=True to at least one unit"
        )
    precision, originals = _cast_for_compute(call.mp_policy, managed)
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=call.outer_dp_sharding_strategy,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    try:
        with _params_hidden(module, ignored):
            fsdp = MegatronFSDP(
                module,
                index,
                config,
                mixed_precision_policy=precision,
                fsdp_unit_modules=[_module.FSDPModule] if units else None,
                device=device,
                sync_model_each_microbatch=True,
                shard_alignment=call.shard_alignment,
                init_model_with_meta_device=on_meta,
                init_meta_values=False,  # torch's flow: to_empty() and the model's init write them
            )
    except BaseException:
        with torch.no_grad():  # leave the caller's model as it was given
            for name, param in managed:
                if name in originals:
                    param.data = originals[name]
        raise
    if originals and not on_meta:  # the main weights from the values before the cast, as torch keeps them
        fsdp.load_state_dict({f"module.{name}": value for name, value in originals.items()}, strict=False)
    if fsdp.sharding.shard_params:
        fsdp.units_kept_after_forward = {
            i for i, unit in enumerate(fsdp.units) if _state(unit).call.reshard_after_forward is False
        }
    return fsdp


def _default_device_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def _arguments(call: _Call, units: list[_module.FSDPModule]) -> dict[str, object]:
    """The root call's arguments every rank must have given alike, and each unit's
    ``reshard_after_forward``, as the caller named them."""
    return {
        "mp_policy": call.mp_policy,
        "outer_dp_sharding_strategy": call.outer_dp_sharding_strategy,
        "shard_alignment": call.shard_alignment,
        "reshard_after_forward": (
            call.reshard_after_forward,
            *(_state(u).call.reshard_after_forward for u in units),
        ),
    }


def _strategy(call: _Call, unit_calls: list[_Call]) -> str:
    """ZeRO-3 when some unit reshards after forward (units given False stay gathered until their
    backward), ZeRO-2 when none does (weights stay whole). Without units the root's own value decides
    (None: ZeRO-3, whose root params are held from forward to the end of backward, as torch's root)."""
    reshards = [c.reshard_after_forward is not False for c in unit_calls] or [
        call.reshard_after_forward is not False
    ]
    return "optim_grads_params" if any(reshards) else "optim_grads"


def _index(call: _Call, device: torch.device | None) -> FSDPDistributedIndex:
    mesh = call.mesh
    if mesh is None:  # torch's default: one dimension over the world
        kind = device.type if device is not None else None
        return FSDPDistributedIndex.from_sizes(dist.get_world_size(), device_type=kind)
    if mesh.mesh_dim_names is None:  # name the dims over the same groups (nothing is communicated)
        names = ("dp_shard",) if mesh.ndim == 1 else ("dp_replicate", "dp_shard")
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        mesh = DeviceMesh.from_group(groups, mesh.device_type, mesh=mesh.mesh, mesh_dim_names=names)
    assert mesh.mesh_dim_names is not None
    if mesh.ndim == 1:
        return FSDPDistributedIndex(mesh, dp_shard_dim=mesh.mesh_dim_names[0])
    outer, shard = mesh.mesh_dim_names
    return FSDPDistributedIndex(
        mesh,
        dp_shard_dim=shard,
        dp_outer_dim=outer,
        hybrid_fsdp_group=flatten_mesh(mesh).get_group(),
        hsdp_outer_dp_shard=call.outer_dp_sharding_strategy == "optim",
    )
