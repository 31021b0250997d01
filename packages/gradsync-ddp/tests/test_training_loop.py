"""DistributedOptimizer's Megatron training-loop API: ``scale_loss``, ``get_loss_scale``, ``step()`` returning
``(update_successful, grad_norm, num_zeros_in_grad)``, clipping from an OptimizerConfig-shaped object,
loss scaling with skipped steps, ``zero_grad(set_to_none)``, ``reload_model_params(state_dict)``,
``sharded_state_dict``'s Megatron call shape. Ranks get different data."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from ddp_testkit import (
    TinyGPT,
    flat_params,
    global_batch,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
)

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.ddp.training_loop import OptimizerSettings
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed

STEPS, MICRO, CLIP = 4, 2, 0.4


@dataclass
class OptimizerConfig:
    """Shaped like Megatron-Core's OptimizerConfig (the fields the training loop reads, its defaults)."""

    lr: float | None = None
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2


def build(config: Any, sharded: bool = True) -> tuple[TinyGPT, DistributedDataParallel, DistributedOptimizer]:
    model = TinyGPT()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, overlap_grad_reduce=True, bucket_size=700
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    return model, ddp, DistributedOptimizer(make_optimizer("sgd", ddp.parameters()), ddp, config)


def megatron_loop(sharded: bool) -> dict[str, Any]:
    """Megatron's shape: zero grads, scaled loss per microbatch with no_sync on all but the last,
    finish_grad_sync (finalize_model_grads' part), ``step()`` tuple."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = OptimizerConfig(clip_grad=CLIP, log_num_zeros_in_grad=True, loss_scale=8.0)
    model, ddp, optimizer = build(config, sharded)
    results = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        batches = local_microbatches(step, rank, world, MICRO)
        for index, batch in enumerate(batches):
            with ddp.no_sync() if index < len(batches) - 1 else nullcontext():
                optimizer.scale_loss(ddp(batch) / len(batches)).backward()
        ddp.finish_grad_sync()
        results.append(optimizer.step())
    return {"params": flat_params(model), "results": results, "scale": float(optimizer.get_loss_scale())}


def reference() -> tuple[torch.Tensor, list[float], list[int]]:
    model = TinyGPT()
    opt = make_optimizer("sgd", model.parameters())
    norms, zeros = [], []
    for step in range(STEPS):
        opt.zero_grad()
        model(global_batch(step, 2, MICRO)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        zeros.append(sum(int((p.grad == 0).sum()) for p in model.parameters() if p.grad is not None))
        opt.step()
    return flat_params(model), norms, zeros


def test_megatron_shaped_loop_matches_one_process() -> None:
    expected, norms, zeros = reference()
    assert max(norms) > CLIP  # clipping is active
    assert min(zeros) > 0  # unused embedding rows: zeros to count
    for sharded in (True, False):
        for result in run_distributed(megatron_loop, 2, args=(sharded,)):
            assert result["scale"] == 8.0
            assert max_relative_difference(result["params"], expected) <= 1e-6, sharded
            for (ok, norm, num_zeros), want_norm, want_zeros in zip(
                result["results"], norms, zeros, strict=True
            ):
                assert ok is True
                assert abs(norm - want_norm) <= 1e-5 * want_norm
                assert num_zeros == want_zeros


def loss_scaling() -> dict[str, Any]:
    """Dynamic scaling: an inf in one rank's shard skips the step on both and backs off; clean steps grow it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = OptimizerConfig(
        fp16=True, initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=2, clip_grad=0
    )
    model, ddp, optimizer = build(config)
    scales, results, moved = [], [], []
    for step in range(4):
        before = flat_params(model)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.scale_loss(ddp(local_microbatches(step, rank, world, 1)[0])).backward()
        ddp.finish_grad_sync()
        if step == 0 and rank == 1:  # an overflow in rank 1's own shard only: rank 0 must learn of it
            piece = optimizer.pieces[0]
            piece.param.main_grad.view(-1)[piece.param_range[0]] = float("inf")  # type: ignore[attr-defined]
        results.append(optimizer.step())
        scales.append(float(optimizer.get_loss_scale()))
        if ddp.ddp_config.overlap_param_gather:
            ddp.start_param_sync(force_sync=True)
        moved.append(not torch.equal(before, flat_params(model)))
    return {"scales": scales, "results": results, "moved": moved, "state": optimizer.state_dict()}


def test_dynamic_loss_scale_skips_on_inf_and_grows() -> None:
    for result in run_distributed(loss_scaling, 2):
        assert result["results"][0] == (False, None, None)
        assert result["moved"] == [False, True, True, True]
        assert all(r[0] is True and r[1] == 0.0 and r[2] == 0 for r in result["results"][1:])
        # 1024 halves on the inf, then doubles after every 2 clean steps.
        assert result["scales"] == [512.0, 512.0, 1024.0, 1024.0]
        assert float(result["state"]["grad_scaler"]["scale"]) == 1024.0
        assert result["state"]["grad_scaler"]["growth_tracker"] == 1


def small_api() -> dict[str, Any]:
    model, ddp, optimizer = build(None)
    out: dict[str, Any] = {
        "scale": optimizer.get_loss_scale().tolist(),
        "scaled": float(optimizer.scale_loss(torch.tensor(3.0))),
        "stub": optimizer.is_stub_optimizer,
    }
    optimizer.prepare_model_params_for_param_sync()
    # reload_model_params(state_dict): main params come from the given tensors, the model follows.
    state = {name: torch.full_like(value, 0.25) for name, value in ddp.state_dict().items()}
    optimizer.reload_model_params(state)
    out["reloaded"] = bool(flat_params(model).eq(0.25).all())
    out["mains"] = bool(all(p.main.eq(0.25).all() for p in optimizer.pieces))
    out["sharded_keys"] = sorted(optimizer.sharded_state_dict({}, is_loading=False, metadata=None))
    out["plain_keys"] = sorted(optimizer.sharded_state_dict())
    out["group"] = optimizer.get_grad_stats_parallel_group() is optimizer.norm_group
    return out


def test_small_api() -> None:
    for result in run_distributed(small_api, 2):
        assert result["scale"] == [1.0]
        assert result["scaled"] == 3.0
        assert result["stub"] is False
        assert result["reloaded"]
        assert result["mains"]
        assert result["sharded_keys"] == result["plain_keys"] != []
        assert result["group"]


def test_settings_take_megatrons_defaults_for_missing_fields() -> None:
    assert OptimizerSettings.of(None).clip_grad == 0.0  # gradsync's own use: no clipping unless asked
    assert OptimizerSettings.of(object()) == OptimizerSettings()  # Megatron's defaults (clip_grad=1.0)
    assert OptimizerSettings.of(OptimizerConfig(clip_grad=0.3)).clip_grad == 0.3
