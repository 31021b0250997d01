"""`nox -s bench-launch`: the launch-bound benchmark. On a model whose compute is negligible beside
the wrappers' host work (the toy GPT at d_model 32, 24 layers, one sequence of 16 tokens per rank: 388
small params in 25 units), what is left of a step is each system's own bookkeeping, reported per step, per
unit (each block, and the root: the fully_shard calls) and per param. Every system's steps run
interleaved in one job, as in bench_ab.py, each on its own copy of the model; a figure is the median over
the timed steps of the slowest rank, beside torch DDP's and the compute floor's (the same model and batch
in the same processes, no wrapper).

On the CPU (gloo; worlds 1 and 2) no GPU is behind any figure: the host time is the step's wall time. On
CUDA (NCCL; world 1) the host time is what the CPU takes to issue the step (timed without synchronising)
and the step time runs until the GPU is done; there larger models run too (fp32 219M and 21M, the bf16
recipe at 370M and 21M; vocabularies sized to those parameter counts), and a last table gives each
system's step time over torch DDP's, one column per model. Sized to take under five minutes on one GPU,
with torch (CUDA build) and the five gradsync packages installed, from the repository root:

    python benchmarks/bench_launch.py --device cuda      # or: nox -s bench-launch -- --device cuda
    python benchmarks/bench_launch.py                    # the CPU: the launch-bound model, worlds 1 and 2

The bf16 recipe: gradsync's systems wrap a bf16 model with fp32 main weights and grads (Megatron's recipe:
grad_reduce_in_fp32 and the distributed optimizer's fp32 main params; MegatronFSDP's MixedPrecisionPolicy);
torch FSDP2 and gradsync's FSDP2-style API shard the fp32 model with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32); the floor and torch DDP run fp32 params under bf16 autocast. DeepSpeed (optional, fp32
models only) runs when named: ``--systems deepspeed-zero1 ...``. A job holds every system's copy of its
model at once, bf16-370M's about 70 GB (estimated): on a smaller GPU, run it with fewer ``--systems`` (a
failed job is reported and the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))  # the toy GPT (and train.py, for bench_worker)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench import machine  # noqa: E402
from bench_ab import commit, median_interval, result_of  # noqa: E402
from bench_worker import Step, fsdp2_step, gradsync_step  # noqa: E402
from bench_worker import build as build_fp32  # noqa: E402
from toygpt.model import GPTConfig, GPTStage  # noqa: E402

SYSTEMS = [
    "floor",
    "torch-ddp",
    "gradsync-ddp+overlap",
    "gradsync-ddp+distopt",
    "gradsync-fsdp-no_shard",
    "gradsync-fsdp-optim",
    "gradsync-fsdp-optim_grads",
    "gradsync-fsdp-optim_grads_params",
    "torch-fsdp2",
    "gradsync-fsdp2",
]


TWINS = {
    "gradsync-fsdp-no_shard": "gradsync-ddp+overlap",
    "gradsync-fsdp-optim": "gradsync-ddp+distopt",
    "gradsync-fsdp-optim_grads": "gradsync-ddp+distopt",
    "gradsync-fsdp-optim_grads_params": "torch-fsdp2",
    "gradsync-fsdp2": "gradsync-fsdp-optim_grads_params",
}
"""Each gradsync-fsdp system's yardstick: its gradsync-ddp twin, torch FSDP2 for ZeRO-3, and the ZeRO-3 it
builds for the FSDP2-style API."""


@dataclass(frozen=True)
class Preset:
    cfg: GPTConfig
    batch: int  # sequences per rank
    bf16: bool = False  # the bf16 recipe (module docstring)


_LAUNCH = GPTConfig(seq_len=16, d_model=32, n_head=4, n_layer=24)
_MID = GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_head=8, n_layer=24)
_LARGE = GPTConfig(vocab_size=65536, seq_len=1024, d_model=1024, n_head=16, n_layer=12)
PRESETS = {
    "launch": Preset(_LAUNCH, batch=1),
    "bf16-launch": Preset(_LAUNCH, batch=1, bf16=True),
    "fp32-21M": Preset(_MID, batch=4),
    "bf16-21M": Preset(_MID, batch=4, bf16=True),
    "fp32-219M": Preset(_LARGE, batch=8),
    "bf16-370M": Preset(replace(_LARGE, n_layer=24), batch=8, bf16=True),  # last: the most memory
}


def build(system: str, preset: Preset, device: torch.device, options: argparse.Namespace) -> Step:
    """``system`` on its own copy of the model under the preset's recipe; bench_worker builds the step."""
    torch.manual_seed(0)
    model = GPTStage(preset.cfg)
    if not preset.bf16:
        return build_fp32(system, model.to(device), options)
    if system in ("floor", "torch-ddp"):
        model.to(device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
        model.forward = autocast(model.forward)  # type: ignore[method-assign]
        return build_fp32(system, model, options)
    if system in ("torch-fsdp2", "gradsync-fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return fsdp2_step(system, model.to(device), options.lr, reshard_after_forward=True, mp_policy=policy)
    if not system.startswith("gradsync-"):
        raise SystemExit(f"{system}: no bf16 recipe here; it runs the fp32 models only")
    bucket_elements = options.bucket_mb * 2**20 // 4
    bf16_model = model.to(device, torch.bfloat16)
    return gradsync_step(system.removeprefix("gradsync-"), bf16_model, options.lr, bucket_elements, bf16=True)


def join_ranks(device_type: str) -> torch.device:
    """A torchrun worker's process group: NCCL on its GPU, or gloo with one CPU thread per rank."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per rank
    return torch.device("cpu")


def worker(args: argparse.Namespace) -> None:
    """The torchrun worker: build every system, time their steps in turn; rank 0 prints the medians."""
    device = join_ranks(args.device)
    rank, preset = dist.get_rank(), PRESETS[args.model]
    options = argparse.Namespace(bucket_mb=args.bucket_mb, lr=1e-3, batch_per_rank=preset.batch)
    steps = {system: build(system, preset, device, options) for system in args.systems}
    generator = torch.Generator().manual_seed(rank)
    shape = (preset.batch, preset.cfg.seq_len + 1)
    batches = [
        torch.randint(preset.cfg.vocab_size, shape, generator=generator).to(device)
        for _ in range(args.warmup + args.steps)
    ]
    host: dict[str, list[float]] = {system: [] for system in args.systems}
    total: dict[str, list[float]] = {system: [] for system in args.systems}
    for index, tokens in enumerate(batches):
        # each round starts one system further on (as bench_ab.py's), so no pair always has the same
        # systems between its two steps
        turn = index % len(args.systems)
        for system in [*args.systems[turn:], *args.systems[:turn]]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()  # nothing in flight on any rank when a step starts
            start = time.perf_counter()
            steps[system](tokens)
            issued = time.perf_counter()  # no synchronisation inside: the CPU's time to issue the step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= args.warmup:
                host[system].append(issued - start)
                total[system].append(time.perf_counter() - start)
    medians = [[statistics.median(host[s]), statistics.median(total[s])] for s in args.systems]
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    by_step = torch.tensor([host[s] for s in args.systems], dtype=torch.float64, device=device)
    dist.all_reduce(by_step, op=dist.ReduceOp.MAX)  # each step's slowest rank
    steps_of = dict(zip(args.systems, by_step.tolist(), strict=True))
    if rank == 0:
        with torch.device("meta"):
            params = list(GPTStage(preset.cfg).parameters())
        name = machine()  # the CPU, and "no GPU"
        if device.type == "cuda":
            gpu = torch.cuda.get_device_name(device)
            name = f"{gpu}, CUDA {torch.version.cuda}, torch {torch.__version__}"
        result = {
            "device": name,
            "backend": dist.get_backend(),
            "params": len(params),
            "elements": sum(p.numel() for p in params),
            "units": preset.cfg.n_layer + 1,
            "times": dict(zip(args.systems, slowest.tolist(), strict=True)),
            "twins": {
                system: [twin, *twin_ratio(steps_of[system], steps_of[twin])]
                for system, twin in TWINS.items()
                if system in steps_of and twin in steps_of
            },
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def twin_ratio(mine: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """The median over rounds of the ratio of two systems' host times in the same round (the machine's
    speed drifts between rounds; within one, the two steps run less than a round apart, and the rotating
    order puts different systems between them), with its 95 % interval."""
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return (statistics.median(ratios), *median_interval(ratios))


def twins_table(result: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "each gradsync-fsdp system against its yardstick, round by round (the median over rounds of the "
        "ratio of host times within a round, with its 95 % interval):",
        "",
        "| system | yardstick | host / yardstick's | 95 % interval |",
        "|---|---|---|---|",
    ]
    for system, (twin, ratio, low, high) in result["twins"].items():
        lines.append(f"| {system} | {twin} | {ratio:.3f} | {low:.3f}-{high:.3f} |")
    return lines


def run_job(args: argparse.Namespace, model: str, world: int) -> dict[str, Any]:
    """One model's interleaved job on ``world`` fresh ranks."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"),
        *(__file__, "--worker", "--device", args.device, "--model", model),
        *("--steps", str(args.steps), "--warmup", str(args.warmup), "--bucket-mb", str(args.bucket_mb)),
        *("--systems", *args.systems),
    ]
    cpu = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"} if args.device == "cpu" else {}
    result: dict[str, Any] = result_of(command, {**os.environ, **cpu})
    return result


def heading(model: str, result: dict[str, Any], world: int, args: argparse.Namespace) -> list[str]:
    """What ran, where, at which commit; "no GPU" on the CPU."""
    preset, cfg = PRESETS[model], PRESETS[model].cfg
    lines = [
        "",
        f"{model}: d_model {cfg.d_model}, {cfg.n_layer} layers, {preset.batch} x {cfg.seq_len} tokens per "
        f"rank, {result['params']} params ({result['elements'] / 1e6:.2f}M elements) in {result['units']} "
        f"units, {'the bf16 recipe' if preset.bf16 else 'fp32'}; {world} rank(s) on {result['backend']}; "
        f"median of {args.steps} interleaved steps after {args.warmup} warm-up",
        f"device: {result['device']}; commit {commit()}",
    ]
    if args.device == "cpu":
        lines.append("no GPU: the host time is the step's wall time")
    return lines


def table(result: dict[str, Any], cuda: bool) -> list[str]:
    """A row per system: host time per step, unit and param, over torch DDP's and the floor's; on CUDA also
    the step time until the GPU is done."""
    columns = ["system", "host ms/step", "host µs/unit", "host µs/param", "host / torch DDP", "host / floor"]
    if cuda:
        columns += ["step ms", "step / torch DDP", "step / floor"]
    times = result["times"]
    ddp, floor = times["torch-ddp"], times["floor"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for system, (host, step) in times.items():
        cells = [
            f"{host * 1e3:.2f}",
            f"{host * 1e6 / result['units']:.1f}",
            f"{host * 1e6 / result['params']:.2f}",
            f"{host / ddp[0]:.2f}",
            f"{host / floor[0]:.2f}",
        ]
        if cuda:
            cells += [f"{step * 1e3:.2f}", f"{step / ddp[1]:.2f}", f"{step / floor[1]:.2f}"]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def versus_ddp(ratios: dict[str, dict[str, float]], systems: list[str], world: int) -> list[str]:
    """The table: a row per system, a column per model, each its step time over torch DDP's."""
    lines = [f"\nstep time / torch DDP's step time in the same run, {world} rank(s)\n"]
    lines += ["| system | " + " | ".join(ratios) + " |", "|---" * (len(ratios) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(f"{ratios[m][s]:.2f}" for m in ratios) + " |" for s in systems]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", choices=list(PRESETS), help="default: launch; all on CUDA")
    parser.add_argument("--worlds", type=int, nargs="+", help="ranks per job; default: 1 2; 1 on CUDA")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per system (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=25, help="buckets wherever a system has them")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cuda = args.device == "cuda"
    args.systems = ["floor", "torch-ddp", *(s for s in args.systems if s not in ("floor", "torch-ddp"))]
    models = args.models or (list(PRESETS) if cuda else ["launch"])
    failed = []
    for world in args.worlds or ([1] if cuda else [1, 2]):
        over_ddp = {}
        for model in models:
            try:
                result = run_job(args, model, world)
            except SystemExit as failure:  # say, out of memory: the other models still run
                print(f"\n{model} on {world} rank(s) failed: {failure}", flush=True)
                failed.append(f"{model} on {world} rank(s)")
                continue
            lines = [*heading(model, result, world, args), "", *table(result, cuda)]
            if result["twins"]:
                lines += twins_table(result)
            print("\n".join(lines), flush=True)
            ddp = result["times"]["torch-ddp"][1]
            over_ddp[model] = {system: step / ddp for system, (_, step) in result["times"].items()}
        if len(over_ddp) > 1:
            print("\n".join(versus_ddp(over_ddp, args.systems, world)), flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
