"""What a ``RaggedDTensor`` param costs a plain torch optimizer that steps on DTensors (torchtitan's loop
over the fsdp2 API): a foreach AdamW step over the same params as plain DTensors and as RaggedDTensors,
interleaved in one process (gloo, world 1: dispatch cost only, no communication). ``fully_shard_optimizer``
steps on the local tensors and pays neither.

    python benchmarks/bench_ragged_dispatch.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from gradsync.fsdp.ragged import RaggedDTensor, RaggedShard
from gradsync.fsdp.version import __version__


def optimizer(mesh: DeviceMesh, ragged: bool, params: int, rows: int) -> torch.optim.Optimizer:
    def shard(values: torch.Tensor) -> DTensor:
        if ragged:
            return RaggedDTensor.wrap(values, mesh, values.shape, [RaggedShard(0, (rows,))])
        return DTensor.from_local(values, mesh, [Shard(0)], run_check=False)

    weights = []
    for _ in range(params):
        weight = nn.Parameter(shard(torch.randn(rows, 64)))
        weight.grad = shard(torch.randn(rows, 64))
        weights.append(weight)
    return torch.optim.AdamW(weights, lr=1e-3, foreach=True)


def step_ms(opt: torch.optim.Optimizer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, default=24)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain, ragged = (optimizer(mesh, kind, args.params, args.rows) for kind in (False, True))
    step_ms(plain, 3), step_ms(ragged, 3)  # state created, caches warm
    times: dict[str, list[float]] = {"plain": [], "ragged": []}
    for _ in range(args.rounds):
        times["plain"].append(step_ms(plain, args.steps))
        times["ragged"].append(step_ms(ragged, args.steps))
    plain_ms, ragged_ms = statistics.median(times["plain"]), statistics.median(times["ragged"])
    print(f"gradsync-fsdp {__version__}, torch {torch.__version__}, {args.params} params of {args.rows}x64")
    print(f"foreach AdamW step: plain DTensor {plain_ms:.3f} ms, RaggedDTensor {ragged_ms:.3f} ms")
    rounds = f"median of {args.rounds} interleaved rounds of {args.steps} steps"
    print(f"ratio {ragged_ms / plain_ms:.2f}x ({rounds})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
