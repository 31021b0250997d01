"""``FSDPModule``: the class ``fully_shard`` swaps in, with the FSDP2 methods that map onto MegatronFSDP;
the others raise, naming the way out.

What ``fully_shard`` records on each module (its call, then its root and unit id), the root's flags, and
the marks and roots themselves: a call on a module that holds no marked module marks it as a unit (its
class swapped to ``FSDP<Class>``); the call on the module holding marked ones builds one MegatronFSDP over
them all (:mod:`.root`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from gradsync.buffers.torch_internals import local_tensor

from ..bucket import FlatParamBucket
from ..hooks import outside_compile
from ..megatron_fsdp import MegatronFSDP
from ..torch_internals import detach_for_saving
from .root import _Call, _cast_at_boundaries, _megatron_fsdp

STATE_ATTR = "_gradsync_fsdp2"
"""Where a module passed to ``fully_shard`` keeps its :class:`State`."""


class _Root:
    """The MegatronFSDP of a root call and the FSDP2 flags that decide where an accumulation cycle ends."""

    def __init__(self, fsdp: MegatronFSDP, ignored: frozenset[nn.Parameter]) -> None:
        self.fsdp = fsdp
        self.ignored = ignored
        self.requires_gradient_sync = True
        self.is_last_backward = True
        self.manual_finalization = False
        self.post_optim_event: Any = None
        self.apply_flags()

    def apply_flags(self) -> None:
        """Without gradient sync the backward defers what it can (``no_sync``); a backward with sync that
        is also the last one reduces everything and gives the DTensors their grads (auto-sync), unless
        the caller finalizes (``finalize_backward()``)."""
        self.fsdp.is_last_microbatch = self.requires_gradient_sync
        ends = self.requires_gradient_sync and self.is_last_backward and not self.manual_finalization
        self.fsdp.set_model_auto_sync(ends)

    def start_cycle_after_step(self, module: nn.Module, args: Any) -> None:
        """A forward after an optimizer step starts a new cycle: torch users zero the DTensors' grads
        (``optimizer.zero_grad()``), gradsync must zero its grad buffers too. So does a forward after a
        step that raised (a backward or a loss that raised on this rank, which then abandons the step
        as ``zero_grad_buffer()`` does, so every rank raises; or the vote that named another rank).
        Grads still set (not zeroed) would be summed into the next step in torch; the buffers hold one
        cycle, so refuse.

        Grads set to None (torch's ``zero_grad()``) are seen on the host: then nothing is read from the
        device and the step has no host sync, as MegatronFSDP's. Only grads still set (zeroed in place
        by ``zero_grad(set_to_none=False)``, or never zeroed) have their values checked, with one host
        read. Whether grads are set is the same on every rank: each rank holds a grad for every trained
        param, an empty one where it owns no rows (the record's ``optimizer_grad``), so every rank takes
        the same branch and posts the same collectives.

        First, the event given by ``set_post_optim_event``: the current stream (on which gradsync's
        gathers are issued) waits for it once."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:
            event.wait()
        if not self.fsdp.steps.grads_consumed:
            # the last step raised (here or elsewhere), or a finished cycle's grads were dropped with no
            # step (torchft's OptimizerWrapper skips a step the quorum did not commit; the loop's
            # zero_grad() then drops them, as torch's FSDP2 starts the retried step from none)
            dropped = self.fsdp.cycle_finished and all(p.grad is None for p in self.fsdp.parameters())
            if self.fsdp.step_left_broken or dropped:
                self.fsdp.zero_grad_buffer()
            return
        named = [(n, local_tensor(p.grad)) for n, p in self.fsdp.named_parameters() if p.grad is not None]
        if named:
            self._refuse_grads_carried_over(named)
        self.fsdp.zero_grad_buffer()

    def _refuse_grads_carried_over(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise on every rank when any rank's grads are not all zero."""
        norms = torch._foreach_norm([grad for _, grad in named])
        # one all-reduced flag: every rank refuses alike (a rank whose shards are all empty would
        # otherwise go on into the forward's gathers), and one host read per step, not one per param
        kept = torch.stack(list(norms)).sum()
        dist.all_reduce(kept, op=dist.ReduceOp.MAX, group=self.fsdp.dist_index.get_dp_group())
        if float(kept) > 0:
            first = next((n for (n, _), norm in zip(named, norms, strict=True) if float(norm) > 0), "?")
            raise RuntimeError(
                "fully_shard: a forward after optimizer.step() found grads still set (first "
                f"{first.removeprefix('module.')!r} here, or on another rank): gradsync's grad buffers hold "
                "one accumulation cycle, so grads cannot carry over to the next step; call "
                "optimizer.zero_grad() after optimizer.step()"
            )


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


def _state(module: nn.Module) -> _State:
    state = module.__dict__.get(STATE_ATTR)
    assert isinstance(state, _State), "a module fully_shard recorded"
    return state


def _is_root(state: _State) -> bool:
    return state.root is not None and state.unit_id is None


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` waits for its gathers."""

    def __init__(self, buckets: list[FlatParamBucket]) -> None:
        self._buckets = buckets

    def wait(self) -> None:
        for bucket in self._buckets:
            bucket.wait_gather()
        self._buckets = []


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns: ``wait()`` ends the cycle (the reductions were
    launched during the backwards) and hands the grads over."""

    def __init__(self, finish: Callable[[], None] | None) -> None:
        self._finish = finish

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def _not_supported(name: str, advice: str) -> Callable[..., NoReturn]:
    """An FSDPModule method gradsync has no counterpart for: it raises, saying what to do instead."""

    def method(self: nn.Module, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__}.{name}() is not supported by gradsync: {advice}")

    method.__name__ = name
    return method


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

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Any:
        """torch's meta-device flow: build under ``torch.device("meta")``, ``fully_shard``, ``to_empty()``,
        then the model's own init on the DTensor params. The params already have storage in gradsync's
        shards on the mesh's device, so they are left as they are (their values are garbage until the init
        writes them, as torch's); buffers and ``ignored_params`` get new uninitialised storage on
        ``device``. The next forward installs whatever the params hold then."""
        root = self._fsdp2_root()
        fsdp = root.fsdp
        target = torch.device(device) if device is not None else fsdp.device
        if target.type != fsdp.device.type:
            raise NotImplementedError(
                f"{type(self).__name__}.to_empty(device={str(target)!r}): gradsync keeps the params on the "
                f"mesh's device ({fsdp.device}) and offloads nothing; pass device={fsdp.device.type!r}"
            )
        with torch.no_grad():
            for owner in self.modules() if recurse else [self]:
                for leaf, buffer in owner._buffers.items():
                    if buffer is not None:
                        owner._buffers[leaf] = torch.empty_like(buffer, device=target)
                for leaf, param in owner._parameters.items():
                    if param is not None and param in root.ignored:
                        empty = torch.empty_like(param, device=target)
                        owner._parameters[leaf] = nn.Parameter(empty, param.requires_grad)
        fsdp.steps.weights_uninstalled = True
        return self

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

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root: True makes no backward end the accumulation cycle (it supersedes
        ``set_is_last_backward``); call :meth:`finalize_backward` after the step's last backward, before
        reading or clearing grads."""
        root = self._root_only("set_manual_backward_finalization")
        root.manual_finalization = bool(enabled)
        root.apply_flags()

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the cycle now, under the current gradient-sync setting: reduce what the backwards left
        pending and hand the DTensors their grads (MegatronFSDP's ``finish_grad_sync()``). Nothing to do
        before any backward, after one already finalized, or with gradient sync off (the cycle goes on).
        ``async_op``: a handle whose ``wait()`` does it."""
        root = self._root_only("finalize_backward")
        fsdp = root.fsdp
        finish = fsdp.finish_grad_sync if root.requires_gradient_sync and fsdp.grads_pending else None
        if async_op:
            return GradientReductionHandle(finish)
        if finish is not None:
            finish()
        return None

    def _root_only(self, method: str) -> _Root:
        root = self._fsdp2_root()
        if _state(self).unit_id is not None:
            raise ValueError(
                f"{type(self).__name__}.{method}: call it on the root FSDP module, which ends the cycle "
                "for all its units"
            )
        return root

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's own grads (not its submodules', as torch's) become the data-parallel ranks' sum
        divided by ``factor`` instead of their mean: 1.0 sums them, as torchtitan sets on every module
        when it scales the loss by the global token count. The grads are multiplied by ``1 / factor``
        before the collective, which sums (torch's PreMulSum; gloo's too, which has no average), and an
        HSDP outer stage sums as well."""
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor):
            raise ValueError(
                f"{type(self).__name__}.set_gradient_divide_factor: factor must be a finite number"
            )
        if factor <= 0:
            raise ValueError(
                f"{type(self).__name__}.set_gradient_divide_factor({factor}): the factor divides the ranks' "
                "summed grads and must be positive"
            )
        _, buckets = self._own_buckets()
        for bucket in buckets:
            bucket.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted either way: gradsync's grad collectives already sum, with the scaling applied before
        them, so no reduction needs an averaging or pre-multiplying collective (what torch's flag avoids)."""
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

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Right after this unit's gather in forward, start gathering these units' weights (in list
        order), in place of the budgeted prefetch there (``suggested_AG_prefetch_size``)."""
        self._choose_prefetch("set_modules_to_forward_prefetch", modules, 1)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Right after this unit's gather for its backward (ZeRO-3), start gathering these units'."""
        self._choose_prefetch("set_modules_to_backward_prefetch", modules, -1)

    def _choose_prefetch(self, method: str, modules: list[FSDPModule], direction: int) -> None:
        root, unit_id = self._fsdp2_root(), _state(self).unit_id
        if unit_id is None:
            raise NotImplementedError(
                f"{type(self).__name__}.{method} on the root: its forward starts with the first units' "
                "budgeted prefetch (megatron_fsdp_of(model).suggested_AG_prefetch_size); call it on units"
            )
        chosen = []
        for module in modules:
            if not isinstance(module, FSDPModule) or module._fsdp2_root() is not root:
                raise ValueError(
                    f"{type(self).__name__}.{method}: {type(module).__name__} is not a module passed to "
                    "fully_shard under this one's root"
                )
            other = _state(module).unit_id
            if other is None:
                raise ValueError(
                    f"{type(self).__name__}.{method}: {type(module).__name__} is the root, whose own params "
                    "are gathered at the start of forward and backward; list units only"
                )
            chosen.append(other)
        root.fsdp.chosen_prefetch[(unit_id, direction)] = chosen

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward needs none of its weights (an embedding's), so a ZeRO-3 unit is
        not gathered for it, nor prefetched."""
        if not isinstance(unshard_in_backward, bool):
            raise ValueError(f"unshard_in_backward must be a bool, not {unshard_in_backward!r}")
        fsdp, unit_id = self._fsdp2_root().fsdp, _state(self).unit_id
        if unit_id is None:
            raise NotImplementedError(
                f"{type(self).__name__}.set_unshard_in_backward on the root: its own params are gathered "
                "together at the backward's start; pass the module to fully_shard as a unit of its own"
            )
        if unshard_in_backward:
            fsdp.units_not_gathered_in_backward.discard(unit_id)
        else:
            fsdp.units_not_gathered_in_backward.add(unit_id)

    def set_post_optim_event(self, event: Any) -> None:
        """The next forward's gathers wait for ``event`` (recorded after the optimizer step) instead of
        all work queued before it: the current stream, on which gradsync issues them, waits for it once."""
        if not callable(getattr(event, "wait", None)):
            raise TypeError(f"set_post_optim_event: event must be a torch.Event, not {type(event).__name__}")
        self._fsdp2_root().post_optim_event = event

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on this rank's reduced grad shard of this module's own params after
        each reduce-scatter, before the shard accumulates into the DTensors' grads, as torch's does:
        torchft's FSDP2 integration averages it across replica groups there, in place. gradsync calls
        it once per bucket of the module (a module's params may fill several; an all-reduce is the same
        split or whole). Not under an HSDP mesh, whose outer all-reduce gradsync runs itself, and on the
        current stream only."""
        name = f"{type(self).__name__}.set_all_reduce_hook"
        if not callable(hook):
            raise TypeError(f"{name}: hook must be callable, got {type(hook).__name__}")
        if stream is not None:
            raise NotImplementedError(
                f"{name}(stream=...): gradsync runs the hook on the stream its reduction waits on; leave "
                "stream unset"
            )
        fsdp, buckets = self._own_buckets()
        if fsdp.outer is not None:
            raise NotImplementedError(
                f"{name}: under an HSDP mesh gradsync runs the outer all-reduce itself "
                "(outer_dp_sharding_strategy); shard over a 1-D mesh to all-reduce across groups in the hook"
            )
        for bucket in buckets:
            bucket.all_reduce_hook = hook

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
    set_keep_unsharded_storage = _not_supported(
        "set_keep_unsharded_storage",
        "a released unit's gather buffer goes back to its allocator; for buffers that keep their storage "
        "(CUDA graphs) build MegatronFSDP with fsdp_double_buffer=True",
    )
    reset_iter_state = _not_supported(
        "reset_iter_state", "after a failed forward or backward, rebuild the model and optimizer"
    )


_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


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
    module.__dict__[STATE_ATTR] = _State(call)
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
        fsdp = _megatron_fsdp(module, call, list(units), ignored, _unit_call, FSDPModule)
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
    module.register_forward_pre_hook(outside_compile(root.start_cycle_after_step), prepend=True)  # first
    module.register_state_dict_post_hook(_picklable_dtensors)  # type: ignore[no-untyped-call]


def _unit_call(unit: nn.Module) -> _Call:
    return _state(unit).call


def _picklable_dtensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
    """The state dict's DTensors as ``torch.save`` can pickle them (:func:`detach_for_saving`); params
    (``keep_vars=True``) stay as they are."""
    for key, value in state_dict.items():
        if isinstance(value, DTensor) and not isinstance(value, nn.Parameter):
            state_dict[key] = detach_for_saving(value)
