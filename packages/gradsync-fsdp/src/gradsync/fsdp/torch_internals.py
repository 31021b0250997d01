"""Every private torch name gradsync-fsdp uses, and the probes for the torch features it depends on.

Nothing else in the package imports a private torch module; each name says the oldest torch it was checked
on (the compat sessions run 2.6, 2.11, 2.13 and 2.15). Features are detected, not read off the version
number: a torch that has them takes the native path, one that lacks them the fallback, or a refusal naming
what is missing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol  # checked on 2.6 (all_gather_tensor)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # checked on 2.6
from torch.distributed.tensor._ops._pointwise_ops import pointwise_ops  # checked on 2.6
from torch.distributed.tensor.placement_types import _StridedShard  # checked on 2.6
from torch.utils import _pytree as pytree  # checked on 2.6

from gradsync.groups.torch_internals import flatten_mesh

try:  # a spec's shard order: checked on 2.11; 2.6 has none
    from torch.distributed.tensor._dtensor_spec import ShardOrder, ShardOrderEntry

    HAS_SHARD_ORDER = hasattr(DTensorSpec, "compute_default_shard_order")
except ImportError:  # pragma: no cover - depends on the installed torch
    HAS_SHARD_ORDER = False

# The functional gathers and reduce-scatters under their current names (``*_single``, checked on 2.13); a
# torch without them (2.6) has only the ``*_tensor`` names, which newer ones keep as aliases that warn at
# every call.
all_gather_single: Any = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
reduce_scatter_single: Any = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)

__all__ = [
    "HAS_SHARD_ORDER",
    "SUBCLASS_DISPATCH",
    "DTensorSpec",
    "ShardOrder",
    "ShardOrderEntry",
    "TensorMeta",
    "_StridedShard",
    "all_gather_single",
    "detach_for_saving",
    "flatten_mesh",
    "funcol",
    "pytree",
    "redistributes_inputs",
    "reduce_scatter_single",
    "require_shard_order",
    "spec_shard_order",
    "version_counter",
]


def _subclass_dispatch() -> bool:
    """Whether ops on a DTensor subclass reach its own ``__torch_dispatch__``. torch 2.11 runs every DTensor
    op, subclasses' included, in a C++ fast path, and its ``DTensor.__torch_dispatch__`` is a stub that
    refuses to be called; 2.6 dispatches in Python, 2.13 and later let a subclass delegate to it."""
    try:
        DTensor.__torch_dispatch__(torch.ops.aten.alias.default, (), (torch.zeros(0),), {})  # type: ignore[no-untyped-call]
    except NotImplementedError:
        return False
    except Exception:
        return True
    return True


SUBCLASS_DISPATCH = _subclass_dispatch()
"""False where an op's output on a :class:`~gradsync.fsdp.ragged.RaggedDTensor` is a plain DTensor (torch
2.11): ``zeros_like``, arithmetic and torch's own optimizer state then lose the ragged split."""


def spec_shard_order(spec: DTensorSpec) -> tuple[Any, ...] | None:
    """The spec's shard order, or None on a torch whose specs have none (every mesh dim cuts left to
    right there)."""
    return spec.shard_order if HAS_SHARD_ORDER else None


def require_shard_order(what: str) -> None:
    """Refuse ``what`` (before any collective) on a torch whose DTensor specs carry no shard order."""
    if not HAS_SHARD_ORDER:
        raise NotImplementedError(
            f"{what} needs a DTensor shard order (torch.distributed.tensor._dtensor_spec.ShardOrder, checked "
            f"on torch 2.11, 2.13 and 2.15); this is torch {torch.__version__}. Mesh dims cut left to right "
            "here: use gradsync.fsdp.uneven_dtensor (uneven_dtensor_to_full_tensor, ...) for such shards"
        )


def detach_for_saving(dtensor: torch.Tensor) -> torch.Tensor:
    """``dtensor.detach()`` with a wrapper that claims storage offset 0, so that ``torch.save`` pickles it
    as the DTensor it is. torch tells a wrapper subclass from a real tensor by its data pointer, and the
    DTensor constructor of torch 2.11 and later gives the wrapper its local tensor's storage offset: a
    DTensor over a view that starts inside its storage (every param view into gradsync's flat buffers)
    then fails to pickle ("invalid python storage"). The local tensor, spec and a subclass's attributes
    are the same objects (checked on torch 2.6, 2.11, 2.13 and 2.15)."""
    detached: Any = dtensor.detach()
    local = detached._local_tensor
    if local.storage_offset() == 0:
        return detached  # type: ignore[no-any-return]
    wrapper: Any = torch.Tensor._make_wrapper_subclass(
        type(detached),
        detached.shape,
        strides=detached.stride(),
        storage_offset=0,
        dtype=detached.dtype,
        device=detached.device,
        layout=detached.layout,
        requires_grad=False,
    )
    wrapper._spec, wrapper._local_tensor = detached._spec, local
    wrapper.__dict__.update(detached.__dict__)
    return wrapper  # type: ignore[no-any-return]


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter, which every in-place torch op on it or on a view of it moves (checked
    on 2.6); collectives do not move it."""
    return int(tensor._version)


_POINTWISE = frozenset(pointwise_ops)


def redistributes_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether torch's DTensor dispatch of ``func`` on these DTensor ``args`` moves an input to other
    placements before running it locally (its sharding propagation, cached per schema; checked on 2.6,
    2.13 and 2.15). Pointwise and foreach ops never do on inputs placed alike, and are not asked."""
    if func in _POINTWISE or func.__name__.startswith("_foreach_"):
        return False
    dispatcher: Any = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(func, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    return sharding is not None and bool(sharding.needs_redistribute)
