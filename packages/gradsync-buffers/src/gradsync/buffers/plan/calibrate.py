"""Measure α and β of this machine's gloo collectives, the planner's third cost source.

Each collective kind runs over 2 and 4 spawned gloo ranks on messages from 4 KiB to 16 MiB; the median
times are fitted, per kind, by least squares on relative error to the α-β form of :mod:`.costs`
(steps·α + share·n·β), so one α and one β per kind describe both rank counts.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from .costs import KINDS, LinkCosts

SIZES = [1 << k for k in range(10, 23, 2)]  # fp32 elements: 4 KiB ... 16 MiB
REPEATS = 7


def _time_collectives(sizes: list[int], repeats: int) -> dict[str, list[float]]:
    """Median seconds per kind and size on this rank (run on every rank)."""
    group = dist.group.WORLD
    assert group is not None
    result: dict[str, list[float]] = {}
    for kind in KINDS:
        medians = []
        for size in sizes:
            bucket = torch.ones(size)
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_reduce":
                    collectives.all_reduce(bucket, group).wait()
                elif kind == "reduce_scatter":
                    collectives.reduce_scatter(bucket, group).wait()
                else:
                    collectives.all_gather_shards(bucket, group).wait()
                samples.append(time.perf_counter() - start)
            medians.append(statistics.median(samples))
        result[kind] = medians
    return result


def measure(ranks: tuple[int, ...] = (2, 4), sizes: list[int] = SIZES) -> dict[int, dict[str, list[float]]]:
    """Median times per rank count, kind and size (the slowest rank's)."""
    from gradsync.groups.testing import run_distributed

    measured = {}
    for world in ranks:
        per_rank = run_distributed(_time_collectives, world, args=(sizes, REPEATS), timeout=600)
        measured[world] = {k: [max(r[k][i] for r in per_rank) for i in range(len(sizes))] for k in KINDS}
    return measured


def fit(measured: dict[int, dict[str, list[float]]], sizes: list[int] = SIZES) -> LinkCosts:
    """α and β per kind from :func:`measure`'s times, by least squares over every rank count and size."""
    alpha, beta = {}, {}
    for kind in KINDS:
        rows, times = [], []
        for world, by_kind in measured.items():
            unit = LinkCosts("unit", dict.fromkeys(KINDS, 1.0), dict.fromkeys(KINDS, 0.0), "")
            steps = unit.terms(kind, 0, world)[0]
            share = (2 if kind == "all_reduce" else 1) * (world - 1) / world
            for size, seconds in zip(sizes, by_kind[kind], strict=True):
                # weighted by 1/time: the relative error is minimised, so small messages count too
                rows.append([steps / seconds, share * size * 4 / seconds])
                times.append(1.0)
        solution = torch.linalg.lstsq(
            torch.tensor(rows, dtype=torch.float64), torch.tensor(times, dtype=torch.float64)[:, None]
        )
        a, b = solution.solution[:, 0].tolist()
        alpha[kind], beta[kind] = max(a, 0.0), b
    return LinkCosts(
        "gloo-here",
        alpha,
        beta,
        "fitted to gloo on this machine (python -m gradsync.buffers.plan --calibrate)",
    )


def save(costs: LinkCosts, measured: dict[int, dict[str, list[float]]], path: Path) -> None:
    path.write_text(
        json.dumps(
            {"name": costs.name, "alpha": costs.alpha, "beta": costs.beta, "source": costs.source,
             "sizes": SIZES, "measured": measured},
            indent=1,
        )
    )  # fmt: skip


def load(path: Path) -> LinkCosts:
    data = json.loads(path.read_text())
    return LinkCosts(data["name"], data["alpha"], data["beta"], data["source"])
