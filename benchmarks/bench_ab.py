"""`nox -s bench-ab`: every system's step interleaved in the same processes. Every system is built on its own
copy of the toy GPT in one torchrun job; the timed loop runs rounds of one step of each system (a barrier
before each; each round starts one system further on), so a drift of the machine's speed touches all
alike. A step's time is its slowest rank's. Each ratio, to the compute floor (the same model and batch in
the same processes, no wrapper, no communication) or to torch DDP, is the median over rounds of the two
steps' ratio within a round; step times are medians over rounds. ``--repeats`` runs the whole job again
in fresh processes and reports the median and the spread of each ratio, and a 95 % interval for the median
ratio to torch DDP over every round; ``--json`` writes them for bench.py.

    python benchmarks/bench_ab.py [--steps 20] [--bucket-mb 4] [--repeats 1] [--systems ...]

A system named ``<system>+telemetry`` runs with communication telemetry recording (its overhead).

``--phases`` runs one more job that also times each step's parts (bench_worker.PHASES; DeepSpeed's steps are
not split) and prints each system's median per part over every round and rank beside the floor's: where a
system's time over the floor goes, with no sampler slowing the 2-core machine. torch DDP and FSDP2 reduce
inside the backward, so their waits fall in it; gradsync's last reductions are waited in
``finalize_model_grads``.
"""

from __future__ import annotations

import argparse
import json
import math
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
    "gradsync-fsdp-no_shard",
    "gradsync-fsdp-optim",
    "gradsync-fsdp-optim_grads",
    "gradsync-fsdp-optim_grads_params",
    "gradsync-fsdp-optim_grads_params+double-buffer",
    "torch-fsdp2-no-reshard",
    "torch-fsdp2",
    "deepspeed-zero1",
    "deepspeed-zero2",
    "deepspeed-zero3",
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
    """The torchrun worker: build every system, time their steps in turn; rank 0 prints the medians (JSON)."""
    import bench_worker
    import torch
    import torch.distributed as dist
    from bench_worker import build
    from toygpt.data import Corpus, local_rows
    from toygpt.model import GPTConfig, GPTStage

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(seq_len=128, d_model=256, n_head=8, n_layer=6)
    options = argparse.Namespace(bucket_mb=args.bucket_mb, lr=1e-3, batch_per_rank=args.batch_per_rank)
    steps = {}
    for system in args.systems:
        torch.manual_seed(0)
        base = system.removesuffix(TELEMETRY)
        steps[system] = build(base, GPTStage(cfg), options)
        if system != base:
            steps[system] = with_telemetry(steps[system])
    corpus = Corpus.from_stdlib()
    warmup = 3
    per_step = args.batch_per_rank * world
    batches = [local_rows(corpus.batch(i, per_step, 128), rank, world) for i in range(warmup + args.steps)]
    times = torch.zeros(args.steps, len(args.systems), dtype=torch.float64)
    parts = torch.zeros(args.steps, len(args.systems), len(bench_worker.PHASES), dtype=torch.float64)
    for index, tokens in enumerate(batches):
        # each round starts one system further on, so none always runs right after the same other one
        turn = index % len(args.systems)
        for column in [*range(turn, len(args.systems)), *range(turn)]:
            dist.barrier()
            bench_worker.phase_marks = [] if args.phases else None
            start = time.perf_counter()
            steps[args.systems[column]](tokens)
            if index >= warmup:
                times[index - warmup, column] = time.perf_counter() - start
                marks = bench_worker.phase_marks or []
                if len(marks) == len(bench_worker.PHASES) + 1:
                    parts[index - warmup, column] = torch.tensor(marks, dtype=torch.float64).diff()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # in each step the slowest rank sets the pace
    every_rank = [torch.zeros_like(parts) for _ in range(world)]
    dist.all_gather(every_rank, parts)
    if rank == 0:
        rounds = dict(zip(args.systems, times.t().tolist(), strict=True))
        print("RESULT " + json.dumps(rounds), flush=True)
        if args.phases:  # per system and part, the median over every round and rank
            medians = torch.cat(every_rank).median(dim=0).values
            by_system = dict(zip(args.systems, medians.tolist(), strict=True))
            print("PHASES " + json.dumps({"parts": bench_worker.PHASES, "median_s": by_system}), flush=True)
    dist.destroy_process_group()


Rounds = dict[str, list[float]]
"""One job's step times (s) per system, round by round: a round runs one step of every system."""


def run_repeats(args: argparse.Namespace, bucket_mb: int, phases: bool = False) -> list[Any]:
    """``args.repeats`` interleaved jobs in fresh processes: per repeat, each system's step times
    (:data:`Rounds`). With ``phases``, one job whose result is each system's median time per part of a step
    instead (:func:`phase_table`)."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "integration"), str(HERE)]),
    }
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"),
        *(__file__, "--worker", "--steps", str(args.steps), "--bucket-mb", str(bucket_mb)),
        *("--batch-per-rank", str(args.batch_per_rank)),
        *("--systems", *args.systems),
    ]
    if phases:
        return [result_of([*command, "--phases"], env, tag="PHASES")]
    return [result_of(command, env) for _ in range(args.repeats)]


def result_of(command: list[str], env: dict[str, str], tag: str = "RESULT") -> Any:
    """Run a torchrun job; the JSON its rank 0 printed last on a line starting with ``tag``."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(f"{tag} ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(
            f"torchrun job failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return json.loads(lines[-1].removeprefix(f"{tag} "))


def phase_table(result: dict[str, Any]) -> list[str]:
    """Each system's median ms per part of a step, and what each part costs over the floor's."""
    names: list[str] = result["parts"]
    phases: dict[str, list[float]] = result["median_s"]
    floor = phases["floor"]
    lines = [
        "| system | " + " | ".join(names) + " | parts' sum | over the floor, by part |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for system, parts in phases.items():
        if not any(parts):
            continue  # a step not split into parts
        over = ", ".join(
            f"{name} {1e3 * (mine - base):+.1f}" for name, mine, base in zip(names, parts, floor, strict=True)
        )
        cells = " | ".join(f"{1e3 * part:.1f}" for part in parts)
        lines.append(f"| {system} | {cells} | {1e3 * sum(parts):.1f} | {over if system != 'floor' else ''} |")
    return lines


def paired_ratio(rounds: Rounds, system: str, reference: str) -> float:
    """The median over rounds of ``system``'s step over ``reference``'s in the same round: the machine's
    speed drifts by tens of percent within a job, and a ratio of steps taken seconds apart cancels it."""
    return statistics.median(
        mine / theirs for mine, theirs in zip(rounds[system], rounds[reference], strict=True)
    )


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics ``k`` and ``n + 1 - k``
    (1-based), with ``k`` the largest for which the chance that fewer than ``k`` of ``n`` draws fall below
    the true median (a fair binomial) is at most half of ``1 - confidence``. Fewer than 6 values cannot
    reach 95 %: their whole range is returned."""
    ordered, n = sorted(values), len(values)
    below, k = 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # the chance that exactly k draws fall below the median
        if below > (1 - confidence) / 2:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def summarise(repeats: list[Rounds]) -> dict[str, dict[str, float]]:
    """Per system: the median step over repeats (each repeat's median), and the median, lowest and
    highest over repeats of its paired ratio to the floor; the median paired ratio to torch DDP, with a
    95 % interval for the median of that ratio over every round of every repeat (a target such as "at most
    torch DDP's step" holds beyond the machine's noise only when the interval's top is under it)."""
    summary = {}
    for system in repeats[0]:
        ratios = sorted(paired_ratio(r, system, "floor") for r in repeats)
        versus_ddp = [paired_ratio(r, system, "torch-ddp") for r in repeats if "torch-ddp" in r]
        every_round = [
            mine / theirs
            for r in repeats
            if "torch-ddp" in r
            for mine, theirs in zip(r[system], r["torch-ddp"], strict=True)
        ]
        low, high = median_interval(every_round) if every_round else (float("nan"), float("nan"))
        summary[system] = {
            "step_s": statistics.median(statistics.median(r[system]) for r in repeats),
            "ratio": statistics.median(ratios),
            "ratio_lo": ratios[0],
            "ratio_hi": ratios[-1],
            "vs_torch_ddp": statistics.median(versus_ddp) if versus_ddp else float("nan"),
            "vs_torch_ddp_lo": low,
            "vs_torch_ddp_hi": high,
        }
    return summary


def table(summary: dict[str, dict[str, float]]) -> list[str]:
    lines = [
        "| system | median ms/step | step / floor | spread over repeats | step / torch DDP | 95 % interval |",
        "|---|---|---|---|---|---|",
    ]
    for system, row in summary.items():
        lines.append(
            f"| {system} | {row['step_s'] * 1e3:.1f} | {row['ratio']:.3f}x | "
            f"{row['ratio_lo']:.3f}-{row['ratio_hi']:.3f} | {row['vs_torch_ddp']:.3f} | "
            f"{row['vs_torch_ddp_lo']:.3f}-{row['vs_torch_ddp_hi']:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[4])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-per-rank", type=int, default=8, help="sequences of 128 bytes per rank")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--json", type=Path, help="write {bucket_mb: summary} here")
    parser.add_argument("--phases", action="store_true", help="also time each step's parts (one more job)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.bucket_mb = args.bucket_mb[0]
        interleaved(args)
        return
    if "floor" not in args.systems:
        args.systems = ["floor", *args.systems]
    from gradsync.ddp import __version__ as ddp_version
    from gradsync.fsdp import __version__ as fsdp_version

    summaries = {}
    for bucket_mb in args.bucket_mb:
        summaries[bucket_mb] = summary = summarise(run_repeats(args, bucket_mb))
        print(
            f"\n{bucket_mb} MiB buckets, {args.nproc} ranks, {args.batch_per_rank} sequences per rank, "
            f"{args.steps} interleaved steps, {args.repeats} "
            f"repeat(s) (gradsync-ddp {ddp_version}, gradsync-fsdp {fsdp_version}, commit {commit()})\n"
        )
        print("\n".join(table(summary)), flush=True)
        if args.phases:
            (phases,) = run_repeats(args, bucket_mb, phases=True)
            print("\nms per part of a step, median over every round and rank of one more job:\n")
            print("\n".join(phase_table(phases)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))


def commit() -> str:
    """The checked-out commit, with ``+dirty`` when the tree has changes."""

    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=HERE, capture_output=True, text=True, check=False).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


if __name__ == "__main__":
    main()
