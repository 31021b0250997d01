"""Every strategy with a low-precision grad wire summed in fp32 (``DistributedDataParallelConfig.
grad_comm_dtype``), on gloo ranks with different data: training stays within the wire's rounding of one
process on the global batch and measurably off it (the wire is really low-precision), with even, ragged
and hybrid (HSDP) shards, fewer bytes sent; and the config that sets two grad wires is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_testkit import STRATEGIES, Trainer, cached_reference, full_weights, max_relative_difference, wrap

from gradsync.groups.testing import run_distributed

STEPS = 6


def train(strategy: str, kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """The full weights after training, and the bytes of the last step's grad reductions."""
    trainer = Trainer.build(strategy, **kwargs)
    sent = 0
    for step in range(STEPS):
        trainer.step(step, 1)
        sent = sum(
            record.bytes
            for bucket in trainer.model.buckets
            for record in bucket.stats.records
            if record.op != "all_gather"
        )
    return full_weights(trainer.model), sent


CASES = [
    *((strategy, 2, {}) for strategy in STRATEGIES),
    ("optim_grads_params", 4, {"shard_alignment": "tensor"}),  # ragged shards: one per whole matrix
    ("optim_grads_params", 4, {"outer": 2, "outer_dp_sharding_strategy": "optim"}),  # HFSDP: two scatters
    ("optim", 4, {"outer": 2}),  # HSDP: a reduce-scatter inside, an all-reduce across replicas
    ("no_shard", 4, {"overlap_grad_reduce": False, "units": False}),  # one coalesced all-reduce
]


@pytest.mark.parametrize(
    ("wire", "tolerance"),
    [
        ({"wire": torch.bfloat16}, 1e-3),
        ({"wire": torch.float8_e4m3fn, "grad_comm_error_feedback": True}, 3e-2),
    ],
    ids=["bf16", "fp8-ef"],
)
@pytest.mark.parametrize(("strategy", "world", "layout"), CASES, ids=str)
def test_training_with_a_low_precision_wire_stays_near_one_process(
    strategy: str, world: int, layout: dict[str, Any], wire: dict[str, Any], tolerance: float
) -> None:
    exact = run_distributed(train, world, args=(strategy, layout))
    cheap = run_distributed(train, world, args=(strategy, {**layout, **wire}))
    for (exact_weights, exact_bytes), (weights, sent) in zip(exact, cheap, strict=True):
        assert max_relative_difference(exact_weights, cached_reference(world, 1, STEPS)) <= 1e-6
        assert 1e-6 < max_relative_difference(weights, cached_reference(world, 1, STEPS)) <= tolerance
        assert sent < (0.55 if wire["wire"] == torch.bfloat16 else 0.4) * exact_bytes, (sent, exact_bytes)


def two_wires() -> str:
    with pytest.raises(ValueError, match="both set the grad wire") as caught:
        wrap("optim_grads", wire=torch.bfloat16, grad_comm_dtype=torch.bfloat16)
    return str(caught.value)


def test_two_grad_wires_are_refused_by_name() -> None:
    for message in run_distributed(two_wires, 2):
        assert "megatron_fsdp_grad_comm_dtype" in message


def test_a_bf16_wire_under_bf16_weights_with_fp32_main_grads_is_lossless() -> None:
    """The usual recipe (bf16 weights, fp32 main grads): one microbatch's grads of bf16 weights are bf16
    values, so a bf16 wire summed in fp32 trains bit-identically to the fp32 reduction, at half its bytes."""
    recipe = {"dtype": torch.bfloat16, "main_grads_dtype": torch.float32}
    exact = run_distributed(train, 2, args=("optim_grads_params", recipe))
    cheap = run_distributed(train, 2, args=("optim_grads_params", {**recipe, "wire": torch.bfloat16}))
    for (exact_weights, exact_bytes), (weights, sent) in zip(exact, cheap, strict=True):
        assert all(torch.equal(weights[k], exact_weights[k]) for k in exact_weights)
        assert sent == exact_bytes // 2
