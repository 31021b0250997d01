"""Megatron's rank layout as pure functions: which global ranks form each process group.

Nothing here touches ``torch.distributed``, so every layout can be checked without a process group, and
every validation error is raised before any group exists. Rank = Σ index_i · stride_i over the axes of the
order string, the first axis varying fastest (``tp-cp-ep-dp-pp``: tp ranks are neighbours, pp ranks are
farthest apart). Dense groups come from a generator with ep folded into dp; expert groups from a generator
with cp folded into the expert data-parallel axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product

Ranks = tuple[int, ...]
RankGroups = tuple[Ranks, ...]
EmbeddingRanksFn = Callable[[list[int]], list[int]]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
AXES = ("tp", "pp", "dp", "ep", "cp")


class ParallelLayoutError(RuntimeError, ValueError):
    """Invalid parallel sizes or order. Both a RuntimeError (as Megatron raises) and a ValueError."""


def _prefix_products(sizes: Sequence[int]) -> list[int]:
    strides = [1]
    for size in sizes[:-1]:
        strides.append(strides[-1] * size)
    return strides


def _mixed_radix(index: int, shape: Sequence[int]) -> list[int]:
    """Digits of ``index`` over ``shape``, first digit fastest."""
    digits = []
    for size in shape:
        digits.append(index % size)
        index //= size
    return digits


def _dot(digits: Sequence[int], strides: Sequence[int]) -> int:
    return sum(d * st for d, st in zip(digits, strides, strict=True))


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> list[list[int]]:
    """Groups formed by the masked axes; the unmasked axes enumerate the groups.

    ``parallel_size`` lists axis sizes in order (first axis = smallest stride). Groups are listed with the
    first unmasked axis varying fastest; ranks inside a group increase, which ``new_group`` relies on.
    """
    if len(parallel_size) != len(mask):
        raise ParallelLayoutError(
            f"parallel_size {list(parallel_size)} and mask {list(mask)} differ in length"
        )
    if math.prod(parallel_size) != world_size:
        raise ParallelLayoutError(
            f"world_size ({world_size}) != product of parallel sizes {list(parallel_size)}"
        )
    strides = _prefix_products(parallel_size)
    masked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if m]
    masked_strides = [st for st, m in zip(strides, mask, strict=True) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if not m]
    unmasked_strides = [st for st, m in zip(strides, mask, strict=True) if not m]
    group_size = math.prod(masked_shape)
    groups = []
    for group_index in range(world_size // group_size):
        base = _dot(_mixed_radix(group_index, unmasked_shape), unmasked_strides)
        groups.append([base + _dot(_mixed_radix(r, masked_shape), masked_strides) for r in range(group_size)])
    return groups


def normalize_order(order: str, sizes: Mapping[str, int]) -> list[str]:
    """Tokens of ``order``, lower-cased, with every missing size-1 axis appended.

    Membership is by token, not by substring (Megatron's substring test lets "tp" hide inside another name).
    """
    tokens = order.lower().split("-")
    for token in tokens:
        if token not in sizes:
            raise ParallelLayoutError(
                f"Unknown token {token!r} in order {order!r}; tokens are {', '.join(sizes)}"
            )
    duplicates = sorted({t for t in tokens if tokens.count(t) > 1})
    if duplicates:
        raise ParallelLayoutError(f"Order {order!r} repeats {', '.join(duplicates)}")
    for name, size in sizes.items():
        if name not in tokens:
            if size != 1:
                raise ParallelLayoutError(
                    f"The size of ({name}) is ({size}), but you haven't specified the order ({order})."
                )
            tokens.append(name)
    return tokens


class RankGenerator:
    """Rank groups of one generator (dense: ep=1; expert: cp=1) for any combination of axes.

    ``get_ranks("dp-cp")`` returns the groups spanned by the named axes; tokens may be given in any order.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        if ep != 1 and cp != 1:
            raise ParallelLayoutError(
                f"Both EP ({ep}) and CP ({cp}) > 1 in one rank generator: CP only applies to the dense "
                "generator and EP only to the expert generator"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.order_tokens = normalize_order(order, self.name_to_size)
        self.order = "-".join(self.order_tokens)
        self.ordered_size = [self.name_to_size[t] for t in self.order_tokens]

    def get_mask(self, token: str) -> list[bool]:
        wanted = token.lower().split("-")
        for name in wanted:
            if name not in self.order_tokens:
                raise ParallelLayoutError(f"Unknown axis {name!r} in {token!r}")
        return [t in wanted for t in self.order_tokens]

    def get_ranks(self, token: str) -> list[list[int]]:
        groups = generate_masked_orthogonal_rank_groups(
            self.world_size, self.ordered_size, self.get_mask(token)
        )
        return [[r + self.rank_offset for r in g] for g in groups]


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The first and last stage of a pipeline (or the only one)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The first stage of a pipeline."""
    return [pp_ranks[0]]


def hierarchical_rank_groups(ranks: Sequence[int], sizes: Sequence[int]) -> list[list[list[int]]]:
    """Split one group into levels: level k groups ranks that differ only in digit k over ``sizes``.

    ranks [0, 2, 4, 6] with sizes [2, 2] give level 0 [[0, 2], [4, 6]] and level 1 [[0, 4], [2, 6]].
    """
    if math.prod(sizes) != len(ranks):
        raise ParallelLayoutError(
            f"hierarchical sizes {list(sizes)} multiply to {math.prod(sizes)}, not to the group size "
            f"{len(ranks)}"
        )
    levels = []
    for k, size in enumerate(sizes):
        inner = math.prod(sizes[:k])
        outer = math.prod(sizes[k + 1 :])
        levels.append(
            [
                [ranks[o * size * inner + j * inner + i] for j in range(size)]
                for o, i in product(range(outer), range(inner))
            ]
        )
    return levels


@dataclass(frozen=True)
class RankLayout:
    """Every group kind's rank lists for one set of parallel sizes.

    ``groups`` maps a :class:`ProcessGroupCollection` field name to its groups (sorted rank tuples). Kinds
    that do not cover every rank (``embd``, ``pos_embd``) list only the groups that exist; a rank outside all
    of them gets None. ``hcp`` holds one entry per hierarchy level.
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    data_parallel_size: int
    expert_data_parallel_size: int
    num_distributed_optimizer_instances: int
    virtual_pipeline_model_parallel_size: int | None
    order: str
    groups: Mapping[str, RankGroups]
    hcp: tuple[RankGroups, ...] = field(default=())

    def group_of(self, kind: str, rank: int) -> Ranks | None:
        """The group of ``kind`` that holds ``rank``, or None."""
        for ranks in self.groups[kind]:
            if rank in ranks:
                return ranks
        return None


def _as_groups(groups: Iterable[Sequence[int]]) -> RankGroups:
    return tuple(tuple(sorted(g)) for g in groups)


def _check_positive(**sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ParallelLayoutError(f"{name} must be a positive integer, got {value!r}")


def compute_rank_layout(
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks: EmbeddingRanksFn | None = None,
    get_position_embedding_ranks: EmbeddingRanksFn | None = None,
) -> RankLayout:
    """The rank lists of every group kind, with the data-parallel sizes derived, or a clear error.

    Validation follows Megatron's ``initialize_model_parallel`` and happens entirely here, before any
    process group exists.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep, n_inst = expert_model_parallel_size, num_distributed_optimizer_instances
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    _check_positive(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        num_distributed_optimizer_instances=n_inst,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    model_size = tp * pp * cp
    if world_size % model_size:
        raise ParallelLayoutError(
            f"world_size ({world_size}) is not divisible by {model_size} "
            f"(tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp} x "
            f"context_parallel_size {cp})"
        )
    if virtual_pipeline_model_parallel_size is not None and pp <= 1:
        raise ParallelLayoutError(
            "pipeline-model-parallel size should be greater than 1 with interleaved schedule "
            f"(virtual_pipeline_model_parallel_size {virtual_pipeline_model_parallel_size}, "
            f"pipeline_model_parallel_size {pp})"
        )
    dp = world_size // model_size
    expert_model_size = etp * ep * pp
    if world_size % expert_model_size:
        raise ParallelLayoutError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size "
            f"({expert_model_size}) (expert_tensor_parallel_size {etp} x expert_model_parallel_size "
            f"{ep} x pipeline_model_parallel_size {pp})"
        )
    edp = world_size // expert_model_size

    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    if order.lower().split("-")[-1] != "pp" and pp != 1 and edp != dp:
        raise ParallelLayoutError(
            "When not using pp-last rank ordering, the data parallel size of the attention and moe "
            f"layers must be the same (order {order!r}: data parallel {dp}, expert data parallel {edp})"
        )
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ParallelLayoutError(
            f"Order {order!r} gives different pipeline groups for the dense layers (tp {tp}, cp {cp}, "
            f"dp {dp}) and the expert layers (etp {etp}, ep {ep}, edp {edp})"
        )
    if (dp * cp) % n_inst:
        raise ParallelLayoutError(
            f"data_parallel_size x context_parallel_size ({dp} x {cp}) is not divisible by "
            f"num_distributed_optimizer_instances ({n_inst})"
        )
    if edp % n_inst:
        raise ParallelLayoutError(
            f"expert data parallel size ({edp}) is not divisible by "
            f"num_distributed_optimizer_instances ({n_inst})"
        )
    if hierarchical_context_parallel_sizes is not None and (
        math.prod(hierarchical_context_parallel_sizes) != cp
    ):
        raise ParallelLayoutError(
            f"hierarchical_context_parallel_sizes {list(hierarchical_context_parallel_sizes)} must "
            f"multiply to context_parallel_size ({cp})"
        )

    groups: dict[str, RankGroups] = {}
    for kind, axes in (
        ("tp", "tp"),
        ("pp", "pp"),
        ("mp", "tp-pp"),
        ("cp", "cp"),
        ("tp_cp", "tp-cp"),
        ("dp", "dp"),
        ("dp_cp", "dp-cp"),
        ("tp_dp_cp", "tp-dp-cp"),
    ):
        groups[kind] = _as_groups(dense.get_ranks(axes))
    for kind, axes in (
        ("ep", "ep"),
        ("expt_tp", "tp"),
        ("tp_ep", "tp-ep"),
        ("tp_ep_pp", "tp-ep-pp"),
        ("expt_dp", "dp"),
    ):
        groups[kind] = _as_groups(expert.get_ranks(axes))

    embedding = get_embedding_ranks or default_embedding_ranks
    position = get_position_embedding_ranks or default_position_embedding_ranks
    pp_lists = [list(g) for g in groups["pp"]]
    groups["embd"] = _as_groups(embedding(g) for g in pp_lists)
    groups["pos_embd"] = _as_groups(position(g) for g in pp_lists)

    # Distributed-optimizer instances: contiguous slices of each dp-cp group, a [edp/N, N] hierarchical
    # split of each expert-dp group, and blocks of edp/N consecutive expert tp-ep-pp groups.
    dp_cp_slice = dp * cp // n_inst
    groups["intra_dp_cp"] = _as_groups(
        g[i * dp_cp_slice : (i + 1) * dp_cp_slice] for g in groups["dp_cp"] for i in range(n_inst)
    )
    split = [hierarchical_rank_groups(g, [edp // n_inst, n_inst]) for g in groups["expt_dp"]]
    groups["intra_expt_dp"] = _as_groups(level_groups for s in split for level_groups in s[0])
    if n_inst > 1:
        groups["inter_dist_opt"] = _as_groups(level_groups for s in split for level_groups in s[1])
    block = edp // n_inst
    tp_ep_pp = groups["tp_ep_pp"]
    groups["intra_dist_opt"] = _as_groups(
        [r for g in tp_ep_pp[i : i + block] for r in g] for i in range(0, len(tp_ep_pp), block)
    )

    hcp: tuple[RankGroups, ...] = ()
    if hierarchical_context_parallel_sizes is not None:
        per_group = [hierarchical_rank_groups(g, hierarchical_context_parallel_sizes) for g in groups["cp"]]
        hcp = tuple(
            _as_groups(level_group for levels in per_group for level_group in levels[k])
            for k in range(len(hierarchical_context_parallel_sizes))
        )

    return RankLayout(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        data_parallel_size=dp,
        expert_data_parallel_size=edp,
        num_distributed_optimizer_instances=n_inst,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        order=order,
        groups=groups,
        hcp=hcp,
    )
