"""What a DistributedDataParallel checks and sets on the params it wraps while it is built, before any
buffer exists.

Every data-parallel rank must wrap the same params with the same config and arguments: a difference would
pair unrelated tensors in the first reduction, or hang it. One collective compares them (an error on every
rank names the first difference) before any other; then, as torch's DDP does, every replica starts from
the first rank's weights.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch.distributed as dist
from torch import nn

from gradsync.buffers import (
    DistributedDataParallelConfig,
    broadcast_from_first_rank,
    check_experts_match_across_ranks,
    check_params_match_across_ranks,
    is_expert_parallel,
    settings_of,
)
from gradsync.buffers.shard_alignment import ShardAlignmentSpec, set_shard_alignments, shard_alignment_of
from gradsync.buffers.wrapper_claims import first_owned_elsewhere, refuse_owned_elsewhere
from gradsync.groups import ProcessGroupCollection

from .base import _BaseDataParallel

NamedParams = Sequence[tuple[str, nn.Parameter]]


def refuse_unknown_unused(named: NamedParams, unused_parameters: Collection[str]) -> None:
    """A misspelt name in ``unused_parameters`` would leave that param in the buffers, waiting for a grad."""
    unknown = set(unused_parameters) - {name for name, _ in named}
    if unknown:
        raise ValueError(f"unused_parameters names params the module does not have: {sorted(unknown)}")


def agree_across_ranks(
    wrapper: _BaseDataParallel,
    named: NamedParams,
    ddp_config: DistributedDataParallelConfig,
    pg_collection: ProcessGroupCollection,
    arguments: dict[str, object],
    *,
    init_sync: bool,
) -> None:
    """Refuse params that differ between data-parallel ranks (with the config and the wrapper's other
    ``arguments``) or that another live wrapper holds; then, with ``init_sync``, give every replica the
    first rank's weights."""
    who = type(wrapper).__name__
    dp_cp = pg_collection.dp_cp
    assert dp_cp is not None
    owned_elsewhere = first_owned_elsewhere(named, wrapper)
    settings = settings_of(
        ddp_config, **arguments, init_sync=init_sync, params_owned_by_another_wrapper=owned_elsewhere
    )
    check_params_match_across_ranks(named, dp_cp, settings=settings)
    refuse_owned_elsewhere(owned_elsewhere, who)
    # dense params first: an expert-group mismatch raises on that group's ranks only, and the others
    # must not be left waiting in a broadcast over the whole data-parallel group
    if init_sync:
        broadcast_module_params(wrapper.module, experts=False, group=dp_cp)
    if pg_collection.expt_dp is not None:
        check_experts_match_across_ranks(named, pg_collection.expt_dp, who=who)
        if init_sync:
            broadcast_module_params(wrapper.module, experts=True, group=pg_collection.expt_dp)


def apply_shard_alignment(
    named: NamedParams, shard_alignment: ShardAlignmentSpec, *, with_full_param_layout: bool
) -> None:
    """Record ``shard_alignment`` on the params, where the distributed optimizer's layout reads it; refuse
    what a plain-tensor layout cannot honour."""
    if with_full_param_layout and shard_alignment is not None:
        raise ValueError(
            "DistributedDataParallel: full_param_layout was computed before shard_alignment could "
            "shape it; pass one or the other (DistributedOptimizer.compute_full_param_layout reads the "
            "policies recorded on the params)"
        )
    set_shard_alignments(named, shard_alignment)
    chunked = [name for name, param in named if shard_alignment_of(param).alone]
    if chunked:
        raise ValueError(
            f"shard_alignment 'chunk' (params {chunked[:3]}...) is gradsync-fsdp's torch-native DTensor "
            "layout; the distributed optimizer's main params are plain tensors: use 'row', 'tensor' or "
            "'block'"
        )


def broadcast_module_params(module: nn.Module, *, experts: bool, group: dist.ProcessGroup | None) -> None:
    """The dense (or expert) params of ``module`` from the first rank of ``group``."""
    chosen = [p.data for p in module.parameters() if is_expert_parallel(p) == experts]
    if not chosen:
        return
    if group is None:
        raise ValueError("broadcast_params: expert params need pg_collection.expt_dp")
    broadcast_from_first_rank(chosen, group)
