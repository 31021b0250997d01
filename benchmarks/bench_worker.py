"""One benchmark run under torchrun: one system trains the toy GPT for a few timed steps; rank 0 prints one
JSON line. Launched by bench.py (``nox -s bench``), once per system, each in fresh processes so that peak
RSS belongs to that system alone; bench.py puts integration/ (the toy GPT) on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench import MUON_SUFFIXES, muon_suffix
from torch import nn
from toygpt.data import Corpus, local_rows
from toygpt.model import GPTConfig, GPTStage, next_token_loss

from gradsync.finalize import finalize_model_grads
from gradsync.groups import initialize_model_parallel

Step = Callable[[torch.Tensor], torch.Tensor]
"""One training step on a batch of tokens; returns the loss, detached and not read, so that a step on a GPU
returns once issued (bench_launch.py times that apart from the GPU's own time)."""


PHASES = ("zero", "forward", "backward", "grad sync", "optimizer")
"""The parts of a step ``bench_ab.py --phases`` times: zeroing the grads, the forward with the loss, the
backward (torch DDP and FSDP2 reduce inside it, and wait there), ``finalize_model_grads`` (gradsync's
exposed reductions; nothing for the others) and the optimizer step."""

phase_marks: list[float] | None = None
"""Set to a list, each step appends the time at its start and at the end of each of its ``PHASES``."""


def mark() -> None:
    if phase_marks is not None:
        phase_marks.append(time.perf_counter())


def bytes_written() -> int:
    """Bytes this process has handed to write()/writev(): on gloo over TCP, what it put on the wire."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["wchar"])


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return next_token_loss(model(tokens[:, :-1]), tokens)


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    """The floor, torch DDP and FSDP2: the wrapper's hooks do the communication inside backward."""

    def step(tokens: torch.Tensor) -> torch.Tensor:
        mark()
        optimizer.zero_grad()
        mark()
        loss = loss_of(model, tokens)
        mark()
        loss.backward()  # type: ignore[no-untyped-call]
        mark()
        mark()  # no grad sync outside the backward
        optimizer.step()
        mark()
        return loss.detach()

    return step


def fsdp2_step(system: str, model: GPTStage, lr: float, **options: Any) -> Step:
    """torchtitan's calls: ``fully_shard`` (torch's for ``torch-fsdp2*``, else gradsync's FSDP2-style API) on
    each block, then on the root, with ``options``; the optimizer built afterwards on the DTensor shards."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from gradsync.fsdp.fsdp2 import fully_shard as gradsync_fully_shard

    shard: Callable[..., Any] = torch_fully_shard if system.startswith("torch-") else gradsync_fully_shard
    for block in model.blocks.values():
        shard(block, **options)
    shard(model, **options)
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=lr))


def gradsync_step(system: str, model: nn.Module, lr: float, bucket_elements: int, bf16: bool = False) -> Step:
    """``bf16``: the model's weights are bf16 and get Megatron's recipe (fp32 main weights and grads).
    ``system@WIRE`` (``ddp+overlap@bf16``, say): with train.py's ``--grad-comm WIRE``."""
    from toygpt.strategies import wrap
    from train import EMBEDDINGS, GRAD_COMMS

    from gradsync.buffers import Muon, muon_param_groups

    system, _, wire = system.partition("@")
    grad_comm = GRAD_COMMS[wire] if wire else None
    suffix = muon_suffix(system)
    strategy = system.removesuffix(suffix)
    groups = initialize_model_parallel()
    if suffix:  # train.py --optimizer muon's layout, Muon's defaults otherwise
        ns_dtype = getattr(torch, MUON_SUFFIXES[suffix])
        wrapped = wrap(
            strategy,
            model,
            groups,
            lambda named: Muon(
                muon_param_groups(named, exclude=EMBEDDINGS),
                lr=lr,
                adamw_betas=(0.9, 0.999),
                ns_dtype=ns_dtype,
            ),
            bucket_elements,
            bf16=bf16,
            shard_alignment=lambda name, param: "tensor" if param.dim() >= 2 else None,
            grad_comm=grad_comm,
        )
    else:
        wrapped = wrap(
            strategy,
            model,
            groups,
            lambda named: torch.optim.AdamW([p for _, p in named], lr=lr),
            bucket_elements,
            bf16=bf16,
            grad_comm=grad_comm,
        )

    def step(tokens: torch.Tensor) -> torch.Tensor:
        mark()
        wrapped.optimizer.zero_grad()
        wrapped.model.zero_grad_buffer()
        mark()
        loss = loss_of(wrapped.model, tokens)
        mark()
        loss.backward()  # type: ignore[no-untyped-call]
        mark()
        finalize_model_grads([wrapped.model], pg_collection=groups)
        mark()
        wrapped.optimizer.step()
        mark()
        return loss.detach()

    return step


def deepspeed_step(stage: int, model: nn.Module, lr: float, bucket_elements: int, micro_batch: int) -> Step:
    import deepspeed  # type: ignore[import-not-found]
    import deepspeed.ops  # type: ignore[import-not-found]

    # The shm op serves only inference all-reduce; without this, DeepSpeed JIT-compiles it with g++.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the others do not clip
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket_elements,
            "allgather_bucket_size": bucket_elements,
            "overlap_comm": stage == 2,
        },
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine, tokens)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def build(system: str, model: GPTStage, args: argparse.Namespace) -> Step:
    bucket_elements = args.bucket_mb * 2**20 // 4
    if system == "floor":
        return plain_step(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    if system == "torch-ddp":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        return plain_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr))
    if system in ("torch-fsdp2", "torch-fsdp2-no-reshard", "gradsync-fsdp2"):
        # ZeRO-3; without resharding after forward: ZeRO-2's memory
        reshard = system != "torch-fsdp2-no-reshard"
        return fsdp2_step(system, model, args.lr, reshard_after_forward=reshard)
    if system.startswith("deepspeed-zero"):
        return deepspeed_step(int(system[-1]), model, args.lr, bucket_elements, args.batch_per_rank)
    return gradsync_step(system.removeprefix("gradsync-"), model, args.lr, bucket_elements)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per rank; the floor gets one core too
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_head=args.n_head, n_layer=args.n_layer)
    model = GPTStage(cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step = build(args.system, model, args)
    corpus = Corpus.from_stdlib()
    batches = [
        local_rows(corpus.batch(i, args.batch_per_rank * world, args.seq_len), rank, world)
        for i in range(args.warmup + args.steps)
    ]
    losses = [float(step(b)) for b in batches[: args.warmup]]
    dist.barrier()
    written, times = bytes_written(), []
    for tokens in batches[args.warmup :]:
        start = time.perf_counter()
        losses.append(float(step(tokens)))
        times.append(time.perf_counter() - start)
    wire = (bytes_written() - written) / args.steps
    stats = torch.tensor(
        [statistics.median(times), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, wire],
        dtype=torch.float64,
    )
    everyone = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(everyone, stats)
    if rank == 0:
        table = torch.stack(everyone)
        result = {
            "system": args.system,
            "world": world,
            "step_s": float(table[:, 0].max()),  # the slowest rank sets the pace
            "peak_rss_bytes": float(table[:, 1].max()),
            "wire_bytes_per_step": float(table[:, 2].mean()),
            "param_bytes": param_bytes,
            "params": param_bytes // 4,
            "first_loss": losses[0],
            "last_loss": losses[-1],
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
