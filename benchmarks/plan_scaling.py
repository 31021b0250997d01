"""The planner's extrapolation from DP 8 to 4096 for a 6.6B-param GPT (d_model 4096, 32 layers, vocab
50304) on published NCCL figures: per strategy, predicted comm and exposed time per step, with the
reference's bucket rule (max(40M, 1M x dp), buckets padded to the DP size and to 2^16 elements for NCCL's
bus bandwidth) and with a fixed 40M bucket, and the DP size from which the alpha terms outweigh the beta
terms (latency-bound). Prints Markdown tables and writes a plot.

    python benchmarks/plan_scaling.py [--costs nccl-h100-ib] [--plot plan_scaling.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gradsync.buffers.plan import PUBLISHED, STRATEGIES, Prediction, predict, specs_from_shapes
from gradsync.buffers.plan.__main__ import gpt_shapes, gpt_units

DPS = [8 * 2**k for k in range(10)]  # 8 ... 4096
FORWARD, BACKWARD = 0.120, 0.240  # seconds per step on each rank (an assumed per-rank batch)


def sweep(costs_name: str, fixed: bool) -> dict[str, list[Prediction]]:
    specs = specs_from_shapes(gpt_shapes(4096, 32, 50304))
    costs = PUBLISHED[costs_name]
    return {
        strategy: [
            predict(strategy, specs, dp, costs, bucket_size=40_000_000 if fixed else None,
                    forward_seconds=FORWARD, backward_seconds=BACKWARD, pad_for_high_nccl_busbw=True,
                    units=gpt_units(32))
            for dp in DPS
        ]
        for strategy in STRATEGIES
    }  # fmt: skip


def crossover(predictions: list[Prediction]) -> str:
    bound = [p.dp for p in predictions if p.latency_bound]
    return f"DP {bound[0]}" if bound else "not up to DP 4096"


def table(costs_name: str) -> dict[str, dict[str, list[Prediction]]]:
    runs = {"reference rule": sweep(costs_name, False), "fixed 40M": sweep(costs_name, True)}
    print(f"\n{costs_name}: {PUBLISHED[costs_name].source}\n")
    print("| strategy | buckets | " + " | ".join(f"DP {dp}" for dp in DPS) + " | latency-bound from |")
    print("|---|---|" + "---|" * len(DPS) + "---|")
    for rule, by_strategy in runs.items():
        for strategy, predictions in by_strategy.items():
            cells = " | ".join(
                f"{p.comm_seconds * 1e3:.0f} / {p.exposed_seconds * 1e3:.0f}" for p in predictions
            )
            print(f"| {strategy} | {rule} | {cells} | {crossover(predictions)} |")
    return runs


def plot(runs: dict[str, dict[str, list[Prediction]]], costs_name: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, (rule, by_strategy) in zip(axes, runs.items(), strict=True):
        for strategy, predictions in by_strategy.items():
            comm = [p.comm_seconds * 1e3 for p in predictions]
            latency = [p.latency_seconds * 1e3 for p in predictions]
            (line,) = ax.plot(DPS, comm, marker="o", label=f"{strategy} comm")
            ax.plot(DPS, latency, linestyle="--", color=line.get_color(), label=f"{strategy} alpha part")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{rule} ({costs_name})")
        ax.set_xlabel("data-parallel size")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per step")
    axes[1].legend(fontsize=8)
    fig.suptitle("6.6B GPT, fp32 grads: predicted comm per step; latency-bound where the dashed line crosses")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--costs", nargs="+", default=list(PUBLISHED))
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    print("Each cell: predicted comm / exposed ms per step (forward 120 ms, backward 240 ms per step).")
    for name in args.costs:
        runs = table(name)
        if args.plot and name == args.costs[-1]:
            plot(runs, name, args.plot)


if __name__ == "__main__":
    main()
