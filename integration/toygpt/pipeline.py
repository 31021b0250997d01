"""A GPipe schedule over send/recv: all forwards, then all backwards, microbatch by microbatch.

Grad reduction must start only in the last microbatch's backward, so the earlier ones run under the
wrapper's ``no_sync()``. The loss of each microbatch is divided by their number, so the grads are those of
the mean loss over this rank's share of the global batch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import telemetry

from .model import GPTStage, next_token_loss
from .parallel_ops import group_size


def _peer(group: dist.ProcessGroup, offset: int) -> int:
    return dist.get_global_rank(group, group.rank() + offset)


def forward_backward(
    model: nn.Module,
    stage: GPTStage,
    microbatches: list[torch.Tensor],
    pp_group: dist.ProcessGroup | None,
    *,
    forward_only: bool = False,
) -> torch.Tensor:
    """Run the microbatches (windows of seq_len + 1 tokens) through this stage; returns the mean loss on
    the last stage (zero elsewhere). ``stage`` is the unwrapped module, ``model`` what to call."""
    count = len(microbatches)
    device = microbatches[0].device
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    loss = torch.zeros((), device=device)
    with torch.set_grad_enabled(not forward_only), telemetry.phase("forward"):
        for tokens in microbatches:
            if stage.pre_process:
                x = tokens[:, :-1]
            else:
                assert pp_group is not None
                dtype = next(stage.parameters()).dtype  # activations travel in the weights' dtype
                x = torch.empty(stage.activation_shape(tokens.shape[0]), device=device, dtype=dtype)
                dist.recv(x, _peer(pp_group, -1))
                x.requires_grad_(not forward_only)
            y = model(x)
            if stage.post_process:
                y = next_token_loss(y, tokens) / count
                loss = loss + y.detach()
            else:
                assert pp_group is not None
                dist.send(y.detach().contiguous(), _peer(pp_group, 1))
            inputs.append(x)
            outputs.append(y)
    if forward_only:
        return loss
    with telemetry.phase("backward"):
        _backward(model, stage, inputs, outputs, pp_group)
    return loss


def _backward(
    model: nn.Module,
    stage: GPTStage,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    pp_group: dist.ProcessGroup | None,
) -> None:
    count = len(outputs)
    for index, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
        sync: AbstractContextManager[Any] = model.no_sync() if index < count - 1 else nullcontext()  # type: ignore[operator]
        with sync:
            if stage.post_process:
                y.backward()  # type: ignore[no-untyped-call]
            else:
                assert pp_group is not None
                grad = torch.empty_like(y)
                dist.recv(grad, _peer(pp_group, 1))
                y.backward(grad)  # type: ignore[no-untyped-call]
        if not stage.pre_process:
            assert pp_group is not None
            assert x.grad is not None
            dist.send(x.grad.contiguous(), _peer(pp_group, -1))


def global_loss(
    loss: torch.Tensor, dp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None
) -> float:
    """Mean over data-parallel replicas of the last stage's loss, known to every rank."""
    loss = loss.detach().clone()
    if group_size(dp_group) > 1:
        dist.all_reduce(loss, group=dp_group)  # SUM: gloo has no AVG
        loss /= group_size(dp_group)
    if group_size(pp_group) > 1:
        dist.broadcast(loss, group=pp_group, group_src=group_size(pp_group) - 1)
    return float(loss)
