"""Megatron-Core config fields that gradsync-fsdp used to accept and ignore now act, or are refused:
``grad_reduce_in_fp32`` gives fp32 main grads reduced in fp32, ``preserve_fp32_weights=False`` steps the
compute weights, ``fsdp_all_gather_in_start_param_sync`` decides whether start_param_sync gathers,
``megatron_fsdp_version=2`` is refused, and constructor keywords a given config contradicts are refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import TinyTransformer, local_microbatches, make_optimizer, shard_index, wrap

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, MixedPrecisionPolicy
from gradsync.groups.testing import run_distributed


def fsdp_config(**fields: Any) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(use_megatron_fsdp=True, **fields)


def reduced_grads(grad_reduce_in_fp32: bool) -> list[torch.Tensor]:
    """no_shard over bf16 weights: every grad whole, as the optimizer gets it."""
    config = fsdp_config(data_parallel_sharding_strategy="no_shard", grad_reduce_in_fp32=grad_reduce_in_fp32)
    model = MegatronFSDP(TinyTransformer().to(torch.bfloat16), shard_index(), config)
    assert {b.grad.dtype for b in model.buckets if b.grad is not None} == {
        torch.float32 if grad_reduce_in_fp32 else torch.bfloat16
    }
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    model.finish_grad_sync()
    return [p.grad.to_local().float().cpu() for p in model.parameters()]


def fp32_mean_of_bf16_grads(world: int) -> list[torch.Tensor]:
    """Each rank's bf16 grads, computed apart, averaged in fp32: what an fp32 reduction gives exactly."""
    per_rank = []
    for rank in range(world):
        model = TinyTransformer().to(torch.bfloat16)
        model(local_microbatches(0, rank, world, 1)[0]).backward()
        per_rank.append([p.grad.float().cpu() for p in model.parameters()])
    return [sum(g * (1.0 / world) for g in grads) for grads in zip(*per_rank, strict=True)]


def reduced_and_expected(grad_reduce_in_fp32: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both in the rank process: bf16 kernels' results depend on the thread count."""
    return reduced_grads(grad_reduce_in_fp32), fp32_mean_of_bf16_grads(dist.get_world_size())


def test_grad_reduce_in_fp32_reduces_bf16_grads_in_fp32() -> None:
    for got, want in run_distributed(reduced_and_expected, 2, args=(True,)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    in_bf16, want = run_distributed(reduced_and_expected, 2, args=(False,))[0]
    assert any(not torch.equal(a, b) for a, b in zip(in_bf16, want, strict=True))  # the check can fail


def optimizer_dtypes(preserve: bool) -> set[torch.dtype]:
    config = fsdp_config(data_parallel_sharding_strategy="optim_grads_params", preserve_fp32_weights=preserve)
    model = MegatronFSDP(TinyTransformer().to(torch.bfloat16), shard_index(), config)
    return {p.dtype for p in model.parameters()}


def test_preserve_fp32_weights_false_steps_the_compute_weights() -> None:
    assert run_distributed(optimizer_dtypes, 2, args=(False,)) == [{torch.bfloat16}] * 2
    assert run_distributed(optimizer_dtypes, 2, args=(True,)) == [{torch.float32}] * 2


def start_param_sync_bytes(gather_in_start: bool) -> int:
    model = wrap("optim", fsdp_all_gather_in_start_param_sync=gather_in_start)
    optimizer = make_optimizer(model.parameters())
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    model.finish_grad_sync()
    optimizer.step()
    model.zero_grad_buffer()
    model.install_optimized_model_weights()
    model.start_param_sync()
    started = model.communicated_bytes()
    model(batch)  # the forward gathers whatever start_param_sync left
    assert model.communicated_bytes() > 0
    return started


def test_fsdp_all_gather_in_start_param_sync_decides_who_gathers() -> None:
    assert all(n > 0 for n in run_distributed(start_param_sync_bytes, 2, args=(True,)))
    assert run_distributed(start_param_sync_bytes, 2, args=(False,)) == [0, 0]


def refusals() -> None:
    def refused(config: DistributedDataParallelConfig, **kwargs: Any) -> str:
        with pytest.raises((ValueError, NotImplementedError)) as caught:
            MegatronFSDP(TinyTransformer(), shard_index(), config, **kwargs)
        return str(caught.value)

    assert "megatron_fsdp_version=2" in refused(fsdp_config(megatron_fsdp_version=2))
    assert "fsdp_double_buffer=True was passed, but ddp_config.fsdp_double_buffer=False" in refused(
        fsdp_config(data_parallel_sharding_strategy="optim_grads_params"), fsdp_double_buffer=True
    )
    assert "nccl_ub=True was passed" in refused(fsdp_config(), nccl_ub=True)
    assert "fine_grained" in refused(fsdp_config(), enable_fine_grained_param_gather_hook=True)
    policy = MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    assert "grad_reduce_in_fp32=True contradicts mixed_precision_policy.main_grads_dtype" in refused(
        fsdp_config(grad_reduce_in_fp32=True), mixed_precision_policy=policy
    )
    assert "preserve_fp32_weights=False contradicts mixed_precision_policy.main_params_dtype" in refused(
        fsdp_config(preserve_fp32_weights=False), mixed_precision_policy=MixedPrecisionPolicy()
    )


def test_contradictions_and_unbuilt_versions_are_refused_by_name() -> None:
    run_distributed(refusals, 2)


@dataclasses.dataclass
class OlderMegatronConfig:
    """Shaped like Megatron-Core 0.19.2's config: no ``megatron_fsdp_version``, a field gradsync lacks."""

    data_parallel_sharding_strategy: str = "no_shard"
    use_megatron_fsdp: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = False
    fp8_recipe_of_the_future: str | None = None  # not a gradsync field: fine at its default


def megatron_config_objects() -> tuple[str, str]:
    older = OlderMegatronConfig("optim_grads", True, True, True, grad_reduce_in_fp32=True)
    model = MegatronFSDP(TinyTransformer(), shard_index(), older)  # type: ignore[arg-type]
    assert isinstance(model.ddp_config, DistributedDataParallelConfig)
    assert model.ddp_config.megatron_fsdp_version == 1
    assert model.mp_policy.main_grads_dtype == torch.float32
    with pytest.raises(ValueError, match="fp8_recipe_of_the_future='x'") as caught:
        MegatronFSDP(TinyTransformer(), shard_index(), OlderMegatronConfig(fp8_recipe_of_the_future="x"))  # type: ignore[arg-type]
    return model.data_parallel_sharding_strategy, str(caught.value)


def test_megatron_core_config_objects_are_accepted() -> None:
    for strategy, _ in run_distributed(megatron_config_objects, 2):
        assert strategy == "optim_grads"
