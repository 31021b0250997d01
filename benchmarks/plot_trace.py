"""Draw a gradsync Chrome trace (``train.py --trace``) as a PNG timeline: one band per rank with its
compute, communication and exposed-wait tracks, for the last steps of the run.

    python benchmarks/plot_trace.py runs/train/trace.json trace.png --steps 2

The trace itself is for ui.perfetto.dev / chrome://tracing; this is a still picture of it for documents.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "finalize": "#8172b2", "optimizer": "#c44e52"}
KIND_COLOURS = {"all_reduce": "#dd8452", "reduce_scatter": "#dd8452", "all_gather": "#937860"}
TRACK_NAMES = ("compute", "comm", "exposed")


def last_steps(events: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    spans = [e for e in events if e["ph"] == "X"]
    last = max(e["args"]["step"] for e in spans)
    return [e for e in spans if e["args"]["step"] > last - steps]


def plot(trace_path: Path, out: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    spans = last_steps(json.loads(trace_path.read_text())["traceEvents"], steps)
    origin = min(e["ts"] for e in spans)
    ranks = sorted({e["pid"] for e in spans})
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(ranks)))
    for band, rank in enumerate(ranks):
        for lane, track in enumerate(TRACK_NAMES):
            y = band * 4 + (2 - lane)
            for e in (e for e in spans if e["pid"] == rank and e["cat"] == track):
                colour = COLOURS.get(e["name"]) or KIND_COLOURS.get(e["args"].get("kind", ""), "#999999")
                start, width = (e["ts"] - origin) / 1e3, max(e["dur"] / 1e3, 0.05)
                ax.barh(y, width, left=start, height=0.8, color=colour, edgecolor="none")
    ax.set_yticks([band * 4 + (2 - lane) for band in range(len(ranks)) for lane in range(3)])
    ax.set_yticklabels([f"rank {r} {t}" for r in ranks for t in TRACK_NAMES])
    ax.set_xlabel("ms")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in [*COLOURS.values(), "#dd8452", "#937860"]]
    labels = [*COLOURS, "grad reduce", "param gather"]
    ax.legend(handles, labels, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    ax.set_title(f"{trace_path.name}: last {steps} steps")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    plot(args.trace, args.out, args.steps)


if __name__ == "__main__":
    main()
