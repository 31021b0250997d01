"""The sharded strategies with packed weight gathers (``param_gather_dtype``) on gloo ranks with different
data: the forward computes with the packed values of the full-precision weights, exports and broadcasts
stay exact and leave the next forward as it was, the gathers send fewer bytes, training stays near one
process (ZeRO-3 with even, ragged and HSDP shards; ZeRO-1 and ZeRO-2, whose buckets would otherwise
gather together); no_shard, which gathers nothing, and HFSDP refuse it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    Block,
    TinyTransformer,
    Trainer,
    cached_reference,
    full_weights,
    local_microbatches,
    max_relative_difference,
    named_weights,
    wrap,
)

from gradsync.buffers import DistributedDataParallelConfig, refuse_fields_ddp_cannot_honour
from gradsync.groups.testing import run_distributed

STEPS = 6


def computed_with(strategy: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, bool, bool]:
    """The first block's first matrix as its forward saw it, the same weight in the model the wrapper was
    built from, whether the export equals that model, and whether a forward after the export saw what
    the first one did."""
    original = named_weights(TinyTransformer())
    model = wrap(strategy, param_gather_dtype=dtype)
    block = next(m for m in model.module.modules() if isinstance(m, Block))
    name = next(n for n, p in block.named_parameters() if p.dim() == 2)
    seen: list[torch.Tensor] = []  # read at the forward: the wrapper shows the gathered compute weights there
    block.register_forward_pre_hook(
        lambda m, _: seen.append(dict(m.named_parameters())[name].detach().clone())
    )
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch)  # the first forward: ZeRO-1/2 gather packed weights before it too, as after each step
    exported = model.full_state_dict(rank0_only=False)
    key = next(k for k in exported if k.endswith(name) and k.startswith("blocks.0."))
    exact = all(torch.equal(exported[k], original[k]) for k in original)
    model(batch)
    return seen[0], original[key], exact, torch.equal(seen[0], seen[-1])


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_the_forward_sees_packed_weights_and_exports_stay_exact(strategy: str, dtype: torch.dtype) -> None:
    for seen, original, exact, unchanged in run_distributed(computed_with, 2, args=(strategy, dtype)):
        assert exact  # a packed gather before the export is redone in full precision
        assert unchanged  # and the forward after the export computes with the packed weights again
        if dtype == torch.bfloat16:
            assert torch.equal(seen, original.to(torch.bfloat16).float())
        else:  # one fp32 scale per block of 32: e4m3's 3 mantissa bits, relative to each block's largest
            assert not torch.equal(seen, original)
            assert float((seen - original).abs().max()) <= 2**-4 * float(original.abs().max())


def train(
    kwargs: dict[str, Any], strategy: str = "optim_grads_params"
) -> tuple[dict[str, torch.Tensor], int]:
    """The full weights after training, and the bytes the last step's gathers sent."""
    trainer = Trainer.build(strategy, **kwargs)
    sent = 0
    for step in range(STEPS):
        trainer.step(step, 1)
        sent = sum(r.bytes for b in trainer.model.buckets for r in b.stats.records if r.op == "all_gather")
    return full_weights(trainer.model), sent


@pytest.mark.parametrize(
    ("strategy", "world", "layout"),
    [
        ("optim_grads_params", 2, {}),
        ("optim_grads_params", 4, {"shard_alignment": "tensor"}),
        ("optim_grads_params", 4, {"outer": 2}),
        ("optim", 2, {"units": False}),  # ZeRO-1: buckets that would gather together
        ("optim_grads", 4, {}),
    ],
    ids=["zero3-even", "zero3-ragged", "zero3-hsdp", "zero1-coalescing", "zero2"],
)
@pytest.mark.parametrize(
    ("dtype", "tolerance", "ratio"),
    [(torch.bfloat16, 5e-3, 0.55), (torch.float8_e4m3fn, 5e-2, 0.35)],
    ids=str,
)
def test_training_with_packed_gathers_stays_near_one_process(
    strategy: str, world: int, layout: dict[str, Any], dtype: torch.dtype, tolerance: float, ratio: float
) -> None:
    exact = run_distributed(train, world, args=(layout, strategy))
    packed = run_distributed(train, world, args=({**layout, "param_gather_dtype": dtype}, strategy))
    for (exact_weights, exact_bytes), (weights, sent) in zip(exact, packed, strict=True):
        assert max_relative_difference(exact_weights, cached_reference(world, 1, STEPS)) <= 1e-6
        assert 1e-6 < max_relative_difference(weights, cached_reference(world, 1, STEPS)) <= tolerance
        assert sent < ratio * exact_bytes, (sent, exact_bytes)


def refusals() -> list[str]:
    messages = []
    for kwargs in ({"strategy": "no_shard"}, {"outer": 2, "outer_dp_sharding_strategy": "optim"}):
        strategy = kwargs.pop("strategy", "optim_grads_params")
        with pytest.raises((ValueError, NotImplementedError)) as caught:
            wrap(str(strategy), param_gather_dtype=torch.bfloat16, **kwargs)
        messages.append(str(caught.value))
    with pytest.raises(ValueError, match="param_gather_dtype") as caught:  # what gradsync-ddp's wrapper calls
        refuse_fields_ddp_cannot_honour(
            DistributedDataParallelConfig(param_gather_dtype=torch.bfloat16), "DDP"
        )
    messages.append(str(caught.value))
    return messages


def test_packed_gathers_are_refused_where_nothing_is_gathered() -> None:
    for no_shard, hfsdp, ddp in run_distributed(refusals, 4):
        assert "data_parallel_sharding_strategy='no_shard' gathers no weights" in no_shard
        assert "(HFSDP) is not implemented" in hfsdp
        assert "param_gather_dtype" in ddp


@pytest.mark.parametrize(
    ("dtype", "lossless"), [(torch.bfloat16, True), (torch.float8_e4m3fn, False)], ids=str
)
def test_packed_gathers_of_bf16_weights_against_the_same_run_without_them(
    dtype: torch.dtype, lossless: bool
) -> None:
    """bf16 weights with fp32 main weights (the usual recipe): a bf16 gather packs them losslessly, so
    training is bit-identical to unpacked gathers at the same bytes; an fp8 one rounds them."""
    recipe = {"dtype": torch.bfloat16, "main_grads_dtype": torch.float32}
    exact = run_distributed(train, 2, args=(recipe,))
    packed = run_distributed(train, 2, args=({**recipe, "param_gather_dtype": dtype},))
    for (exact_weights, exact_bytes), (weights, sent) in zip(exact, packed, strict=True):
        difference = max_relative_difference(weights, exact_weights)  # bf16 weights, read as fp32
        assert difference == 0 if lossless else 0 < difference <= 5e-2, difference
        assert sent == exact_bytes if lossless else sent < 0.7 * exact_bytes
