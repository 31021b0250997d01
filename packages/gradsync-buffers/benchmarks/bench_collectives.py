"""Benchmark: each collective path gradsync-buffers can take, on this machine, as a table.

    python benchmarks/bench_collectives.py [--worlds 2 4] [--numels 262144 4194304 16777216]

Times are the median of several repetitions, relative to an all_reduce of the same fp32 bucket measured
in the same run; busbw is the bus bandwidth. The "chosen" column is what the capability table selects.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.buffers import collectives
from gradsync.groups import get_backend_capabilities
from gradsync.groups.testing import run_distributed

REPS = 7


def _time(fn: Callable[[], None]) -> float:
    fn()
    samples = []
    for _ in range(REPS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(numel: int) -> dict[str, float]:
    group = dist.group.WORLD
    assert group is not None
    bucket = torch.ones(numel)
    return {
        "all_reduce": _time(lambda: collectives.all_reduce(bucket, group).wait()),
        **{
            f"rs_{path}": _time(lambda path=path: collectives.reduce_scatter(bucket, group, path=path).wait())
            for path in ("native", "all_reduce", "all_to_all")
        },
        "ag_native": _time(lambda: collectives.all_gather_shards(bucket, group, via_broadcasts=False).wait()),
        "ag_broadcasts": _time(
            lambda: collectives.all_gather_shards(bucket, group, via_broadcasts=True).wait()
        ),
    }


def chosen() -> tuple[str, str]:
    group = dist.group.WORLD
    assert group is not None
    caps = get_backend_capabilities()
    return (
        f"RS {collectives.reduce_scatter_path(group, torch.device('cpu')).replace('_', '-')}",
        "AG broadcasts" if caps.all_gather_via_broadcasts else "AG native",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numels", type=int, nargs="+", default=[1 << 18, 1 << 22, 1 << 24])
    args = parser.parse_args()
    columns = ["ranks", "elements", "all_reduce ms", "RS native", "RS via all-reduce", "RS via all-to-all"]
    columns += ["AG native", "AG broadcasts", "chosen"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for world in args.worlds:
        rs_choice, ag_choice = run_distributed(chosen, world)[0]
        for numel in args.numels:
            times = run_distributed(measure, world, args=(numel,))[0]
            base = times["all_reduce"]
            bytes_moved = numel * 4 * (world - 1) / world

            def cell(key: str, times: dict[str, float] = times, moved: float = bytes_moved) -> str:
                return f"{times[key] / times['all_reduce']:.2f}x ({moved / times[key] / 1e9:.2f} GB/s)"

            row = [str(world), str(numel), f"{base * 1e3:.1f}"]
            keys = ("rs_native", "rs_all_reduce", "rs_all_to_all", "ag_native", "ag_broadcasts")
            row += [cell(k) for k in keys]
            print("| " + " | ".join([*row, f"{rs_choice}, {ag_choice}"]) + " |")


if __name__ == "__main__":
    main()
