"""Benchmark (not a test): gradsync DDP against torch DDP and the compute floor, in one run.

    python benchmarks/bench_ddp.py [--worlds 2 4] [--steps 6] [--model gpt|tiny-params]

``gpt``: a ~23M-parameter GPT, fp32, on gloo ranks of this machine. ``tiny-params``
(``nox -s bench-overhead``): 10,000 params of 4 elements and next to no compute, so a step is the
wrappers' own per-param and per-bucket work. The compute floor is the same model and per-rank batch in
one process with the same per-rank thread share and no communication; every step time is also given as
a ratio to it. The overhead column is a wrapper's cost over the floor in microseconds per step: forward,
backward and the grad-sync wait, without the optimizer step (which the wrappers do not change). Columns
break a step into forward+backward, the wait in finish_grad_sync, and the optimizer step (which includes
the distributed optimizer's param gather).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.ddp import __version__ as ddp_version
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed

VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 8192, 512, 6, 8, 128, 4
BUCKET_ELEMENTS = 4_000_000  # 16 MB of fp32 grads per bucket, for both gradsync and torch DDP


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        )
        return x + self.out(F.gelu(self.fc(self.ln2(x))))  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln_f = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embedding(tokens))
        logits = self.ln_f(x) @ self.embedding.weight.T
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class ManyTinyParams(nn.Module):
    """Many 4-element params and almost no arithmetic: what is left of a step is bookkeeping."""

    def __init__(self, count: int = 10_000) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.stack(list(self.weights)) * x).sum()


def gpt_batch(generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def tiny_batch(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(4, generator=generator)


MODELS: dict[str, tuple[type[nn.Module], Any]] = {
    "gpt": (GPT, gpt_batch),
    "tiny-params": (ManyTinyParams, tiny_batch),
}


@contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    into[key] = time.perf_counter() - start


class Variant:
    """One wrapper (or none: the floor) around its own copy of the model, stepped one step at a time."""

    def __init__(self, variant: str, model_name: str) -> None:
        model_class, self.make_batch = MODELS[model_name]
        model = model_class()
        self.sync: Any = None
        if variant == "torch DDP":
            self.wrapped: nn.Module = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=BUCKET_ELEMENTS * 4 / 2**20
            )
        elif variant.startswith("gradsync"):
            config = DistributedDataParallelConfig(
                overlap_grad_reduce="overlap" in variant,
                use_distributed_optimizer="distopt" in variant,
                overlap_param_gather="param gather" in variant,
                bucket_size=BUCKET_ELEMENTS,
            )
            self.wrapped = self.sync = DistributedDataParallel(ModelParallelConfig(), config, model)
        else:
            self.wrapped = model
        self.optimizer: Any = torch.optim.SGD(self.wrapped.parameters(), lr=1e-3, momentum=0.9)
        if self.sync is not None and self.sync.ddp_config.use_distributed_optimizer:
            self.optimizer = DistributedOptimizer(self.optimizer, self.sync)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(rank)
        self.samples: dict[str, list[float]] = {k: [] for k in ("step", "compute", "wait", "update")}

    def step(self, record: bool) -> None:
        tokens = self.make_batch(self.generator)
        times = dict.fromkeys(self.samples, 0.0)
        start = time.perf_counter()
        if self.sync is not None:
            self.sync.zero_grad_buffer()
        self.optimizer.zero_grad()
        with timed(times, "compute"):
            self.wrapped(tokens).backward()
        with timed(times, "wait"):
            if self.sync is not None:
                self.sync.finish_grad_sync()
        with timed(times, "update"):
            self.optimizer.step()
        times["step"] = time.perf_counter() - start
        if record:
            for key, value in times.items():
                self.samples[key].append(value)

    def medians(self) -> dict[str, float]:
        return {key: statistics.median(values) for key, values in self.samples.items()}


WARMUP = 2


def run_variant(variant: str, steps: int, threads: int, model_name: str = "gpt") -> dict[str, float]:
    """One variant in fresh processes (its peak RSS is its own)."""
    torch.set_num_threads(threads)
    runner = Variant(variant, model_name)
    for index in range(WARMUP + steps):
        runner.step(record=index >= WARMUP)
    return {**runner.medians(), "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_interleaved(variants: list[str], steps: int, threads: int, model_name: str) -> dict[str, Any]:
    """Every variant in the same processes, one step of each in turn (a barrier before each), so a drift
    of the machine's speed touches all alike; the floor runs on every rank, without communication."""
    torch.set_num_threads(threads)
    runners = {variant: Variant(variant, model_name) for variant in variants}
    for index in range(WARMUP + steps):
        for runner in runners.values():
            dist.barrier()
            runner.step(record=index >= WARMUP)
    return {variant: runner.medians() for variant, runner in runners.items()}


VARIANTS = [
    "torch DDP",
    "gradsync DDP",
    "gradsync DDP overlap",
    "gradsync DDP distopt",
    "gradsync DDP distopt overlap",
    "gradsync DDP distopt overlap param gather",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", choices=list(MODELS), default="gpt")
    parser.add_argument(
        "--interleave", action="store_true", help="time every variant in the same processes, step by step"
    )
    args = parser.parse_args()
    model = MODELS[args.model][0]()
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    cores = os.cpu_count() or 1
    print(f"model {args.model}: {tensors} params, {params / 1e6:.2f}M elements, fp32, {cores} cores")
    print(f"torch {torch.__version__}, gradsync-ddp {ddp_version}")
    for world in args.worlds:
        threads = max(1, cores // world)
        if args.interleave:
            per_rank = run_distributed(
                run_interleaved,
                world,
                args=(["floor", *VARIANTS], args.steps, threads, args.model),
                timeout=1200,
            )
            slowest = {v: max((r[v] for r in per_rank), key=lambda m: m["step"]) for v in per_rank[0]}
            floor, rows = slowest.pop("floor"), list(slowest.items())
            where = "the same processes, interleaved step by step"
        else:
            floor_args = ("floor", args.steps, threads, args.model)
            floor = run_distributed(run_variant, 1, args=floor_args, reuse=False)[0]
            rows = []
            for variant in VARIANTS:
                one = (variant, *floor_args[1:])
                results = run_distributed(run_variant, world, args=one, reuse=False, timeout=1200)
                rows.append((variant, max(results, key=lambda r: r["step"])))
            where = "1 rank, fresh processes"
        print(f"\n{world} ranks ({threads} thread(s) each); floor: {where}, same batch, no communication\n")
        columns = ["variant", "step ms", "x floor", "overhead us", "fwd+bwd ms", "grad-sync wait ms"]
        print("| " + " | ".join([*columns, "optimizer ms", "peak RSS MB", "x floor RSS"]) + " |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, r in [("compute floor", floor), *rows]:
            cells = [name, f"{r['step'] * 1e3:.1f}", f"{r['step'] / floor['step']:.3f}"]
            synced, floor_synced = r["compute"] + r["wait"], floor["compute"] + floor["wait"]
            cells += [f"{(synced - floor_synced) * 1e6:.0f}"]
            cells += [f"{r[k] * 1e3:.1f}" for k in ("compute", "wait", "update")]
            rss = r.get("rss_mb")
            cells += [f"{rss:.0f}", f"{rss / floor['rss_mb']:.2f}"] if rss else ["-", "-"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
