"""A Megatron-shaped training loop through gradsync: Megatron's DDP config object (0.19.2's fields, which
lack ``megatron_fsdp_version``), an OptimizerConfig-shaped object, the schedule's ``no_sync_func`` for all
but the last microbatch, ``grad_scale_func = optimizer.scale_loss``, ``finalize_model_grads_func`` and
the ``(update_successful, grad_norm, num_zeros_in_grad)`` tuple of ``optimizer.step()`` (as
megatron/training/training.py's ``train_step``). Two gloo ranks with different data must end where one
process trained on the global batch ends, with clipping active.

Each case runs twice: with stand-ins shaped like Megatron-Core 0.19.2's objects, and with Megatron-Core's
own ``DistributedDataParallelConfig``, ``TransformerConfig`` and ``OptimizerConfig`` (the integration
session unzips the pinned megatron-core wheel onto the path and sets GRADSYNC_REQUIRE_MEGATRON_CORE, so
there it cannot be skipped). MegatronFSDP takes Megatron-Core's DDP config too."""

from __future__ import annotations

import dataclasses
import importlib
import os
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.finalize import finalize_model_grads
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed

STEPS, MICRO, ROWS, CLIP, VOCAB = 5, 3, 2, 0.3, 40

# Megatron-Core 0.19.2's DistributedDataParallelConfig has gradsync's fields (Megatron HEAD's plus the
# older preserve_fp32_weights) except megatron_fsdp_version and preserve_fp32_weights: a foreign class.
MegatronDDPConfig = dataclasses.make_dataclass(
    "DistributedDataParallelConfig",
    [
        (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(DistributedDataParallelConfig)
        if f.name not in ("megatron_fsdp_version", "preserve_fp32_weights")
    ],
)


@dataclasses.dataclass
class OptimizerConfig:
    """The OptimizerConfig fields Megatron's training loop reads, with its defaults."""

    lr: float = 0.05
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    loss_scale: float | None = None
    fp16: bool = False
    bf16: bool = False


def megatron_core(name: str) -> Any:
    """A class of Megatron-Core's (``module:Class``), or a skip where megatron-core is not on the path
    (outside the integration session, which requires it)."""
    module, cls = name.split(":")
    try:
        return getattr(importlib.import_module(f"megatron.core.{module}"), cls)
    except ImportError:
        if os.environ.get("GRADSYNC_REQUIRE_MEGATRON_CORE") == "1":
            raise
        pytest.skip("megatron-core is not on the path (the integration session puts it there)")


def configs(source: str, ddp_fields: dict[str, Any], opt_fields: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The model config, the DDP config and the optimizer config, as stand-ins or Megatron-Core's own."""
    if source == "stand-ins":
        return ModelParallelConfig(), MegatronDDPConfig(**ddp_fields), OptimizerConfig(**opt_fields)
    model_config = megatron_core("transformer:TransformerConfig")(
        num_layers=1, hidden_size=12, num_attention_heads=1
    )
    ddp_config = megatron_core("distributed:DistributedDataParallelConfig")(**ddp_fields)
    return model_config, ddp_config, megatron_core("optimizer:OptimizerConfig")(**opt_fields)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, 12)
        self.mlp = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 12))
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        logits = self.head(self.norm(x + self.mlp(x)))  # untied: unused embedding rows get zero grads
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB // 2, (world * MICRO * ROWS, 6), generator=generator)


def forward_backward_no_pipelining(ddp: Any, microbatches: list[torch.Tensor], config: Any) -> None:
    """Megatron's schedule, reduced to what it asks of the wrappers."""
    for index, micro in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with nullcontext() if last else config.no_sync_func():
            output = ddp(micro) / len(microbatches)
            output = config.grad_scale_func(output)
            output.backward()
    config.finalize_model_grads_func([ddp])


def train(ddp_fields: dict[str, Any], source: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model()
    opt_fields = {"lr": 0.05, "clip_grad": CLIP, "log_num_zeros_in_grad": True, "loss_scale": 4.0}
    config, ddp_config, opt_config = configs(source, ddp_fields, opt_fields)
    ddp = DistributedDataParallel(config, ddp_config, model)
    assert ddp.ddp_config.megatron_fsdp_version == 1  # converted: newer code reads the newer fields
    inner = torch.optim.SGD(ddp.parameters(), lr=opt_config.lr, momentum=0.9)
    optimizer = DistributedOptimizer(inner, ddp, opt_config)
    config.no_sync_func = ddp.no_sync  # type: ignore[attr-defined]
    config.grad_scale_func = optimizer.scale_loss  # type: ignore[attr-defined]
    config.finalize_model_grads_func = finalize_model_grads  # type: ignore[attr-defined]
    steps = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        mine = batch(step, world).chunk(world)[rank]
        forward_backward_no_pipelining(ddp, list(mine.split(ROWS)), config)
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        steps.append((update_successful, grad_norm, num_zeros_in_grad))
    if ddp.ddp_config.overlap_param_gather:
        ddp.disable_forward_pre_hook(param_sync=True)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "steps": steps}


def reference() -> tuple[torch.Tensor, list[float], list[int]]:
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    norms, zeros = [], []
    for step in range(STEPS):
        opt.zero_grad()
        model(batch(step, 2)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        zeros.append(sum(int((p.grad == 0).sum()) for p in model.parameters() if p.grad is not None))
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), norms, zeros


@pytest.mark.parametrize(
    "ddp_fields",
    [
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 500},
        {
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "overlap_param_gather": True,
            "bucket_size": 500,
        },
        {"overlap_grad_reduce": True},
    ],
    ids=["distopt", "distopt-overlap-gather", "all-reduce"],
)
@pytest.mark.parametrize("source", ["stand-ins", "megatron-core"])
def test_megatron_shaped_loop_matches_one_process(ddp_fields: dict[str, Any], source: str) -> None:
    assert not hasattr(MegatronDDPConfig(), "megatron_fsdp_version")
    if source == "megatron-core":  # 0.19.2's own object lacks it too: gradsync converts it
        assert not hasattr(
            megatron_core("distributed:DistributedDataParallelConfig")(), "megatron_fsdp_version"
        )
    expected, norms, zeros = reference()
    assert max(norms) > CLIP
    assert min(zeros) > 0
    for result in run_distributed(train, 2, args=(ddp_fields, source)):
        scale = (expected - result["params"]).abs().max() / expected.abs().max()
        assert float(scale) <= 1e-6
        for (ok, norm, num_zeros), want_norm, want_zeros in zip(result["steps"], norms, zeros, strict=True):
            assert ok is True
            assert norm == pytest.approx(want_norm, rel=1e-5)
            assert num_zeros == want_zeros


def megatron_fsdp_with_megatron_cores_config() -> dict[str, Any]:
    """MegatronFSDP (ZeRO-3) built from Megatron-Core's DDP config, trained with its own loop and
    ``finalize_model_grads`` ending each step, on this rank's rows of the global batch."""
    from gradsync.fsdp import MegatronFSDP
    from gradsync.groups import FSDPDistributedIndex

    rank, world = dist.get_rank(), dist.get_world_size()
    ddp_config = megatron_core("distributed:DistributedDataParallelConfig")(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    inner = Model()
    inner.config = megatron_core("transformer:TransformerConfig")(  # as Megatron's modules carry it
        num_layers=1, hidden_size=12, num_attention_heads=1
    )
    model = MegatronFSDP(inner, FSDPDistributedIndex.from_sizes(world), ddp_config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        model.zero_grad_buffer()
        model(batch(step, world).chunk(world)[rank]).backward()
        finalize_model_grads([model])
        optimizer.step()
        model.install_optimized_model_weights()
    full = model.full_state_dict(rank0_only=False)
    return {
        "strategy": model.data_parallel_sharding_strategy,
        "params": torch.cat([full[name].reshape(-1) for name, _ in Model().named_parameters()]),
    }


def test_megatron_fsdp_takes_megatron_cores_config() -> None:
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        model(batch(step, 2)).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for result in run_distributed(megatron_fsdp_with_megatron_cores_config, 2):
        assert result["strategy"] == "optim_grads_params"
        assert float((expected - result["params"]).abs().max() / expected.abs().max()) <= 1e-6
