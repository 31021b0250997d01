"""The training strategies, by name: one entry each.

A strategy names the wrapper that implements it and the config options it sets. gradsync-ddp's wrapper
is registered here; gradsync-fsdp's strategies (no_shard, optim, optim_grads, optim_grads_params, hsdp)
will each be one more entry once its wrapper is registered in ``WRAPPERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ProcessGroupCollection

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str
    wrapper: str
    options: Mapping[str, Any] = field(default_factory=dict)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("ddp", "bucketed all-reduce once backward is done", "ddp"),
        Strategy(
            "ddp+overlap",
            "bucketed all-reduce overlapped with backward",
            "ddp",
            {"overlap_grad_reduce": True},
        ),
        Strategy(
            "ddp+distopt",
            "reduce-scatter, sharded optimizer step, param all-gather (ZeRO-1/2)",
            "ddp",
            {"use_distributed_optimizer": True},
        ),
        Strategy(
            "ddp+distopt+overlap-param-gather",
            "reduce-scatter overlapped with backward, param all-gather overlapped with the next forward",
            "ddp",
            {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True},
        ),
    )
}


@dataclass
class Wrapped:
    """A wrapped model chunk and the optimizer that steps it."""

    model: Any
    optimizer: Any
    sharded_optimizer: bool

    def settle_params(self) -> None:
        """Finish any param all-gather still deferred to the next forward, so the params are current."""
        if getattr(self.model.ddp_config, "overlap_param_gather", False):
            self.model.disable_forward_pre_hook(param_sync=True)
            self.model.enable_forward_pre_hook()

    def comm_bytes(self) -> int:
        """Payload this rank handed to grad/param collectives since the last zero_grad_buffer."""
        return sum(group.stats.total_bytes for group in self.model.grad_buffers.all_bucket_groups)


def _wrap_ddp(
    strategy: Strategy,
    stage: nn.Module,
    groups: ProcessGroupCollection,
    make_optimizer: OptimizerFactory,
    bucket_size: int | None,
    bf16: bool,
) -> Wrapped:
    """bf16 weights get Megatron's mixed-precision recipe: grads reduced in fp32, fp32 main params."""
    ddp_config = DistributedDataParallelConfig(
        bucket_size=bucket_size, grad_reduce_in_fp32=bf16, **strategy.options
    )
    model = DistributedDataParallel(stage.config, ddp_config, stage, pg_collection=groups)  # type: ignore[arg-type]
    optimizer = make_optimizer(model.parameters())
    sharded = ddp_config.use_distributed_optimizer
    if sharded or bf16:
        return Wrapped(model, DistributedOptimizer(optimizer, model), sharded_optimizer=sharded)
    return Wrapped(model, optimizer, sharded_optimizer=False)


WRAPPERS = {"ddp": _wrap_ddp}


def wrap(
    name: str,
    stage: nn.Module,
    groups: ProcessGroupCollection,
    make_optimizer: OptimizerFactory,
    bucket_size: int | None = None,
    *,
    bf16: bool = False,
) -> Wrapped:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    strategy = STRATEGIES[name]
    return WRAPPERS[strategy.wrapper](strategy, stage, groups, make_optimizer, bucket_size, bf16)
