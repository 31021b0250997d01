"""Progress lines while training, and the final report: a Markdown table and a PNG of the loss curves and
the step-time breakdown (the PNG needs matplotlib; without it the report says so and stays Markdown)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    comm_bytes: int  # grad/param collective payload this rank handed to gradsync in the step
    compute_s: float  # forward + backward (pipeline sends/receives included)
    sync_s: float  # finalize_model_grads: the grad-sync wait backward did not hide
    optimizer_s: float  # optimizer step (with its param all-gather unless overlapped with the forward)
    step_s: float
    val_loss: float | None = None

    @property
    def exposed_comm(self) -> float:
        return self.sync_s / self.step_s if self.step_s else 0.0


def progress_line(r: StepRecord, total_steps: int) -> str:
    val = f" | val {r.val_loss:.4f}" if r.val_loss is not None else ""
    return (
        f"step {r.step:>4}/{total_steps} | loss {r.loss:.4f}{val} | {r.tokens_per_s:>8.0f} tok/s | "
        f"comm {r.comm_bytes / 2**20:7.2f} MiB | exposed comm {100 * r.exposed_comm:4.1f}% | "
        f"{1000 * r.step_s:6.1f} ms"
    )


def steady_median(records: list[StepRecord], attr: str) -> float:
    """Median of ``attr`` over the steps after the first (which pays for warm-up)."""
    return float(statistics.median(getattr(r, attr) for r in (records[1:] or records)))


def steady_mean(records: list[StepRecord], attr: str) -> float:
    """Mean of ``attr`` over the steps after the first: the per-step share of what some steps do only
    (DiLoCo's syncs)."""
    return float(statistics.fmean(getattr(r, attr) for r in (records[1:] or records)))


def _summary_row(name: str, records: list[StepRecord]) -> str:
    val = [r.val_loss for r in records if r.val_loss is not None]

    def ms(attr: str) -> float:
        return 1000 * steady_median(records, attr)

    val_text = f"{val[-1]:.4f}" if val else "–"
    return (
        f"| {name} | {len(records)} | {records[0].loss:.4f} | {records[-1].loss:.4f} | {val_text} | "
        f"{steady_median(records, 'tokens_per_s'):.0f} | {ms('step_s'):.1f} | "
        f"{ms('compute_s'):.1f} | "
        f"{ms('sync_s'):.1f} | {ms('optimizer_s'):.1f} | "
        f"{100 * steady_median(records, 'exposed_comm'):.1f}% | "
        f"{steady_mean(records, 'comm_bytes') / 2**20:.2f} |"
    )


def write_report(out_dir: Path, runs: dict[str, list[StepRecord]], facts: dict[str, str]) -> Path:
    """Write report.md (+ report.png) under ``out_dir``; returns the Markdown file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = _plot(out_dir / "report.png", runs)
    lines = ["# gradsync training report", ""]
    lines += [f"- **{k}**: {v}" for k, v in facts.items()]
    lines += [
        "",
        "Times are medians over the steps after the first, comm MiB/step a mean over them; exposed comm "
        "is the share of the step spent waiting for grad sync in `finalize_model_grads`.",
        "",
        "| run | steps | first loss | last loss | last val loss | tokens/s | step ms | compute ms | "
        "grad-sync wait ms | optimizer ms | exposed comm | comm MiB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_summary_row(name, records) for name, records in runs.items()]
    lines += [
        "",
        f"![loss and step time]({png.name})" if png else "(matplotlib is not installed: no plot)",
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


SMOOTHING = 20
"""Steps in the running mean the loss panels draw: one step's loss moves by a few percent from batch to batch,
more than the runs differ."""


def running_mean(values: list[float], width: int = SMOOTHING) -> list[float]:
    """The mean of each value and the ``width - 1`` before it (fewer at the start)."""
    means, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - width] if i >= width else 0.0)
        means.append(total / min(i + 1, width))
    return means


def short_names(names: list[str]) -> tuple[list[str], str]:
    """The run names without the words they all share, and those words (for the title)."""
    words = [name.split() for name in names]
    shared = [w for w in words[0] if all(w in other for other in words[1:])] if len(names) > 1 else []
    short = [" ".join(w for w in each if w not in shared) or " ".join(each) for each in words]
    return short, " ".join(shared)


def _plot(path: Path, runs: dict[str, list[StepRecord]]) -> Path | None:
    """Three panels: each run's training loss (a running mean) with its validation points, each run's
    training loss minus the first run's, the reference (where a few percent of difference shows), and
    the step-time breakdown; one legend under them, runs named by what sets them apart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(runs)
    labels, shared = short_names(names)
    fig, (loss_ax, diff_ax, time_ax) = plt.subplots(1, 3, figsize=(15, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    baseline = running_mean([r.loss for r in runs[names[0]]])
    for i, (name, label) in enumerate(zip(names, labels, strict=True)):
        records, colour = runs[name], colours[i % len(colours)]
        steps, smooth = [r.step for r in records], running_mean([r.loss for r in records])
        loss_ax.plot(steps, smooth, color=colour, linewidth=1.2, label=label)
        val = [(r.step, r.val_loss) for r in records if r.val_loss is not None]
        if val:
            loss_ax.plot(*zip(*val, strict=True), "o", color=colour, markersize=3)
        if i:
            pairs = list(zip(smooth, baseline, strict=False))[SMOOTHING:]  # once the means are full
            diff = [a - b for a, b in pairs]
            diff_ax.plot(steps[SMOOTHING : SMOOTHING + len(diff)], diff, color=colour, linewidth=1.2)
    diff_ax.axhline(0.0, color=colours[0], linewidth=1.2)
    loss_ax.set(
        xlabel="step",
        ylabel="cross-entropy (nats/byte)",
        title=f"training loss, mean of {SMOOTHING} steps; dots: validation",
    )
    settled = [running_mean([r.loss for r in records])[SMOOTHING:] for records in runs.values()]
    if all(settled):
        low = min(min(means) for means in settled)
        loss_ax.set_ylim(low - 0.1, low + 1.5)  # the first steps' drop would squash the rest
    diff_ax.set(xlabel="step", ylabel="nats/byte", title=f"training loss minus {labels[0]}'s (same mean)")
    bottom = [0.0] * len(names)
    for attr, part, shade in (
        ("compute_s", "forward+backward", "0.35"),
        ("sync_s", "grad-sync wait", "tab:orange"),
        ("optimizer_s", "optimizer", "0.7"),
    ):
        heights = [1000 * steady_median(runs[n], attr) for n in names]
        time_ax.bar(labels, heights, bottom=bottom, label=part, color=shade)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    time_ax.set(ylabel="ms per step (median)", title="step time")
    time_ax.legend(fontsize=8, loc="lower right")
    time_ax.tick_params(axis="x", labelsize=8)
    fig.legend(*loss_ax.get_legend_handles_labels(), loc="lower center", ncol=len(names), frameon=False)
    if shared:
        fig.suptitle(shared)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def records_to_json(records: list[StepRecord]) -> list[dict[str, object]]:
    return [asdict(r) for r in records]
