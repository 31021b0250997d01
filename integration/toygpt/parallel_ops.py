"""Differentiable collectives for the toy tensor, sequence and expert parallelism.

Each op is a pair (what the forward does, what the backward does to the incoming grad) over one process
group; a group of one rank makes every op the identity, so the same model code runs on a single process.
The pairs are Megatron's: a copy into the tensor-parallel region all-reduces its grad, an all-gather along
the sequence reduce-scatters its grad, and so on.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from gradsync.buffers import collectives

Op = Literal["identity", "all_reduce", "all_gather", "reduce_scatter", "split"]


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else group.rank()


def _run(op: Op, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if op == "identity" or size == 1:
        return x
    if op == "all_reduce":
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out
    if op == "split":
        return x.chunk(size, dim=dim)[group_rank(group)].contiguous()
    front = x.movedim(dim, 0).contiguous()  # the tensor collectives work along dim 0
    if op == "all_gather":
        out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
        collectives.dist_all_gather_func(out, front, group=group)
    else:
        if front.shape[0] % size:
            raise ValueError(
                f"reduce_scatter along dim {dim}: size {front.shape[0]} is not divisible by {size}"
            )
        out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
        collectives.dist_reduce_scatter_func(out, front, group=group)
    return out.movedim(0, dim)


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int, fwd: Op, bwd: Op
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return _run(fwd, x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _run(ctx.bwd, grad, ctx.dim, ctx.group), None, None, None, None


def collective(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int, fwd: Op, bwd: Op) -> torch.Tensor:
    """``fwd`` on the way in, ``bwd`` on the grad on the way back."""
    if group_size(group) == 1:
        return x
    out: torch.Tensor = _Collective.apply(x, group, dim, fwd, bwd)  # type: ignore[no-untyped-call]
    return out


def gather_without_grad(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along dim 0 of a tensor that carries no grad (the experts' routing choices)."""
    return _run("all_gather", x, 0, group)
