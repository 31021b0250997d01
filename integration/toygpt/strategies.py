"""The training strategies, by name: one entry each.

A strategy names the wrapper that implements it and the config options it sets: gradsync-ddp's
DistributedDataParallel (with or without its DistributedOptimizer) or gradsync-fsdp's MegatronFSDP with one
of its four sharding strategies, each transformer block an FSDP unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.fsdp import FSDPDistributedIndex, MegatronFSDP, MixedPrecisionPolicy, fully_shard_optimizer
from gradsync.groups import ProcessGroupCollection

from .model import Block

OptimizerFactory = Callable[[Iterable[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
GradComm = Mapping[str, Any]
"""DistributedDataParallelConfig's ``grad_comm_*`` fields, by name."""
"""Builds the optimizer from the wrapped model's named params (names let Muon split off embeddings)."""


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
        *(
            Strategy(f"fsdp-{name}", summary, "fsdp", {"data_parallel_sharding_strategy": name})
            for name, summary in (
                ("no_shard", "MegatronFSDP, nothing sharded: all-reduce once per step"),
                ("optim", "MegatronFSDP ZeRO-1: optimizer state sharded, grads reduce-scattered per step"),
                ("optim_grads", "MegatronFSDP ZeRO-2: grads reduce-scattered after every backward too"),
                ("optim_grads_params", "MegatronFSDP ZeRO-3: weights gathered per block and released"),
            )
        ),
        Strategy(
            "fsdp-optim_grads_params+double-buffer",
            "MegatronFSDP ZeRO-3 with two persistent block-sized buffers per kind, lent block to block",
            "fsdp",
            {"data_parallel_sharding_strategy": "optim_grads_params", "fsdp_double_buffer": True},
        ),
    )
}


def supports(name: str, layout: Mapping[str, Any]) -> bool:
    """Whether strategy ``name`` can run a layout's options: MegatronFSDP has no pipeline parallelism (as
    in the reference) and no expert sharding yet."""
    if STRATEGIES[name].wrapper != "fsdp":
        return True
    return int(layout.get("pp", 1)) == 1 and not layout.get("moe", False)


@dataclass
class Wrapped:
    """A wrapped model chunk and the optimizer that steps it."""

    model: Any
    optimizer: Any
    sharded_optimizer: bool
    checkpoint_format = "per-rank"  # one torch.save file per rank; resumes under the same layout only

    def settle_params(self) -> None:
        """Finish any param all-gather still deferred to the next forward, so the params are current."""
        if getattr(self.model.ddp_config, "overlap_param_gather", False):
            self.model.disable_forward_pre_hook(param_sync=True)
            self.model.enable_forward_pre_hook()

    def current_params(self) -> dict[str, torch.Tensor] | None:
        """The stage's params by name where the module does not hold them whole; None: read the module
        (after settling any deferred gather)."""
        self.settle_params()
        return None

    def comm_bytes(self) -> int:
        """Payload this rank handed to grad/param collectives since the last zero_grad_buffer."""
        return sum(group.stats.total_bytes for group in self.model.grad_buffers.all_bucket_groups)


class FSDPWrapped(Wrapped):
    checkpoint_format = "dcp"  # torch.distributed.checkpoint: resumes at another data-parallel size too

    def current_params(self) -> dict[str, torch.Tensor] | None:
        """Every weight whole, exported one bucket at a time (double buffers hold at most two blocks)."""
        return self.model.full_state_dict(rank0_only=False)  # type: ignore[no-any-return]

    def comm_bytes(self) -> int:
        return int(self.model.communicated_bytes())


@dataclass(frozen=True)
class Hybrid:
    """Hybrid sharding for the fsdp strategies: ``outer`` replicas of the shard group, which replicate
    (``no_shard``) or also shard (``optim``) the optimizer state."""

    outer: int = 1
    outer_strategy: str = "no_shard"

    def index(self, groups: ProcessGroupCollection) -> FSDPDistributedIndex:
        """The shard (and outer) mesh over the data-parallel group."""
        assert groups.dp_cp is not None
        if self.outer == 1:  # param gathers on dp_cp_ag when the collection has it (the gather lane)
            return FSDPDistributedIndex.from_group(groups.dp_cp, all_gather_group=groups.dp_cp_ag)
        dp, tp = groups.dp_cp.size(), groups.tp.size() if groups.tp is not None else 1
        if dp % self.outer:
            raise ValueError(f"--hsdp {self.outer} must divide the data-parallel size {dp}")
        index = FSDPDistributedIndex.from_sizes(
            dp // self.outer, self.outer, tp, hsdp_outer_dp_shard=self.outer_strategy == "optim"
        )
        hybrid = dist.get_process_group_ranks(index.get_dp_group())
        if hybrid != dist.get_process_group_ranks(groups.dp_cp):
            raise ValueError(
                f"--hsdp {self.outer}: the (outer, shard, tp) mesh's data-parallel ranks {hybrid} are not "
                "this layout's data-parallel group; hybrid sharding needs --pp 1 and no context parallelism"
            )
        return index


def _wrap_ddp(
    strategy: Strategy,
    stage: nn.Module,
    groups: ProcessGroupCollection,
    make_optimizer: OptimizerFactory,
    bucket_size: int | None,
    bf16: bool,
    hsdp: Hybrid,
    shard_alignment: ShardAlignmentSpec,
    grad_comm: GradComm,
) -> Wrapped:
    """bf16 weights get Megatron's mixed-precision recipe: grads reduced in fp32, fp32 main params."""
    if hsdp.outer > 1:
        raise ValueError(f"{strategy.name}: --hsdp applies to the fsdp-* strategies only")
    ddp_config = DistributedDataParallelConfig(
        bucket_size=bucket_size, grad_reduce_in_fp32=bf16, **strategy.options, **grad_comm
    )
    model = DistributedDataParallel(
        stage.config,  # type: ignore[arg-type]
        ddp_config,
        stage,
        pg_collection=groups,
        shard_alignment=shard_alignment,
    )
    optimizer = make_optimizer(model.named_parameters())
    sharded = ddp_config.use_distributed_optimizer
    if sharded or bf16:
        return Wrapped(model, DistributedOptimizer(optimizer, model), sharded_optimizer=sharded)
    return Wrapped(model, optimizer, sharded_optimizer=False)


def _wrap_fsdp(
    strategy: Strategy,
    stage: nn.Module,
    groups: ProcessGroupCollection,
    make_optimizer: OptimizerFactory,
    bucket_size: int | None,
    bf16: bool,
    hsdp: Hybrid,
    shard_alignment: ShardAlignmentSpec,
    grad_comm: GradComm,
) -> Wrapped:
    """Each block an FSDP unit, sharded over the data-parallel group (or ``hsdp``'s shard group); bf16
    weights get fp32 main weights and fp32 main grads, as the DDP strategies' recipe. The optimizer's step
    installs the weights."""
    if groups.pp is not None and groups.pp.size() > 1:
        raise ValueError(f"{strategy.name}: MegatronFSDP does not support pipeline parallelism; use --pp 1")
    if any(getattr(p, "allreduce", True) is False for p in stage.parameters()):
        raise ValueError(f"{strategy.name}: MegatronFSDP does not shard expert params yet; drop --moe")
    assert groups.dp_cp is not None
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        bucket_size=bucket_size,
        outer_dp_sharding_strategy=hsdp.outer_strategy if hsdp.outer > 1 else "no_shard",
        **strategy.options,
        **grad_comm,
    )
    policy = MixedPrecisionPolicy(torch.float32, torch.float32 if bf16 else None)
    model = MegatronFSDP(
        stage,
        hsdp.index(groups),
        config,
        fsdp_unit_modules=[Block],
        mixed_precision_policy=policy,
        shard_alignment=shard_alignment,
    )
    optimizer = fully_shard_optimizer(make_optimizer(model.named_parameters()))
    return FSDPWrapped(
        model, optimizer, sharded_optimizer=strategy.options["data_parallel_sharding_strategy"] != "no_shard"
    )


WRAPPERS = {"ddp": _wrap_ddp, "fsdp": _wrap_fsdp}


def wrap(
    name: str,
    stage: nn.Module,
    groups: ProcessGroupCollection,
    make_optimizer: OptimizerFactory,
    bucket_size: int | None = None,
    *,
    bf16: bool = False,
    hsdp: Hybrid = Hybrid(),
    shard_alignment: ShardAlignmentSpec = None,
    grad_comm: GradComm | None = None,
) -> Wrapped:
    """``shard_alignment``: where the sharded strategies may cut each param (whole matrices for Muon);
    ``grad_comm``: the config's ``grad_comm_*`` fields (a low-precision grad wire)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    strategy = STRATEGIES[name]
    wrapper = WRAPPERS[strategy.wrapper]
    return wrapper(
        strategy, stage, groups, make_optimizer, bucket_size, bf16, hsdp, shard_alignment, grad_comm or {}
    )
