"""ZeRO-3 with packed weight gathers (``param_gather_dtype``) on gloo ranks with different data: the forward
computes with the packed values of the full-precision weights, exports and broadcasts stay exact, the
gathers send fewer bytes, training stays near one process (even, ragged and HSDP shards); the strategies
that do not gather before every use refuse it."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    Block,
    TinyTransformer,
    Trainer,
    full_weights,
    local_microbatches,
    max_relative_difference,
    named_weights,
    reference_training,
    wrap,
)

from gradsync.buffers import DistributedDataParallelConfig, refuse_fields_ddp_cannot_honour
from gradsync.groups.testing import run_distributed

STEPS = 6


@functools.lru_cache(maxsize=4)
def reference(world: int) -> dict[str, torch.Tensor]:
    return reference_training(world, 1, STEPS)


def computed_with(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The first block's first matrix as its forward saw it, the same weight exported afterwards, and
    whether the export equals the model the wrapper was built from."""
    original = named_weights(TinyTransformer())
    model = wrap("optim_grads_params", param_gather_dtype=dtype)
    block = next(m for m in model.module.modules() if isinstance(m, Block))
    name = next(n for n, p in block.named_parameters() if p.dim() == 2)
    seen: list[torch.Tensor] = []  # read at the forward: the wrapper shows the gathered compute weights there
    block.register_forward_pre_hook(
        lambda m, _: seen.append(dict(m.named_parameters())[name].detach().clone())
    )
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0])
    exported = model.full_state_dict(rank0_only=False)
    key = next(k for k in exported if k.endswith(name) and k.startswith("blocks.0."))
    exact = all(torch.equal(exported[k], original[k]) for k in original)
    return seen[0], original[key], exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_the_forward_sees_packed_weights_and_exports_stay_exact(dtype: torch.dtype) -> None:
    for seen, original, exact in run_distributed(computed_with, 2, args=(dtype,)):
        assert exact  # a packed gather before the export is redone in full precision
        if dtype == torch.bfloat16:
            assert torch.equal(seen, original.to(torch.bfloat16).float())
        else:  # one fp32 scale per block of 32: e4m3's 3 mantissa bits, relative to each block's largest
            assert not torch.equal(seen, original)
            assert float((seen - original).abs().max()) <= 2**-4 * float(original.abs().max())


def train(kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """The full weights after training, and the bytes the last step's gathers sent."""
    trainer = Trainer.build("optim_grads_params", **kwargs)
    sent = 0
    for step in range(STEPS):
        trainer.step(step, 1)
        sent = sum(r.bytes for b in trainer.model.buckets for r in b.stats.records if r.op == "all_gather")
    return full_weights(trainer.model), sent


@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, {}), (4, {"shard_alignment": "tensor"}), (4, {"outer": 2})],
    ids=["even", "ragged", "hsdp"],
)
@pytest.mark.parametrize(
    ("dtype", "tolerance", "ratio"),
    [(torch.bfloat16, 5e-3, 0.55), (torch.float8_e4m3fn, 5e-2, 0.35)],
    ids=str,
)
def test_training_with_packed_gathers_stays_near_one_process(
    world: int, layout: dict[str, Any], dtype: torch.dtype, tolerance: float, ratio: float
) -> None:
    exact = run_distributed(train, world, args=(layout,))
    packed = run_distributed(train, world, args=({**layout, "param_gather_dtype": dtype},))
    for (exact_weights, exact_bytes), (weights, sent) in zip(exact, packed, strict=True):
        assert max_relative_difference(exact_weights, reference(world)) <= 1e-6
        assert 1e-6 < max_relative_difference(weights, reference(world)) <= tolerance
        assert sent < ratio * exact_bytes, (sent, exact_bytes)


def refusals() -> list[str]:
    messages = []
    for kwargs in ({"strategy": "optim"}, {"outer": 2, "outer_dp_sharding_strategy": "optim"}):
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


def test_packed_gathers_are_refused_where_nothing_is_gathered_before_every_use() -> None:
    for zero1, hfsdp, ddp in run_distributed(refusals, 4):
        assert "does not gather weights before every use; use 'optim_grads_params'" in zero1
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
