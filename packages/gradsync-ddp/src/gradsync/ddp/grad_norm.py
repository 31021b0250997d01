"""The global grad norm and the clip coefficient, computed in Megatron-Core's order.

Megatron (``megatron/core/optimizer/clip_grads.py``, without Transformer Engine's tensor-scale kernel):
each rank takes the 2-norm of its grads in fp32 (the norm of the per-tensor norms) and squares it, or sums
``norm(grad, p) ** p`` per grad for another p; the sum over ranks is one fp32 all-reduce; the host reads it
back and takes the root in Python double; the clip coefficient ``max_norm / (norm + 1e-6)`` is a Python
double too, applied (as an fp32 multiply) only when it is below 1. Taking the root in fp32 instead gives
a coefficient about 1e-7 apart, so clipped runs would drift from Megatron's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm


def local_norm_power(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the norm as a 0-dim fp32 tensor: ``norm ** p`` (the max for p = inf)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    if not grads:
        return total
    if norm_type == math.inf:
        return get_total_norm(grads, norm_type).to(device=device, dtype=torch.float32)
    if norm_type == 2.0:
        return get_total_norm(grads, 2.0).to(device=device, dtype=torch.float32) ** 2.0
    for grad in grads:
        total += torch.linalg.vector_norm(grad, norm_type).to(device=device, dtype=torch.float32) ** norm_type
    return total


def global_grad_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> float:
    """The norm over every rank's ``grads`` in ``group``: one all-reduce, one read-back, the root in
    Python double."""
    norm_type = float(norm_type)
    local = local_norm_power(grads, norm_type, device)
    if norm_type == math.inf:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return float(local.item())
    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return float(float(local.item()) ** (1.0 / norm_type))  # float() only narrows the type


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """Megatron's clip coefficient, in Python double; grads are scaled only when it is below 1."""
    return max_norm / (total_norm + 1.0e-6)
