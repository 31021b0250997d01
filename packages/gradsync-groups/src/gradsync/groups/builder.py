"""Create every process group of a rank layout collectively, and tear them down again.

``torch.distributed.new_group`` is collective over the default group: every rank creates every group, in
the same order, and keeps the ones that contain it. Nothing is stored in module globals; the returned
:class:`ProcessGroupCollection` is the whole state.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from .collection import ProcessGroupCollection
from .layout import DEFAULT_ORDER, EmbeddingRanksFn, RankLayout, compute_rank_layout

# Creation order; every rank walks it identically.
_CREATION_ORDER = (
    "dp_cp",
    "intra_dp_cp",
    "dp",
    "cp",
    "mp",
    "tp",
    "pp",
    "embd",
    "pos_embd",
    "tp_dp_cp",
    "tp_cp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "expt_dp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
)
# Kinds that are the very same group object as another when their rank lists agree (one optimizer
# instance; GTP off), as in the reference.
_ALIASES = {
    "intra_dp_cp": "dp_cp",
    "intra_expt_dp": "expt_dp",
}
_GTP_ALIASES = {
    "dp_cp_gtp_remat": "dp_cp",
    "expt_dp_gtp_remat": "expt_dp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
}


def _new_groups(
    all_groups: Sequence[Sequence[int]], rank: int, timeout: timedelta | None, desc: str
) -> dist.ProcessGroup | None:
    """Create each group (collectively) and return the one holding ``rank``."""
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks=list(ranks), timeout=timeout, group_desc=desc)
        if rank in ranks:
            mine = group
    return mine


def build_process_groups(
    layout: RankLayout,
    *,
    timeout: timedelta | None = None,
    create_all_gather_groups: bool = False,
) -> ProcessGroupCollection:
    """Create the groups of ``layout`` on the initialised default group and return this rank's ones.

    ``create_all_gather_groups`` adds separate communicators over the dp_cp and expt_dp ranks
    (``dp_cp_ag``/``expt_dp_ag``) so param all-gathers can overlap grad reductions.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group before "
            "building process groups"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(
            f"layout was computed for world_size {layout.world_size} but the default group has {world} ranks"
        )
    created: dict[str, dist.ProcessGroup | list[dist.ProcessGroup] | None] = {}
    for kind in _CREATION_ORDER:
        if kind not in layout.groups:
            continue
        alias = _ALIASES.get(kind)
        if alias is not None and layout.groups[kind] == layout.groups[alias]:
            created[kind] = created[alias]
        else:
            created[kind] = _new_groups(layout.groups[kind], rank, timeout, kind)
    for kind, target in _GTP_ALIASES.items():
        created[kind] = created[target]
    if layout.hcp:
        hcp = [_new_groups(level, rank, timeout, f"hcp{k}") for k, level in enumerate(layout.hcp)]
        created["hcp"] = [g for g in hcp if g is not None]
    if create_all_gather_groups:
        created["dp_cp_ag"] = _new_groups(layout.groups["dp_cp"], rank, timeout, "dp_cp_ag")
        created["expt_dp_ag"] = _new_groups(layout.groups["expt_dp"], rank, timeout, "expt_dp_ag")
    return ProcessGroupCollection(**created)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    distributed_timeout_minutes: float = 30,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks: EmbeddingRanksFn | None = None,
    get_position_embedding_ranks: EmbeddingRanksFn | None = None,
    create_all_gather_groups: bool = False,
) -> ProcessGroupCollection:
    """Megatron's ``initialize_model_parallel``, returning the collection instead of setting globals.

    The layout is validated before any group is created, so a bad size fails on every rank alike and
    nothing hangs. Release the groups with :func:`destroy_process_groups`.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group before "
            "initialize_model_parallel"
        )
    layout = compute_rank_layout(
        dist.get_world_size(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        order=order,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
    )
    return build_process_groups(
        layout,
        timeout=timedelta(minutes=distributed_timeout_minutes),
        create_all_gather_groups=create_all_gather_groups,
    )


def destroy_process_groups(collection: ProcessGroupCollection) -> None:
    """Destroy every distinct group held by ``collection`` (never the default group).

    A barrier on the default group comes first: a rank tearing down while a peer is still inside a
    collective makes gloo abort ("terminate called without an active exception").
    """
    groups: dict[int, dist.ProcessGroup] = {}
    for name in collection.field_names():
        value = getattr(collection, name)
        for group in value if isinstance(value, list) else [value]:
            if group is not None and group is not dist.GroupMember.WORLD:
                groups[id(group)] = group
    dist.barrier()
    for group in groups.values():
        dist.destroy_process_group(group)
