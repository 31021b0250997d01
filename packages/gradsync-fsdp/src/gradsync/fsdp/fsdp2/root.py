"""What a root call builds: each call's arguments as recorded, and the one MegatronFSDP over a root and
its units (strategy, mesh, precision) from them.

torch's ``MixedPrecisionPolicy`` on gradsync's buckets: the compute cast, the boundary casts, and the
ignored params kept out of the buckets while they are laid out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from gradsync.buffers import DistributedDataParallelConfig, check_params_match_across_ranks
from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.groups import FSDPDistributedIndex

from ..megatron_fsdp import MegatronFSDP
from ..settings import MixedPrecisionPolicy as GradsyncPrecision
from ..settings import choose_device
from ..torch_internals import flatten_mesh, pytree


@dataclasses.dataclass(frozen=True)
class _Call:
    """One ``fully_shard`` call's arguments, after the refusals."""

    mesh: DeviceMesh | None
    reshard_after_forward: bool | None
    mp_policy: MixedPrecisionPolicy
    ignored_params: frozenset[nn.Parameter]
    outer_dp_sharding_strategy: str
    shard_alignment: ShardAlignmentSpec = None

    def shared(self) -> dict[str, object]:
        """What every call of one root must agree on: it shapes the buckets all units share."""
        return {
            "mesh": self.mesh,
            "mp_policy.param_dtype": self.mp_policy.param_dtype,
            "mp_policy.reduce_dtype": self.mp_policy.reduce_dtype,
            "outer_dp_sharding_strategy": self.outer_dp_sharding_strategy,
        }


def _cast_for_compute(
    policy: MixedPrecisionPolicy, managed: list[tuple[str, nn.Parameter]]
) -> tuple[GradsyncPrecision, dict[str, torch.Tensor]]:
    """torch's policy as gradsync's: compute weights in ``param_dtype`` (cast here, before the buckets
    are laid out) over main weights, main grads and their accumulation in the original dtype, reduced in
    ``reduce_dtype`` (else ``param_dtype``). Returns the original values, for the main weights."""
    floating = {p.dtype for _, p in managed if p.is_floating_point()}
    compute = policy.param_dtype
    if compute is None or floating <= {compute}:
        return GradsyncPrecision(None, None, policy.reduce_dtype), {}
    if len(floating) > 1:
        raise NotImplementedError(
            f"fully_shard: mp_policy.param_dtype={compute} over params of several dtypes "
            f"{sorted(map(str, floating))}: gradsync keeps one main dtype; cast the model to one dtype first"
        )
    (original,) = floating
    originals = {}
    with torch.no_grad():
        for name, param in managed:
            if param.is_floating_point() and param.dtype != compute:
                originals[name] = param.data
                param.data = param.data.to(compute)
    return GradsyncPrecision(original, original, policy.reduce_dtype or compute), originals


@contextlib.contextmanager
def _params_hidden(root: nn.Module, hidden: frozenset[nn.Parameter]) -> Iterator[None]:
    """``ignored_params`` leave their modules while MegatronFSDP (which manages every param it finds) is
    built, and come back in their places: unsharded, never moved, their grads never reduced."""
    saved = []
    for owner in root.modules():
        params = owner._parameters
        if any(p is not None and p in hidden for p in params.values()):
            saved.append((owner, dict(params)))
            for leaf in [leaf for leaf, p in params.items() if p is not None and p in hidden]:
                del params[leaf]
    try:
        yield
    finally:
        for owner, original in saved:
            params = owner._parameters  # the registry may have swapped the others: keep those
            restored = {leaf: params.get(leaf, value) for leaf, value in original.items()}
            params.clear()
            params.update(restored)


def _cast_at_boundaries(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """``cast_forward_inputs`` / ``output_dtype``: floating inputs to ``param_dtype``, outputs to
    ``output_dtype``, at this module's forward, as torch does for every fully_shard module."""
    compute, output = policy.param_dtype, policy.output_dtype
    if compute is not None and policy.cast_forward_inputs:
        module.register_forward_pre_hook(
            lambda module, args, kwargs: _cast_floating((args, kwargs), compute), with_kwargs=True
        )
    if output is not None:
        module.register_forward_hook(lambda module, args, out: _cast_floating(out, output))


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _megatron_fsdp(
    module: nn.Module,
    call: _Call,
    units: list[nn.Module],
    ignored: frozenset[nn.Parameter],
    unit_call: Callable[[nn.Module], _Call],
    unit_class: type[nn.Module],
) -> MegatronFSDP:
    """The MegatronFSDP of a root call over ``module`` with its ``units`` (``unit_call``: the call that
    marked each; ``unit_class``: the class every marked module is an instance of)."""
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
        managed,
        index.get_dp_group(),
        who="fully_shard",
        settings=_arguments(call, [unit_call(u) for u in units]),
    )
    strategy = _strategy(call, [unit_call(u) for u in units])
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
                fsdp_unit_modules=[unit_class] if units else None,
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
            i for i, unit in enumerate(fsdp.units) if unit_call(unit).reshard_after_forward is False
        }
    return fsdp


def _default_device_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def _arguments(call: _Call, unit_calls: list[_Call]) -> dict[str, object]:
    """The root call's arguments every rank must have given alike, and each unit's
    ``reshard_after_forward``, as the caller named them."""
    return {
        "mp_policy": call.mp_policy,
        "outer_dp_sharding_strategy": call.outer_dp_sharding_strategy,
        "shard_alignment": call.shard_alignment,
        "reshard_after_forward": (
            call.reshard_after_forward,
            *(c.reshard_after_forward for c in unit_calls),
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
