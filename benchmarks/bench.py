"""`nox -s bench`: gradsync's DDP and FSDP strategies side by side with torch DDP, torch FSDP2 and DeepSpeed
ZeRO-1/2/3 on the same model, batch and ranks. Step times come from bench_ab.py: every system's steps
interleaved in the same processes (so the machine's drift touches all alike), as ratios to the compute
floor measured in the same processes, over ``--repeats`` fresh jobs (median and spread). Peak memory and
wire bytes come from each system run alone in its own processes (bench_worker.py), where peak RSS is that
system's. Writes every figure to benchmarks/results.json, then renders RESULTS.md, results.png and the
blocks of the README and docs/performance.md that quote them (bench_report.py).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_report

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


def launch(system: str, nproc: int, extra: list[str]) -> Result:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(HERE.parent / "integration"),
    }
    job = subprocess.Popen(
        [*command, str(HERE / "bench_worker.py"), "--system", system, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, so a stuck rank can be killed with the launcher
    )
    # A rank has been seen stuck in gloo's teardown after its result line while the other had exited: the
    # job then gets a minute to end after that line (and 15 in all) before it is killed.
    deadline = threading.Timer(900, os.killpg, (job.pid, signal.SIGKILL))
    deadline.start()
    assert job.stdout is not None
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith("RESULT "):
            break
    try:
        stdout, stderr = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        print(f"{system}: killed a minute after its result line (stuck in teardown)", flush=True)
    deadline.cancel()
    results = [line for line in [*lines, *stdout.splitlines()] if line.startswith("RESULT ")]
    if not results:
        raise SystemExit(
            f"{system} failed (exit {job.returncode}):\n{''.join(lines)[-3000:]}\n{stderr[-5000:]}"
        )
    if job.returncode != 0:  # measured, then crashed in teardown (seen once with torch FSDP2: SIGABRT)
        print(f"{system}: exit {job.returncode} after its result line; the result is used", flush=True)
    result: Result = json.loads(results[-1].removeprefix("RESULT "))
    print(f"{system:>45}: {1000 * result['step_s']:7.1f} ms/step", flush=True)
    return result


def version(name: str) -> str:
    """The version of the code that runs: a gradsync package's own ``__version__`` (an editable install's
    metadata keeps the version it was installed at), else the distribution's."""
    if name.startswith("gradsync-"):
        return str(importlib.import_module(name.replace("-", ".")).__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


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

    return (
        f"{cpu}, {os.cpu_count()} cores, {int(memory) / 2**20:.0f} GiB RAM, no GPU; "
        f"Linux {platform.release()}; "
        f"Python {platform.python_version()}, torch {version('torch')}, deepspeed {version('deepspeed')}, "
        f"gradsync-ddp {version('gradsync-ddp')}, gradsync-fsdp {version('gradsync-fsdp')}"
    )


def muon_suffix(system: str) -> str:
    """The Muon suffix ``system`` ends in, or ``""`` for an AdamW system."""
    return next((suffix for suffix in MUON_SUFFIXES if system.endswith(suffix)), "")


def device() -> str:
    """The machine in a few words, for the ``Measured:`` lines: ``2-core Intel Xeon CPU (no GPU)``."""
    name = machine().split(",", 1)[0]
    for noise in ("(R)", "(TM)", "Processor", "CPU"):
        name = name.replace(noise, "")
    name = " ".join(name.split("@", 1)[0].split())
    return f"{os.cpu_count()}-core {name} CPU (no GPU)"


def results(
    times: dict[str, dict[str, float]], alone: dict[str, Result], args: argparse.Namespace
) -> bench_report.Results:
    """Everything bench_report renders, with where and what it ran on."""
    from bench_ab import commit

    run = {
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "device": device(),
        "torch": version("torch"),
        "versions": {name: version(name) for name in ("gradsync-ddp", "gradsync-fsdp")},
        "world": args.nproc,
        "steps": args.steps,
        "repeats": args.repeats,
        "bucket_mb": args.bucket_mb,
        "model": {
            "params": alone["floor"]["params"],
            "d_model": args.d_model,
            "n_layer": args.n_layer,
            "seq_len": args.seq_len,
            "batch_per_rank": args.batch_per_rank,
        },
    }
    return {"run": run, "times": times, "alone": alone}


def main() -> None:
    from bench_ab import run_repeats, summarise

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--systems", nargs="*", default=GRADSYNC + PEERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-steps", type=int, default=5, help="steps of each run alone (peak RSS)")
    parser.add_argument("--bucket-mb", type=int, default=4)
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: write RESULTS.md, results.png and the docs' blocks from results.json again",
    )
    args = parser.parse_args()
    root = HERE.parent
    if args.render:
        print("written:", *bench_report.write(root, bench_report.load()))
        return
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
    alone = {"floor": launch("floor", 1, extra)}
    alone |= {system: launch(system, args.nproc, extra) for system in args.systems}
    data = results(times, alone, args)
    if data["run"]["commit"].endswith("+dirty"):
        print("the tree has uncommitted changes: the figures name no commit that ran", flush=True)
    bench_report.RESULTS_JSON.write_text(json.dumps(data, indent=1) + "\n")
    print("written:", bench_report.RESULTS_JSON, *bench_report.write(root, data))


if __name__ == "__main__":
    main()
