"""A tiny transformer (tied embedding, two Block units) and the training loops the FSDP tests share.
Spawned ranks import this module, so everything stays at module level. Models and batches are drawn on
the CPU, then moved to the harness device, so every rank and the reference start from the same values."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, MixedPrecisionPolicy, fully_shard
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import test_device
from gradsync.groups.testing.devices import backend_for, requested_device

VOCAB, DIM, SEQ, MICRO_ROWS, LAYERS = 24, 12, 6, 2, 2
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class Block(nn.Module):
    """One FSDP unit: layernorm, a two-layer MLP with odd widths (uneven shards), a gated residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM + 1)
        self.down = nn.Linear(3 * DIM + 1, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, seed: int = 0, checkpoint: str | None = None, layers: int = LAYERS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embedding.weight  # tied
        self.checkpoint = checkpoint
        if not self.embedding.weight.is_meta:  # built under torch.device("meta"): MegatronFSDP places it
            self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            if self.checkpoint is not None:  # "reentrant" or "non_reentrant" activation checkpointing
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_batch(step: int, world: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (world * micro * MICRO_ROWS, SEQ), generator=generator)
    return tokens.to(test_device())


def local_microbatches(step: int, rank: int, world: int, micro: int) -> list[torch.Tensor]:
    rows = global_batch(step, world, micro)[rank * micro * MICRO_ROWS : (rank + 1) * micro * MICRO_ROWS]
    return list(rows.split(MICRO_ROWS))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def reference_training(
    world: int,
    micro: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
    init_device: str = "cpu",
    layers: int = LAYERS,
) -> dict[str, torch.Tensor]:
    """One process, the whole global batch every step. bf16: fp32 main weights stepped with fp32 grads,
    copied back to the bf16 compute weights, as MegatronFSDP's mixed-precision recipe does. ``init_device``:
    whose generator draws the initial weights (the model then moves to the test device)."""
    with torch.device(init_device):
        model = TinyTransformer(layers=layers).to(dtype)
    params = list(model.parameters())
    mains = [nn.Parameter(p.detach().float()) for p in params] if dtype != torch.float32 else params
    optimizer = make_optimizer(mains)
    for step in range(steps):
        optimizer.zero_grad()
        model.zero_grad()
        for batch in global_batch(step, world, micro).split(world * MICRO_ROWS):
            (model(batch) / micro).backward()
        for main, param in zip(mains, params, strict=True):
            if main is not param:
                assert param.grad is not None
                main.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for main, param in zip(mains, params, strict=True):
                if main is not param:
                    param.copy_(main)
    return named_weights(model)


@functools.lru_cache(maxsize=8)
def cached_reference(world: int, micro: int, steps: int) -> dict[str, torch.Tensor]:
    """:func:`reference_training` in fp32, computed once per test process for each shape: several tests of
    a file compare with the same one."""
    return reference_training(world, micro, steps)


def shard_index(outer: int = 1, outer_strategy: str = "no_shard") -> FSDPDistributedIndex:
    """The whole world as one shard group, or (``outer`` > 1) ``outer`` replicas of a shard group."""
    return FSDPDistributedIndex.from_sizes(
        dist.get_world_size() // outer,
        outer,
        hsdp_outer_dp_shard=outer_strategy == "optim",
        device_type=test_device().type,
    )


@dataclass
class MeshWrapped:
    """A TinyTransformer wrapped by Megatron-FSDP's ``fully_shard`` over a caller's mesh."""

    model: MegatronFSDP
    optimizer: torch.optim.Optimizer
    mesh: DeviceMesh
    hybrid: dist.ProcessGroup | None

    @classmethod
    def build(
        cls,
        sizes: tuple[int, int, int],
        strategy: int,
        outer_strategy: int | None,
        optimizer: Callable[[Any], torch.optim.Optimizer],
        **kwargs: Any,
    ) -> MeshWrapped:
        """Over an ``(outer, shard, tp)`` mesh of ``sizes``, HSDP when ``outer_strategy`` is given (the
        outer and shard dims flattened into the hybrid group), units at each Block; ``kwargs`` go to
        ``fully_shard``."""
        mesh = init_device_mesh(test_device().type, sizes, mesh_dim_names=("outer", "shard", "tp"))
        hybrid = mesh["outer", "shard"]._flatten("hsdp").get_group() if outer_strategy is not None else None
        module = TinyTransformer()
        model, stepper = fully_shard(
            module,
            optimizer(module.parameters()),
            device_mesh=mesh,
            dp_shard_dim="shard",
            dp_outer_dim="outer" if outer_strategy is not None else None,
            tp_dim="tp",
            hybrid_fsdp_group=hybrid,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            outer_dp_sharding_strategy=outer_strategy or 0,
            **kwargs,
        )
        return cls(model, stepper, mesh, hybrid)


def wrap(
    strategy: str,
    *,
    dtype: torch.dtype = torch.float32,
    checkpoint: str | None = None,
    units: bool = True,
    main_grads_dtype: torch.dtype | None = None,
    grad_comm_dtype: torch.dtype | None = None,
    wire: torch.dtype | None = None,
    seed: int = 0,
    layers: int = LAYERS,
    outer: int = 1,
    shard_alignment: Any = None,
    gather_lane: bool = True,
    init_sync: bool = True,
    **config: Any,
) -> MegatronFSDP:
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=config.pop("overlap_grad_reduce", True),
        overlap_param_gather=config.pop("overlap_param_gather", True),
        grad_comm_dtype=wire,
        **config,
    )
    model = TinyTransformer(seed, checkpoint=checkpoint, layers=layers).to(dtype)
    return MegatronFSDP(
        model,
        shard_index(outer, ddp_config.outer_dp_sharding_strategy),
        ddp_config,
        fsdp_unit_modules=[Block] if units else None,
        mixed_precision_policy=MixedPrecisionPolicy(torch.float32, main_grads_dtype, grad_comm_dtype),
        shard_alignment=shard_alignment,
        gather_lane=gather_lane,
        init_sync=init_sync,
    )


@dataclass
class Trainer:
    model: MegatronFSDP
    optimizer: torch.optim.Optimizer

    @classmethod
    def build(cls, strategy: str, **kwargs: Any) -> Trainer:
        model = wrap(strategy, **kwargs)
        return cls(model, make_optimizer(model.parameters()))

    def step(self, step: int, micro: int, accumulation: str = "no_sync") -> None:
        """One optimizer step over ``micro`` microbatches, all but the last under no_sync(); the last runs
        plainly (``no_sync``), inside sync() (``sync``), with auto-sync switched on (``auto``) or under
        no_sync() too (``deferred``: finish_grad_sync must reduce what the cycle left); or every forward
        first, then every backward (``forwards_first``); or with no no_sync() at all, every backward
        reducing, with auto-sync (``always_sync``) or without (``plain``)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = local_microbatches(step, rank, world, micro)
        if accumulation in ("always_sync", "plain"):  # no no_sync() at all, as torch DDP / FSDP2 users
            self.model.set_model_auto_sync(accumulation == "always_sync")  # write it: every backward
            for batch in batches:  # reduces, the reduced grads add up
                (self.model(batch) / micro).backward()
            self.model.set_model_auto_sync(False)
            self.model.finish_grad_sync()
            self.optimizer.step()
            self.model.install_optimized_model_weights()
            return
        if accumulation == "forwards_first":  # as a pipeline schedule's warm-up: every forward, then
            losses = [self.model(batch) / micro for batch in batches]  # every backward
            for loss in losses[:-1]:
                with self.model.no_sync():
                    loss.backward()
            losses[-1].backward()
            self.model.finish_grad_sync()
            self.optimizer.step()
            self.model.install_optimized_model_weights()
            return
        for batch in batches[:-1]:
            with self.model.no_sync():
                (self.model(batch) / micro).backward()
        last = batches[-1]
        if accumulation == "sync":
            with self.model.sync():
                (self.model(last) / micro).backward()
        elif accumulation == "auto":
            self.model.set_model_auto_sync(True)
            (self.model(last) / micro).backward()
            self.model.set_model_auto_sync(False)
        elif accumulation == "deferred":
            with self.model.no_sync():
                (self.model(last) / micro).backward()
        else:
            (self.model(last) / micro).backward()
        self.model.finish_grad_sync()
        self.optimizer.step()
        self.model.install_optimized_model_weights()


def full_weights(model: MegatronFSDP) -> dict[str, torch.Tensor]:
    """The compute weights as a forward would see them, gathered whole at once and read from the module
    (independent of ``full_state_dict``, which tests compare with it)."""
    model.all_gather_and_wait_parameters_ready(list(model.module.parameters()), prefetch=False)
    model._replace_param_with_raw_if_needed()  # the modules hold the optimizer's DTensors between steps
    weights = named_weights(model.module)
    model.synchronize_param_gather()
    return weights


# The parity bound the tests use (max_relative_difference <= 1e-6 in fp32) set from a measured spread: the
# reference below with only its summation order changed (each microbatch backpropagated in 2 or 4 pieces,
# on 1 or 2 threads) lands up to 1.6e-7 from itself after 20 steps (2-core AMD EPYC, torch 2.13,
# 2026-11-26): the bound leaves a margin of 6.
def max_relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    a = torch.cat([got[k].reshape(-1) for k in want])
    b = torch.cat([want[k].reshape(-1) for k in want])
    return float((a - b).abs().max() / b.abs().max().clamp_min(math.ulp(1.0)))


def skip_where_torch_gathers_crash(world: int) -> None:
    """Skip a test that runs torch's own DTensor all-gathers (``full_tensor``, ``redistribute`` to
    Replicate, DCP resharding) where torch's functional all-gather crashes the process: gloo with CUDA
    tensors, the ranks sharing GPUs (seen on torch 2.11). The same tests run on the CPU and over NCCL."""
    device = requested_device()
    if device == "cuda" and backend_for(device, world) == "gloo":
        pytest.skip("torch's functional all-gather crashes on gloo with CUDA tensors (torch 2.11)")


def clear_torch_mesh_state() -> None:
    """What Megatron-FSDP's tests do between meshes: drop torch's global DeviceMesh bookkeeping, the parts
    this torch has (the process groups stay)."""
    from torch.distributed.device_mesh import _mesh_resources

    for name in (
        "child_to_root_mapping",
        "root_to_flatten_mapping",
        "mesh_stack",
        "flatten_name_to_root_dims",
    ):
        kept = getattr(_mesh_resources, name, None)
        if kept is not None:
            kept.clear()
