"""`nox -s bench-ab`: gradsync DDP against torch DDP step by step in the same processes, at 4 and 25 MiB
buckets. Every system is built on its own copy of the toy GPT in one torchrun job; the timed loop runs one
step of each system in turn (a barrier before each), so a drift of the machine's speed touches all alike.
Each figure is the median step time of the slowest rank, as a ratio to the compute floor (the same model
and batch in the same processes, no wrapper, no communication) and to torch DDP.

    python benchmarks/bench_ab.py [--steps 30] [--bucket-mb 4 25]     (launches torchrun itself)

A system named ``<system>+telemetry`` runs with communication telemetry recording (its overhead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SYSTEMS = [
    "floor",
    "torch-ddp",
    "gradsync-ddp",
    "gradsync-ddp+overlap",
    "gradsync-ddp+distopt",
    "gradsync-ddp+distopt+overlap-param-gather",
]


TELEMETRY = "+telemetry"
"""A system name ending in this runs with gradsync's communication telemetry on during its steps."""


def with_telemetry(step: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``step`` recording into one recorder of its own (off again for the other systems' steps)."""
    from gradsync.buffers import CommTelemetry, disable_telemetry, enable_telemetry

    recorder = CommTelemetry()

    def traced(tokens: Any) -> Any:
        enable_telemetry(recorder)
        try:
            return step(tokens)
        finally:
            disable_telemetry()

    return traced


def interleaved(args: argparse.Namespace) -> None:
    """The torchrun worker: build every system, time their steps in turn, print a table on rank 0."""
    import torch
    import torch.distributed as dist
    from bench_worker import build
    from toygpt.data import Corpus, local_rows
    from toygpt.model import GPTConfig, GPTStage

    from gradsync.ddp import __version__ as ddp_version

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(seq_len=128, d_model=256, n_head=8, n_layer=6)
    options = argparse.Namespace(bucket_mb=args.bucket_mb, lr=1e-3, batch_per_rank=8)
    steps = {}
    for system in args.systems:
        torch.manual_seed(0)
        base = system.removesuffix(TELEMETRY)
        steps[system] = build(base, GPTStage(cfg), options)
        if system != base:
            steps[system] = with_telemetry(steps[system])
    corpus = Corpus.from_stdlib()
    warmup = 3
    batches = [local_rows(corpus.batch(i, 8 * world, 128), rank, world) for i in range(warmup + args.steps)]
    times: dict[str, list[float]] = {system: [] for system in args.systems}
    for index, tokens in enumerate(batches):
        for system in args.systems:
            dist.barrier()
            start = time.perf_counter()
            steps[system](tokens)
            if index >= warmup:
                times[system].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[s]) for s in args.systems], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank == 0:
        by_system = dict(zip(args.systems, medians.tolist(), strict=True))
        floor, torch_ddp = by_system["floor"], by_system.get("torch-ddp")
        print(f"\n{args.bucket_mb} MiB buckets, {world} ranks, {args.steps} interleaved steps (gradsync-ddp "
              f"{ddp_version}, torch {torch.__version__})\n")  # fmt: skip
        print("| system | median ms/step | step / floor | step / torch DDP |")
        print("|---|---|---|---|")
        for system, seconds in by_system.items():
            versus = f"{seconds / torch_ddp:.3f}" if torch_ddp else "-"
            print(f"| {system} | {seconds * 1e3:.1f} | {seconds / floor:.3f}x | {versus} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[4, 25])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.bucket_mb = args.bucket_mb[0]
        interleaved(args)
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "integration"), str(HERE)]),
    }
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
    ]
    for bucket_mb in args.bucket_mb:
        command = [*launcher, __file__, "--worker", "--steps", str(args.steps), "--bucket-mb", str(bucket_mb)]
        subprocess.run([*command, "--systems", *args.systems], env=env, check=True)


if __name__ == "__main__":
    main()
