"""`nox -s bench-memory`: what each strategy holds per param, and its peak in a step.

Every system of bench_launch.py that keeps state (the distributed optimizer, MegatronFSDP's four
strategies, torch FSDP2 and gradsync's FSDP2-style API) is built alone, on its own copy of a small GPT, in
fp32 and in the bf16 recipe (bench_launch.py's docstring), and run for two steps. Two figures per rank:

- resident: the bytes of the tensor storages Python objects hold after the first step that were not
  there before the model was built (params, grad buffers, main weights, the optimizer's state:
  ``fully_shard_optimizer`` creates the state at construction, torch's optimizers at their first step,
  so only after a step do they compare), per param of the model;
- peak: resident plus the most bytes allocated at once during a later step over what was allocated
  when it began (torch's profiler with ``profile_memory``: every allocation and free, in time order; the
  least of three steps, as a free made on a communication thread can escape the profiler), per param;
  activations included (the same model and batch for every system).

Beside them, the bytes per param of the ZeRO formulas for d ranks (what Megatron-Core's distributed
optimizer documents for its own case: 8 + 8/d with fp32 params and grads, 6 + 12/d with bf16 params and
fp32 grads and main weights): params P, grads G, main weights M (bf16 recipe only) and Adam's two moments
8, each whole or divided by d as the strategy shards it. On CUDA both figures come from ``torch.cuda``'s
allocator statistics instead.

    python benchmarks/bench_memory.py [--worlds 1 2] [--systems ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench import machine  # noqa: E402
from bench_ab import commit, result_of  # noqa: E402
from bench_launch import _MID, Preset, build, join_ranks  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

MODEL = replace(_MID, vocab_size=1024, seq_len=64, d_model=128, n_head=4, n_layer=4)
SYSTEMS = [
    "gradsync-ddp+distopt",
    "gradsync-fsdp-no_shard",
    "gradsync-fsdp-optim",
    "gradsync-fsdp-optim_grads",
    "gradsync-fsdp-optim_grads_params",
    "torch-fsdp2",
    "gradsync-fsdp2",
]
SHARDED = {  # what each system divides among the d ranks: params, grads, main weights, Adam's moments
    "gradsync-ddp+distopt": "MA",
    "gradsync-fsdp-no_shard": "",
    "gradsync-fsdp-optim": "MA",
    "gradsync-fsdp-optim_grads": "GMA",
    "gradsync-fsdp-optim_grads_params": "PGMA",
    "torch-fsdp2": "PGMA",
    "gradsync-fsdp2": "PGMA",
}


def formula(system: str, bf16: bool, world: int) -> float:
    """Bytes per param by the ZeRO formulas. torch FSDP2 and the FSDP2-style API keep fp32 params in the
    bf16 recipe too (they cast per gather), so no main weights."""
    fsdp2 = system in ("torch-fsdp2", "gradsync-fsdp2")
    parts = {
        "P": 2.0 if bf16 and not fsdp2 else 4.0,
        "G": 4.0,
        "M": 4.0 if bf16 and not fsdp2 else 0.0,
        "A": 8.0,
    }
    return sum(size / world if part in SHARDED[system] else size for part, size in parts.items())


def live_storages() -> dict[int, int]:
    """Every CPU tensor storage a Python object holds: data pointer -> bytes (DTensors hold none of their
    own: their local tensors are counted)."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def excess_in(run: Callable[[], object]) -> int:
    """The most bytes allocated at once within ``run`` over what was allocated when it began, from every
    allocation and free the profiler recorded, in time order (its event tree)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    changes: list[tuple[int, int]] = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            changes.append((node.start_time_ns, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    live = peak = 0
    for _, size in sorted(changes):
        live += size
        peak = max(peak, live)
    return peak


def measure(system: str, bf16: bool, device: torch.device, tokens: list[torch.Tensor]) -> tuple[int, int]:
    preset = Preset(MODEL, batch=tokens[0].shape[0], bf16=bf16)
    options = argparse.Namespace(bucket_mb=4, lr=1e-3, batch_per_rank=preset.batch)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step = build(system, preset, device, options)
        step(tokens[0])
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(tokens[1])
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - start
        gc.collect()
        dist.barrier()
        return torch.cuda.memory_allocated(device) - start, peak

    before = live_storages()
    step = build(system, preset, device, options)
    step(tokens[0])
    gc.collect()
    resident = sum(size for ptr, size in live_storages().items() if ptr not in before)
    # frees made on a communication thread can escape the profiler, which only inflates the excess
    return resident, resident + min(excess_in(lambda: step(tokens[1])) for _ in range(3))


def worker(args: argparse.Namespace) -> None:
    device = join_ranks(args.device)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = [
        torch.randint(MODEL.vocab_size, (2, MODEL.seq_len + 1), generator=generator).to(device)
        for _ in range(2)
    ]
    figures = {
        f"{s}/{r}": measure(s, r == "bf16", device, tokens) for s in args.systems for r in ("fp32", "bf16")
    }
    most = torch.tensor(list(figures.values()), dtype=torch.float64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the rank holding most sets what must fit
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(dict(zip(figures, most.tolist(), strict=True))), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with torch.device("meta"):
        from toygpt.model import GPTStage

        elements = sum(p.numel() for p in GPTStage(MODEL).parameters())
    print(
        f"GPT d_model {MODEL.d_model}, {MODEL.n_layer} layers, vocabulary {MODEL.vocab_size}: "
        f"{elements / 1e6:.2f}M params, AdamW, 2 x {MODEL.seq_len} tokens per rank; device: {machine()}; "
        f"commit {commit()}; bytes per param per rank (the rank holding most), formula beside"
    )
    for world in args.worlds:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"),
            *(__file__, "--worker", "--device", args.device, "--systems", *args.systems),
        ]
        cpu = {"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {}
        result: dict[str, Any] = result_of(command, {**os.environ, **cpu})
        print(f"\n{world} rank(s)\n")
        print("| system | fp32 resident | formula | fp32 peak | bf16 recipe resident | formula | bf16 peak |")
        print("|---|---|---|---|---|---|---|")
        for system in args.systems:
            cells = []
            for recipe in ("fp32", "bf16"):
                resident, peak = result[f"{system}/{recipe}"]
                cells += [f"{resident / elements:.2f}", f"{formula(system, recipe == 'bf16', world):.2f}"]
                cells.append(f"{peak / elements:.2f}")
            print(f"| {system} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
