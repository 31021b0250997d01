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
from .teardown import guard_group_teardown

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


# Megatron keywords whose only supported value is Megatron's default: name -> (default, why and the fix).
_DEFAULT_ONLY: dict[str, tuple[object, str]] = {
    "use_sharp": (False, "SHARP (NCCL CollNet) is not set up; pass use_sharp=False"),
    "sharp_enabled_group": (None, "SHARP (NCCL CollNet) is not set up; pass sharp_enabled_group=None"),
    "hybrid_context_parallel": (
        False,
        "hybrid dp x cp groups are not built; pass hybrid_context_parallel=False",
    ),
    "gtp_remat_size": (
        1,
        "GTP weight rematerialisation has no axis in gradsync's layout; pass gtp_remat_size=1",
    ),
    "expert_gtp_remat_size": (
        1,
        "expert GTP weight rematerialisation has no axis in gradsync's layout; pass expert_gtp_remat_size=1",
    ),
    "nccl_communicator_config_path": (
        None,
        "per-group NCCL options are not applied; pass None (NCCL_MIN_CTAS, NCCL_MAX_CTAS and "
        "NCCL_CGA_CLUSTER_SIZE in the environment set them for every communicator)",
    ),
    "high_priority_stream_groups": (
        None,
        "groups are created without NCCL options, so none gets a high-priority stream; pass None",
    ),
    "rank_offset": (
        0,
        "groups always span the whole default group; pass 0 and initialise torch.distributed over just "
        "the ranks to lay out",
    ),
    "local_world_size": (
        None,
        "groups always span the whole default group; pass None and initialise torch.distributed over just "
        "the ranks to lay out",
    ),
}


def _refuse_unsupported(**values: object) -> None:
    """Refuse a Megatron option gradsync does not implement, on every rank alike and before any group
    exists, rather than build groups that silently lack what the option asks for."""
    for name, value in values.items():
        default, fix = _DEFAULT_ONLY[name]
        if value != default:
            raise NotImplementedError(
                f"initialize_model_parallel: {name}={value!r} is not supported by gradsync: {fix}"
            )


def _check_pipeline_backend(backend: str | None) -> None:
    """Megatron's pipeline backends are the default, NCCL and UCC; gradsync does the first two."""
    if backend == "ucc":
        raise NotImplementedError(
            "initialize_model_parallel: pipeline_model_parallel_comm_backend='ucc' is not supported by "
            "gradsync: Megatron also sets UCC/UCX environment variables for it, which gradsync does not. "
            "Set them yourself and call build_process_groups(layout, "
            "pipeline_model_parallel_comm_backend='ucc'), or pass None"
        )
    if backend not in (None, "nccl"):
        raise ValueError(
            f"initialize_model_parallel: pipeline_model_parallel_comm_backend={backend!r} is not a "
            "pipeline backend; pass None (the default group's backend) or 'nccl'"
        )


def _new_groups(
    all_groups: Sequence[Sequence[int]],
    rank: int,
    timeout: timedelta | None,
    desc: str,
    backend: str | None = None,
) -> dist.ProcessGroup | None:
    """Create each group (collectively) and return the one holding ``rank``."""
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks=list(ranks), timeout=timeout, backend=backend, group_desc=desc)
        if rank in ranks:
            guard_group_teardown(group)
            mine = group
    return mine


def build_process_groups(
    layout: RankLayout,
    *,
    timeout: timedelta | None = None,
    create_all_gather_groups: bool = False,
    pipeline_model_parallel_comm_backend: str | None = None,
) -> ProcessGroupCollection:
    """Create the groups of ``layout`` on the initialised default group and return this rank's ones.

    ``create_all_gather_groups`` adds separate communicators over the dp_cp and expt_dp ranks
    (``dp_cp_ag``/``expt_dp_ag``) so param all-gathers can overlap grad reductions.
    ``pipeline_model_parallel_comm_backend`` is the backend of the ``pp`` groups (None: the default
    group's), so pipeline traffic can run on a different transport from the gradient reductions.
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
            backend = pipeline_model_parallel_comm_backend if kind == "pp" else None
            created[kind] = _new_groups(layout.groups[kind], rank, timeout, kind, backend)
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
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: float = 30,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks: EmbeddingRanksFn | None = None,
    get_position_embedding_ranks: EmbeddingRanksFn | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Sequence[str] | None = None,
    sharp_enabled_group: str | None = None,
    rank_offset: int = 0,
    local_world_size: int | None = None,
    create_all_gather_groups: bool = False,
) -> ProcessGroupCollection:
    """Megatron's ``initialize_model_parallel``, returning the collection instead of setting globals.

    Every Megatron argument is accepted, with its name, order and default; after the first three they are
    keyword-only (Megatron's own callers pass them by keyword). Options gradsync does not implement
    (SHARP, hybrid CP, GTP, NCCL communicator configs, high-priority streams, rank offsets, the UCC
    pipeline backend) raise for any value but the default. ``create_gloo_process_groups`` is accepted
    either way: gradsync never creates gloo twins of the groups, nothing here would read them.

    Arguments and the layout are validated before any group is created, so a bad value fails on every
    rank alike and nothing hangs. Release the groups with :func:`destroy_process_groups`.
    """
    _refuse_unsupported(
        use_sharp=use_sharp,
        sharp_enabled_group=sharp_enabled_group,
        hybrid_context_parallel=hybrid_context_parallel,
        gtp_remat_size=gtp_remat_size,
        expert_gtp_remat_size=expert_gtp_remat_size,
        nccl_communicator_config_path=nccl_communicator_config_path,
        high_priority_stream_groups=high_priority_stream_groups or None,
        rank_offset=rank_offset,
        local_world_size=local_world_size,
    )
    _check_pipeline_backend(pipeline_model_parallel_comm_backend)
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
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
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
