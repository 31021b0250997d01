"""`nox -s bench`: gradsync's DDP and FSDP strategies side by side with torch DDP, torch FSDP2 and DeepSpeed
ZeRO-1/2/3 on the same model, batch and ranks. Step times come from bench_ab.py: every system's steps
interleaved in the same processes (so the machine's drift touches all alike), as ratios to the compute
floor measured in the same processes, over ``--repeats`` fresh jobs (median and spread). Peak memory and
wire bytes come from each system run alone in its own processes (bench_worker.py), where peak RSS is that
system's. Writes benchmarks/RESULTS.md (one table, with the commit and versions) and results.png.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MUON_SUFFIXES = {"+muon": "float32", "+muon-bf16": "bfloat16"}
"""A gradsync system name ending in one of these steps with Muon (whole matrices on one rank each), not
AdamW, with its Newton-Schulz math in that dtype (bf16 as Keller Jordan's and Moonlight's Muon run it)."""
Result = dict[str, Any]  # one system's JSON line from bench_worker.py
GRADSYNC = [
    "gradsync-ddp",
    "gradsync-ddp+overlap",
    "gradsync-ddp+distopt",
    "gradsync-ddp+distopt+overlap-param-gather",
    "gradsync-fsdp-no_shard",
    "gradsync-fsdp-optim",
    "gradsync-fsdp-optim_grads",
    "gradsync-fsdp-optim_grads_params",
    "gradsync-fsdp-optim_grads_params+double-buffer",
]
PEERS = [
    "torch-ddp",
    "torch-fsdp2-no-reshard",
    "torch-fsdp2",
    "deepspeed-zero1",
    "deepspeed-zero2",
    "deepspeed-zero3",
]
TARGETS = [  # (system, peer, at most this ratio of the peer's step time): the targets
    ("gradsync-fsdp-no_shard", "gradsync-ddp+overlap", 1.0),
    ("gradsync-fsdp-optim", "gradsync-ddp+distopt", 1.0),
    ("gradsync-fsdp-no_shard", "torch-ddp", 1.0),
    ("gradsync-fsdp-optim", "torch-ddp", 1.0),
    ("gradsync-fsdp-optim", "deepspeed-zero1", 1.0),
    ("gradsync-fsdp-optim_grads", "deepspeed-zero2", 1.0),
    ("gradsync-fsdp-optim_grads_params", "torch-fsdp2", 0.90),
]


def launch(system: str, nproc: int, extra: list[str]) -> Result:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(HERE.parent / "integration"),
    }
    done = subprocess.run(
        [*command, str(HERE / "bench_worker.py"), "--system", system, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(
            f"{system} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    if done.returncode != 0:  # measured, then crashed in teardown (seen once with torch FSDP2: SIGABRT)
        print(f"{system}: exit {done.returncode} after its result line; the result is used", flush=True)
    result: Result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"{system:>45}: {1000 * result['step_s']:7.1f} ms/step", flush=True)
    return result


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or "unknown CPU",
    )
    memory = next(
        line.split()[1]
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )

    def version(name: str) -> str:
        """The version of the code that runs: a gradsync package's own ``__version__`` (an editable
        install's metadata keeps the version it was installed at), else the distribution's."""
        if name.startswith("gradsync-"):
            return str(importlib.import_module(name.replace("-", ".")).__version__)
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"{cpu}, {os.cpu_count()} cores, {int(memory) / 2**20:.0f} GiB RAM, no GPU; "
        f"Linux {platform.release()}; "
        f"Python {platform.python_version()}, torch {version('torch')}, deepspeed {version('deepspeed')}, "
        f"gradsync-ddp {version('gradsync-ddp')}, gradsync-fsdp {version('gradsync-fsdp')}"
    )


def muon_suffix(system: str) -> str:
    """The Muon suffix ``system`` ends in, or ``""`` for an AdamW system."""
    return next((suffix for suffix in MUON_SUFFIXES if system.endswith(suffix)), "")


def ring_minimum(param_bytes: float, world: int) -> float:
    """Bytes each rank must send to sum the grads across ``world`` ranks (ring all-reduce, or
    reduce-scatter + all-gather): 2 (p - 1) / p of the grads."""
    return 2 * (world - 1) / world * param_bytes


MEMORY_PEERS = {  # each gradsync strategy against the peers that shard as much
    "gradsync-ddp": ["torch-ddp"],
    "gradsync-ddp+overlap": ["torch-ddp"],
    "gradsync-fsdp-no_shard": ["torch-ddp"],
    "gradsync-ddp+distopt": ["deepspeed-zero1"],
    "gradsync-ddp+distopt+overlap-param-gather": ["deepspeed-zero1"],
    "gradsync-fsdp-optim": ["deepspeed-zero1"],
    "gradsync-fsdp-optim_grads": ["deepspeed-zero2", "torch-fsdp2-no-reshard"],
    "gradsync-fsdp-optim_grads_params": ["torch-fsdp2", "deepspeed-zero3"],
    "gradsync-fsdp-optim_grads_params+double-buffer": ["torch-fsdp2", "deepspeed-zero3"],
}


def write_results(
    times: dict[str, dict[str, float]], rows: dict[str, Result], floor: Result, args: argparse.Namespace
) -> Path:
    """One table: step times from the interleaved runs (``times``, bench_ab's summary), wire bytes and
    peak RSS from the runs alone (``rows``); then the targets, met or not."""
    from bench_ab import commit

    world = args.nproc
    lines = [
        "# Benchmarks: gradsync vs torch DDP, torch FSDP2 and DeepSpeed ZeRO",
        "",
        f"Written by `nox -s bench` (benchmarks/bench.py) at commit {commit()}. Machine: {machine()}.",
        "",
        f"Measured: commit {commit()}, {datetime.date.today().isoformat()}, {machine()}",
        "",
        f"Model: the integration toy GPT, {floor['params'] / 1e6:.2f}M params (d_model {args.d_model}, "
        f"{args.n_layer} layers, seq {args.seq_len}), fp32, AdamW. {world} gloo ranks with one thread each, "
        f"8 sequences per rank per step; buckets of {args.bucket_mb} MiB wherever a system has them.",
        "",
        "- **step / floor**: every system's steps interleaved in the same processes (rounds of one step of "
        "each, a barrier before each step, each round starting one system further on), so a drift of the "
        "machine's speed touches all alike; a step's time is its slowest rank's. The median over "
        f"{args.steps} rounds (after 3 warm-up rounds) of a system's step over the compute floor's in the "
        "same round (the same model and per-rank batch in the same processes, no wrapper, no "
        f"communication). The median over {args.repeats} such jobs in fresh processes, and their spread "
        "(lowest-highest).",
        "- **wire / ring min**: bytes each rank wrote to its sockets per step (`wchar` in /proc/self/io; "
        "gloo sends over TCP) over the ring minimum for summing the grads, 2(p-1)/p x param bytes "
        f"= {ring_minimum(floor['param_bytes'], world) / 2**20:.1f} MiB; and **peak RSS / floor**, the "
        "largest rank's peak resident memory over the floor's (one rank): both from each system run alone "
        "in its own processes, where peak RSS is that system's.",
        "",
        "| system | ms/step | step / floor | spread over repeats | wire MiB/step | wire / ring min | "
        "peak RSS MiB | peak RSS / floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, timing in times.items():
        row = rows.get(system, floor)
        wire = row["wire_bytes_per_step"]
        ring = ring_minimum(row["param_bytes"], world) if system != "floor" else 0.0
        lines.append(
            f"| {system} | {1000 * timing['step_s']:.1f} | {timing['ratio']:.3f}x | "
            f"{timing['ratio_lo']:.3f}-{timing['ratio_hi']:.3f} | {wire / 2**20:.1f} | "
            f"{wire / ring if ring else 0:.2f}x | {row['peak_rss_bytes'] / 2**20:.0f} | "
            f"{row['peak_rss_bytes'] / floor['peak_rss_bytes']:.2f}x |"
        )
    lines += ["", "Targets, step times as ratios in the same interleaved runs:", ""]
    for system, peer, bound in TARGETS:
        if system in times and peer in times:
            ratio = times[system]["ratio"] / times[peer]["ratio"]
            verdict = "met" if ratio <= bound else "missed"
            lines.append(
                f"- {system} {times[system]['ratio']:.3f}x against {peer} {times[peer]['ratio']:.3f}x: "
                f"{ratio:.3f} of it (target <= {bound:.2f}): {verdict}"
            )
    for system, peers in MEMORY_PEERS.items():
        present = [p for p in peers if p in rows]
        if system in rows and present:
            mine = rows[system]["peak_rss_bytes"]
            worst = min(rows[p]["peak_rss_bytes"] for p in present)
            verdict = "met" if mine <= worst else "missed"
            lines.append(
                f"- peak RSS of {system} {mine / 2**20:.0f} MiB against {', '.join(present)} "
                f"(lowest {worst / 2**20:.0f} MiB): {verdict}"
            )
    lines += [
        "",
        "Reading the wire column: gloo's `reduce_scatter_tensor` all-reduces and keeps its part, so it "
        "sends as many bytes as an all-reduce (measured: 1.0x the bucket at 2 ranks, 1.5x at 4, vs "
        "(p-1)/p for NCCL). Every ZeRO strategy here therefore pays reduce-scatter at all-reduce price "
        "plus the param all-gather: 1.5x the ring minimum at 2 ranks, where NCCL would give 1.0x. ZeRO-3 "
        "(FSDP2, gradsync's fsdp-optim_grads_params, DeepSpeed ZeRO-3) also gathers the params again for "
        "backward: about 2.0x. gradsync keeps the last block gathered from its forward into the backward, "
        "one block's gather less per step. DeepSpeed ZeRO-3 keeps params below its "
        "stage3_param_persistence_threshold unsharded, which lowers its wire bytes and raises its memory.",
        "",
        "Allocators: fsdp-optim_grads_params+double-buffer is the same ZeRO-3 with `fsdp_double_buffer`, "
        "two persistent block-sized buffers per kind lent from block to block instead of buffers "
        "allocated per gather and per backward; its peak RSS next to fsdp-optim_grads_params is what the "
        "allocator changes in memory. It also serialises more: a grad waits for the oldest reduction to "
        "free a buffer, and prefetch stops while two blocks hold both.",
    ]
    png = plot(HERE / "results.png", times)
    if png:
        lines += ["", f"![step time over the floor]({png.name})"]
    path = HERE / "RESULTS.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot(path: Path, times: dict[str, dict[str, float]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [name for name in times if name != "floor"]
    ratios = [times[n]["ratio"] for n in names]
    spread = [
        [times[n]["ratio"] - times[n]["ratio_lo"] for n in names],
        [times[n]["ratio_hi"] - times[n]["ratio"] for n in names],
    ]
    colours = ["tab:blue" if n.startswith("gradsync") else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.barh(names, ratios, xerr=spread, color=colours)
    ax.axvline(1.0, color="black", linewidth=1, label="compute floor")
    ax.set(
        xlabel="step time / compute floor, interleaved (lower is better)",
        title="fp32 GPT step time, gloo on CPU",
    )
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    from bench_ab import run_repeats, summarise

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--systems", nargs="*", default=GRADSYNC + PEERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-steps", type=int, default=5, help="steps of each run alone (peak RSS)")
    parser.add_argument("--bucket-mb", type=int, default=4)
    args = parser.parse_args()
    args.batch_per_rank, args.seq_len, args.d_model, args.n_layer = 8, 128, 256, 6  # bench_ab's model
    timed = argparse.Namespace(
        nproc=args.nproc,
        steps=args.steps,
        repeats=args.repeats,
        systems=["floor", *args.systems],
        batch_per_rank=args.batch_per_rank,
    )
    times = summarise(run_repeats(timed, args.bucket_mb))
    print("step times (interleaved):", json.dumps({k: round(v["ratio"], 3) for k, v in times.items()}))
    extra = [f"--bucket-mb={args.bucket_mb}", "--warmup=2", f"--steps={args.memory_steps}"]
    floor = launch("floor", 1, extra)
    rows = {system: launch(system, args.nproc, extra) for system in args.systems}
    print(f"results: {write_results(times, rows, floor, args)}")


if __name__ == "__main__":
    main()
