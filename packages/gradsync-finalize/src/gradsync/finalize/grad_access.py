"""Reading and writing a param's gradient the way every wrapper stores it.

DDP-style wrappers keep the grad in ``main_grad`` (used when the attribute exists, even if None); others
use ``.grad``. FSDP grads are DTensor shards (MegatronFSDP's uneven dim-0 shards among them, which no
DTensor redistribution reads correctly): their local shard is reduced in place. That is right for the
groups finalize reduces over TP-duplicated params with, whose ranks hold the same modules and therefore
the same shard layout; the pipeline embedding reduction, whose two stages hold different models, refuses
sharded grads instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gradsync.groups import get_backend_capabilities


def grad_attribute(param: torch.Tensor) -> str:
    return "main_grad" if hasattr(param, "main_grad") else "grad"


def read_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``param`` (its local shard for a DTensor), or None."""
    grad = getattr(param, grad_attribute(param))
    if isinstance(grad, DTensor):
        return grad.to_local()
    return grad  # type: ignore[no-any-return]


def write_grad(param: torch.Tensor, full: torch.Tensor) -> None:
    """Store a reduced gradient back in place (into the local shard of a DTensor).

    A wrapper whose ``main_grad`` cannot be the optimizer-facing grad (bf16 params with fp32 main grads)
    keeps ``.grad`` as a copy in the param dtype: that copy is refreshed too, so an optimizer stepping on
    ``.grad`` after finalize sees the finished gradient.
    """
    attribute = grad_attribute(param)
    original = getattr(param, attribute)
    if isinstance(original, DTensor):
        original = original.to_local()
    if original.data_ptr() != full.data_ptr():
        original.copy_(full)
    copy = param.grad if attribute == "main_grad" else None
    if copy is not None and not isinstance(copy, DTensor) and copy.data_ptr() != original.data_ptr():
        copy.copy_(full)


def all_reduce_grads(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup, *, average: bool = False
) -> None:
    """Sum (or average) the grads of ``params`` over ``group``, one flat collective per dtype."""
    grads = [(p, read_grad(p)) for p in params]
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for param, grad in grads:
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append((param, grad))
    for pairs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for _, g in pairs])
        trusted_avg = get_backend_capabilities(group, flat.device).avg_trusted
        op = dist.ReduceOp.AVG if average and trusted_avg else dist.ReduceOp.SUM
        dist.all_reduce(flat, op=op, group=group)
        if average and not trusted_avg:
            flat.div_(group.size())
        pieces = torch.split(flat, [g.numel() for _, g in pairs])
        for (param, grad), reduced in zip(pairs, pieces, strict=True):
            write_grad(param, reduced.view_as(grad))
