"""`python benchmarks/bench_grad_hook.py`: the Python work MegatronFSDP's backward does per grad and per
bucket, the part of a step that grows with the param count. Stacks of small linear layers run forward and
backward in one process (one gloo rank, one thread): 8 blocks of 1 layer, then 8 blocks of 4, each
strategy twice, every block its own unit (the grads go to their buckets in the unit's post-backward) and
no units (each grad through its own hook, one bucket). The Python calls into gradsync's code during one
backward (``sys.setprofile``, which no machine's noise changes) are counted at both sizes: what the extra
grads add is the calls per grad, the rest over the buckets the calls per bucket. The backward's host time
of the larger stack is beside the floor's, the same model's backward with no wrapper (best of several
rounds). Run it at two commits to compare them.

    python benchmarks/bench_grad_hook.py [--rounds 30]
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
WIDTH, BLOCKS = 8, 8


def python_calls(call: Callable[[], None]) -> int:
    """The Python functions in gradsync's code that ``call`` enters (each hook included)."""
    count = 0

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal count
        count += event == "call" and "gradsync" in frame.f_code.co_filename

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


class Block(nn.Sequential):
    """One unit when the stack has units."""


def stack(layers_per_block: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(Block(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers_per_block))) for _ in range(BLOCKS))
    )


class Loop:
    """A training loop's steps on ``model``: the forward, the backward, and the cycle's end."""

    def __init__(self, model: nn.Module, batch: torch.Tensor) -> None:
        self.model, self.batch = model, batch
        self.loss: torch.Tensor | None = None

    def forward(self) -> None:
        self.loss = self.model(self.batch).square().sum()

    def backward(self) -> None:
        assert self.loss is not None
        self.loss.backward()  # type: ignore[no-untyped-call]

    def finish(self) -> None:
        sync = getattr(self.model, "finish_grad_sync", None)
        if sync is not None:  # a wrapper: reduce, and start the next cycle
            sync()
            self.model.zero_grad_buffer()  # type: ignore[operator]
        else:
            self.model.zero_grad()


def measure(strategy: str | None, units: bool, layers_per_block: int, rounds: int) -> dict[str, float]:
    """One backward's Python calls into gradsync and its best host time in µs; ``strategy`` None: the
    floor (no wrapper)."""
    module = stack(layers_per_block)
    model: nn.Module = module
    if strategy is not None:
        model = fully_shard_model(
            module, zero_dp_strategy=strategy, fsdp_unit_modules=[Block] if units else []
        )
    loop = Loop(model, torch.randn(4, WIDTH))
    timings = []
    for round_ in range(rounds + 3):  # the first backwards borrow buffers and build views: not timed
        loop.forward()
        started = time.perf_counter()
        loop.backward()
        if round_ >= 3:
            timings.append((time.perf_counter() - started) * 1e6)
        loop.finish()
    loop.forward()
    calls = python_calls(loop.backward)
    loop.finish()
    return {
        "calls": calls,
        "grads": sum(1 for p in module.parameters() if p.requires_grad),
        "buckets": len(getattr(model, "buckets", ())),
        "us": min(timings),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        print(f"torch {torch.__version__}, 1 gloo rank, {BLOCKS} blocks of 1 and of 4 linear layers")
        print("| strategy | units | Python calls / grad | calls / bucket | backward / floor's (4 layers) |")
        print("|---|---|---|---|---|")
        floor = measure(None, False, 4, args.rounds)
        for strategy in STRATEGIES:
            for units in (True, False):
                small = measure(strategy, units, 1, args.rounds)
                large = measure(strategy, units, 4, args.rounds)
                per_grad = (large["calls"] - small["calls"]) / (large["grads"] - small["grads"])
                per_bucket = (small["calls"] - per_grad * small["grads"]) / small["buckets"]
                print(
                    f"| {strategy} | {'each block' if units else 'none'} | {per_grad:.2f} | "
                    f"{per_bucket:.1f} | {large['us'] / floor['us']:.2f}x |"
                )
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
