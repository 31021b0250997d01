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


def _plot(path: Path, runs: dict[str, list[StepRecord]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, records in runs.items():
        loss_ax.plot([r.step for r in records], [r.loss for r in records], label=f"{name} (train)")
        val = [(r.step, r.val_loss) for r in records if r.val_loss is not None]
        if val:
            loss_ax.plot(*zip(*val, strict=True), "o--", label=f"{name} (val)")
    loss_ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    loss_ax.legend(fontsize=8)
    names = list(runs)
    bottom = [0.0] * len(names)
    for attr, label in (
        ("compute_s", "forward+backward"),
        ("sync_s", "grad-sync wait"),
        ("optimizer_s", "optimizer"),
    ):
        heights = [1000 * steady_median(runs[n], attr) for n in names]
        time_ax.bar(names, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    time_ax.set(ylabel="ms per step (median)", title="step-time breakdown")
    time_ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    time_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def records_to_json(records: list[StepRecord]) -> list[dict[str, object]]:
    return [asdict(r) for r in records]
