"""What `nox -s bench` writes, rendered from one file: benchmarks/results.json holds every figure of the
last run (with its commit, date, machine and versions); RESULTS.md, results.png and the blocks the docs
quote from it (``QUOTES``, each between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``) are
rendered from that file alone, so the doc check can render them again and fail on any figure that
differs (tools/doccheck.py). No torch here: the doc check imports this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "RESULTS.md"
RESULTS_PNG = HERE / "results.png"
Results = dict[str, Any]
"""results.json: ``run`` (commit, date, machine, device, torch, versions, world, model, args),
``times`` (bench_ab's summary per system, the interleaved runs) and ``alone`` (bench_worker's result per
system run alone in its own processes, ``floor`` on one rank)."""

BLOCK = re.compile(r"^<!-- bench:([\w-]+) -->\n(.*?)^<!-- /bench:\1 -->$", re.MULTILINE | re.DOTALL)

COMPARISONS = [  # (gradsync's system, the peer whose step it is read against)
    ("gradsync-fsdp-no_shard", "gradsync-ddp+overlap"),
    ("gradsync-fsdp-optim", "gradsync-ddp+distopt"),
    ("gradsync-fsdp-no_shard", "torch-ddp"),
    ("gradsync-fsdp-optim", "torch-ddp"),
    ("gradsync-fsdp-optim", "deepspeed-zero1"),
    ("gradsync-fsdp-optim_grads", "deepspeed-zero2"),
    ("gradsync-fsdp-optim_grads_params", "torch-fsdp2"),
]
MEMORY_PEERS = {  # each gradsync strategy against the peers that shard as much
    "gradsync-ddp": ["torch-ddp"],
    "gradsync-ddp+overlap": ["torch-ddp"],
    "gradsync-fsdp-no_shard": ["torch-ddp"],
    "gradsync-ddp+distopt": ["deepspeed-zero1"],
    "gradsync-ddp+distopt+overlap-param-gather": ["deepspeed-zero1"],
    "gradsync-fsdp-optim": ["deepspeed-zero1"],
    "gradsync-fsdp-optim_grads": ["deepspeed-zero2", "torch-fsdp2-no-reshard"],
    "gradsync-fsdp-optim_grads_params": ["torch-fsdp2", "deepspeed-zero3"],
    "gradsync-fsdp-optim_grads_params+double-buffer": ["torch-fsdp2", "deepspeed-zero3"],
}
FSDP2_ON_GLOO = (
    "torch FSDP2 on gloo: its reduce-scatter (gloo's `reduce_scatter_tensor`) runs as an all-reduce, "
    "twice the wire bytes a reduce-scatter needs, where gradsync reduce-scatters through an all-to-all and "
    "a local sum; NCCL reduce-scatters natively, so this part of FSDP2's gap is gloo's, not FSDP2's."
)
"""The caveat beside every table that compares against torch FSDP2 on gloo."""
FRONT_PAGE = [  # (system, its name on the front page)
    ("torch-ddp", "torch DDP"),
    ("gradsync-ddp+overlap", "gradsync-ddp, overlapped all-reduce"),
    ("gradsync-fsdp-no_shard", "gradsync-fsdp no_shard"),
    ("gradsync-fsdp-optim_grads_params", "gradsync-fsdp ZeRO-3 (`optim_grads_params`)"),
    ("torch-fsdp2", "torch FSDP2 `fully_shard`"),
    ("deepspeed-zero3", "DeepSpeed ZeRO-3"),
]
SIDE_BY_SIDE = [  # (row, gradsync's systems, the peers')
    ("ZeRO-3", ["gradsync-fsdp-optim_grads_params", "gradsync-fsdp-optim_grads_params+double-buffer"],
     ["torch-fsdp2", "deepspeed-zero3"]),
    ("ZeRO-2", ["gradsync-fsdp-optim_grads"], ["deepspeed-zero2", "torch-fsdp2-no-reshard"]),
    ("ZeRO-1", ["gradsync-fsdp-optim", "gradsync-ddp+distopt"], ["deepspeed-zero1"]),
    ("no sharding", ["gradsync-fsdp-no_shard", "gradsync-ddp+overlap"], ["torch-ddp"]),
]  # fmt: skip


def load(path: Path = RESULTS_JSON) -> Results:
    data: Results = json.loads(path.read_text())
    return data


def ring_minimum(param_bytes: float, world: int) -> float:
    """Bytes each rank must send to sum the grads across ``world`` ranks (ring all-reduce, or
    reduce-scatter + all-gather): 2 (p - 1) / p of the grads."""
    return 2 * (world - 1) / world * param_bytes


def provenance(data: Results) -> str:
    run = data["run"]
    return (
        f"Measured: commit {run['commit']}, {run['date']}, {run['device']}, {run['world']} gloo ranks, "
        f"torch {run['torch']}, gradsync-ddp {run['versions']['gradsync-ddp']}, "
        f"gradsync-fsdp {run['versions']['gradsync-fsdp']}, `nox -s bench`"
    )


def model_line(data: Results) -> str:
    run, model = data["run"], data["run"]["model"]
    return (
        f"{model['params'] / 1e6:.2f}M-param GPT (d_model {model['d_model']}, {model['n_layer']} layers, "
        f"seq {model['seq_len']}), fp32 AdamW, {run['world']} gloo ranks with one thread each, "
        f"{model['batch_per_rank']} sequences per rank per step, buckets of {run['bucket_mb']} MiB "
        "wherever a system has them"
    )


def _ratio(data: Results, system: str) -> str:
    t = data["times"][system]
    return f"{t['ratio']:.3f}x ({t['ratio_lo']:.3f}-{t['ratio_hi']:.3f})"


def _versus_ddp(data: Results, system: str) -> str:
    t = data["times"][system]
    return f"{t['vs_torch_ddp']:.3f} ({t['vs_torch_ddp_lo']:.3f}-{t['vs_torch_ddp_hi']:.3f})"


def _rss_mib(data: Results, system: str) -> str:
    return f"{data['alone'][system]['peak_rss_bytes'] / 2**20:.0f} MiB"


def comparison_lines(data: Results) -> list[str]:
    """Each gradsync strategy's step over its peer's, and its peak RSS beside the lowest of the peers that
    shard as much: the figures only, for the reader to weigh against the spread."""
    times, alone = data["times"], data["alone"]
    lines = []
    for system, peer in COMPARISONS:
        if system in times and peer in times:
            ratio = times[system]["ratio"] / times[peer]["ratio"]
            lines.append(
                f"- {system} {times[system]['ratio']:.3f}x against {peer} {times[peer]['ratio']:.3f}x: "
                f"{ratio:.3f} of its step"
            )
    for system, peers in MEMORY_PEERS.items():
        present = [p for p in peers if p in alone]
        if system in alone and present:
            mine = alone[system]["peak_rss_bytes"]
            lowest = min(alone[p]["peak_rss_bytes"] for p in present)
            lines.append(
                f"- peak RSS of {system} {mine / 2**20:.0f} MiB against {', '.join(present)} "
                f"(lowest {lowest / 2**20:.0f} MiB)"
            )
    return lines


def results_md(data: Results) -> str:
    """benchmarks/RESULTS.md: one table of every system, each strategy against its peer, and how to read
    the wire column."""
    run, times, alone = data["run"], data["times"], data["alone"]
    floor = alone["floor"]
    world = run["world"]
    lines = [
        "# Benchmarks: gradsync vs torch DDP, torch FSDP2 and DeepSpeed ZeRO",
        "",
        f"Written by `nox -s bench` (benchmarks/bench.py) from benchmarks/results.json. Machine: "
        f"{run['machine']}.",
        "",
        provenance(data),
        "",
        f"Model: the integration toy GPT, {model_line(data)}.",
        "",
        "- **step / floor**: every system's steps interleaved in the same processes (rounds of one step of "
        "each, a barrier before each step, each round starting one system further on), so a drift of the "
        "machine's speed touches all alike; a step's time is its slowest rank's. The median over "
        f"{run['steps']} rounds (after 3 warm-up rounds) of a system's step over the compute floor's in the "
        "same round (the same model and per-rank batch in the same processes, no wrapper, no "
        f"communication). The median over {run['repeats']} such jobs in fresh processes, and their spread "
        "(lowest-highest).",
        "- **step / torch DDP**: the median over the jobs of the same paired ratio to torch DDP's step, and "
        "a 95 % interval for the median over every round of every job.",
        "- **wire / ring min**: bytes each rank wrote to its sockets per step (`wchar` in /proc/self/io; "
        "gloo sends over TCP) over the ring minimum for summing the grads, 2(p-1)/p x param bytes "
        f"= {ring_minimum(floor['param_bytes'], world) / 2**20:.1f} MiB; and **peak RSS / floor**, the "
        "largest rank's peak resident memory over the floor's (one rank): both from each system run alone "
        "in its own processes, where peak RSS is that system's.",
        "",
        "| system | ms/step | step / floor | spread over jobs | step / torch DDP | 95 % interval | "
        "wire MiB/step | wire / ring min | peak RSS MiB | peak RSS / floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, t in times.items():
        row = alone.get(system, floor)
        wire = row["wire_bytes_per_step"]
        ring = ring_minimum(row["param_bytes"], world) if system != "floor" else 0.0
        lines.append(
            f"| {system} | {1000 * t['step_s']:.1f} | {t['ratio']:.3f}x | "
            f"{t['ratio_lo']:.3f}-{t['ratio_hi']:.3f} | {t['vs_torch_ddp']:.3f} | "
            f"{t['vs_torch_ddp_lo']:.3f}-{t['vs_torch_ddp_hi']:.3f} | {wire / 2**20:.1f} | "
            f"{wire / ring if ring else 0:.2f}x | {row['peak_rss_bytes'] / 2**20:.0f} | "
            f"{row['peak_rss_bytes'] / floor['peak_rss_bytes']:.2f}x |"
        )
    lines += [
        "",
        "Each gradsync strategy against its peer: step times as ratios in the same interleaved runs, and "
        "peak RSS beside the lowest of the peers that shard as much:",
        "",
        *comparison_lines(data),
    ]
    lines += [
        "",
        "Reading the wire column: gradsync reduce-scatters a CPU bucket over gloo as an all-to-all of its "
        "shards (each rank sends (p-1)/p of the bucket) and gathers params by one broadcast per shard from "
        "its owner, so ZeRO-1/2 send about what an all-reduce sends, split between the grads and the "
        "params. torch FSDP2 calls gloo's `reduce_scatter_tensor`, which all-reduces and keeps a part: twice "
        "the bytes a reduce-scatter needs, a cost of gloo's (NCCL reduce-scatters natively). "
        "ZeRO-3 (FSDP2, gradsync's fsdp-optim_grads_params, DeepSpeed ZeRO-3) also gathers the params "
        "again for backward; gradsync keeps the last block gathered from its forward into the backward, "
        "one block's gather less per step. DeepSpeed ZeRO-3 keeps params below its "
        "stage3_param_persistence_threshold unsharded, which lowers its wire bytes and raises its memory.",
        "",
        "Allocators: fsdp-optim_grads_params+double-buffer is the same ZeRO-3 with `fsdp_double_buffer`, "
        "two persistent block-sized buffers per kind lent from block to block instead of buffers "
        "allocated per gather and per backward; its peak RSS next to fsdp-optim_grads_params is what the "
        "allocator changes in memory. It also serialises more: a grad waits for the oldest reduction to "
        "free a buffer, and prefetch stops while two blocks hold both.",
        "",
        f"![step time over the floor]({RESULTS_PNG.name})",
    ]
    return "\n".join(lines) + "\n"


def front_page(data: Results) -> str:
    """The README's performance line: a few systems, with the spread over jobs and the 95 % interval."""
    lines = [
        f"A {model_line(data)}; every system's steps interleaved in the same processes, each a ratio to "
        f"another's step in the same round, the median over {data['run']['repeats']} jobs:",
        "",
        "| system | step / compute floor (spread over the jobs) | step / torch DDP (95 % interval) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {_ratio(data, system)} | {_versus_ddp(data, system)} |"
        for system, name in FRONT_PAGE
        if system in data["times"]
    ]
    return "\n".join([*lines, "", FSDP2_ON_GLOO, "", provenance(data)]) + "\n"


def side_by_side(data: Results) -> str:
    """docs/performance.md's table: each degree of sharding, gradsync's strategies beside the peers'."""
    times, alone = data["times"], data["alone"]

    def cell(systems: list[str]) -> str:
        return "; ".join(
            f"{s} {_ratio(data, s)}, {_rss_mib(data, s)} peak RSS"
            for s in systems
            if s in times and s in alone
        )

    run = data["run"]
    lines = [
        f"### On a {run['device']}, at {run['commit']}",
        "",
        f"A {model_line(data)}; each step a ratio to the compute floor measured in the same round "
        f"({1000 * times['floor']['step_s']:.1f} ms), median over {data['run']['repeats']} jobs (spread in "
        "brackets); peak RSS from each system run alone.",
        "",
        "| | gradsync | peers |",
        "|---|---|---|",
    ]
    lines += [f"| {row} | {cell(mine)} | {cell(theirs)} |" for row, mine, theirs in SIDE_BY_SIDE]
    lines += ["", FSDP2_ON_GLOO, "", *comparison_lines(data), "", provenance(data)]
    return "\n".join(lines) + "\n"


QUOTES: dict[str, tuple[str, Callable[[Results], str]]] = {
    "front-page": ("README.md", front_page),
    "side-by-side": ("docs/performance.md", side_by_side),
}
"""Each block the docs quote: the doc that holds it, and what renders it."""


def blocks(text: str) -> Iterator[tuple[str, str, int]]:
    """Each quoted block in ``text``: its name, its body and the line it starts on."""
    for match in BLOCK.finditer(text):
        yield match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1


def with_quotes(text: str, data: Results) -> str:
    """``text`` with every block it holds rendered afresh from ``data``."""

    def render(match: re.Match[str]) -> str:
        name = match.group(1)
        home_and_render = QUOTES.get(name)
        body = home_and_render[1](data) if home_and_render else match.group(2)  # unknown: left as it is
        return f"<!-- bench:{name} -->\n{body}<!-- /bench:{name} -->"

    return BLOCK.sub(render, text)


def stale_quotes(rel: str, text: str, data: Results) -> Iterator[tuple[int, str]]:
    """(line, problem) for each block of ``text`` (the doc at ``rel``) that is not what ``data`` renders,
    that names no renderer or is in another doc than ``QUOTES`` says, and for a block ``rel`` lacks."""
    found = set()
    for name, body, line in blocks(text):
        found.add(name)
        home, render = QUOTES.get(name, ("no doc", None))
        if home != rel or render is None:
            yield line, f"bench block {name!r} belongs in {home}"
        elif body != render(data):
            yield line, f"bench block {name!r} differs from benchmarks/results.json: run `nox -s bench`"
    for name, (home, _) in QUOTES.items():
        if home == rel and name not in found:
            yield 1, f"no bench block {name!r} (the figures `nox -s bench` writes here)"


def write(root: Path, data: Results) -> list[Path]:
    """RESULTS.md, results.png (with matplotlib) and every doc's blocks, from ``data``."""
    RESULTS_MD.write_text(results_md(data))
    written = [RESULTS_MD]
    if plot(RESULTS_PNG, data):
        written.append(RESULTS_PNG)
    for rel in sorted({home for home, _ in QUOTES.values()}):
        path = root / rel
        path.write_text(with_quotes(path.read_text(), data))
        written.append(path)
    return written


def plot(path: Path, data: Results) -> bool:
    """Each system's step over the floor with its spread; the axis starts near the smallest ratio, since
    the systems differ by a few percent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    times = data["times"]
    names = [name for name in times if name != "floor"]
    ratios = [times[n]["ratio"] for n in names]
    spread = [
        [times[n]["ratio"] - times[n]["ratio_lo"] for n in names],
        [times[n]["ratio_hi"] - times[n]["ratio"] for n in names],
    ]
    colours = ["tab:blue" if n.startswith("gradsync") else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ax.barh(names, ratios, xerr=spread, color=colours, capsize=3)
    low = min(times[n]["ratio_lo"] for n in names)
    high = max(times[n]["ratio_hi"] for n in names)
    ax.set_xlim(min(1.0, low) - 0.02, high + 0.03)
    ax.axvline(1.0, color="black", linewidth=1)
    for name, ratio in zip(names, ratios, strict=True):
        ax.annotate(f"{ratio:.3f}x", (ratio, name), xytext=(4, -9), textcoords="offset points", fontsize=7)
    run = data["run"]
    ax.set_xlabel("step time / compute floor (1.0: no wrapper, no communication; lower is better)")
    ax.set_title(
        f"fp32 GPT step, {run['world']} gloo ranks, {run['device']}\ngradsync blue, peers grey; bars: "
        f"spread over {run['repeats']} jobs",
        fontsize=10,
    )
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
