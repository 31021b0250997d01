"""`nox -s bench`: gradsync's DDP and FSDP strategies side by side with torch DDP, torch FSDP2 and DeepSpeed
ZeRO-1/2/3, in one run on the same model, batch and ranks, each as a ratio to the compute floor (the same
model and per-rank batch on one rank, no communication). Writes benchmarks/RESULTS.md and results.png.
"""

from __future__ import annotations

import argparse
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
PEERS = ["torch-ddp", "torch-fsdp2", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]


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
    if done.returncode != 0 or not lines:
        raise SystemExit(
            f"{system} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
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


def ring_minimum(param_bytes: float, world: int) -> float:
    """Bytes each rank must send to sum the grads across ``world`` ranks (ring all-reduce, or
    reduce-scatter + all-gather): 2 (p - 1) / p of the grads."""
    return 2 * (world - 1) / world * param_bytes


def write_results(rows: list[Result], floor: Result, args: argparse.Namespace) -> Path:
    world = args.nproc
    lines = [
        "# Benchmarks: gradsync vs torch DDP, torch FSDP2 and DeepSpeed ZeRO",
        "",
        f"Written by `nox -s bench` (benchmarks/bench.py). Machine: {machine()}.",
        "",
        f"Model: the integration toy GPT, {floor['params'] / 1e6:.2f}M params (d_model {args.d_model}, "
        f"{args.n_layer} layers, seq {args.seq_len}), fp32, AdamW. {world} gloo ranks with one thread each, "
        f"{args.batch_per_rank} sequences per rank per step; buckets of {args.bucket_mb} MiB wherever a "
        f"system has them. Median of {args.steps} steps after {args.warmup} warm-up steps; the slowest "
        "rank counts.",
        "",
        "- **step / floor**: step time over the compute floor's (the same model and per-rank batch on one "
        "rank, no communication, measured in this run).",
        "- **exposed comm**: step time minus the floor, i.e. the communication (and wrapper overhead) that "
        "computation did not hide.",
        "- **wire / ring min**: bytes each rank wrote to its sockets per step (`wchar` in /proc/self/io; "
        "gloo sends over TCP) over the ring minimum for summing the grads, 2(p-1)/p x param bytes "
        f"= {ring_minimum(floor['param_bytes'], world) / 2**20:.1f} MiB.",
        "- **peak RSS / floor**: the largest rank's peak resident memory over the floor's.",
        "",
        "| system | ms/step | step / floor | exposed comm ms | wire MiB/step | wire / ring min | "
        "peak RSS MiB | peak RSS / floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in [floor, *rows]:
        exposed = 1000 * (row["step_s"] - floor["step_s"])
        wire = row["wire_bytes_per_step"]
        ring = ring_minimum(row["param_bytes"], world) if row is not floor else 0.0
        lines.append(
            f"| {row['system']} | {1000 * row['step_s']:.1f} | {row['step_s'] / floor['step_s']:.2f}x | "
            f"{exposed:.1f} | {wire / 2**20:.1f} | {wire / ring if ring else 0:.2f}x | "
            f"{row['peak_rss_bytes'] / 2**20:.0f} | {row['peak_rss_bytes'] / floor['peak_rss_bytes']:.2f}x |"
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
        "",
        "Each system runs in its own processes, one after another, so a drift of the machine's speed "
        "between systems (10-25 % on this machine) moves their ratios. `nox -s bench-ab` times gradsync "
        "DDP and torch DDP step by step in the same processes instead, which cancels the drift (results "
        "in packages/gradsync-ddp/README.md).",
    ]
    png = plot(HERE / "results.png", floor, rows)
    if png:
        lines += ["", f"![step time over the floor]({png.name})"]
    path = HERE / "RESULTS.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot(path: Path, floor: Result, rows: list[Result]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["system"] for r in rows]
    ratios = [r["step_s"] / floor["step_s"] for r in rows]
    colours = ["tab:blue" if n.startswith("gradsync") else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.barh(names, ratios, color=colours)
    ax.axvline(1.0, color="black", linewidth=1, label="compute floor")
    ax.set(xlabel="step time / compute floor (lower is better)", title="fp32 GPT step time, gloo on CPU")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--systems", nargs="*", default=GRADSYNC + PEERS)
    for flag, default in (
        ("--batch-per-rank", 8),
        ("--seq-len", 128),
        ("--d-model", 256),
        ("--n-layer", 6),
        ("--bucket-mb", 4),
        ("--warmup", 3),
        ("--steps", 20),
    ):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    extra = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("batch_per_rank", "seq_len", "d_model", "n_layer", "bucket_mb", "warmup", "steps")
    ]
    floor = launch("floor", 1, extra)
    rows = [launch(system, args.nproc, extra) for system in args.systems]
    print(f"results: {write_results(rows, floor, args)}")


if __name__ == "__main__":
    main()
