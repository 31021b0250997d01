"""`python benchmarks/bench_grad_hook.py`: what MegatronFSDP's grad hook costs per grad, the part of a
step that grows with the param count. One param's post-accumulate-grad hook is called directly, outside
any backward, many times in a row (a repeated grad of one param never completes its bucket, so no
collective runs), in one process and one thread, for each strategy family: the best of several rounds,
beside the floor, the same add into a buffer view with the same ``.grad`` set and cleared and no hook.
It also counts the Python calls one grad makes below the hook (``sys.setprofile``), which no machine's
noise changes. Run it at two commits to compare them.

    python benchmarks/bench_grad_hook.py [--calls 5000] [--rounds 25]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.fsdp import fully_shard_model

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def best_us(call: Callable[[], None], calls: int, rounds: int) -> float:
    """The fastest round's microseconds per call (the machine's noise only ever adds time)."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return min(times)


def python_calls(call: Callable[[], None]) -> int:
    """The Python functions ``call`` enters, itself and the hook excluded."""
    count = 0

    def profile(_frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count - 2


def measure(strategy: str, calls: int, rounds: int) -> tuple[float, float, int]:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(20)]
    model = fully_shard_model(nn.Sequential(*layers), zero_dp_strategy=strategy, fsdp_unit_modules=[])
    param = next(r.compute for r in model.params if r.name == "5.weight")
    (hook,) = param._post_accumulate_grad_hooks.values()
    grad = torch.randn_like(param)
    target = torch.zeros(param.numel() * 4)[: param.numel()].view_as(param)

    def hooked() -> None:
        param.grad = grad
        hook(param)

    def floor() -> None:
        param.grad = grad
        target.add_(param.grad)
        param.grad = None

    hooked()  # the first grad borrows ZeRO-2/3's whole-bucket buffer
    best_us(hooked, calls, 1)  # warm up: the first rounds of a process run slower
    return best_us(hooked, calls, rounds), best_us(floor, calls, rounds), python_calls(hooked)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        print(f"torch {torch.__version__}, 1 gloo rank, best of {args.rounds} rounds of {args.calls} calls")
        print("| strategy | hook µs/grad | floor µs/grad | hook / floor | Python calls below the hook |")
        print("|---|---|---|---|---|")
        for strategy in STRATEGIES:
            hooked, floor, count = measure(strategy, args.calls, args.rounds)
            print(f"| {strategy} | {hooked:.2f} | {floor:.2f} | {hooked / floor:.2f}x | {count} |")
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
