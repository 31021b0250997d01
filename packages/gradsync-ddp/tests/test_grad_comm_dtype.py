"""DDP and the distributed optimizer with a low-precision wire (``grad_comm_dtype``) on 2 gloo ranks with
different data per rank: replicas stay identical, training stays within the wire's rounding of one process
on the global batch (and measurably off it: the wire is really low-precision), and the bytes handed to
torch.distributed shrink with the wire."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import Trainer, max_relative_difference, reference_training

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.testing import issued_collectives
from gradsync.groups.testing import run_distributed

STEPS = 8
BUCKET_SIZE = 600  # several buckets, so overlap launches several reductions during backward


def train_with_wire(
    config: DistributedDataParallelConfig, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, int, list[int]]:
    """The params after training, and the bytes the gradient reductions of the last step handed to
    torch.distributed (the first phase of a low-precision one), and the buckets' sizes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "adam", dtype=dtype)
    sent = 0
    for step in range(STEPS):
        with issued_collectives() as seen:
            trainer.step(step, rank, world, 1)
        sent = sum(c.nbytes for c in seen if c.kind in ("all_reduce", "reduce_scatter", "all_to_all"))
        params = trainer.full_params()
        replicas = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(replicas, params)
        assert all(torch.equal(r, params) for r in replicas), f"replicas differ after step {step}"
    sizes = [b.grad_data.numel() for g in trainer.ddp.grad_buffers.all_bucket_groups for b in g.buckets]
    return trainer.full_params(), sent, sizes


def wire_bytes(sizes: list[int], world: int, wire: dict[str, object]) -> int:
    """Each bucket cut into one piece per rank; fp8 pads each piece to whole blocks of 32 values (the default) and adds
    an fp32 scale per block."""
    total = 0
    for size in sizes:
        piece = -(-size // world)
        if wire["grad_comm_dtype"] == torch.bfloat16:
            total += world * piece * 2
        else:
            blocks = -(-piece // 32)
            total += world * blocks * (32 + 4)
    return total


@functools.cache
def reference() -> torch.Tensor:
    return reference_training("adam", 2, 1, STEPS)


def config(distopt: bool, overlap: bool, **wire: object) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=overlap,
        bucket_size=BUCKET_SIZE,
        **wire,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("distopt", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize(
    ("wire", "tolerance"),
    [
        ({"grad_comm_dtype": torch.bfloat16}, 1e-3),
        ({"grad_comm_dtype": torch.float8_e4m3fn, "grad_comm_error_feedback": True}, 3e-3),
    ],
    ids=["bf16", "fp8-ef"],
)
def test_training_with_a_low_precision_wire_stays_near_one_process(
    distopt: bool, overlap: bool, wire: dict[str, object], tolerance: float
) -> None:
    exact_runs = run_distributed(train_with_wire, 2, args=(config(distopt, overlap),))
    wire_runs = run_distributed(train_with_wire, 2, args=(config(distopt, overlap, **wire),))
    for (exact_params, exact_bytes, sizes), (params, sent, _) in zip(exact_runs, wire_runs, strict=True):
        assert max_relative_difference(exact_params, reference()) <= 1e-6
        assert 1e-5 < max_relative_difference(params, reference()) <= tolerance
        # The reduction's first phase (DDP's second, an all-gather, is as large again, as a ring
        # all-reduce's is) against the fp32 reduction of the same buckets.
        assert exact_bytes == 4 * sum(sizes)
        assert sent == wire_bytes(sizes, 2, wire), (sent, exact_bytes)


@pytest.mark.parametrize(
    ("distopt", "fields", "lossless"),
    [
        # Megatron's recipe (bf16 weights, fp32 grads and main params): one microbatch's grads of bf16
        # weights are bf16 values, so a bf16 wire summed in fp32 loses nothing at 2 ranks
        (True, {"grad_reduce_in_fp32": True, "grad_comm_dtype": torch.bfloat16}, True),
        # bf16 grads: an fp8 wire whose residual is kept in bf16
        (False, {"grad_comm_dtype": torch.float8_e4m3fn, "grad_comm_error_feedback": True}, False),
    ],
    ids=["bf16-weights-fp32-grads", "bf16-grads-fp8-ef"],
)
def test_a_wire_under_bf16_weights_against_the_same_run_without_it(
    distopt: bool, fields: dict[str, object], lossless: bool
) -> None:
    plain = {k: v for k, v in fields.items() if k == "grad_reduce_in_fp32"}
    exact = run_distributed(train_with_wire, 2, args=(config(distopt, True, **plain), torch.bfloat16))
    cheap = run_distributed(train_with_wire, 2, args=(config(distopt, True, **fields), torch.bfloat16))
    for (exact_params, exact_bytes, _), (params, sent, _) in zip(exact, cheap, strict=True):
        assert params.dtype == torch.bfloat16
        difference = max_relative_difference(params.float(), exact_params.float())
        assert difference == 0 if lossless else 0 < difference <= 2e-2, difference
        assert sent < exact_bytes
