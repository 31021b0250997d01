"""FSDP2's per-module API over MegatronFSDP: ``from gradsync.fsdp.fsdp2 import fully_shard``.

torchtitan-style code calls ``fully_shard`` bottom-up, on each block and then on the root, and builds the
optimizer afterwards on ``model.parameters()``. gradsync lays out all of a model's buckets at once, so the
calls are read as one plan: a call on a module that holds no marked module marks it as a *unit* (its
params gathered, released and reduced together: one bucket per dtype); the call on a module that holds
marked ones is the *root* call and builds one :class:`MegatronFSDP` over it with those units, at once. As
with torch, the params are then the optimizer's DTensor shards, the module is the same object with its
class swapped to ``FSDP<Class>`` (an :class:`FSDPModule`), and ``model(x)``, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()`` train it: each backward that ends an accumulation cycle
reduces the grads and hands them to the DTensors (auto-sync), the step marks the model (the global
post-step hook of :mod:`~gradsync.fsdp.step_tracking`), and the next forward zeroes the grad buffers and
installs the updated weights. A marked module that no later call covers becomes a root on its own when
first used (its ``parameters()``, a forward, an FSDPModule method), as ``fully_shard(model)`` alone needs.

The package README maps every argument and method to gradsync's (section "FSDP2-style per-module API").
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_map_only

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.matrix_optim.local import local_tensor
from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.groups import FSDPDistributedIndex

from .bucket import FlatParamBucket
from .megatron_fsdp import MegatronFSDP
from .mixed_precision import MixedPrecisionPolicy as GradsyncPrecision
from .step_tracking import OWNER
from .strategy import STRATEGY_NAMES, parse_strategy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "megatron_fsdp_of",
]

_STATE = "_gradsync_fsdp2"
_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


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


class _Root:
    """The MegatronFSDP of a root call and the FSDP2 flags that decide where an accumulation cycle ends."""

    def __init__(self, fsdp: MegatronFSDP, ignored: frozenset[nn.Parameter]) -> None:
        self.fsdp = fsdp
        self.ignored = ignored
        self.requires_gradient_sync = True
        self.is_last_backward = True
        self.apply_flags()

    def apply_flags(self) -> None:
        """Without gradient sync the backward defers what it can (``no_sync``); a backward with sync that
        is also the last one reduces everything and gives the DTensors their grads (auto-sync)."""
        self.fsdp.is_last_microbatch = self.requires_gradient_sync
        self.fsdp.set_model_auto_sync(self.requires_gradient_sync and self.is_last_backward)

    def start_cycle_after_step(self, module: nn.Module, args: Any) -> None:
        """A forward after an optimizer step starts a new cycle: torch users zero the DTensors' grads
        (``optimizer.zero_grad()``), gradsync must zero its grad buffers too. Grads still set (not
        zeroed) would be summed into the next step in torch; the buffers hold one cycle, so refuse."""
        if not self.fsdp._reductions.stepped:
            return
        named = [(n, local_tensor(p.grad)) for n, p in self.fsdp.named_parameters() if p.grad is not None]
        norms = torch._foreach_norm([grad for _, grad in named]) if named else []
        # one all-reduced flag: every rank refuses alike (a rank whose shards are all empty would
        # otherwise go on into the forward's gathers), and one host read per step, not one per param
        kept = torch.stack(list(norms)).sum() if norms else torch.zeros((), device=self.fsdp.device)
        dist.all_reduce(kept, op=dist.ReduceOp.MAX, group=self.fsdp.dist_index.get_dp_group())
        if float(kept) > 0:
            first = next((n for (n, _), norm in zip(named, norms, strict=True) if float(norm) > 0), "?")
            raise RuntimeError(
                "fully_shard: a forward after optimizer.step() found grads still set (first "
                f"{first.removeprefix('module.')!r} here, or on another rank): gradsync's grad buffers hold "
                "one accumulation cycle, so grads cannot carry over to the next step; call "
                "optimizer.zero_grad() after optimizer.step()"
            )
        self.fsdp.zero_grad_buffer()


@dataclasses.dataclass
class _State:
    """What ``fully_shard`` recorded on a module: its call, and once built, its root and unit id (None
    for the root itself). ``building`` while a MegatronFSDP is being laid out over it."""

    call: _Call
    root: _Root | None = None
    unit_id: int | None = None
    building: bool = False


_PENDING: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Marked modules no root call has covered yet."""

_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


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
    :class:`MegatronFSDP`'s (``"chunk"`` gives torch's own ``Shard(0)`` shards)."""
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
    for target in modules:
        _refuse_unsupported_placements(target, shard_placement_fn, call.ignored_params)
        _refuse_reuse(target)
        _refuse_meta(target, call.ignored_params)
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


# --- argument checks -------------------------------------------------------------------------------


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
    if any(getattr(p, OWNER, None) is not None for p in module.parameters()):
        raise ValueError(
            f"fully_shard: {type(module).__name__} belongs to a model that is already sharded; call "
            "fully_shard on the submodules before the root"
        )


def _refuse_meta(module: nn.Module, ignored: frozenset[nn.Parameter]) -> None:
    on_meta = [n for n, p in module.named_parameters() if p.is_meta and p not in ignored]
    if on_meta:
        raise NotImplementedError(
            f"fully_shard: {len(on_meta)} params are on the meta device (first {on_meta[0]!r}); gradsync "
            "shards real values when the root is built, so to_empty() and init_weights() after it cannot "
            "work: initialise the model before fully_shard (or use MegatronFSDP(..., "
            "init_model_with_meta_device=True), which runs each module's reset_parameters())"
        )


def _refuse_disagreement(target: nn.Module, call: _Call) -> NoReturn:
    theirs, ours = _state(target).call.shared(), call.shared()
    field = next(k for k in ours if theirs[k] != ours[k])
    raise ValueError(
        f"fully_shard: the root call's {field}={ours[field]!r} differs from {theirs[field]!r} given for "
        f"its {type(target).__name__} unit; gradsync lays out one root's units together over one mesh "
        "and precision, so pass the same value to every call"
    )


# --- marks and roots -------------------------------------------------------------------------------


def _state(module: nn.Module) -> _State:
    state = module.__dict__.get(_STATE)
    assert isinstance(state, _State), "a module fully_shard recorded"
    return state


def _is_root(state: _State) -> bool:
    return state.root is not None and state.unit_id is None


def _as_fsdp(module: nn.Module) -> FSDPModule:
    assert isinstance(module, FSDPModule)
    return module


def _swap_class(module: nn.Module) -> None:
    """``FSDP<Class>``: FSDPModule's methods first, then the module's own, as torch does."""
    cls = type(module)
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
        _FSDP_CLASSES[cls] = fsdp_cls
    module.__class__ = fsdp_cls


def _mark(module: nn.Module, call: _Call) -> None:
    module.__dict__[_STATE] = _State(call)
    _swap_class(module)
    _PENDING.add(module)


def _marked_inside(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]


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


def _build_root(module: nn.Module, call: _Call, units: list[FSDPModule]) -> None:
    """One MegatronFSDP over ``module`` with ``units``; then ``module`` is an FSDPModule root."""
    ignored = call.ignored_params.union(*(_state(u).call.ignored_params for u in units))
    states = [_state(m) for m in [*units, module] if isinstance(m, FSDPModule)]
    for state in states:  # their named_parameters() must not resolve them meanwhile
        state.building = True
    try:
        fsdp = _megatron_fsdp(module, call, units, ignored)
    finally:
        for state in states:
            state.building = False
    root = _Root(fsdp, ignored)
    if not isinstance(module, FSDPModule):
        _mark(module, call)
    _state(module).root = root
    for unit_id, unit in enumerate(fsdp.units):
        _state(unit).root, _state(unit).unit_id = root, unit_id
    for member in [*units, module]:
        _PENDING.discard(member)
        _cast_at_boundaries(member, _state(member).call.mp_policy)
    module.register_forward_pre_hook(root.start_cycle_after_step, prepend=True)  # before MegatronFSDP's


def _megatron_fsdp(
    module: nn.Module, call: _Call, units: list[FSDPModule], ignored: frozenset[nn.Parameter]
) -> MegatronFSDP:
    managed = [(n, p) for n, p in module.named_parameters() if p not in ignored]
    strategy = _strategy(call, [_state(u).call for u in units])
    if call.outer_dp_sharding_strategy == "optim" and strategy != "optim_grads_params":
        raise ValueError(
            "fully_shard: outer_dp_sharding_strategy='optim' (ZeRO-1 over the outer axis) needs ZeRO-3 "
            "inside: pass reshard_after_forward=True to at least one unit"
        )
    device = _device(call.mesh, managed)
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
                _index(call, device),
                config,
                mixed_precision_policy=precision,
                fsdp_unit_modules=[FSDPModule] if units else None,
                device=device,
                sync_model_each_microbatch=True,
                shard_alignment=call.shard_alignment,
            )
    except BaseException:
        with torch.no_grad():  # leave the caller's model as it was given
            for name, param in managed:
                if name in originals:
                    param.data = originals[name]
        raise
    if originals:  # the main weights from the values before the cast, as torch keeps them
        fsdp.load_state_dict({f"module.{name}": value for name, value in originals.items()}, strict=False)
    if fsdp.sharding.shard_params:
        fsdp.units_kept_after_forward = {
            i for i, unit in enumerate(fsdp.units) if _state(unit).call.reshard_after_forward is False
        }
    return fsdp


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
        hybrid_fsdp_group=mesh._flatten().get_group(),
        hsdp_outer_dp_shard=call.outer_dp_sharding_strategy == "optim",
    )


def _device(mesh: DeviceMesh | None, managed: list[tuple[str, nn.Parameter]]) -> torch.device | None:
    """Where the shards live: the mesh's device (the current accelerator), as torch moves the module
    there; without a mesh, the params' device."""
    if mesh is None:
        return managed[0][1].device if managed else None
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


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
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


# --- the module class ------------------------------------------------------------------------------


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` waits for its gathers."""

    def __init__(self, buckets: list[FlatParamBucket]) -> None:
        self._buckets = buckets

    def wait(self) -> None:
        for bucket in self._buckets:
            bucket.wait_gather()
        self._buckets = []


def _not_supported(name: str, advice: str) -> Callable[..., NoReturn]:
    """An FSDPModule method gradsync has no counterpart for: it raises, saying what to do instead."""

    def method(self: nn.Module, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__}.{name}() is not supported by gradsync: {advice}")

    method.__name__ = name
    return method


_PREFETCH = "units are prefetched in order: set megatron_fsdp_of(model).suggested_AG_prefetch_size"
_COMMS = "gradsync's collectives come from gradsync-buffers, chosen per backend"


class FSDPModule(nn.Module):
    """What ``fully_shard`` makes of a module (its class becomes ``FSDP<Class>``, this first in the
    MRO), with the FSDP2 methods that map onto MegatronFSDP; the others raise, naming the way out."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """``FSDP<Class>(...)`` (containers rebuild themselves with ``type(self)(...)`` when sliced)
        builds a plain ``<Class>``, which no fully_shard call has seen."""
        original: Any = cls.__mro__[2]
        instance = original.__new__(original)
        instance.__init__(*args, **kwargs)
        return instance

    def _fsdp2_root(self) -> _Root:
        state = _state(self)
        return state.root if state.root is not None else _resolve_alone(self, forward=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if state.root is None and not state.building:
            _resolve_alone(self, forward=True)
        return super().__call__(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """A mark read on its own (say, to build its optimizer) becomes a root first: its params are the
        optimizer's DTensors then, as torch's right after fully_shard."""
        state = _state(self)
        if state.root is None and not state.building:
            _resolve_alone(self, forward=False)
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if state.root is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: moving or casting (to(), cuda(), float(), to_empty(), ...) after "
                "fully_shard is not supported: the params are views of gradsync's flat buffers; do it "
                "before fully_shard"
            )
        return super()._apply(*args, **kwargs)  # type: ignore[no-untyped-call]

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """The root's params from whole tensors or DTensor shards of the same layout, through
        MegatronFSDP (which installs the compute weights; ``ignored_params`` are copied as they are)."""
        state = _state(self)
        root = self._fsdp2_root()
        if state.unit_id is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.load_state_dict on a unit: load the root's state dict (keys as "
                "model.state_dict() gives them)"
            )
        ignored = {name: p for name, p in self.named_parameters() if p in root.ignored}
        result = root.fsdp.load_state_dict(
            {f"module.{k}": v for k, v in state_dict.items() if k not in ignored}, strict=False, assign=assign
        )
        with torch.no_grad():
            for name, param in ignored.items():
                if name in state_dict:
                    param.copy_(state_dict[name])
        missing = [k for k in (k.removeprefix("module.") for k in result.missing_keys) if k not in ignored]
        missing += [name for name in ignored if name not in state_dict]
        unexpected = [k.removeprefix("module.") for k in result.unexpected_keys]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"{type(self).__name__}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        return _IncompatibleKeys(missing, unexpected)

    # --- gradient sync ----------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: the next backwards accumulate without ending the cycle (gradsync's ``no_sync``; ZeRO-2/3
        still reduce-scatter each backward, summed in the shard). True: a backward reduces everything and
        gives the DTensors their grads."""
        root = self._fsdp2_root()
        if _state(self).unit_id is not None or not recurse:
            raise NotImplementedError(
                f"{type(self).__name__}.set_requires_gradient_sync on a unit or with recurse=False: gradsync "
                "syncs all the units of a root together; call model.set_requires_gradient_sync(flag) on "
                "the root"
            )
        root.requires_gradient_sync = requires_gradient_sync
        root.apply_flags()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backwards do not end the cycle even with gradient sync on (grads are reduced
        but not yet handed to the DTensors). Shared by the whole root, as in torch."""
        root = self._fsdp2_root()
        root.is_last_backward = is_last_backward
        root.apply_flags()

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Accepted and ignored: gradsync's HSDP all-reduce already runs once per cycle, in its last
        backward, which is what this is for."""
        self._fsdp2_root()

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Accepted and ignored: gradsync always reduces every bucket on every rank, so params unused on
        some ranks never mismatch the collectives."""
        self._fsdp2_root()

    # --- gathers and releases ---------------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Per unit under ZeRO-3 (released after forward or kept until its backward); the root's own
        params are always kept. A ZeRO-2 root (every unit built with False) cannot start resharding."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, not {reshard_after_forward!r}")
        state = _state(self)
        if state.root is None:  # not built yet: the root call reads it
            state.call = dataclasses.replace(state.call, reshard_after_forward=reshard_after_forward)
            return
        fsdp = self._fsdp2_root().fsdp
        if not fsdp.sharding.shard_params:
            if reshard_after_forward:
                raise NotImplementedError(
                    f"{type(self).__name__}.set_reshard_after_forward(True): this root was built with "
                    "reshard_after_forward=False on every unit, so gradsync keeps whole weights (ZeRO-2) "
                    "and cannot start resharding; pass True to fully_shard on the units instead"
                )
            return
        if state.unit_id is not None:
            unit_ids = [state.unit_id]
        else:
            unit_ids = list(range(len(fsdp.units))) if recurse else []
        for unit_id in unit_ids:
            if reshard_after_forward:
                fsdp.units_kept_after_forward.discard(unit_id)
            else:
                fsdp.units_kept_after_forward.add(unit_id)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Accepted when it says what the root does: ZeRO-3 releases after every backward, ZeRO-2
        never does."""
        fsdp = self._fsdp2_root().fsdp
        if reshard_after_backward != fsdp.sharding.shard_params:
            does = "releases its weights after every backward" if fsdp.sharding.shard_params else "never"
            raise NotImplementedError(
                f"{type(self).__name__}.set_reshard_after_backward({reshard_after_backward}): this root "
                f"{does} ({fsdp.sharding.name}); choose at fully_shard: reshard_after_forward=False "
                "on every unit keeps whole weights (ZeRO-2), True on some unit releases them (ZeRO-3)"
            )

    def _own_buckets(self) -> tuple[MegatronFSDP, list[FlatParamBucket]]:
        """This module's buckets: a unit's, or the root's own (outside every unit)."""
        fsdp = self._fsdp2_root().fsdp
        unit_id = _state(self).unit_id
        return fsdp, [b for b in fsdp.buckets if b.spec.unit_id == unit_id]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's weights (not recursive); with ``async_op`` the handle waits. They are
        used from the module's next forward on (the module shows its DTensors until then)."""
        fsdp, buckets = self._own_buckets()
        params = [p for bucket in buckets for p in bucket.spec.params]
        fsdp.all_gather_and_wait_parameters_ready(params, prefetch=False, wait_bucket_ready=not async_op)
        handle = UnshardHandle(buckets)
        return handle if async_op else None

    def reshard(self) -> None:
        """Release this module's gathered weights (ZeRO-3; not recursive)."""
        _, buckets = self._own_buckets()
        for bucket in buckets:
            bucket.release()

    set_modules_to_forward_prefetch = _not_supported("set_modules_to_forward_prefetch", _PREFETCH)
    set_modules_to_backward_prefetch = _not_supported("set_modules_to_backward_prefetch", _PREFETCH)
    set_custom_all_gather = _not_supported("set_custom_all_gather", _COMMS)
    set_custom_reduce_scatter = _not_supported("set_custom_reduce_scatter", _COMMS)
    set_allocate_memory_from_process_group_for_comm = _not_supported(
        "set_allocate_memory_from_process_group_for_comm", _COMMS
    )
    set_symm_mem_for_comm = _not_supported("set_symm_mem_for_comm", _COMMS)
    set_separate_reduce_scatter_group = _not_supported("set_separate_reduce_scatter_group", _COMMS)
    set_reduce_scatter_max_input_buffers = _not_supported(
        "set_reduce_scatter_max_input_buffers",
        "ZeRO-2/3's reductions in flight are bounded by megatron_fsdp_of(model).suggested_RS_queue_capacity",
    )
    set_force_sum_reduction_for_comms = _not_supported("set_force_sum_reduction_for_comms", _COMMS)
    set_all_reduce_hook = _not_supported(
        "set_all_reduce_hook", "gradsync runs HSDP's outer all-reduce itself (outer_dp_sharding_strategy)"
    )
    set_gradient_divide_factor = _not_supported(
        "set_gradient_divide_factor",
        "grads are averaged over the data-parallel ranks; scale the loss instead",
    )
    set_reduce_scatter_divide_factor = _not_supported(
        "set_reduce_scatter_divide_factor",
        "grads are averaged over the data-parallel ranks; scale the loss instead",
    )
    set_unshard_in_backward = _not_supported(
        "set_unshard_in_backward", "a ZeRO-3 unit is gathered for its backward whenever it was released"
    )
    set_post_optim_event = _not_supported(
        "set_post_optim_event", "the first forward after a step installs and gathers on the current stream"
    )
    reset_iter_state = _not_supported(
        "reset_iter_state", "after a failed forward or backward, rebuild the model and optimizer"
    )
