"""The main job under torchft: the toy GPT trained by replica groups that a fault does not stop.

    python integration/train_ft.py --replicas 3 --steps 150 --kill-replica 1 --kill-at-step 50

It starts a torchft lighthouse on 127.0.0.1 and ``--replicas`` replica groups of one process each
(``train_ft_replica.py``: gradsync DDP, the buckets reduced across groups by torchft's manager), twice:

1. with no fault, the reference;
2. with replica group ``--kill-replica`` SIGKILLed mid-backward at step ``--kill-at-step`` and restarted
   at once, as a job scheduler would (it heals from a peer and rejoins).

The report (``--out-dir``: report.md, report.png, metrics.json) shows each step's quorum size, the
committed and the discarded attempts, the time to heal and to rejoin, and both runs' loss curves in one
plot with the fault marked. A step's loss is the mean over the replica groups that committed it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gradsync.groups.testing.replica_groups import ReplicaJob

REPLICA = Path(__file__).with_name("train_ft_replica.py")


@dataclass
class Run:
    """One job's outcome, from its replica groups' records."""

    losses: dict[int, float] = field(default_factory=dict)  # committed step -> mean loss of its groups
    quorum: dict[int, int] = field(default_factory=dict)  # committed step -> replica groups in its quorum
    discarded: list[tuple[int, int]] = field(default_factory=list)  # (replica group, step) not committed
    heal_s: list[float] = field(default_factory=list)  # a restarted group's first quorum (the heal)
    rejoin_s: list[float] = field(default_factory=list)  # from its restart to its first committed step
    wall_s: float = 0.0


def summarise(job: ReplicaJob, restarted_at: dict[int, float], wall_s: float) -> Run:
    run = Run(wall_s=wall_s)
    committers: dict[int, list[float]] = {}
    for replica, lines in job.records().items():
        outcomes = [line for line in lines if "committed" in line]
        for line in outcomes:
            if line["committed"]:
                committers.setdefault(line["step"], []).append(line["loss"])
                run.quorum[line["step"]] = line["participants"]
            else:
                run.discarded.append((replica, line["step"]))
            if "heal_s" in line:
                run.heal_s.append(line["heal_s"])
        if replica in restarted_at:
            later = [line for line in outcomes if line["committed"] and line["t"] > restarted_at[replica]]
            run.rejoin_s.append(later[0]["t"] - restarted_at[replica])
    run.losses = {step: statistics.fmean(losses) for step, losses in sorted(committers.items())}
    return run


def train(out: Path, opts: argparse.Namespace, kill: tuple[int, int] | None, passed: list[str]) -> Run:
    """One job; ``kill``: (replica group, step) to SIGKILL mid-backward and restart."""
    shutil.rmtree(out, ignore_errors=True)  # the records of an earlier run would read as this one's
    out.mkdir(parents=True)
    started = time.monotonic()
    options = dict(arg.lstrip("-").split("=", 1) for arg in passed)
    restarted_at: dict[int, float] = {}
    with ReplicaJob(out, REPLICA, opts.replicas, 1, opts.steps, **options) as job:
        for replica in range(opts.replicas):
            job.launch(replica, f"backward:{kill[1]}" if kill and replica == kill[0] else "")
        if kill is not None:
            killed = job.kill_when_stopped(kill[0], timeout=opts.timeout)
            print(
                f"killed replica group {killed} (SIGKILL) mid-backward at step {kill[1]}; restarting it",
                flush=True,
            )
            restarted_at[killed] = time.time()
            job.launch(killed)
        job.finish(timeout=opts.timeout)
        return summarise(job, restarted_at, time.monotonic() - started)


def ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "none"


def report(out: Path, opts: argparse.Namespace, clean: Run, fault: Run) -> Path:
    by_size: dict[int, list[int]] = {}
    for step, size in fault.quorum.items():
        by_size.setdefault(size, []).append(step)
    common = [s for s in fault.losses if s in clean.losses]
    last, before = common[-20:], [s for s in common if s < opts.kill_at_step]
    apart = max((abs(clean.losses[s] - fault.losses[s]) for s in before), default=0.0)
    lines = [
        "# gradsync under torchft: the main job with a replica group killed",
        "",
        f"- **job**: the toy GPT ({opts.replicas} replica groups of one process, gradsync DDP, AdamW), "
        f"{opts.steps} committed steps; replica group {opts.kill_replica} SIGKILLed mid-backward at step "
        f"{opts.kill_at_step} and restarted at once",
        f"- **versions**: torch {torch.__version__}, torchft {version('torchft')}, gloo on CPU",
        f"- **wall time**: {clean.wall_s:.0f} s with no fault, {fault.wall_s:.0f} s with the fault "
        "(the startup included)",
        "",
        "| | with the fault |",
        "|---|---|",
    ]
    lines += [
        f"| steps committed by a quorum of {size} | {ranges(steps)} |"
        for size, steps in sorted(by_size.items())
    ]
    lines += [
        "| attempts discarded (replica group, step) | "
        + (", ".join(f"({r}, {s})" for r, s in sorted(fault.discarded)) or "none")
        + " |",
        "| the heal (the restarted group's first quorum, which fetches the state) | "
        + (", ".join(f"{s:.2f} s" for s in fault.heal_s) or "none")
        + " |",
        "| from the restart to its first committed step | "
        + (", ".join(f"{s:.1f} s" for s in fault.rejoin_s) or "none")
        + " |",
        f"| mean loss of the last {len(last)} steps: no fault / with the fault | "
        f"{mean_loss(clean, last):.4f} / {mean_loss(fault, last):.4f} |",
        f"| the two runs' losses before the fault (steps 0-{opts.kill_at_step - 1}) | "
        + ("bit-identical" if apart == 0 else f"up to {apart:.2e} apart")
        + " |",
        f"| steps never committed, below the last one | {ranges(missing(fault))} |",
        "",
        "A step committed while the group was down is a step of the job: its loss is the mean over the "
        "groups that committed it.",
    ]
    png = plot(out / "report.png", opts, clean, fault)
    if png is not None:
        lines += ["", f"![loss and quorum]({png.name})"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "metrics.json").write_text(
        json.dumps({"no_fault": asdict(clean), "fault": asdict(fault)}, indent=1)
    )
    return path


def missing(run: Run) -> list[int]:
    """Steps below the last committed one that no quorum committed (a lost step; torchft retries a
    discarded attempt instead)."""
    return sorted(set(range(max(run.losses, default=-1) + 1)) - set(run.losses))


def mean_loss(run: Run, steps: list[int]) -> float:
    return statistics.fmean(run.losses[s] for s in steps)


def plot(path: Path, opts: argparse.Namespace, clean: Run, fault: Run) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (loss_ax, quorum_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 1))
    for run, label in ((clean, "no fault"), (fault, f"replica group {opts.kill_replica} killed")):
        loss_ax.plot(list(run.losses), list(run.losses.values()), linewidth=1.0, label=label)
    quorum_ax.step(list(fault.quorum), list(fault.quorum.values()), where="mid", color="tab:orange")
    for ax in (loss_ax, quorum_ax):
        ax.axvline(opts.kill_at_step, color="tab:red", linestyle="--", linewidth=1)
    loss_ax.set(
        ylabel="training loss (nats/byte)", title="the toy GPT under torchft: SIGKILL at the dashed line"
    )
    loss_ax.legend()
    quorum_ax.set(xlabel="committed step", ylabel="quorum", yticks=range(1, opts.replicas + 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def version(package: str) -> str:
    from importlib.metadata import version as installed

    return installed(package)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-replica", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=50)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/train-ft"))
    parser.add_argument("--timeout", type=float, default=600, help="seconds each job may take")
    opts, passed = parser.parse_known_args(argv)  # the rest goes to each replica group (--d-model=...)
    if not 0 <= opts.kill_replica < opts.replicas or not 0 < opts.kill_at_step < opts.steps:
        parser.error("--kill-replica must name a replica group and --kill-at-step a step before --steps")
    bad = [arg for arg in passed if not arg.startswith("--") or "=" not in arg]
    if bad:
        parser.error(f"options for the replica groups read --name=value: {bad}")
    print(f"the job with no fault: {opts.replicas} replica groups, {opts.steps} steps", flush=True)
    clean = train(opts.out_dir / "no-fault", opts, None, passed)
    print("the job with the fault", flush=True)
    fault = train(opts.out_dir / "fault", opts, (opts.kill_replica, opts.kill_at_step), passed)
    print(f"report: {report(opts.out_dir, opts, clean, fault).resolve()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
