# ruff: noqa: INP001 (a script, not a package)
"""Draw the layout pictures in docs/ from the packages' own layout code, so that no picture can drift from
what the code does: a change that moves a param, a pad or a group is redrawn by running this again.

- ``flat-buffer-ddp.png``: gradsync DDP with the distributed optimizer. One flat grad buffer, params in
  reverse registration order, padded param starts and bucket ends, and the pieces each rank's optimizer
  owns (``compute_full_param_layout``, ``PerBufferParamLayout.shard_range`` and ``shard_param_ranges``).
- ``flat-buffer-zero3.png``: MegatronFSDP ZeRO-3 (``optim_grads_params``) on the same model: a flat
  buffer per bucket, each rank's whole rows (``find_units``, ``group_into_buckets``,
  ``balance_param_order``, ``bucket_layout``: what ``build_bucket_set`` runs).
- ``hsdp-mesh.png``: HSDP / HFSDP, 2 outer replicas x 4 shard ranks (``FSDPDistributedIndex.from_sizes``:
  each rank's mesh coordinate, groups and HFSDP piece).
- ``fault-tolerance-layout.png``: torchft's lighthouse, 3 replica groups of 2 ranks (each group's own
  world from ``compute_rank_layout``), rank r of every group paired across groups.

The FSDP code needs process groups only for their sizes and ranks, so it runs on torch's fake backend
(``torch.testing._internal.distributed.fake_pg``: a world of any size in one process, whose collectives
do nothing), once per rank where a picture shows each rank's own answer.

The output is deterministic (fixed sizes and dpi, no Software tag in the PNG): the same tree and
matplotlib draw the same bytes.

    python tools/draw_layouts.py                 # writes the pictures into docs/ (or: nox -s pictures)
    python tools/draw_layouts.py --out-dir DIR   # elsewhere
"""

from __future__ import annotations

import argparse
import itertools
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch.distributed as dist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from gradsync.buffers import (
    DistributedDataParallelConfig,
    ParamSpec,
    PerBufferParamLayout,
    compute_full_param_layout,
    effective_bucket_size,
)
from gradsync.buffers.layout import PARAM_START_ALIGNMENT, bucket_end_divisor
from gradsync.fsdp.bucket import bucket_layout
from gradsync.fsdp.layout import (
    BucketLayout,
    BucketSpec,
    balance_param_order,
    find_units,
    group_into_buckets,
    resolve_unit_classes,
)
from gradsync.fsdp.settings import parse_strategy
from gradsync.groups import FSDPDistributedIndex, compute_rank_layout

ROOT = Path(__file__).resolve().parent.parent
PICTURES = ("flat-buffer-ddp.png", "flat-buffer-zero3.png", "hsdp-mesh.png", "fault-tolerance-layout.png")
"""What this script writes (into docs/): tools/doccheck.py checks that a doc shows each one."""
DP = 4
BUCKET_SIZE = 500  # elements: three buckets of the small model
HSDP_OUTER, HSDP_SHARD = 2, 4
FT_GROUPS, FT_RANKS = 3, 2
ZERO3_GAP = 40  # elements of blank drawn between ZeRO-3's buckets (each is a buffer of its own)
DPI = 100
COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3")


class SmallModel(nn.Module):
    """An embedding and two linear layers: five params, three buckets of ``BUCKET_SIZE``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)


# --- what is drawn, computed by the packages ------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A param's elements ``[lo, hi)`` on a picture's x axis."""

    lo: int
    hi: int
    name: str


@dataclass(frozen=True)
class BucketView:
    """One bucket: where it lies, its params, each rank's shard and the param pieces in it."""

    label: str
    start: int
    end: int
    params: tuple[Span, ...]
    shards: tuple[tuple[int, int], ...]
    owned: tuple[tuple[Span, ...], ...]
    ticks: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class BufferPicture:
    title: str
    note: str
    buckets: tuple[BucketView, ...]
    legend: dict[str, str]  # param name -> its legend entry


@contextmanager
def fake_world(rank: int, size: int) -> Iterator[dist.ProcessGroup]:
    """A default group of ``size`` ranks in which this process is ``rank`` (torch's fake backend)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


def shape_labels(model: nn.Module) -> dict[str, str]:
    return {name: f"{name} ({'×'.join(map(str, p.shape))})" for name, p in model.named_parameters()}


def ddp_picture(model: nn.Module) -> BufferPicture:
    """The distributed optimizer's padded layout of ``model``'s grad buffer at DP ``DP``."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE
    )
    full = compute_full_param_layout(
        [ParamSpec.of(p) for _, p in named],
        effective_bucket_size(config, DP),
        grad_reduce_in_fp32=config.grad_reduce_in_fp32,
        padded=True,
        data_parallel_world_size=DP,
        pad_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
    )
    ((key, layout),) = full.layouts.items()  # one dtype: one buffer
    names = [named[i][0] for i in full.members[key]]
    buckets = tuple(ddp_bucket(layout, b, names) for b in range(len(layout.bucket_indices)))
    note = (
        f"Params in reverse registration order (the last layer's grads are ready first); each starts at a "
        f"multiple of {PARAM_START_ALIGNMENT} elements, and each bucket ends at a multiple of lcm(DP, 128) = "
        f"{bucket_end_divisor(DP, config.pad_buckets_for_high_nccl_busbw)}, so it splits into {DP} equal "
        "shards. A bucket is reduce-scattered into the shards; rank r's optimizer steps the param pieces in "
        "its shard of every bucket. Padding belongs to nobody."
    )
    title = f"gradsync DDP with the distributed optimizer: one flat grad buffer, DP {DP}, "
    title += f"bucket_size {BUCKET_SIZE}"
    return BufferPicture(title, note, buckets, shape_labels(model))


def ddp_bucket(layout: PerBufferParamLayout[int], bucket: int, names: Sequence[str]) -> BucketView:
    start, end = layout.bucket_indices[bucket]
    params = tuple(Span(*layout.param_index_map[i][:2], names[i]) for i in layout.bucket_params(bucket))
    shards = tuple(layout.shard_range(bucket, rank, DP) for rank in range(DP))
    owned = tuple(
        tuple(
            Span(*piece.gbuf_world, names[piece.param_index])
            for piece in layout.shard_param_ranges(bucket, rank, DP)
        )
        for rank in range(DP)
    )
    return BucketView(
        f"bucket {bucket}", start, end, params, shards, owned, ((start, str(start)), (end, str(end)))
    )


def zero3_picture(model: nn.Module) -> BufferPicture:
    """MegatronFSDP's buckets of ``model`` under ZeRO-3 at DP ``DP``, units ``nn.Linear``."""
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params", bucket_size=BUCKET_SIZE
    )
    sharding = parse_strategy(config.data_parallel_sharding_strategy)
    units = find_units(model, resolve_unit_classes([nn.Linear]))
    specs = group_into_buckets(model, units, config.bucket_size)
    with fake_world(0, DP) as group:
        layouts = balance_param_order(specs, lambda spec: bucket_layout(spec, sharding, group))
    unit_names = {id(module): name for name, module in model.named_modules()}
    buckets, base = [], 0
    for b, (spec, layout) in enumerate(zip(specs, layouts, strict=True)):
        unit = f"unit {unit_names[id(units[spec.unit_id])]}" if spec.unit_id is not None else "outside units"
        buckets.append(zero3_bucket(f"bucket {b}: {unit}", spec, layout, base))
        base += layout.size + ZERO3_GAP
    note = (
        "A flat buffer per bucket: one per FSDP unit (each nn.Linear here), the params outside units "
        f"bucketed at bucket_size. Each bucket is cut into {DP} shards whose size is a multiple of every "
        "row size, so every rank holds whole rows of each param (a dim-0 DTensor shard, maybe empty); a "
        "bucket's params lie in module order or reversed, whichever evens out the params each rank steps. "
        "ZeRO-3 keeps only its shard of weights, grads and optimizer state; a unit's weights are whole "
        "between its gather and its release."
    )
    title = f"MegatronFSDP ZeRO-3 (optim_grads_params): a flat buffer per bucket, DP {DP}"
    return BufferPicture(title, note, tuple(buckets), shape_labels(model))


def zero3_bucket(label: str, spec: BucketSpec, layout: BucketLayout, base: int) -> BucketView:
    params = tuple(
        Span(base + item.offset, base + item.end, name)
        for item, name in zip(layout.items, spec.names, strict=True)
    )
    shards = tuple((base + lo, base + hi) for lo, hi in map(layout.shard_range, range(layout.world)))
    owned = tuple(
        tuple(
            Span(base + lo, base + hi, name)
            for index, name in enumerate(spec.names)
            for lo, hi in [layout.local_span(index, rank)]
            if hi > lo
        )
        for rank in range(layout.world)
    )
    ticks = ((base, "0"), (base + layout.size, str(layout.size)))
    return BucketView(label, base, base + layout.size, params, shards, owned, ticks)


@dataclass(frozen=True)
class MeshRank:
    """One rank of the HSDP mesh, as its own process sees it."""

    rank: int
    coordinate: tuple[int, int]  # (outer, shard) in the mesh
    inner_shard: int
    shard_group: tuple[int, ...]
    outer_group: tuple[int, ...]
    piece: int  # its piece of the optimizer state under HFSDP


def hsdp_mesh(outer: int, shard: int) -> list[MeshRank]:
    """Every rank's view of ``FSDPDistributedIndex.from_sizes(dp_shard=shard, dp_outer=outer)``."""
    ranks = []
    for rank in range(outer * shard):
        with fake_world(rank, outer * shard):
            index = FSDPDistributedIndex.from_sizes(
                dp_shard=shard, dp_outer=outer, hsdp_outer_dp_shard=True, device_type="cpu"
            )
            coordinate = index.get_root_mesh().get_coordinate()
            outer_group = index.get_outer_fsdp_group()
            assert coordinate is not None
            assert outer_group is not None
            ranks.append(
                MeshRank(
                    rank,
                    (coordinate[0], coordinate[1]),
                    index.get_fsdp_group().rank(),
                    tuple(dist.get_process_group_ranks(index.get_fsdp_group())),
                    tuple(dist.get_process_group_ranks(outer_group)),
                    index.get_logical_hybrid_fsdp_rank(),
                )
            )
    return ranks


def replica_group_ranks(ranks: int) -> tuple[int, ...]:
    """The data-parallel ranks of one replica group, a torch.distributed world of its own: what
    ``initialize_model_parallel`` builds in each group. torchft pairs rank r of every group."""
    (group,) = compute_rank_layout(ranks).groups["dp"]
    return group


# --- drawing --------------------------------------------------------------------------------------------


def draw_buffer(picture: BufferPicture, out: Path) -> None:
    names = list(dict.fromkeys(span.name for bucket in picture.buckets for span in bucket.params))
    colour = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 5))
    rows = ["flat buffer", *(f"rank {r}" for r in range(len(picture.buckets[0].shards)))]
    for bucket in picture.buckets:
        draw_bucket(ax, bucket, colour, len(rows))
    ax.set_yticks([-row for row in range(len(rows))], rows)
    ticks = sorted({tick for bucket in picture.buckets for tick in bucket.ticks})
    ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.set_xlabel("element offset (bucket boundaries)", fontsize=9)
    ax.set_xlim(picture.buckets[0].start - 10, picture.buckets[-1].end + 10)
    ax.set_ylim(-len(rows) + 0.4, 1.0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    handles = [Patch(facecolor=colour[name], label=picture.legend[name]) for name in names]
    handles.append(Patch(facecolor="white", edgecolor="0.55", hatch="////", linewidth=0.6, label="padding"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.19), ncol=6, fontsize=8, frameon=False
    )
    ax.set_title(picture.title, fontsize=11)
    note(fig, picture.note)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.32)
    save(fig, out)


def draw_bucket(ax: Axes, bucket: BucketView, colour: dict[str, str], rows: int) -> None:
    """The bucket in the buffer row and each rank's shard of it in the rows below."""
    height = 0.6
    ax.add_patch(padding((bucket.start, -height / 2), bucket.end - bucket.start, height))
    for span in bucket.params:
        ax.add_patch(Rectangle((span.lo, -height / 2), span.hi - span.lo, height, color=colour[span.name]))
    for rank, ((lo, hi), pieces) in enumerate(zip(bucket.shards, bucket.owned, strict=True)):
        y = -(rank + 1) - height / 2
        ax.add_patch(padding((lo, y), hi - lo, height))
        for span in pieces:
            ax.add_patch(Rectangle((span.lo, y), span.hi - span.lo, height, color=colour[span.name]))
        ax.plot([lo, lo], [0.45, -rows + 0.55], color="0.5", linewidth=0.6, linestyle=":")
    for x in (bucket.start, bucket.end):
        ax.plot([x, x], [0.6, -rows + 0.55], color="black", linewidth=1.4)
    ax.text((bucket.start + bucket.end) / 2, 0.62, bucket.label, ha="center", va="bottom", fontsize=9)


def draw_hsdp(ranks: Sequence[MeshRank], out: Path) -> None:
    shard, outer = len(ranks[0].shard_group), len(ranks[0].outer_group)
    fig, ax = plt.subplots(figsize=(11, 5))
    where = {r.rank: (r.coordinate[1] * 2.2, -r.coordinate[0] * 2.0) for r in ranks}
    for group in sorted({r.shard_group for r in ranks}):
        x0, y0, x1, y1 = bounds([where[m] for m in group], 0.9, 0.55)
        rounded(ax, (x0, y0, x1, y1), facecolor="#e8eef7", edgecolor=COLOURS[0], linewidth=1.5)
        label = f"shard group\n{group}"
        ax.text(x0 - 0.15, (y0 + y1) / 2, label, ha="right", va="center", fontsize=9, color=COLOURS[0])
    for group in sorted({r.outer_group for r in ranks}):
        x0, y0, x1, y1 = bounds([where[m] for m in group], 0.78, 0.72)
        rounded(ax, (x0, y0, x1, y1), facecolor="none", edgecolor=COLOURS[1], linewidth=1.5, linestyle="--")
        label = f"outer group {group}"
        ax.text((x0 + x1) / 2, y0 - 0.08, label, ha="center", va="top", fontsize=9, color=COLOURS[1])
    for r in ranks:
        x, y = where[r.rank]
        box(ax, (x, y), (1.3, 0.8), f"rank {r.rank}\ninner shard {r.inner_shard}\nHFSDP piece {r.piece}")
    ax.set_title(
        f"HSDP / HFSDP: FSDPDistributedIndex.from_sizes(dp_shard={shard}, dp_outer={outer}), {len(ranks)} "
        "ranks, outer-major",
        fontsize=11,
    )
    note(
        fig,
        f"Shard group (dp_shard, N = {shard}): params gathered and grads reduce-scattered within it, every "
        f"backward (ZeRO-3). Outer group (dp_outer, M = {outer}): HSDP (outer no_shard) all-reduces each "
        "rank's grad shard across the replicas once per cycle; HFSDP (outer optim) cuts inner shard i into M "
        "pieces, and rank (outer o, inner i) steps piece i·M + o: the accumulated shard is reduce-scattered "
        "into the pieces, which are all-gathered back after each step.",
    )
    frame(ax, list(where.values()), (2.7, 1.1), (1.4, 1.0))
    fig.subplots_adjust(left=0.01, right=0.99, top=0.92, bottom=0.16)
    save(fig, out)


def draw_fault_tolerance(groups: int, group_ranks: Sequence[int], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 5.4))
    pitch, top = 3.6, 0.9
    lighthouse = ((groups - 1) * pitch / 2, 2.1)
    box(ax, lighthouse, (2.6, 0.6), "torchft lighthouse\n(a quorum every step)", facecolor="#f3e8c8")
    where: dict[tuple[int, int], tuple[float, float]] = {}
    for g in range(groups):
        x = g * pitch
        bottom = -len(group_ranks) * 1.1 - 0.1
        rounded(
            ax,
            (x - 1.3, bottom, x + 1.3, top + 0.2),
            facecolor="#e8eef7",
            edgecolor=COLOURS[0],
            linewidth=1.5,
        )
        title = f"replica group {g}\nits own world, ranks {group_ranks}"
        ax.text(x, top - 0.15, title, ha="center", va="center", fontsize=8.5)
        ax.plot(
            [x, lighthouse[0]], [top + 0.22, lighthouse[1] - 0.3], color="0.4", linestyle="--", linewidth=1
        )
        for r in group_ranks:
            where[(g, r)] = (x, -r * 1.1 - 0.45)
            box(ax, where[(g, r)], (2.0, 0.75), f"rank {r} + its Manager\nshard {r} under FSDP")
    for r in group_ranks:
        pair_across(ax, [where[(g, r)] for g in range(groups)], r)
    ax.set_title(
        f"Fault tolerance with torchft: {groups} replica groups of {len(group_ranks)} ranks", fontsize=11
    )
    note(
        fig,
        "Each replica group reduces its buckets among its own ranks first (gradsync DDP or MegatronFSDP), "
        "then across the groups in the quorum through torchft's Manager, rank r with rank r of every group. "
        "A restarted group heals at the next quorum: each of its ranks copies the weights and optimizer "
        "state from the same rank of a healthy group. Under DDP every rank holds the whole model.",
    )
    frame(ax, [*where.values(), lighthouse], (1.5, 3.2), (0.8, 0.6))
    fig.subplots_adjust(left=0.01, right=0.99, top=0.93, bottom=0.14)
    save(fig, out)


def pair_across(ax: Axes, boxes: Sequence[tuple[float, float]], rank: int) -> None:
    """Rank ``rank`` of every group joined by one line, labelled at its end."""
    colour = COLOURS[2 + rank % (len(COLOURS) - 2)]
    for (xa, y), (xb, _) in itertools.pairwise(boxes):
        ax.plot([xa + 1.0, xb - 1.0], [y, y], color=colour, linewidth=3)
    x, y = boxes[-1]
    label = (
        f"rank {rank} of every group:\nall-reduce of shard {rank}\nacross the groups; heals\n"
        f"from a peer's rank {rank}"
    )
    ax.text(x + 1.45, y, label, ha="left", va="center", fontsize=8.5, color=colour)


def box(
    ax: Axes, centre: tuple[float, float], size: tuple[float, float], text: str, facecolor: str = "white"
) -> None:
    (x, y), (w, h) = centre, size
    ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, facecolor=facecolor, edgecolor="black", linewidth=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=9)


def padding(corner: tuple[float, float], width: float, height: float) -> Rectangle:
    """A hatched box: elements no param owns (drawn first, the params over it)."""
    return Rectangle(corner, width, height, facecolor="white", edgecolor="0.55", hatch="////", linewidth=0.6)


def rounded(ax: Axes, corners: tuple[float, float, float, float], **style: Any) -> None:
    x0, y0, x1, y1 = corners
    ax.add_patch(
        FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.12", **style)
    )


def bounds(points: Sequence[tuple[float, float]], dx: float, dy: float) -> tuple[float, float, float, float]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return min(xs) - dx, min(ys) - dy, max(xs) + dx, max(ys) + dy


def frame(
    ax: Axes,
    points: Sequence[tuple[float, float]],
    x_margin: tuple[float, float],
    y_margin: tuple[float, float],
) -> None:
    """Limits around ``points`` (margins left and right, below and above), no axes drawn."""
    x0, y0, x1, y1 = bounds(points, 0, 0)
    ax.set_xlim(x0 - x_margin[0], x1 + x_margin[1])
    ax.set_ylim(y0 - y_margin[0], y1 + y_margin[1])
    ax.set_axis_off()


def note(fig: Figure, text: str) -> None:
    """A caption along the bottom of ``fig``, wrapped to its width."""
    fig.text(0.02, 0.02, textwrap.fill(text, width=int(fig.get_figwidth() * 14.5)), fontsize=8.5, va="bottom")


def save(fig: Figure, out: Path) -> None:
    """Write ``fig`` as a PNG with no Software tag (the bytes then depend on the drawing only)."""
    fig.savefig(out, dpi=DPI, metadata={"Software": None})
    plt.close(fig)


DRAWERS: dict[str, Callable[[Path], None]] = dict(
    zip(
        PICTURES,
        (
            lambda out: draw_buffer(ddp_picture(SmallModel()), out),
            lambda out: draw_buffer(zero3_picture(SmallModel()), out),
            lambda out: draw_hsdp(hsdp_mesh(HSDP_OUTER, HSDP_SHARD), out),
            lambda out: draw_fault_tolerance(FT_GROUPS, replica_group_ranks(FT_RANKS), out),
        ),
        strict=True,
    )
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out-dir", type=Path, default=ROOT / "docs", help="where to write the PNGs (default docs/)"
    )
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw in DRAWERS.items():
        draw(args.out_dir / name)
        print(args.out_dir / name)


if __name__ == "__main__":
    main()
