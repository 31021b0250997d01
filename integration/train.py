"""Train the toy GPT with gradsync, under torchrun.

    torchrun --standalone --nproc-per-node=4 integration/train.py --strategy ddp+distopt --tp 2

The loop below is the whole training step: gradsync's calls are ``zero_grad_buffer`` (a new step),
``no_sync`` (inside the pipeline schedule: earlier microbatches only accumulate), ``finalize_model_grads``
(wait for the overlapped grad reduction, then the TP/SP and tied-embedding reductions) and the optimizer
step (which, with the distributed optimizer, steps this rank's shard and all-gathers the params).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from toygpt import checkpoint
from toygpt.data import Corpus, local_rows
from toygpt.full_state import gather_full_params
from toygpt.local_sync import DILOCO, check_layout, local_sync, replica_groups
from toygpt.model import GPTConfig, GPTStage
from toygpt.pipeline import forward_backward, global_loss
from toygpt.report import StepRecord, progress_line, records_to_json, write_report
from toygpt.strategies import STRATEGIES, Hybrid, OptimizerFactory, wrap

from gradsync.buffers import Muon, disable_telemetry, enable_telemetry, muon_param_groups, telemetry
from gradsync.buffers.shard_alignment import ShardAlignmentSpec
from gradsync.finalize import finalize_model_grads
from gradsync.groups import (
    default_backend,
    destroy_process_groups,
    device_for_group,
    initialize_model_parallel,
)

TRACE_FILE = "trace.json"


@dataclass(frozen=True)
class Options:
    strategy: str = "ddp+distopt+overlap-param-gather"
    tp: int = 1
    pp: int = 1
    hsdp: int = 1  # fsdp-*: this many outer replicas of the shard group (hybrid sharding)
    hsdp_outer: str = "no_shard"  # fsdp-* with --hsdp: "optim" also shards the optimizer state over them
    ep: int = 1
    sequence_parallel: bool = False
    moe: bool = False
    bf16: bool = False  # bf16 weights, grads reduced in fp32, fp32 main params in the optimizer
    steps: int = 600
    global_batch: int = 32
    microbatches: int = 1
    seq_len: int = 64
    d_model: int = 128
    n_head: int = 4
    n_layer: int = 4
    optimizer: str = "adamw"  # sgd, adamw, or muon (whole matrices: each sharded strategy keeps them whole)
    compare_with: str = "auto"  # also train with this optimizer and report both ("auto": adamw for muon only)
    lr: float = 3e-3
    eps: float = 1e-8  # Adam's epsilon (adamw, and muon's AdamW part)
    bucket_size: int | None = 40_000
    seed: int = 0
    eval_every: int = 50
    corpus_bytes: int = 4 << 20
    out_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    kill_rank: int = -1  # for the killed-rank test: this rank SIGKILLs itself at kill_at_step
    kill_at_step: int = -1
    timeout_s: float = 600
    quiet: bool = False
    collect_params: bool = False  # return the full params on rank 0 (parity tests)
    trace: bool = False  # record communication telemetry and write trace.json (Chrome / Perfetto)
    grad_comm: str = "fp32"  # grad wire(s), comma-separated (GRAD_COMMS); each against the fp32 wire
    grad_comm_block_size: int = 32  # values per fp32 scale on the fp8 wires


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    full_params: dict[str, torch.Tensor] | None = None
    report: Path | None = None


OPTIMIZERS = ("sgd", "adamw", "muon")
GRAD_COMMS: dict[str, dict[str, object]] = {
    "fp32": {},
    "bf16": {"grad_comm_dtype": torch.bfloat16},
    "bf16-ef": {"grad_comm_dtype": torch.bfloat16, "grad_comm_error_feedback": True},
    "fp16": {"grad_comm_dtype": torch.float16},
    "fp8-e4m3": {"grad_comm_dtype": torch.float8_e4m3fn},
    "fp8-e4m3-ef": {"grad_comm_dtype": torch.float8_e4m3fn, "grad_comm_error_feedback": True},
    "fp8-e5m2-ef": {"grad_comm_dtype": torch.float8_e5m2, "grad_comm_error_feedback": True},
    "gather-bf16": {"param_gather_dtype": torch.bfloat16},
    "gather-fp8-e4m3": {"param_gather_dtype": torch.float8_e4m3fn},
}
"""``--grad-comm`` choices: the grad wire (every strategy); fp32 is the grad buffer's own dtype, reduced
by the backend. ``gather-*``: packed weight gathers instead (the sharded fsdp strategies).
The fp8 wires carry one fp32 scale per ``--grad-comm-block-size`` values."""
COMM_HOOKS = {"powersgd-r4": 4, "powersgd-r16": 16}
"""``--grad-comm`` choices that register torch's PowerSGD comm hook instead (its matrix rank; a plain
all-reduce for the first 10 steps), on a DDP strategy without the distributed optimizer."""
EMBEDDINGS = ("wte", "wpe", "output_weight")  # the toy GPT's embeddings and untied head: AdamW under Muon


def make_optimizer(opts: Options, tp_group: dist.ProcessGroup | None = None) -> OptimizerFactory:
    """``tp_group``: Muon gathers the TP shards of each split matrix over it (Muon's ``duplicated`` mode, the
    same step as one process on the unsplit model)."""

    def build(named: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        if opts.optimizer == "sgd":
            return torch.optim.SGD([p for _, p in named], lr=opts.lr, momentum=0.9)
        if opts.optimizer == "adamw":
            return torch.optim.AdamW([p for _, p in named], lr=opts.lr, eps=opts.eps, weight_decay=0.01)
        if opts.optimizer == "muon":  # Moonlight's recipe: AdamW's learning rate and decay carry over
            groups = muon_param_groups(named, exclude=EMBEDDINGS)
            return Muon(
                groups,
                lr=opts.lr,
                weight_decay=0.01,
                adamw_betas=(0.9, 0.999),
                adamw_eps=opts.eps,
                tp_group=tp_group,
            )
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {opts.optimizer!r}")

    return build


def shard_alignment(opts: Options) -> ShardAlignmentSpec:
    """Muon orthogonalises whole matrices: every matrix (its TP shard, with --tp) sits whole on one rank of
    the sharded strategies."""
    if opts.optimizer != "muon":
        return None
    return lambda name, param: "tensor" if param.dim() >= 2 else None


def comparison(opts: Options) -> str | None:
    """The optimizer to train with as well, for the report (``--compare-with``)."""
    choice = (
        ("adamw" if opts.optimizer == "muon" else "none")
        if opts.compare_with == "auto"
        else opts.compare_with
    )
    if choice in ("none", "", opts.optimizer):
        return None
    if choice not in OPTIMIZERS:
        raise ValueError(f"--compare-with must be one of {', '.join(OPTIMIZERS)} or none, got {choice!r}")
    return choice


def grad_comms(opts: Options) -> list[str]:
    """The ``--grad-comm`` wires to train with, in order: the fp32 wire first whenever another is asked
    for (the reference each is compared with)."""
    wires = [wire.strip() for wire in opts.grad_comm.split(",") if wire.strip()]
    known = [*GRAD_COMMS, *COMM_HOOKS, *DILOCO]
    unknown = [wire for wire in wires if wire not in known]
    if unknown or not wires:
        raise ValueError(
            f"--grad-comm takes a comma-separated list of {', '.join(known)}; got {opts.grad_comm!r}"
        )
    return list(dict.fromkeys(["fp32", *wires] if wires != ["fp32"] else wires))


def register_powersgd(model: nn.Module, opts: Options, group: dist.ProcessGroup | None) -> Any:
    """torch's own PowerSGD hook on gradsync's DistributedDataParallel (``--grad-comm powersgd-r*``); its
    state, whose ``total_numel_after_compression`` counts the values it has sent compressed."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    register = getattr(model, "register_comm_hook", None)
    if register is None or getattr(model, "ddp_config", None) is None:
        raise ValueError(
            f"--grad-comm {opts.grad_comm}: needs a ddp strategy (ddp, ddp+overlap), not {opts.strategy}"
        )
    state = powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=COMM_HOOKS[opts.grad_comm], start_powerSGD_iter=10
    )
    register(state, powerSGD_hook.powerSGD_hook)
    return state


def comm_bytes(wrapped: Any, diloco: Any, synced_bytes: int, powersgd: Any, compressed: int) -> int:
    """What this rank's step sent: a DiLoCo replica's syncs only (its wrapper reduces over the rank
    alone); once PowerSGD compresses, its own count of the values it all-reduced (fp32 grads, as the
    script's recipes reduce them); else the wrapper's count."""
    if diloco is not None:
        return int(diloco.communicated_bytes - synced_bytes)
    if powersgd is not None and powersgd.total_numel_after_compression > compressed:
        return 4 * int(powersgd.total_numel_after_compression - compressed)
    return int(wrapped.comm_bytes())


def grad_comm_fields(opts: Options) -> dict[str, object]:
    """The config's ``grad_comm_*`` fields for this run's wire."""
    fields = GRAD_COMMS.get(opts.grad_comm, {})
    block = "param_gather_block_size" if opts.grad_comm.startswith("gather-") else "grad_comm_block_size"
    return {**fields, block: opts.grad_comm_block_size} if fields else {}


def param_dtype(opts: Options) -> torch.dtype:
    return torch.bfloat16 if opts.bf16 else torch.float32


def run(opts: Options, baseline: dict[str, list[StepRecord]] | None = None) -> RunResult:
    """Train on the already initialised default process group; every rank calls this. ``baseline``: runs
    to put beside this one in the report (the same model and data with another optimizer)."""
    rank = dist.get_rank()
    if opts.grad_comm in DILOCO:
        checkpoints = bool(opts.save_every or opts.resume)
        check_layout(opts.grad_comm, opts.strategy, opts.tp * opts.pp * opts.ep, checkpoints)
    groups = initialize_model_parallel(
        opts.tp,
        opts.pp,
        expert_model_parallel_size=opts.ep,
        create_all_gather_groups=opts.strategy.startswith("fsdp"),  # gradsync-fsdp's gather lane
    )
    device = device_for_group(groups.dp)
    cfg = GPTConfig(
        seq_len=opts.seq_len, d_model=opts.d_model, n_head=opts.n_head, n_layer=opts.n_layer, moe=opts.moe
    )
    stage = GPTStage(cfg, groups, opts.sequence_parallel).to(device, param_dtype(opts))
    wrapped = wrap(
        opts.strategy,
        stage,
        replica_groups(groups) if opts.grad_comm in DILOCO else groups,
        make_optimizer(opts, groups.tp),
        opts.bucket_size,
        bf16=opts.bf16,
        hsdp=Hybrid(opts.hsdp, opts.hsdp_outer),
        shard_alignment=shard_alignment(opts),
        grad_comm=grad_comm_fields(opts),
    )
    powersgd = register_powersgd(wrapped.model, opts, groups.dp_cp) if opts.grad_comm in COMM_HOOKS else None
    model, optimizer = wrapped.model, wrapped.optimizer
    diloco = local_sync(opts.grad_comm, model, optimizer, groups) if opts.grad_comm in DILOCO else None
    if diloco is not None:
        optimizer = diloco
    corpus = Corpus.from_stdlib(opts.corpus_bytes)
    dp_rank, dp_size = groups.dp_cp.rank(), groups.dp_cp.size()  # type: ignore[union-attr]
    local_batch = opts.global_batch // dp_size
    if local_batch % opts.microbatches:
        raise ValueError(f"--microbatches {opts.microbatches} must divide the per-rank batch {local_batch}")
    layout = {k: getattr(opts, k) for k in ("strategy", "tp", "pp", "ep", "sequence_parallel", "moe")} | {
        "world": dist.get_world_size()
    }
    ckpt_dir = Path(opts.out_dir or ".") / "checkpoints"
    start = checkpoint.load(ckpt_dir, wrapped, stage, layout, groups.dp_cp) if opts.resume else 0

    def shard(tokens: torch.Tensor) -> list[torch.Tensor]:
        return list(local_rows(tokens, dp_rank, dp_size).to(device).chunk(opts.microbatches))

    recorder = enable_telemetry() if opts.trace else None
    result = RunResult()
    for step in range(start, opts.steps):
        if step == opts.kill_at_step and rank == opts.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        synced_bytes = diloco.communicated_bytes if diloco else 0
        compressed = powersgd.total_numel_after_compression if powersgd else 0
        model.zero_grad_buffer()  # a new step: empty grad buffers, reset the bucket groups
        optimizer.zero_grad()
        batch = corpus.batch(step, opts.global_batch, opts.seq_len, seed=opts.seed)
        loss = forward_backward(model, stage, shard(batch), groups.pp)
        t1 = time.perf_counter()
        with telemetry.phase("finalize"):
            finalize_model_grads([model], pg_collection=groups)
        t2 = time.perf_counter()
        with telemetry.phase("optimizer"):
            optimizer.step()
        t3 = time.perf_counter()
        record = StepRecord(
            step + 1,
            global_loss(loss, groups.dp_cp, groups.pp),
            opts.global_batch * opts.seq_len / (t3 - t0),
            comm_bytes(wrapped, diloco, synced_bytes, powersgd, compressed),
            t1 - t0,
            t2 - t1,
            t3 - t2,
            t3 - t0,
        )
        if opts.eval_every and (step + 1) % opts.eval_every == 0:
            val = corpus.batch(0, opts.global_batch, opts.seq_len, split="val", seed=opts.seed)
            record.val_loss = global_loss(
                forward_backward(model, stage, shard(val), groups.pp, forward_only=True),
                groups.dp_cp,
                groups.pp,
            )
        result.losses.append(record.loss)
        result.records.append(record)
        if rank == 0 and not opts.quiet:
            print(progress_line(record, opts.steps), flush=True)
        if opts.save_every and (step + 1) % opts.save_every == 0:
            checkpoint.save(ckpt_dir, step + 1, wrapped, stage, layout)
    if recorder is not None:
        disable_telemetry()
        if opts.out_dir:
            Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
            recorder.write_chrome_trace(Path(opts.out_dir) / TRACE_FILE)
    if opts.collect_params:
        result.full_params = gather_full_params(stage, groups, wrapped.current_params())
    if rank == 0 and opts.out_dir and result.records:
        peak_sync = diloco.peak_sync_bytes if diloco is not None else 0
        result.report = write_outputs(
            opts, result.records, cfg, corpus, dp_size, device, baseline or {}, peak_sync
        )
    destroy_process_groups(groups)
    return result


def write_outputs(
    opts: Options,
    records: list[StepRecord],
    cfg: GPTConfig,
    corpus: Corpus,
    dp_size: int,
    device: torch.device,
    baseline: dict[str, list[StepRecord]],
    peak_sync_bytes: int = 0,
) -> Path:
    """metrics.json and the report under --out-dir (``baseline``'s runs beside this one); returns the
    report's path. ``peak_sync_bytes``: a DiLoCo run's largest sync."""
    peak_sync_mib = peak_sync_bytes / 2**20
    out = Path(opts.out_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(records_to_json(records), indent=1))
    facts = {
        "strategy": f"{opts.strategy}: {STRATEGIES[opts.strategy].summary}",
        "layout": f"world {dist.get_world_size()} = dp {dp_size} × tp {opts.tp} × pp {opts.pp}, ep {opts.ep}"
        + (", sequence parallel" if opts.sequence_parallel and opts.tp > 1 else "")
        + (f"; HSDP: {opts.hsdp} outer replicas ({opts.hsdp_outer})" if opts.hsdp > 1 else ""),
        "backend": f"{dist.get_backend()} on {device}",
        "model": f"{sum(p.numel() for p in GPTStage(cfg).parameters()) / 1e6:.2f}M params, {cfg}",
        "data": f"{corpus.source}; global batch {opts.global_batch} × {opts.seq_len} bytes",
        "optimizer": f"{opts.optimizer}, lr {opts.lr}",
        "grad wire": opts.grad_comm
        + (" (the grad dtype, reduced by the backend)" if opts.grad_comm == "fp32" else "")
        + (", summed in fp32" if opts.grad_comm.startswith(("bf16", "fp16", "fp8")) else "")
        + (": packed weight gathers, fp32 grads" if opts.grad_comm.startswith("gather-") else "")
        + (
            ": torch's PowerSGD comm hook (comm MiB/step: its own count of the values it all-reduces once it "
            "compresses)"
            if opts.grad_comm in COMM_HOOKS
            else ""
        )
        + (
            f": {DILOCO[opts.grad_comm].describe()}, each rank a replica on its own batch (outer Nesterov "
            f"SGD, lr 0.7, momentum 0.9); losses are the replicas' mean; the most one sync sent: "
            f"{peak_sync_mib:.2f} MiB"
            if opts.grad_comm in DILOCO
            else ""
        ),
    }
    if opts.trace:
        facts["trace"] = (
            f"[{TRACE_FILE}]({TRACE_FILE}): every rank's compute phases, collectives and exposed waits; "
            "open it in ui.perfetto.dev or chrome://tracing"
        )
    wires_compared = any(name.endswith(" wire") for name in baseline)
    label = opts.strategy if not baseline else f"{opts.strategy} {opts.optimizer}"
    label += f" {opts.grad_comm} wire" if wires_compared else ""
    if baseline:
        facts["compared with"] = ", ".join(baseline) + ": the same model, data and steps"
    return write_report(out, {**baseline, label: records}, facts)  # the reference first


def parse_args(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Options()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=value)
        elif name == "strategy":
            parser.add_argument(flag, choices=list(STRATEGIES), default=value)
        elif name == "optimizer":
            parser.add_argument(flag, choices=OPTIMIZERS, default=value)
        else:
            kind = int if name in ("bucket_size",) else type(value) if value is not None else str
            parser.add_argument(flag, type=kind, default=value)
    return Options(**vars(parser.parse_args(argv)))


def main(argv: list[str]) -> None:
    opts = parse_args(argv)
    backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=opts.timeout_s))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    shard_alignment(opts)  # refuse a layout Muon cannot run on before anything trains
    baseline: dict[str, list[StepRecord]] = {}
    *earlier, last = grad_comms(opts)
    for wire in earlier:  # the fp32 wire and every other one first, so the last run's report shows all
        if dist.get_rank() == 0:
            print(f"baseline: the same run with --grad-comm {wire}", flush=True)
        compared = run(dataclasses.replace(opts, grad_comm=wire, out_dir=None, save_every=0, trace=False))
        baseline[f"{opts.strategy} {opts.optimizer} {wire} wire"] = compared.records
    opts = dataclasses.replace(opts, grad_comm=last)
    other = comparison(opts)
    if other is not None:
        if dist.get_rank() == 0:
            print(f"baseline: the same run with --optimizer {other}", flush=True)
        compared = run(dataclasses.replace(opts, optimizer=other, out_dir=None, save_every=0, trace=False))
        baseline[f"{opts.strategy} {other}" + (f" {last} wire" if earlier else "")] = compared.records
    result = run(opts, baseline)
    if dist.get_rank() == 0 and result.report:
        print(f"report: {result.report.resolve()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
