"""Muon against AdamW under the same strategy: steps interleaved in the same processes
(bench_ab.py) at two batch sizes, and each system alone for the bytes it writes to its sockets.

Muon's extra cost is the Newton-Schulz math of the matrices a rank owns (its FLOPs do not grow with the
batch) plus the padding the ``tensor`` policy adds to the wire; AdamW's step is element-wise. So the
ratio falls as the batch per rank grows, and the table shows it at 8 and 64 sequences of 128 bytes, with
Newton-Schulz in fp32 (``+muon``) and in bf16 (``+muon-bf16``, as Keller Jordan's and Moonlight's Muon).

    python benchmarks/bench_muon.py            # nox -s bench-muon
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import MUON_SUFFIXES, launch, muon_suffix  # noqa: E402
from bench_ab import commit, paired_ratio, run_repeats  # noqa: E402
from bench_report import ring_minimum  # noqa: E402

STRATEGIES = ["gradsync-ddp+distopt", "gradsync-fsdp-optim", "gradsync-fsdp-optim_grads_params"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64], help="sequences per rank")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 8], help="timed steps per batch size")
    parser.add_argument("--repeats", type=int, nargs="+", default=[3, 1], help="jobs per batch size")
    args = parser.parse_args()
    systems = ["floor", *(s + suffix for s in STRATEGIES for suffix in ("", *MUON_SUFFIXES))]
    ratios: dict[int, dict[str, float]] = {}
    for batch, steps, repeats in zip(args.batches, args.steps, args.repeats, strict=True):
        job = argparse.Namespace(nproc=2, steps=steps, repeats=repeats, systems=systems, batch_per_rank=batch)
        runs = run_repeats(job, 4)
        ratios[batch] = {s: statistics.median(paired_ratio(r, s, "floor") for r in runs) for s in systems}
    alone = {s: launch(s, 2, ["--steps", "5", "--bucket-mb", "4"]) for s in systems[1:]}
    ring = ring_minimum(alone[systems[1]]["param_bytes"], 2)
    header = " | ".join(f"step / floor, {b} seq/rank | Muon / AdamW, {b} seq/rank" for b in args.batches)
    print(f"\nMuon vs AdamW, 2 gloo ranks, toy GPT 4.84M params, commit {commit()}\n")
    print(f"| system | {header} | wire MiB/step | wire / ring min |")
    print("|---|" + "---|" * (2 * len(args.batches) + 2))
    for system in systems[1:]:
        adamw = system.removesuffix(muon_suffix(system))
        cells = " | ".join(
            f"{ratios[b][system]:.3f}x | {ratios[b][system] / ratios[b][adamw]:.3f}" for b in args.batches
        )
        wire = alone[system]["wire_bytes_per_step"]
        print(f"| {system} | {cells} | {wire / 2**20:.1f} | {wire / ring:.2f}x |")


if __name__ == "__main__":
    main()
