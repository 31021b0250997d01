"""`python benchmarks/bench_fault_tolerance.py`: what torchft costs gradsync DDP per step, and how long a
killed replica group takes to heal, on this machine.

Three jobs train the same MLP with AdamW, interleaved round by round:

- floor: one process, no communication (the compute floor);
- plain: two ranks in one gloo world, gradsync DDP over both;
- torchft: two replica groups of one rank each, a lighthouse on 127.0.0.1, gradsync DDP's buckets reduced
  across groups through torchft's manager (gradsync.ddp.fault_tolerance).

Each prints the median step time of its steady steps; the ratios are to the floor of the same round.
Then one torchft job kills a group between steps (SIGKILL), restarts it, and reports the time from its
restart to its first committed step, and the heal itself (its first quorum, which fetches the state).

    python benchmarks/bench_fault_tolerance.py [--hidden 512] [--steps 30] [--rounds 3]
    python benchmarks/bench_fault_tolerance.py --hidden 7072 --steps 8 --rounds 0   # the heal, 100M params
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.ddp.fault_tolerance import register_fault_tolerant_hook, replica_state
from gradsync.groups import ModelParallelConfig, initialize_model_parallel

WARMUP = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 8)
    )


def batch(hidden: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(32, hidden, generator=generator)
    return inputs, inputs[:, :8].sin()


def wrap(module: nn.Module) -> DistributedDataParallel:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)
    return DistributedDataParallel(
        ModelParallelConfig(), config, module, pg_collection=initialize_model_parallel()
    )


def worker(args: argparse.Namespace) -> None:
    """One rank of a job; writes its step times (and, under torchft, its heal) to ``--report``."""
    report: dict[str, Any] = {}
    if args.job == "floor":
        model: nn.Module = build(args.hidden)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = []
        for step in range(args.steps):
            began = time.perf_counter()
            optimizer.zero_grad()
            inputs, targets = batch(args.hidden, step, 0)
            F.mse_loss(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            times.append(time.perf_counter() - began)
        report["times"] = times
    elif args.job == "plain":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
        )
        ddp = wrap(build(args.hidden))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        times = []
        for step in range(args.steps):
            began = time.perf_counter()
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            inputs, targets = batch(args.hidden, step, args.rank)
            F.mse_loss(ddp(inputs), targets).backward()  # type: ignore[no-untyped-call]
            ddp.finish_grad_sync()
            optimizer.step()
            times.append(time.perf_counter() - began)
        report["times"] = times
        dist.destroy_process_group()
    else:
        report.update(torchft_worker(args))
    Path(args.report).write_text(json.dumps(report))


def torchft_worker(args: argparse.Namespace) -> dict[str, Any]:
    torchft = importlib.import_module("torchft")  # the optional extra: imported only where it runs
    wrapper = importlib.import_module("torchft.optim").OptimizerWrapper

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    prefixed = dist.PrefixStore("replica", store)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=prefixed, rank=0, world_size=1)
    ddp = wrap(build(args.hidden))
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    state_dict, load_state_dict = replica_state(ddp, inner)
    seconds = timedelta(seconds=30)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=seconds), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, use_async_quorum=False, replica_id=f"replica{args.rank}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
        timeout=seconds, quorum_timeout=timedelta(seconds=120), connect_timeout=seconds,
    )  # fmt: skip
    register_fault_tolerant_hook(ddp, manager)
    optimizer = wrapper(manager, inner)
    times, quorums, committed_at, discarded = [], [], None, 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        began = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        quorums.append(time.perf_counter() - began)
        inputs, targets = batch(args.hidden, manager.current_step(), args.rank)
        F.mse_loss(ddp(inputs), targets).backward()  # type: ignore[no-untyped-call]
        ddp.finish_grad_sync()
        optimizer.step()
        times.append(time.perf_counter() - began)
        if committed_at is None and manager.current_step() > step:
            committed_at = time.time()
        discarded += manager.current_step() == step  # an attempt the quorum did not commit
        if args.stop_at == manager.current_step():
            Path(args.report + ".stopped").touch()
            time.sleep(600)  # killed here by the driver
    manager.shutdown(wait=False)
    state = sum(t.numel() * t.element_size() for t in tensors_in(state_dict()))
    return {
        "times": times,
        "first_quorum": quorums[0],
        "first_commit": committed_at,
        "discarded": discarded,
        "state_bytes": state,
    }


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested state dict: what a heal sends."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in tensors_in(value)]
    if isinstance(tree, list | tuple):
        return [t for value in tree for t in tensors_in(value)]
    return []


def run(command: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RUST_LOG": "error"}
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )


def median_steady(report: dict[str, Any]) -> float:
    return float(statistics.median(report["times"][WARMUP:]))


def job(kind: str, args: argparse.Namespace, tmp: Path, stop_at: int = -1) -> list[dict[str, Any]]:
    """Run one job to its end; each rank's report (a restarted rank's with the time it was restarted)."""
    me = [sys.executable, __file__, "--worker", kind, f"--hidden={args.hidden}", f"--steps={args.steps}"]
    reports = [tmp / f"{kind}-{rank}.json" for rank in range(1 if kind == "floor" else 2)]
    lighthouse = None
    if kind == "torchft":
        port = free_port()
        binary = str(Path(sys.executable).with_name("torchft_lighthouse"))
        flags = ["--min_replicas", "2", "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1000"]
        lighthouse = run([binary, "--bind", f"127.0.0.1:{port}", *flags])
        me.append(f"--lighthouse=http://127.0.0.1:{port}")
    port = free_port()
    procs = [
        run(
            [
                *me,
                f"--rank={rank}",
                f"--port={port}",
                f"--report={path}",
                f"--stop-at={stop_at if rank else -1}",
            ]
        )
        for rank, path in enumerate(reports)
    ]
    if stop_at >= 0:
        stopped = Path(str(reports[1]) + ".stopped")
        while not stopped.exists():
            time.sleep(0.02)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        restarted = time.time()
        procs[1] = run([*me, "--rank=1", f"--report={reports[1]}"])
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise SystemExit(f"a {kind} rank failed (exit {proc.returncode})")
    if lighthouse is not None:
        os.killpg(lighthouse.pid, signal.SIGKILL)
    results = [json.loads(path.read_text()) for path in reports]
    if stop_at >= 0:
        results[1]["restarted"] = restarted
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's width")
    parser.add_argument("--steps", type=int, default=30, help="steps per job")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the three jobs, interleaved (0: the heal alone)"
    )
    parser.add_argument("--worker", choices=("floor", "plain", "torchft"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--report", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.job = args.worker
        worker(args)
        return

    params = sum(p.numel() for p in build(args.hidden).parameters())
    print(f"torch {torch.__version__}, MLP of {params:,} params (fp32), 2 ranks or replica groups, "
          f"{args.steps} steps per job, median of the steps after {WARMUP}")  # fmt: skip
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        ratios = []
        if args.rounds:
            print("| round | floor (ms) | plain DDP / floor | torchft DDP / floor | torchft / plain |")
            print("|---|---|---|---|---|")
        for round_ in range(args.rounds):
            floor = median_steady(job("floor", args, tmp)[0])
            plain = max(median_steady(r) for r in job("plain", args, tmp))
            ft = max(median_steady(r) for r in job("torchft", args, tmp))
            ratios.append(ft / plain)
            cells = (
                f"{floor * 1e3:.2f}",
                f"{plain / floor:.2f}x",
                f"{ft / floor:.2f}x",
                f"{ft / plain:.3f}x",
            )
            print(f"| {round_ + 1} | " + " | ".join(cells) + " |")
        if ratios:
            print(f"torchft over plain DDP, median of the rounds: {statistics.median(ratios):.3f}x")
        survivor, healed = job("torchft", args, tmp, stop_at=args.steps // 2)
        heal, back = healed["first_quorum"], healed["first_commit"] - healed["restarted"]
        mb = healed["state_bytes"] / 1e6
        print(f"heal: the restarted group's first quorum (fetching {mb:.1f} MB of weights and AdamW state) "
              f"{heal:.2f} s, {mb / heal:.0f} MB/s")  # fmt: skip
        print(f"restart to its first committed step: {back:.2f} s (process start and imports included)")
        print(f"attempts the surviving group made that no quorum committed: {survivor['discarded']}")


if __name__ == "__main__":
    main()
