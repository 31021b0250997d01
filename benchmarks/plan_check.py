"""Check the α-β planner against measured runs here: gradsync DDP, without and with overlap, at DP 2 and 4.

1. α and β of this machine's gloo are fitted (``python -m gradsync.buffers.plan --calibrate``) and the fit's
   error on its own points is printed;
2. one process times the toy GPT's forward and backward alone (one thread, as each rank has);
3. ``bench_ab.py`` times the compute floor, gradsync-ddp and gradsync-ddp+overlap step by step in the
   same processes at 4 MiB buckets, at DP 2 and 4;
4. the planner predicts each system's exposed communication (what it adds to the floor) from the model's
   param shapes, the bucket size and the forward/backward times, and the table sets it beside the
   measured step minus floor.

    python benchmarks/plan_check.py [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SYSTEMS = ["floor", "gradsync-ddp", "gradsync-ddp+overlap"]
BUCKET_MB = 4


sys.path.insert(0, str(HERE.parent / "integration"))


def toy_gpt() -> torch.nn.Module:
    from toygpt.model import GPTConfig, GPTStage

    return GPTStage(GPTConfig(seq_len=128, d_model=256, n_head=8, n_layer=6))


def forward_backward_seconds() -> tuple[float, float]:
    """Median forward and backward times of one rank's batch (8 x 128 tokens), one thread."""
    from toygpt.data import Corpus
    from toygpt.model import next_token_loss

    torch.set_num_threads(1)
    model, corpus = toy_gpt(), Corpus.from_stdlib()
    forward, backward = [], []
    for step in range(8):
        tokens = corpus.batch(step, 8, 128)
        start = time.perf_counter()
        loss = next_token_loss(model(tokens[:, :-1]), tokens)
        middle = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        end = time.perf_counter()
        if step >= 2:
            forward.append(middle - start)
            backward.append(end - middle)
    return statistics.median(forward), statistics.median(backward)


def measured_steps(nproc: int, steps: int) -> dict[str, float]:
    command = [
        sys.executable,
        str(HERE / "bench_ab.py"),
        "--steps",
        str(steps),
        "--bucket-mb",
        str(BUCKET_MB),
    ]
    out = subprocess.run(
        [*command, "--nproc", str(nproc), "--systems", *SYSTEMS],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout  # fmt: skip
    return {m[1]: float(m[2]) / 1e3 for m in re.finditer(r"^\| (\S+) \| ([\d.]+) \|", out, re.M)}


def main() -> None:
    from gradsync.buffers import __version__
    from gradsync.buffers.plan import calibrate, predict, specs_from_shapes

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    measured_costs = calibrate.measure()
    costs = calibrate.fit(measured_costs)
    errors = []
    for world, by_kind in measured_costs.items():
        for kind, times in by_kind.items():
            for size, seconds in zip(calibrate.SIZES, times, strict=True):
                errors.append(abs(costs.time(kind, size * 4, world) - seconds) / seconds)
    print(f"gradsync-buffers {__version__}, torch {torch.__version__}; gloo fit: alpha (ms) "
          + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in costs.alpha.items())
          + "; busbw (GB/s) " + ", ".join(f"{k} {1 / v / 1e9:.2f}" for k, v in costs.beta.items())
          + f"; fit error on its {len(errors)} points: median {statistics.median(errors):.0%}, "
          f"max {max(errors):.0%}")  # fmt: skip
    forward, backward = forward_backward_seconds()
    print(f"one rank's forward {forward * 1e3:.1f} ms, backward {backward * 1e3:.1f} ms (one thread)\n")
    specs = specs_from_shapes([list(p.shape) for p in toy_gpt().parameters()])
    bucket = BUCKET_MB * 2**20 // 4
    print("| DP | system | measured step - floor (ms) | predicted exposed (ms) | error |")
    print("|---|---|---|---|---|")
    for nproc in (2, 4):
        steps = measured_steps(nproc, args.steps)
        for system, overlap in (("gradsync-ddp", False), ("gradsync-ddp+overlap", True)):
            got = steps[system] - steps["floor"]
            forward_s, backward_s = (forward, backward) if overlap else (0.0, 0.0)
            want = predict(
                "ddp", specs, nproc, costs, bucket_size=bucket, forward_seconds=forward_s,
                backward_seconds=backward_s,
            ).exposed_seconds  # fmt: skip
            print(f"| {nproc} | {system} | {got * 1e3:.1f} | {want * 1e3:.1f} | {(want - got) / got:+.0%} |")


if __name__ == "__main__":
    main()
