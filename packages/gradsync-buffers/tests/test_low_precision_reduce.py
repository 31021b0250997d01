"""Low-precision wires with fp32 sums (``grad_comm_dtype``): the packing's error bound, the reductions
against an fp32 reduction of every rank's inputs (gathered by another collective and summed here), the
carried residual of error feedback, and the config's refusals."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from buffers_testkit import device

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.low_precision_reduce import GradCommWire, LowPrecisionReduction
from gradsync.buffers.wire_format import WireFormat
from gradsync.groups.testing import run_distributed

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
WIRES = [torch.bfloat16, torch.float16, *FP8]


def packing_bound(dtype: torch.dtype, values: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """Per element of the flat ``values``, the most one packing may move it when cut into ``rows`` wire
    rows: half a unit in the last place relative to the value and, for fp8, half the subnormal spacing at
    its block's scale."""
    numel = values.numel()
    chunk = -(-numel // rows)
    length = WireFormat(dtype, block).padded_length(chunk)
    grid = F.pad(F.pad(values, (0, rows * chunk - numel)).view(rows, chunk), (0, length - chunk))
    info = torch.finfo(dtype)
    bound = grid.abs() * info.eps / 2
    if dtype.itemsize == 1:
        blocks = grid.view(rows, -1, block)
        scale = blocks.abs().amax(dim=-1, keepdim=True) / info.max
        bound = bound + (scale * info.tiny * info.eps).expand_as(blocks).reshape(rows, length)
    return bound[:, :chunk].reshape(-1)[:numel]


@pytest.mark.parametrize("dtype", WIRES, ids=str)
def test_a_packed_row_comes_back_within_one_rounding(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    block = 64
    # Blocks of very different magnitudes side by side: each keeps its own scale.
    magnitudes = torch.logspace(-6, 3, 8).repeat_interleave(block)
    values = torch.randn(2, 8 * block, generator=generator) * magnitudes
    values[1, :block] = 0.0  # an all-zero block
    wire = WireFormat(dtype, block)
    packed = wire.encode(values)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, wire.row_bytes(8 * block))
    back = wire.decode(packed, 8 * block)
    assert torch.equal(back[1, :block], torch.zeros(block))
    if not wire.scaled:
        assert torch.equal(back, values.to(dtype).float())  # a plain cast
        return
    assert packed.shape[1] == 8 * block + 8 * 4  # one byte per value, one fp32 scale per block
    error = (back - values).abs().view(-1)
    assert bool((error <= packing_bound(dtype, values.view(-1), 2, block)).all())
    assert float(error.max()) > 0  # fp8 does round these


def exact_inputs(bucket: torch.Tensor) -> torch.Tensor:
    """Every rank's bucket, one row per rank, gathered by an all-gather (not the path under test)."""
    rows = [torch.empty_like(bucket) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, bucket)
    return torch.stack(rows).double()


def rank_grads(numel: int, grad_dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(100 * step + rank)
    spread = torch.logspace(-4, 2, numel)[torch.randperm(numel, generator=generator)]
    return (torch.randn(numel, generator=generator) * spread * (rank + 1)).to(grad_dtype).to(device())


def reduced_matches_fp32_sum(wire_dtype: torch.dtype, grad_dtype: torch.dtype, scatter: bool) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    block, numel = 32, 40 * world + (0 if scatter else 3)  # all-reduce buckets need not split evenly
    bucket = rank_grads(numel, grad_dtype)
    inputs = exact_inputs(bucket)
    wire = WireFormat(wire_dtype, block)
    reduction = LowPrecisionReduction(bucket, dist.group.WORLD, wire, average=False, residual=None)
    (reduction.reduce_scatter("t") if scatter else reduction.all_reduce("t")).wait()
    exact = inputs.sum(dim=0)
    chunk = -(-numel // world)
    own = slice(rank * chunk, min((rank + 1) * chunk, numel))
    # Each contribution rounded once into the wire, an fp32 sum, then the sum rounded once more: into the
    # wire for an all-reduce, into the grad dtype for either.
    contributions = sum(packing_bound(wire_dtype, row, world, block) for row in inputs)
    bound = contributions + 1e-6 * inputs.abs().sum(dim=0)
    bound += (exact.abs() + bound) * torch.finfo(grad_dtype).eps
    if not scatter:
        bound += packing_bound(wire_dtype, exact.abs() + bound, world, block)
    result, target, allowed = (bucket, exact, bound) if not scatter else (bucket[own], exact[own], bound[own])
    excess = (result.double() - target).abs() - allowed
    assert float(excess.max()) <= 0, f"off by {float(excess.max())} more than the bound"
    if wire_dtype in (torch.bfloat16, torch.float16) and grad_dtype == torch.float32 and scatter:
        # Exactly the fp32 sum of the cast inputs: one rounding per contribution, none per hop.
        cast = inputs.float().to(wire_dtype).float().sum(dim=0)
        assert torch.equal(bucket[own], cast[own])
    if not scatter:
        replicas = exact_inputs(bucket)
        assert all(torch.equal(replicas[0], row) for row in replicas)


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize(
    ("wire_dtype", "grad_dtype", "world"),
    [
        (torch.bfloat16, torch.float32, 2),
        (torch.bfloat16, torch.float32, 4),
        (torch.float16, torch.float32, 4),
        (torch.bfloat16, torch.bfloat16, 4),
        (torch.float8_e4m3fn, torch.float32, 4),
        (torch.float8_e5m2, torch.bfloat16, 2),
    ],
    ids=str,
)
def test_low_precision_reduction_is_within_one_rounding_per_contribution(
    wire_dtype: torch.dtype, grad_dtype: torch.dtype, world: int, scatter: bool
) -> None:
    run_distributed(reduced_matches_fp32_sum, world, args=(wire_dtype, grad_dtype, scatter))


def averaged_is_the_sum_over_the_group(scatter: bool) -> None:
    world = dist.get_world_size()
    grads = rank_grads(64 * world, torch.float32)
    summed, averaged = grads.clone(), grads.clone()
    wire = WireFormat(torch.bfloat16, 32)
    for bucket, average in ((summed, False), (averaged, True)):
        reduction = LowPrecisionReduction(bucket, dist.group.WORLD, wire, average=average, residual=None)
        (reduction.reduce_scatter("t") if scatter else reduction.all_reduce("t")).wait()
    rank, chunk = dist.get_rank(), 64
    own = slice(rank * chunk, (rank + 1) * chunk) if scatter else slice(None)  # the rest keeps local grads
    assert not torch.equal(summed[own], grads[own])
    assert torch.equal(averaged[own] * world, summed[own])  # a power-of-two group: the division is exact


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "all_reduce"])
def test_average_in_collective_divides_the_fp32_sum_by_the_group_size(scatter: bool) -> None:
    run_distributed(averaged_is_the_sum_over_the_group, 4, args=(scatter,))


def sent_over_steps(
    error_feedback: bool, wire_dtype: torch.dtype, steps: int, scatter: bool
) -> tuple[float, float, float]:
    """Reduce ``steps`` buckets of different grads per rank and step (this rank's shard of the sum after
    a reduce-scatter, the whole bucket's mean after an all-reduce); return how far the summed results are from the
    summed exact reductions, how far that is from what the residuals say it must be, and the fp32
    rounding the sums may add over the steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = 96 * world
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=scatter, grad_comm_dtype=wire_dtype, grad_comm_block_size=32,
        grad_comm_error_feedback=error_feedback,
    )  # fmt: skip
    comm = GradCommWire.from_config(config)
    assert comm is not None
    own = slice(rank * (numel // world), (rank + 1) * (numel // world)) if scatter else slice(None)
    received = torch.zeros(numel, dtype=torch.float64)[own]
    exact = torch.zeros(numel, dtype=torch.float64)
    slop, average = 0.0, not scatter  # the all-reduce averages: its owners fold world x their loss
    for step in range(steps):
        grads = rank_grads(numel, torch.float32, step=step % 2)  # two patterns, so errors can pile up
        inputs = exact_inputs(grads)
        exact += inputs.mean(dim=0) if average else inputs.sum(dim=0)
        slop += 8 * torch.finfo(torch.float32).eps * float(inputs.abs().sum(dim=0).max())
        comm.launch(0, grads, dist.group.WORLD, scatter=scatter, average=average, label="t")[1].wait()
        received += grads[own].double()
    error = float((received - exact[own]).abs().max())
    if not error_feedback:
        return error, float("nan"), slop
    assert comm.residuals is not None
    # sum over steps of what was sent = sum of the grads - the last residual, on every rank: so the
    # summed results miss the exact sums by the sum of the ranks' last residuals. An all-reduce's owners
    # fold the second packing's loss into their residuals, so the same holds there.
    residuals = exact_inputs(comm.residuals[0]).sum(dim=0)[own] / (world if average else 1)
    return error, float((received - exact[own] + residuals).abs().max()), slop


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_error_feedback_carries_the_residual_so_errors_do_not_pile_up(
    wire_dtype: torch.dtype, scatter: bool
) -> None:
    steps = 64  # long enough for an all-reduce's uncorrected second rounding to pile up
    with_feedback = run_distributed(sent_over_steps, 2, args=(True, wire_dtype, steps, scatter))
    without = run_distributed(sent_over_steps, 2, args=(False, wire_dtype, steps, scatter))
    for (error, unexplained, slop), (plain_error, _, _) in zip(with_feedback, without, strict=True):
        assert unexplained <= slop, (unexplained, slop)  # telescoped: only fp32 rounding is left
        assert error * 8 < plain_error, (error, plain_error)  # one step's rounding, not sixty-four


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"grad_comm_dtype": torch.float32}, "grad_comm_dtype=torch.float32 is not a wire dtype; use one of"),
        ({"grad_comm_error_feedback": True}, "grad_comm_error_feedback=True needs a low-precision"),
        ({"grad_comm_dtype": torch.bfloat16, "grad_comm_block_size": 0}, "grad_comm_block_size must be"),
        (
            {"grad_comm_dtype": torch.bfloat16, "use_distributed_optimizer": True,
             "reduce_scatter_with_fp32_accumulation": True},
            "drop reduce_scatter_with_fp32_accumulation=True",
        ),
        (
            {"grad_comm_dtype": torch.bfloat16, "use_distributed_optimizer": True,
             "num_distributed_optimizer_instances": 2},
            "not supported with num_distributed_optimizer_instances > 1",
        ),
    ],
)  # fmt: skip
def test_bad_grad_comm_fields_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        DistributedDataParallelConfig(**fields)  # type: ignore[arg-type]


def uneven_shards_reduced(wire_dtype: torch.dtype, cuts: tuple[int, ...]) -> None:
    rank, block = dist.get_rank(), 16
    bucket = rank_grads(cuts[-1], torch.float32)
    inputs = exact_inputs(bucket)
    residual = torch.zeros_like(bucket)
    reduction = LowPrecisionReduction(
        bucket, dist.group.WORLD, WireFormat(wire_dtype, block), average=False, residual=residual, cuts=cuts
    )
    lo, hi = cuts[rank], cuts[rank + 1]
    assert reduction.wire_bytes == sum(WireFormat(wire_dtype, block).row_bytes(b - a) for a, b in
                                       itertools.pairwise(cuts))  # fmt: skip
    reduction.reduce_scatter("t").wait()
    # Each piece is packed as its own row: the residual is what packing that piece lost.
    for a, b in itertools.pairwise(cuts):
        lost = residual[a:b].double().abs()
        assert bool((lost <= packing_bound(wire_dtype, inputs[rank, a:b], 1, block)).all())
    assert float(residual.abs().sum()) > 0  # fp32 grads do lose bits in either wire
    if hi == lo:
        return
    exact = inputs[:, lo:hi]
    bound = sum(packing_bound(wire_dtype, row, 1, block) for row in exact) + 1e-6 * exact.abs().sum(dim=0)
    excess = (bucket[lo:hi].double() - exact.sum(dim=0)).abs() - bound
    assert float(excess.max()) <= 0
    if wire_dtype == torch.bfloat16:
        assert torch.equal(bucket[lo:hi], exact.float().to(wire_dtype).float().sum(dim=0))


@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_uneven_shards_each_get_their_fp32_sum(wire_dtype: torch.dtype) -> None:
    run_distributed(uneven_shards_reduced, 4, args=(wire_dtype, (0, 10, 10, 57, 100)))  # rank 1 owns nothing
