"""``python -m gradsync.buffers.plan``: predict one step's communication for a model at several DP sizes.

    python -m gradsync.buffers.plan --gpt 4096 32 50304 --dp 8 64 512 4096 --costs nccl-h100-ib \\
        --forward-ms 120 --backward-ms 240
    python -m gradsync.buffers.plan --shapes shapes.json --dp 2 4 --costs gloo.json
    python -m gradsync.buffers.plan --module mypkg.model:build --unit-class Block --dp 64   (meta device)

``zero3`` needs the FSDP units: ``--gpt`` knows them (one per block), ``--module`` takes them from
``--unit-class``, a ``--shapes`` file gives them as ``{"shapes": [...], "units": [id or null, ...]}``.
    python -m gradsync.buffers.plan --gpt 8192 80 32000 --dp 512 --costs nccl-100g --grad-comm fp8
    python -m gradsync.buffers.plan --calibrate gloo.json                    (measure gloo's α and β here)
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ..layout import ParamSpec
from ..shard_alignment import parse_shard_alignment
from ..wire_format import WireFormat
from . import calibrate
from .costs import PUBLISHED, LinkCosts
from .muon import busiest_rank_flops
from .predict import (
    FP32,
    STRATEGIES,
    GradWire,
    Prediction,
    powersgd_wire,
    predict,
    recommend_bucket_size,
    specs_from_shapes,
)

CANDIDATES = (1_000_000, 4_000_000, 10_000_000, 25_000_000, 40_000_000, 100_000_000)


def gpt_shapes(d_model: int, n_layer: int, vocab: int) -> list[list[int]]:
    """A GPT block stack (fused qkv, 4x MLP, layernorms, biases) with a tied embedding."""
    d = d_model
    block = [[3 * d, d], [3 * d], [d, d], [d], [d], [d], [4 * d, d], [4 * d], [d, 4 * d], [d], [d], [d]]
    return [[vocab, d], *block * n_layer, [d], [d]]


def gpt_units(n_layer: int) -> list[int | None]:
    """:func:`gpt_shapes`' FSDP units: each block one unit, the embedding and final norm outside."""
    return [None, *(layer for layer in range(n_layer) for _ in range(12)), None, None]


def module_shapes(
    target: str, unit_class: str | None = None
) -> tuple[list[list[int]], list[int | None] | None]:
    """Build ``module:callable`` on the meta device; its param shapes, and each param's unit (the
    outermost submodule whose class is named ``unit_class``) when one is named."""
    module_name, _, attribute = target.partition(":")
    factory = getattr(importlib.import_module(module_name), attribute)
    with torch.device("meta"):
        model = factory()
    shapes = [list(p.shape) for p in model.parameters()]
    if unit_class is None:
        return shapes, None
    unit_of: dict[int, int] = {}
    for module in model.modules():
        if type(module).__name__ == unit_class and not any(id(p) in unit_of for p in module.parameters()):
            unit = len({*unit_of.values()})
            unit_of.update((id(p), unit) for p in module.parameters())
    return shapes, [unit_of.get(id(p)) for p in model.parameters()]


WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
"""``--grad-comm``: the wire's dtype (None: fp32 through the backend's own reduction)."""


POWERSGD = re.compile(r"powersgd-r([1-9][0-9]*)")
"""``--grad-comm powersgd-rN``: torch's PowerSGD comm hook at matrix rank N (the ddp strategy)."""


def grad_wire(name: str, block_size: int, shapes: Sequence[Sequence[int]] = ()) -> GradWire:
    """``--grad-comm``'s wire, priced at the bytes per value the wrappers' packing sends, or PowerSGD's
    factors for the model's ``shapes``."""
    powersgd = POWERSGD.fullmatch(name)
    if powersgd:
        return powersgd_wire(shapes, int(powersgd.group(1)))
    if name not in WIRE_DTYPES:
        raise SystemExit(f"--grad-comm {name!r}: choose one of {', '.join(WIRE_DTYPES)} or powersgd-rN")
    dtype = WIRE_DTYPES[name]
    return GradWire() if dtype is None else GradWire(WireFormat(dtype, block_size).bytes_per_value)


def gather_wire_bytes(name: str, block_size: int) -> float:
    """``--param-gather``'s bytes per value: fp32, or the packed wire's (payload and fp8 scales)."""
    dtype = WIRE_DTYPES[name]
    return float(FP32) if dtype is None else WireFormat(dtype, block_size).bytes_per_value


def costs_from(name: str) -> LinkCosts:
    if name in PUBLISHED:
        return PUBLISHED[name]
    path = Path(name)
    if not path.exists():
        raise SystemExit(f"--costs {name!r}: neither a published profile ({', '.join(PUBLISHED)}) nor a file")
    return calibrate.load(path)


def row(p: Prediction, recommended: str) -> str:
    bound = "latency" if p.latency_bound else "bandwidth"
    return (
        f"| {p.strategy} | {p.dp} | {p.bucket_size / 1e6:g}M | {p.buckets} | {p.comm_seconds * 1e3:.2f} | "
        f"{p.exposed_seconds * 1e3:.2f} | {bound} | {p.wire_bytes / 2**20:.1f} | "
        f"{p.peak_bytes / 2**30:.2f} | {p.padding_bytes / 2**20:.2f} | {recommended} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gpt", nargs=3, type=int, metavar=("D_MODEL", "N_LAYER", "VOCAB"))
    source.add_argument("--shapes", type=Path, help="JSON list of param shapes")
    source.add_argument("--module", help="module:callable building the model (on the meta device)")
    source.add_argument("--calibrate", type=Path, help="measure gloo's alpha and beta here, write this JSON")
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--bucket-size", type=int, help="elements (default: max(40M, 1M x dp))")
    parser.add_argument("--unit-class", help="with --module: the FSDP unit class name (for zero3)")
    parser.add_argument(
        "--costs", default="nccl-h100-ib", help=f"{', '.join(PUBLISHED)} or a calibration JSON"
    )
    parser.add_argument(
        "--shard-alignment",
        default="row",
        help="policy of every matrix param (row, tensor, block:k, block:RxC): its padding is reported",
    )
    parser.add_argument(
        "--grad-comm",
        default="fp32",
        help="what grad reductions send: fp32 reduced by the backend, a low-precision wire summed in "
        "fp32 (bf16, fp16, fp8: grad_comm_dtype; fp8 with one fp32 scale per --grad-comm-block-size "
        "values), or powersgd-rN (torch's PowerSGD hook at rank N, ddp only)",
    )
    parser.add_argument("--grad-comm-block-size", type=int, default=32)
    parser.add_argument(
        "--param-gather",
        default="fp32",
        choices=list(WIRE_DTYPES),
        help="what zero3's weight gathers send: fp32, or each rank's shard packed (param_gather_dtype; "
        "fp8 with one fp32 scale per --param-gather-block-size values)",
    )
    parser.add_argument("--param-gather-block-size", type=int, default=32)
    parser.add_argument("--forward-ms", type=float, default=0.0)
    parser.add_argument("--backward-ms", type=float, default=0.0)
    parser.add_argument(
        "--muon-tflops",
        type=float,
        help="matmul TFLOP/s of a rank: add Muon's Newton-Schulz time on the busiest rank (every matrix "
        "whole on one rank, as with --shard-alignment tensor; with --gpt, all but the embedding) beside "
        "--forward-ms + --backward-ms",
    )
    args = parser.parse_args()
    if args.calibrate:
        measured = calibrate.measure()
        fitted = calibrate.fit(measured)
        calibrate.save(fitted, measured, args.calibrate)
        print(json.dumps({"alpha": fitted.alpha, "beta": fitted.beta}, indent=1))
        return
    units: list[int | None] | None = None
    if args.gpt:
        shapes, units = gpt_shapes(*args.gpt), gpt_units(args.gpt[1])
    elif args.shapes:
        loaded = json.loads(args.shapes.read_text())
        shapes, units = (
            (loaded["shapes"], loaded.get("units")) if isinstance(loaded, dict) else (loaded, None)
        )
    else:
        shapes, units = module_shapes(args.module, args.unit_class)
    specs: list[ParamSpec] = specs_from_shapes(shapes, parse_shard_alignment(args.shard_alignment))
    costs = costs_from(args.costs)
    wire = grad_wire(args.grad_comm, args.grad_comm_block_size, shapes)
    forward, backward = args.forward_ms / 1e3, args.backward_ms / 1e3
    print(f"{sum(s.numel for s in specs) / 1e6:.1f}M params; costs: {costs.name} ({costs.source})")
    hook = (
        ": fp32 all-reduces of the whole tensors, the P and the Q factors" if wire.all_reduce_shares else ""
    )
    print(f"grad wire: {args.grad_comm} ({wire.value_bytes:.3g} bytes per value{hook})")
    gather_bytes = gather_wire_bytes(args.param_gather, args.param_gather_block_size)
    print(f"zero3 weight gathers: {args.param_gather} ({gather_bytes:.3g} bytes per value)\n")
    print("| strategy | dp | bucket | buckets | comm ms | exposed ms | bound | wire MiB/rank | peak GiB/rank "
          "| padding MiB | recommended bucket |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for strategy in args.strategy:
        if wire.all_reduce_shares and strategy != "ddp":
            print(f"| {strategy} |" + " - |" * 9 + " PowerSGD is priced for ddp only (a hook all-reduces) |")
            continue
        if gather_bytes != FP32 and strategy != "zero3":
            print(f"| {strategy} |" + " - |" * 9 + " packed weight gathers are zero3's |")
            continue
        if strategy == "zero3" and units is None:
            print("| zero3 |" + " - |" * 9 + " needs units (--unit-class, or units in --shapes) |")
            continue
        for dp in args.dp:
            p = predict(strategy, specs, dp, costs, bucket_size=args.bucket_size, forward_seconds=forward,
                        backward_seconds=backward, units=units, wire=wire,
                        gather_bytes=gather_bytes)  # fmt: skip
            if strategy == "zero3":  # buckets are the FSDP units, not a size
                print(row(p, "- (per unit)"))
                continue
            best = recommend_bucket_size(specs, dp, costs, strategy, CANDIDATES, forward, backward, wire)
            print(row(p, f"{best.bucket_size / 1e6:g}M"))
    if args.muon_tflops:  # --gpt: its tied embedding (the first shape) stays with AdamW, as Moonlight's
        print_muon(shapes[1:] if args.gpt else shapes, args.dp, args.muon_tflops, forward + backward)


def print_muon(shapes: list[list[int]], dps: list[int], tflops: float, compute_seconds: float) -> None:
    """Muon's Newton-Schulz on the busiest rank, and the step it makes against the same step with an
    element-wise optimizer (forward + backward given; the optimizers' own element-wise math left out)."""
    print(f"\nMuon (5 Newton-Schulz steps, every matrix whole on one rank, {tflops:g} TFLOP/s per rank)\n")
    print("| dp | NS GFLOP busiest rank | NS ms | step vs AdamW |")
    print("|---|---|---|---|")
    for dp in dps:
        flops = busiest_rank_flops(shapes, dp)
        seconds = flops / (tflops * 1e12)
        ratio = (
            f"{(compute_seconds + seconds) / compute_seconds:.3f}x"
            if compute_seconds
            else "- (no --forward-ms)"
        )
        print(f"| {dp} | {flops / 1e9:.1f} | {seconds * 1e3:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
