"""Where each system's host time goes on the launch-bound model (not a test): bench_launch.py's interleaved
job (the same systems, model and batch, every system's steps in turn in the same processes), run under
py-spy with idle time (so a wait on gloo counts as the wall time it takes), and each sample put in one
of four kinds for the system whose step it fell in:

- model compute + torch: the model's forward, the autograd engine, and torch code that no gradsync frame
  below it called;
- optimizer math: inside ``torch.optim``;
- wait: waiting for a collective;
- gradsync bookkeeping: gradsync's own Python (hooks, schedules, lending, ...) and what it calls.

Each system's step is called through a function named after it, so every sample has one owner.
``--model gpt`` profiles bench_ab.py's side-by-side GPT instead (d_model 256, 6 layers, 8 sequences of 128
tokens per rank, 4 MiB buckets), where compute hides most host work. torch DDP's reducer waits in C++,
which py-spy does not see as a wait: its waits count as model compute + torch. Needs
py-spy (``pip install py-spy``; it reads the ranks' memory, so it may need ptrace rights). From the
repository root:

    python benchmarks/profile_launch.py --steps 300 --detail gradsync-fsdp-optim gradsync-ddp+distopt
    python benchmarks/profile_launch.py --model gpt --steps 30 --systems floor torch-ddp \
        gradsync-fsdp-no_shard gradsync-fsdp-optim gradsync-fsdp-optim_grads_params torch-fsdp2
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = [
    "floor",
    "gradsync-ddp+overlap",
    "gradsync-ddp+distopt",
    "gradsync-fsdp-no_shard",
    "gradsync-fsdp-optim",
    "gradsync-fsdp-optim_grads",
]
RATES = {"launch": 200, "gpt": 50}  # samples per second: the GPT's steps are 40 times longer
KINDS = ("model compute + torch", "optimizer math", "wait", "gradsync bookkeeping")
GRADSYNC_FRAME = re.compile(r"\((fsdp|ddp|buffers|finalize|groups)/")
# gradsync frames that only hold the model's or the optimizer's own work
CONTAINERS = (
    "MegatronFSDP.forward",
    "DistributedDataParallel.forward",
    "fully_shard_optimizer.<locals>.step",
    "MegatronTrainingLoop.step",
    "DistributedOptimizer.step_with_ready_grads",
    "labelled.<locals>",
    "weak_method.<locals>",
)
WAITS = ("Launched.wait", "_SummedAllToAllWork.wait", ".wait (torch")


def caller_name(system: str) -> str:
    return "SYS_" + re.sub(r"\W", "_", system)


def worker(systems: list[str], steps: int, model: str) -> None:
    """bench_launch's interleaved loop on ``model`` (the launch-bound model, or bench_ab's GPT), each
    step called through its system's own function."""
    sys.path.insert(0, str(HERE))
    import bench_launch
    import torch
    import torch.distributed as dist

    device = bench_launch.join_ranks("cpu")
    if model == "gpt":  # bench_ab.py's side-by-side model and buckets
        from toygpt.model import GPTConfig

        cfg = GPTConfig(seq_len=128, d_model=256, n_head=8, n_layer=6)
        preset, bucket_mb = bench_launch.Preset(cfg, batch=8), 4
    else:
        preset, bucket_mb = bench_launch.PRESETS["launch"], 25
    options = argparse.Namespace(bucket_mb=bucket_mb, lr=1e-3, batch_per_rank=preset.batch)
    callers = {}
    for system in systems:
        step = bench_launch.build(system, preset, device, options)
        scope: dict[str, object] = {}
        exec(f"def {caller_name(system)}(step, tokens):\n    return step(tokens)\n", scope)
        callers[system] = (scope[caller_name(system)], step)
    generator = torch.Generator().manual_seed(dist.get_rank())
    shape = (preset.batch, preset.cfg.seq_len + 1)
    for _ in range(steps):
        tokens = torch.randint(preset.cfg.vocab_size, shape, generator=generator)
        for call, step in callers.values():
            dist.barrier()  # nothing in flight when a step starts
            call(step, tokens)  # type: ignore[operator]
    dist.destroy_process_group()


def kind_of(frames: list[str]) -> str:
    """The kind of one sample's frames below its system's caller."""
    if any(wait in frame for frame in frames for wait in WAITS):
        return "wait"
    if GRADSYNC_FRAME.search(frames[-1]):
        return "gradsync bookkeeping"
    ours = [
        i
        for i, frame in enumerate(frames)
        if GRADSYNC_FRAME.search(frame) and not frame.startswith(CONTAINERS)
    ]
    below = frames[max(ours) + 1 :] if ours else frames
    if any("torch/optim/" in frame for frame in below):
        return "optimizer math"
    if ours and not any("toygpt/" in f or "_engine_run_backward" in f for f in below):
        return "gradsync bookkeeping"
    return "model compute + torch"


def summarise(raw: Path, systems: list[str], steps: int, detail: list[str], rate: int) -> list[str]:
    """Samples per rank and step of each system, by kind; the top bookkeeping frames of ``detail``."""
    owners = {caller_name(s): s for s in systems}
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    frames_of: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    ranks: dict[str, set[str]] = collections.defaultdict(set)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        found = [(i, owners[f.split(" (")[0]]) for i, f in enumerate(frames) if f.split(" (")[0] in owners]
        if not found:
            continue
        index, system = found[0]
        below = frames[index + 1 :] or ["(the caller itself)"]
        kind = kind_of(below)
        kinds[system][kind] += int(count)
        ranks[system].add(frames[1].split(":")[0])
        if kind in ("gradsync bookkeeping", "wait"):
            ours = [re.sub(r":\d+\)", ")", f) for f in below if GRADSYNC_FRAME.search(f)]
            top = [f for f in ours if not f.startswith(CONTAINERS)][:2] or ours[-1:] or ["(torch's own)"]
            frames_of[system, kind][" > ".join(top)] += int(count)
    ms = 1000 / rate
    lines = [
        f"ms per rank and step ({rate} Hz samples with idle time, {steps} interleaved steps; each ratio is "
        "the total over the floor's)",
        "",
        "| system | total | " + " | ".join(KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    per_step = {s: steps * max(1, len(ranks[s])) for s in systems}
    floor = sum(kinds["floor"].values()) / per_step["floor"] if "floor" in systems else 0.0
    for system in systems:
        total = sum(kinds[system].values()) / per_step[system]
        ratio = f" ({total / floor:.2f}x)" if floor else ""
        cells = " | ".join(f"{kinds[system][k] / per_step[system] * ms:.1f}" for k in KINDS)
        lines.append(f"| {system} | {total * ms:.1f}{ratio} | {cells} |")
    for system in detail:
        for kind, shown in (("gradsync bookkeeping", 10), ("wait", 5)):
            lines += ["", f"{system}: {kind.removeprefix('gradsync ')} by frame, ms per rank and step"]
            for frame, samples in frames_of[system, kind].most_common(shown):
                lines.append(f"  {samples / per_step[system] * ms:6.2f}  {frame[:160]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", choices=["launch", "gpt"], default="launch")
    parser.add_argument(
        "--detail", nargs="*", default=[], help="systems whose bookkeeping and waits to list by frame"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.systems, args.steps, args.model)
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("profile_launch.py needs py-spy: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
        job += ["--worker", "--steps", str(args.steps), "--model", args.model, "--systems", *args.systems]
        record = [
            spy,
            "record",
            "--idle",
            "--subprocesses",
            "-r",
            str(RATES[args.model]),
            "-f",
            "raw",
            "-o",
            str(raw),
            "--",
        ]
        subprocess.run([*record, *job], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        print("\n".join(summarise(raw, args.systems, args.steps, args.detail, RATES[args.model])))


if __name__ == "__main__":
    main()
