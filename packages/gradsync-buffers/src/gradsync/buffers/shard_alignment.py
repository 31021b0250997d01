"""Where a shard boundary may cut a param: the per-param alignment policies both wrappers lay out by.

Element-wise optimizers (Adam, SGD) accept any cut. Matrix optimizers do not: Muon orthogonalises a
whole matrix, block-diagonal Shampoo preconditions whole ``r x c`` tiles, and block-scaled low precision
(MXFP8 scales over 32 elements, fp8 128 x 128 tiles) needs shards that never split a block. A policy says
which cuts are allowed:

- ``row`` (the default): between dim-0 rows in gradsync-fsdp (its shards are dim-0 DTensors); anywhere in
  gradsync-ddp's distributed optimizer, whose shards are flat ranges, as the reference's;
- ``chunk`` (gradsync-fsdp only): torch's own ``Shard(0)`` rule, ``torch.chunk`` of the rows over the
  ranks, so torch's DTensor ops (``full_tensor()``, ``redistribute()``, DCP) work natively on the shard;
  the param gets a bucket (one collective) of its own, as that rule cannot share a flat shard;
- ``tensor``: nowhere: the param lives whole in one rank's shard; params are assigned to ranks to
  balance their bytes, and a rank may own several params or none;
- ``block:k``: on multiples of ``k`` elements of the flattened param; ``block:RxC`` (or ``block:(R,C)``):
  between groups of ``R`` whole rows, so every ``R x C`` tile (ragged at the edges) stays on one rank.
  A 1-D param counts as one row, so ``block:RxC`` cuts it on multiples of ``C``.

Policies are chosen per param name with :func:`resolve_shard_alignments` from a single policy, a mapping
of ``fnmatch`` patterns (``{"*.weight": "tensor", "mlp.*": "block:32"}``, first match wins) or a callable.
Nothing here needs a process group.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

SHARD_ALIGNMENT_ATTR = "shard_alignment"
"""The attribute a wrapper sets on each param to the :class:`ShardAlignment` its layout must follow."""


@dataclass(frozen=True)
class ShardAlignment:
    """One param's policy: ``kind`` is ``row``, ``tensor`` or ``block``; ``block`` is ``(1, k)`` for
    ``block:k`` (k elements) or ``(R, C)`` for tiles of R rows by C columns."""

    kind: str
    block: tuple[int, int] | None = None
    elementwise: bool = False  # block:k counts elements of the flattened param, not tiles

    def __str__(self) -> str:
        if self.kind != "block":
            return self.kind
        assert self.block is not None
        return f"block:{self.block[1]}" if self.elementwise else f"block:{self.block[0]}x{self.block[1]}"

    @property
    def whole(self) -> bool:
        """The param may not be cut at all."""
        return self.kind == "tensor"

    @property
    def alone(self) -> bool:
        """The param needs a bucket of its own (``chunk``: its shards are the whole shards)."""
        return self.kind == "chunk"

    def row_multiple(self, shape: Sequence[int]) -> int:
        """Elements a cut must be a multiple of when shards are also whole rows (gradsync-fsdp's dim-0
        DTensors): the row size, or a multiple of it that keeps blocks whole. (A ``chunk`` param alone in
        its bucket, cut between rows, is cut exactly as ``torch.chunk`` cuts its rows.)"""
        row = row_size(shape)
        if self.kind != "block":
            return row
        assert self.block is not None
        rows, cols = self.block
        if self.elementwise:
            return math.lcm(row, cols)
        return rows * row if len(shape) > 1 else cols

    def flat_multiple(self, shape: Sequence[int]) -> int:
        """Elements a cut must be a multiple of when shards are flat ranges (gradsync-ddp's distributed
        optimizer): anything for ``row`` (the reference cuts anywhere), the block otherwise."""
        if self.kind != "block":
            return 1
        assert self.block is not None
        return self.block[1] if self.elementwise else self.row_multiple(shape)


ROW = ShardAlignment("row")
TENSOR = ShardAlignment("tensor")
CHUNK = ShardAlignment("chunk")

ShardAlignmentSpec = (
    str
    | ShardAlignment
    | Mapping[str, "str | ShardAlignment"]
    | Callable[[str, torch.Tensor], "str | ShardAlignment | None"]
    | None
)
"""What a user passes as ``shard_alignment``: one policy for every param, patterns, or a callable
``(name, param) -> policy`` (None: the default)."""

_BLOCK = re.compile(r"^block:\(?\s*(\d+)\s*(?:[x,]\s*(\d+)\s*)?\)?$")


def row_size(shape: Sequence[int]) -> int:
    """Elements per dim-0 row (a 0-d or 1-d param is one element per row)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def parse_shard_alignment(policy: str | ShardAlignment) -> ShardAlignment:
    """``row``, ``tensor``, ``block:k``, ``block:RxC`` or ``block:(R,C)``; ValueError otherwise."""
    if isinstance(policy, ShardAlignment):
        return policy
    text = policy.strip().lower()
    if text == "row":
        return ROW
    if text == "tensor":
        return TENSOR
    if text == "chunk":
        return CHUNK
    match = _BLOCK.match(text)
    if match is None:
        raise ValueError(
            f"shard_alignment {policy!r} is not a policy: use 'row', 'tensor', 'chunk', 'block:k' or "
            "'block:RxC'"
        )
    first, second = int(match.group(1)), match.group(2)
    block = (1, first) if second is None else (first, int(second))
    if min(block) < 1:
        raise ValueError(f"shard_alignment {policy!r}: block sizes must be positive")
    return ShardAlignment("block", block, elementwise=second is None)


def resolve_shard_alignments(
    spec: ShardAlignmentSpec, named_params: Iterable[tuple[str, torch.Tensor]], default: ShardAlignment = ROW
) -> dict[str, ShardAlignment]:
    """Every param's policy by name. Mapping keys are ``fnmatch`` patterns tried in order against the
    param's name (first match wins); a pattern that matches no param is an error (a typo would otherwise
    silently leave the default)."""
    named = list(named_params)
    if spec is None:
        return {name: default for name, _ in named}
    if isinstance(spec, str | ShardAlignment):
        policy = parse_shard_alignment(spec)
        return {name: policy for name, _ in named}
    if isinstance(spec, Mapping):
        patterns = [(pattern, parse_shard_alignment(value)) for pattern, value in spec.items()]
        unused = [p for p, _ in patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in named)]
        if unused:
            raise ValueError(
                f"shard_alignment: patterns {unused} match no param name (names look like "
                f"{[n for n, _ in named[:3]]}); fix or drop them"
            )
        return {name: _first_match(name, patterns, default) for name, _ in named}
    chosen = {name: spec(name, param) for name, param in named}
    return {
        name: default if value is None else parse_shard_alignment(value) for name, value in chosen.items()
    }


def _first_match(
    name: str, patterns: Sequence[tuple[str, ShardAlignment]], default: ShardAlignment
) -> ShardAlignment:
    for pattern, policy in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return policy
    return default


def shard_alignment_of(param: torch.Tensor) -> ShardAlignment:
    """The policy a wrapper recorded on ``param`` (``row`` when none)."""
    policy = getattr(param, SHARD_ALIGNMENT_ATTR, None)
    return policy if isinstance(policy, ShardAlignment) else ROW


def set_shard_alignments(named_params: Iterable[tuple[str, torch.Tensor]], spec: ShardAlignmentSpec) -> None:
    """Resolve ``spec`` and record each param's policy on it, where the layouts (and matrix optimizers,
    on every rank alike) read it. With ``spec`` None, earlier records are kept and the others get the
    default, ``row``."""
    named = dict(named_params)
    if spec is None:
        for param in named.values():
            if not hasattr(param, SHARD_ALIGNMENT_ATTR):
                setattr(param, SHARD_ALIGNMENT_ATTR, ROW)
        return
    for name, policy in resolve_shard_alignments(spec, named.items()).items():
        setattr(named[name], SHARD_ALIGNMENT_ATTR, policy)


@dataclass(frozen=True)
class PackedShards:
    """Offsets of a bucket's params, in the order given, and the shard size: ``world`` shards of
    ``shard_size`` elements make the bucket."""

    offsets: tuple[int, ...]
    shard_size: int


def pack_shards(
    numels: Sequence[int],
    cut_multiples: Sequence[int],
    whole: Sequence[bool],
    world: int,
    *,
    start_multiple: int = 1,
    shard_quantum: int = 1,
    first_rank: int = 0,
) -> PackedShards:
    """Lay out one bucket of ``world`` equal shards so that every cut falls where its param allows.

    Params that may be cut (``whole`` False) are placed first, in order, each starting at a multiple of
    ``lcm(start_multiple, cut_multiple)``, and the shard size is a multiple of every cut multiple (and of
    ``shard_quantum``): so each shard boundary is a legal cut for each of them. Whole params are then
    placed, largest first, in the shard with the most room left, each inside one shard: the bytes each
    rank owns are balanced greedily. Ties go to the first rank with that room counting from
    ``first_rank``: rotating it from bucket to bucket (callers pass the bucket's index) keeps buckets of
    the same shape from all giving their largest param to rank 0. The shard size grows until everything
    fits.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    offsets: list[int | None] = [None] * len(numels)
    end, factor = 0, shard_quantum
    for i, (numel, multiple, is_whole) in enumerate(zip(numels, cut_multiples, whole, strict=True)):
        if is_whole:
            continue
        end = _round_up(end, math.lcm(start_multiple, multiple))
        offsets[i] = end
        end += numel
        factor = math.lcm(factor, multiple)
    whole_order = sorted((i for i, w in enumerate(whole) if w), key=lambda i: (-numels[i], i))
    largest = max((numels[i] for i in whole_order), default=0)
    shard = _round_up(max(-(-(end + sum(numels[i] for i in whole_order)) // world), largest, 1), factor)
    while True:
        placed = _place_whole(numels, whole_order, end, shard, world, start_multiple, first_rank)
        if placed is not None:
            for i, offset in placed.items():
                offsets[i] = offset
            return PackedShards(tuple(o if o is not None else 0 for o in offsets), shard)
        shard = _round_up(shard + max(factor, shard // 32), factor)


def _place_whole(
    numels: Sequence[int],
    order: Sequence[int],
    flowing_end: int,
    shard: int,
    world: int,
    start_multiple: int,
    first_rank: int,
) -> dict[int, int] | None:
    """Worst-fit placement of whole params into the free tails of ``world`` shards; None if one does not
    fit."""
    free = [max(r * shard, _round_up(flowing_end, start_multiple)) for r in range(world)]
    placed = {}
    for i in order:
        best, room = -1, -1
        for rank in ((first_rank + k) % world for k in range(world)):
            start = _round_up(free[rank], start_multiple)
            left = (rank + 1) * shard - start
            if left >= numels[i] and left > room:
                best, room = rank, left
        if best < 0:
            return None
        start = _round_up(free[best], start_multiple)
        placed[i] = start
        free[best] = start + numels[i]
    return placed


def drop_tail_padding(
    offsets: Sequence[int], numels: Sequence[int], shard_size: int, world: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ragged shards from a :func:`pack_shards` layout: each shard without the padding at its tail, so the
    bucket holds only its params and the alignment gaps between them (no param crosses a boundary with
    padding before it, so every param stays contiguous and every cut stays where it was in its params).
    Returns the params' new offsets and the ``world + 1`` shard cuts."""
    if shard_size == 0:
        return tuple(offsets), (0,) * (world + 1)
    used = [rank * shard_size for rank in range(world)]  # where each shard's last param ends
    for offset, numel in zip(offsets, numels, strict=True):
        for rank in range(offset // shard_size, -(-(offset + numel) // shard_size)):
            used[rank] = max(used[rank], min(offset + numel, (rank + 1) * shard_size))
    removed = [0]
    for rank in range(world):
        removed.append(removed[-1] + (rank + 1) * shard_size - used[rank])
    cuts = tuple(rank * shard_size - removed[rank] for rank in range(world + 1))
    moved = []
    for offset in offsets:
        rank = min(offset // shard_size, world - 1)
        moved.append(min(offset - removed[rank], cuts[rank + 1]))  # an empty param in the tail: its end
    return tuple(moved), cuts


def equal_cuts(shard_size: int, world: int) -> tuple[int, ...]:
    """The ``world + 1`` boundaries of ``world`` equal shards."""
    return tuple(rank * shard_size for rank in range(world + 1))


def owned_elements(offsets: Sequence[int], numels: Sequence[int], cuts: Sequence[int]) -> list[int]:
    """Param elements (padding excluded) in each shard ``[cuts[r], cuts[r + 1])``."""
    owned = [0] * (len(cuts) - 1)
    for offset, numel in zip(offsets, numels, strict=True):
        for rank, (start, end) in enumerate(itertools.pairwise(cuts)):
            owned[rank] += max(0, min(offset + numel, end) - max(offset, start))
    return owned


@dataclass(frozen=True)
class ShardBalance:
    """What a layout costs: padding elements, and how evenly the params' elements fall to the ranks
    (``imbalance`` is the largest rank's over the mean; 1.0 is perfect)."""

    numel: int
    padded_numel: int
    owned: tuple[int, ...]

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def imbalance(self) -> float:
        mean = sum(self.owned) / len(self.owned) if self.owned else 0.0
        return max(self.owned) / mean if mean else 1.0

    def __add__(self, other: ShardBalance) -> ShardBalance:
        if len(self.owned) != len(other.owned):
            raise ValueError("balances over different numbers of shards cannot be added")
        owned = tuple(a + b for a, b in zip(self.owned, other.owned, strict=True))
        return ShardBalance(self.numel + other.numel, self.padded_numel + other.padded_numel, owned)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
