"""The α-β planner: collective costs against the ring/tree formulas worked by hand, buckets from the real
layout rules, the overlap simulation against cases whose answer is known, the latency-bound crossover,
and the command line (a model built on the meta device, a JSON shape list, a table per DP size)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gradsync.buffers.matrix_optim import newton_schulz
from gradsync.buffers.plan import PUBLISHED, LinkCosts, predict, recommend_bucket_size, specs_from_shapes
from gradsync.buffers.plan.__main__ import gather_wire_bytes, gpt_shapes, gpt_units, grad_wire, module_shapes
from gradsync.buffers.plan.muon import busiest_rank_flops, newton_schulz_flops
from gradsync.buffers.plan.predict import ADAM_STATE_BYTES, FP32, bucket_sizes
from gradsync.buffers.shard_alignment import parse_shard_alignment

COSTS = LinkCosts.uniform("test", alpha=1e-5, busbw_gbps=10.0, source="test")
SPECS = specs_from_shapes(gpt_shapes(64, 4, 1000))
UNITS = gpt_units(4)


def test_collective_costs_follow_the_ring_and_tree_formulas() -> None:
    n, p, a, b = 8e6, 8, 1e-5, 1e-10
    assert COSTS.time("reduce_scatter", n, p) == pytest.approx(7 * a + 7 / 8 * n * b)
    assert COSTS.time("all_gather", n, p) == pytest.approx(7 * a + 7 / 8 * n * b)
    assert COSTS.time("all_reduce", n, p) == pytest.approx(14 * a + 14 / 8 * n * b)
    assert COSTS.time("all_reduce", n, 1) == 0.0
    tree = LinkCosts.uniform("t", alpha=1e-5, busbw_gbps=10.0, source="", tree_all_reduce=True)
    small, ranks = 1e3, 1024  # latency dominates: log2 beats the ring's 2(p-1) steps
    assert tree.time("all_reduce", small, ranks) == pytest.approx(2 * math.log2(ranks) * a + 2 * small * b)
    big = 1e10  # bandwidth dominates: the ring moves 2(p-1)/p of the message, the tree twice all of it
    assert tree.time("all_reduce", big, 4) == pytest.approx(COSTS.time("all_reduce", big, 4))


def test_buckets_follow_the_reference_padding_rules() -> None:
    numels = [s.numel for s in SPECS]
    for dp in (3, 8, 64):
        sizes = bucket_sizes(numels, 50_000, dp)
        assert all(size % math.lcm(dp, 128) == 0 for size in sizes)
        assert sum(sizes) >= sum(numels)
        assert all(
            size % 2**16 == 0 for size in bucket_sizes(numels, 50_000, dp, pad_for_high_nccl_busbw=True)
        )
    assert predict("ddp", SPECS, 64, COSTS).bucket_size == 64_000_000  # max(40M, 1M x dp)
    assert predict("ddp", SPECS, 8, COSTS).bucket_size == 40_000_000


def test_wire_bytes_and_memory_per_strategy() -> None:
    dp = 4
    padded = sum(bucket_sizes([s.numel for s in SPECS], 50_000, dp))
    ddp = predict("ddp", SPECS, dp, COSTS, bucket_size=50_000)
    distopt = predict("distopt", SPECS, dp, COSTS, bucket_size=50_000)
    assert ddp.wire_bytes == pytest.approx(2 * 3 / 4 * padded * FP32)
    assert distopt.wire_bytes == pytest.approx(ddp.wire_bytes)  # reduce-scatter + all-gather = all-reduce
    assert distopt.peak_bytes < ddp.peak_bytes  # the optimizer state is sharded
    assert predict("zero3", SPECS, dp, COSTS, units=UNITS).peak_bytes < distopt.peak_bytes


def test_zero3_models_the_units_and_the_params_outside_them() -> None:
    """Units are the model's FSDP units (one bucket each); the embedding and final norm, outside every
    unit, are gathered once, held whole through the step and their grads too; the last unit is gathered
    once (kept from its forward into the backward). Worked by hand from the padded bucket sizes."""
    dp = 4
    numels = [s.numel for s in SPECS]
    unit = sum(bucket_sizes(numels[1:13], None, dp))  # the four blocks are alike
    outside = sum(bucket_sizes([numels[0], numels[-2], numels[-1]], 40_000_000, dp))
    got = predict("zero3", SPECS, dp, COSTS, units=UNITS)
    padded = 4 * unit + outside
    assert got.buckets == 4 + 1
    assert got.wire_bytes == pytest.approx(3 / 4 * ((4 + 3) * unit + outside + padded) * FP32)
    state = padded / dp * (2 * FP32 + ADAM_STATE_BYTES)
    assert got.peak_bytes == pytest.approx(state + (2 * outside + 5 * unit) * FP32)
    with pytest.raises(ValueError, match="zero3 needs each param's FSDP unit"):
        predict("zero3", SPECS, dp, COSTS)


def test_overlap_simulation() -> None:
    dp = 4
    alone = predict("ddp", SPECS, dp, COSTS, bucket_size=50_000)
    assert alone.exposed_seconds == pytest.approx(alone.comm_seconds)  # nothing to hide behind
    exposures = [
        predict("ddp", SPECS, dp, COSTS, bucket_size=50_000, backward_seconds=t).exposed_seconds
        for t in (1e-4, 1e-3, 1e-2, 1.0)
    ]
    assert exposures == sorted(exposures, reverse=True)
    sizes = bucket_sizes([s.numel for s in SPECS], 50_000, dp)
    last = COSTS.time("all_reduce", sizes[-1] * FP32, dp)
    assert exposures[-1] == pytest.approx(last)  # a long backward hides all but the last bucket
    slow = predict("distopt", SPECS, dp, COSTS, bucket_size=50_000, forward_seconds=1.0, backward_seconds=1.0)
    first_gather = COSTS.time("all_gather", sizes[-1] * FP32, dp)  # the forward waits for its first weights
    assert slow.exposed_seconds == pytest.approx(
        first_gather + COSTS.time("reduce_scatter", sizes[-1] * FP32, dp)
    )


def test_small_fixed_buckets_become_latency_bound_at_scale() -> None:
    fixed = [predict("distopt", SPECS, dp, COSTS, bucket_size=50_000) for dp in (2, 4096)]
    assert [p.latency_bound for p in fixed] == [False, True]
    best = recommend_bucket_size(SPECS, 4096, COSTS, "ddp", [10_000, 50_000, 10_000_000], 0.0, 0.0)
    assert best.bucket_size == 10_000_000  # fewer, larger messages when latency dominates


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def test_command_line(tmp_path: Path) -> None:
    assert module_shapes(f"{__name__}:tiny") == ([[16, 8], [16], [4, 16], [4]], None)
    assert module_shapes(f"{__name__}:tiny", "Linear")[1] == [0, 0, 1, 1]
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"shapes": gpt_shapes(64, 2, 100), "units": gpt_units(2)}))
    command = [sys.executable, "-m", "gradsync.buffers.plan", "--shapes", str(shapes), "--dp", "2", "64"]
    out = subprocess.run(
        [*command, "--costs", "nccl-h100-nvlink"], capture_output=True, text=True, check=True
    )
    rows = [
        line for line in out.stdout.splitlines() if line.startswith("| ddp") or line.startswith("| zero3")
    ]
    assert len(rows) == 4
    assert PUBLISHED["nccl-h100-nvlink"].source.split(";")[0] in out.stdout


def test_padding_of_shard_alignment_policies() -> None:
    """The padding each policy costs: the padded layout's elements minus the params', counted here from
    the shapes. The distributed optimizer's equal shards: whole matrices cost more than cuts anywhere,
    block-rows in between, and wire bytes grow with it. ZeRO-3's ragged units (gradsync-fsdp) hold whole
    matrices without padding, however many ranks share them."""
    shapes, units = gpt_shapes(64, 2, 96), gpt_units(2)
    cost = PUBLISHED["nccl-h100-ib"]
    numel = sum(math.prod(s) for s in shapes)
    got: dict[tuple[str, str, int], Any] = {}
    for strategy in ("distopt", "zero3"):
        for policy in ("row", "block:16x64", "tensor"):
            for dp in (8, 64):
                specs = specs_from_shapes(shapes, parse_shard_alignment(policy))
                got[strategy, policy, dp] = predict(
                    strategy, specs, dp, cost, bucket_size=20_000, units=units
                )
    for prediction in got.values():
        padded = prediction.padding_bytes / FP32 + numel
        assert padded == int(padded)
    distopt = {policy: got["distopt", policy, 8] for policy in ("row", "block:16x64", "tensor")}
    assert (
        distopt["row"].padding_bytes < distopt["block:16x64"].padding_bytes < distopt["tensor"].padding_bytes
    )
    assert distopt["row"].wire_bytes < distopt["tensor"].wire_bytes
    for dp in (8, 64):
        assert got["zero3", "tensor", dp].padding_bytes == 0  # whole matrices need no alignment gaps
        assert got["zero3", "tensor", dp].padding_bytes < got["distopt", "tensor", dp].padding_bytes
    # equal shards pad more as ranks are added; ragged ones do not
    assert got["distopt", "tensor", 64].padding_bytes > got["distopt", "tensor", 8].padding_bytes


@pytest.mark.parametrize("shape", [(12, 40), (40, 12), (16, 4, 5), (7, 7)])
def test_newton_schulz_flops_count_the_matmuls_muon_runs(shape: tuple[int, ...]) -> None:
    """The formula against torch's own FLOP counter over gradsync's Newton-Schulz on such a matrix."""
    matrix = torch.randn(shape[0], math.prod(shape[1:]))
    with FlopCounterMode(display=False) as counter:
        newton_schulz(matrix, steps=5)
    assert newton_schulz_flops(shape, steps=5) == counter.get_total_flops()


def test_busiest_rank_takes_the_largest_matrices_first() -> None:
    shapes = [[4, 4], [8, 8], [8, 8], [16, 16], [3]]  # the 1-D param stays with AdamW
    each = [newton_schulz_flops(s) for s in shapes[:4]]
    assert busiest_rank_flops(shapes, 1) == sum(each)
    assert busiest_rank_flops(shapes, 64) == max(each)  # more ranks than matrices: the largest alone
    # two ranks: the 16x16 on one, both 8x8 and the 4x4 on the other, whichever is heavier
    assert busiest_rank_flops(shapes, 2) == max(each[3], each[0] + each[1] + each[2])
    with pytest.raises(ValueError, match="dp must be at least 1"):
        busiest_rank_flops(shapes, 0)


def test_command_line_reports_muon_on_the_busiest_rank() -> None:
    command = [sys.executable, "-m", "gradsync.buffers.plan", "--gpt", "64", "2", "100", "--dp", "2", "8"]
    out = subprocess.run(
        [*command, "--strategy", "distopt", "--muon-tflops", "1", "--forward-ms", "1", "--backward-ms", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line for line in out.stdout.split("Muon")[-1].splitlines() if line.startswith("| 2 ")]
    flops = busiest_rank_flops(gpt_shapes(64, 2, 100)[1:], 2)
    assert rows == [f"| 2 | {flops / 1e9:.1f} | {flops / 1e9:.2f} | {(3e-3 + flops / 1e12) / 3e-3:.3f}x |"]


@pytest.mark.parametrize(("name", "per_value"), [("bf16", 2.0), ("fp8", 1.0 + 4 / 32)])
def test_a_low_precision_grad_wire_scales_only_the_reductions(name: str, per_value: float) -> None:
    """The reductions' bytes shrink by the wire's bytes per value over fp32's 4, the α terms do not, and
    the params' all-gathers stay fp32; an all-reduce becomes an all-to-all and an all-gather (a ring,
    never NCCL's tree)."""
    wire = grad_wire(name, 32)
    assert wire.value_bytes == per_value
    dp, size = 16, 200_000
    fp32 = {
        s: predict(s, SPECS, dp, COSTS, bucket_size=size, units=UNITS) for s in ("ddp", "distopt", "zero3")
    }
    low = {s: predict(s, SPECS, dp, COSTS, bucket_size=size, units=UNITS, wire=wire) for s in fp32}
    ratio = per_value / FP32
    assert low["ddp"].wire_bytes == pytest.approx(fp32["ddp"].wire_bytes * ratio)
    assert low["distopt"].wire_bytes == pytest.approx(fp32["distopt"].wire_bytes * (1 + ratio) / 2)
    for strategy in ("ddp", "distopt"):  # ring costs: the same message steps, fewer bytes
        assert low[strategy].latency_seconds == pytest.approx(fp32[strategy].latency_seconds)
    bandwidth = {s: p.comm_seconds - p.latency_seconds for s, p in fp32.items()}
    assert low["ddp"].comm_seconds - low["ddp"].latency_seconds == pytest.approx(bandwidth["ddp"] * ratio)
    assert low["distopt"].comm_seconds - low["distopt"].latency_seconds == pytest.approx(
        bandwidth["distopt"] * (1 + ratio) / 2
    )
    assert fp32["zero3"].comm_seconds > low["zero3"].comm_seconds > fp32["zero3"].comm_seconds * 2 / 3
    tree = LinkCosts.uniform("t", alpha=1e-5, busbw_gbps=10.0, source="", tree_all_reduce=True)
    huge_dp = predict("ddp", SPECS, 1024, tree, bucket_size=size, wire=wire)
    assert huge_dp.latency_seconds == pytest.approx(2 * 1023 * 1e-5 * huge_dp.buckets)  # ring steps


def test_powersgd_sends_its_factors_and_the_tensors_it_leaves_whole() -> None:
    """Worked by hand for torch's rule (compress a matrix when its rank-r factors are 2x smaller): a
    64 x 64 weight goes as 64 x 4 P and Q factors, a 64 x 2 one and a bias go whole; three fp32
    all-reduces per bucket, as a ddp strategy's all-reduce is priced, and refused for the others."""
    shapes = [[64, 64], [64, 2], [64]]
    wire = grad_wire("powersgd-r4", 32, shapes)
    total = 64 * 64 + 64 * 2 + 64
    assert wire.all_reduce_shares == (
        pytest.approx(192 / total),
        pytest.approx(256 / total),
        pytest.approx(256 / total),
    )
    specs = specs_from_shapes(shapes)
    fp32 = predict("ddp", specs, 8, COSTS, bucket_size=10_000)
    hooked = predict("ddp", specs, 8, COSTS, bucket_size=10_000, wire=wire)
    assert hooked.wire_bytes == pytest.approx(fp32.wire_bytes * 704 / total)
    assert hooked.latency_seconds == pytest.approx(3 * fp32.latency_seconds)  # three all-reduces a bucket
    with pytest.raises(ValueError, match="price it for the ddp strategy"):
        predict("distopt", specs, 8, COSTS, bucket_size=10_000, wire=wire)


def test_command_line_prices_powersgd_for_ddp_only() -> None:
    command = [sys.executable, "-m", "gradsync.buffers.plan", "--gpt", "256", "2", "1000", "--dp", "8",
               "--costs", "nccl-100g", "--grad-comm", "powersgd-r4"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "grad wire: powersgd-r4" in out
    assert "| distopt | - |" in out
    assert "PowerSGD is priced for ddp only" in out
    assert [line for line in out.splitlines() if line.startswith("| ddp | 8 |")]


@pytest.mark.parametrize(("name", "per_value"), [("bf16", 2.0), ("fp8", 1.0 + 4 / 32)])
def test_packed_zero3_gathers_scale_only_the_gathers(name: str, per_value: float) -> None:
    """ZeRO-3's weight gathers send the packed bytes per value and its grads' reduce-scatters fp32 (worked
    by hand as in the test above); the strategies that gather in fp32 refuse a packed gather, as the
    config does."""
    assert gather_wire_bytes(name, 32) == per_value
    dp = 4
    numels = [s.numel for s in SPECS]
    unit = sum(bucket_sizes(numels[1:13], None, dp))
    outside = sum(bucket_sizes([numels[0], numels[-2], numels[-1]], 40_000_000, dp))
    got = predict("zero3", SPECS, dp, COSTS, units=UNITS, gather_bytes=per_value)
    gathered, reduced = (4 + 3) * unit + outside, 4 * unit + outside
    assert got.wire_bytes == pytest.approx(3 / 4 * (gathered * per_value + reduced * FP32))
    assert got.latency_seconds == pytest.approx(
        predict("zero3", SPECS, dp, COSTS, units=UNITS).latency_seconds
    )
    with pytest.raises(ValueError, match="packed weight gathers are priced for zero3"):
        predict("distopt", SPECS, dp, COSTS, gather_bytes=per_value)
