"""`python benchmarks/bench_foreign_optimizer.py`: what gradsync costs an optimizer that holds none of its
params. Building a gradsync wrapper registers one process-wide optimizer step hook
(gradsync.buffers.optimizer_watch), and torch runs it at every step of every optimizer in the process.
Here a plain AdamW over a model no wrapper holds steps in rounds, one step with that hook in place and one
without (torch's global hook tables swapped out and back in), in one process and one thread; the ratio of
the median steps is what the hook costs, per param count. The floor is the step without it.

    python benchmarks/bench_foreign_optimizer.py [--params 100 1000 10000] [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import optimizer as torch_optimizer

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.fsdp import fully_shard_model
from gradsync.groups import ModelParallelConfig, initialize_model_parallel

GLOBAL_PRE_HOOKS: dict[int, Any] = torch_optimizer._global_optimizer_pre_hooks
GLOBAL_POST_HOOKS: dict[int, Any] = torch_optimizer._global_optimizer_post_hooks


def register_gradsync_hooks() -> None:
    """Build each wrapper once on a model of its own, as a training script would: that registers the
    process-wide hook."""
    pgs = initialize_model_parallel(tensor_model_parallel_size=1)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    DistributedDataParallel(ModelParallelConfig(), config, nn.Linear(8, 8), pg_collection=pgs)
    fully_shard_model(nn.Linear(8, 8), zero_dp_strategy="optim_grads_params")


@contextmanager
def without_global_hooks() -> Iterator[None]:
    """torch's process-wide step hooks emptied for the duration, then put back as they were (benchmark
    only: these tables are torch's private state)."""
    tables: list[dict[int, Any]] = [GLOBAL_PRE_HOOKS, GLOBAL_POST_HOOKS]
    saved = [dict(table) for table in tables]
    for table in tables:
        table.clear()
    try:
        yield
    finally:
        for table, hooks in zip(tables, saved, strict=True):
            table.update(hooks)


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(params: int, rounds: int) -> tuple[float, float]:
    """Median step without and with gradsync's hooks, in seconds, over ``rounds`` interleaved rounds."""
    model = nn.ParameterList(nn.Parameter(torch.randn(16)) for _ in range(params))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for param in model:
        param.grad = torch.randn_like(param)
    for _ in range(3):  # warm-up: the state exists, the owners' caches are filled
        optimizer.step()
    bare, hooked = [], []
    for index in range(rounds):
        order = (True, False) if index % 2 else (False, True)  # neither always goes first
        for with_hooks in order:
            if with_hooks:
                hooked.append(timed(optimizer.step))
            else:
                with without_global_hooks():
                    bare.append(timed(optimizer.step))
    return statistics.median(bare), statistics.median(hooked)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{scratch}/store", rank=0, world_size=1)
        register_gradsync_hooks()
        hooks = len(torch_optimizer._global_optimizer_pre_hooks) + len(
            torch_optimizer._global_optimizer_post_hooks
        )
        print(f"{hooks} process-wide optimizer hook(s) registered; AdamW (foreach) over 16-element params")
        print("| params | step without the hooks (floor) | with them | step / floor | hooks per step |")
        print("|---|---|---|---|---|")
        for count in args.params:
            bare, hooked = measure(count, args.rounds)
            print(
                f"| {count} | {bare * 1e3:.3f} ms | {hooked * 1e3:.3f} ms | {hooked / bare:.3f}x | "
                f"{(hooked - bare) * 1e6:.0f} us |",
                flush=True,
            )
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
