"""What MegatronFSDP settles before it builds anything: the config it runs with, the device, every refusal
of an unsupported or contradictory setting, and one collective in which every data-parallel rank agrees
on the params and settings it wraps.

All of it runs before any other collective, so bad input raises on every rank, by name, instead of
leaving some ranks in a collective the others never join.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.buffers import (
    DistributedDataParallelConfig,
    broadcast_from_first_rank,
    check_params_match_across_ranks,
    is_expert_parallel,
    settings_of,
)
from gradsync.buffers.shard_alignment import ShardAlignmentSpec, set_shard_alignments
from gradsync.buffers.wrapper_claims import first_owned_elsewhere, refuse_owned_elsewhere
from gradsync.groups import FSDPDistributedIndex

from .device_choice import wrapped_module_device
from .hsdp import OuterReplication, outer_replication
from .meta_init import MetaReplacement, replace_meta_params
from .mixed_precision import MixedPrecisionPolicy, policy_from_config
from .strategy import Sharding, parse_strategy
from .support import (
    config_for_wrap,
    refuse_packed_gathers_where_nothing_is_gathered,
    refuse_two_grad_wires,
    refuse_unsupported,
)
from .units import UnitEntry, resolve_unit_classes


@dataclass(frozen=True)
class WrapArguments:
    """MegatronFSDP's own arguments that change what it builds: every rank must pass the same."""

    disable_bucketing: bool
    calculate_per_token_loss: bool
    init_model_with_meta_device: bool
    sync_model_each_microbatch: bool
    report_nan_in_param_grad: bool
    shard_alignment: ShardAlignmentSpec
    gather_lane: bool
    init_sync: bool


@dataclass(frozen=True)
class Prepared:
    """The settled inputs: ``named`` is the module's params after the move to ``device``, and ``meta`` what
    a meta-device model's params were replaced with (None for a real one)."""

    config: DistributedDataParallelConfig
    sharding: Sharding
    policy: MixedPrecisionPolicy
    device: torch.device
    outer: OuterReplication | None
    meta: MetaReplacement | None
    named: list[tuple[str, nn.Parameter]]
    unit_classes: tuple[type[nn.Module], ...]


def prepare_wrap(
    owner: nn.Module,
    module: nn.Module,
    dist_index: FSDPDistributedIndex,
    config: DistributedDataParallelConfig | None,
    policy: MixedPrecisionPolicy | None,
    unit_modules: Sequence[UnitEntry] | None,
    asked_device: torch.device | None,
    keywords: dict[str, bool],
    arguments: WrapArguments,
) -> Prepared:
    """Settle ``owner``'s inputs (``keywords``: the config-building flags, see :func:`config_for_wrap`),
    check them on every rank at once, and give every replica the first rank's weights when
    ``arguments.init_sync`` asks (a meta-device model is broadcast after it is materialised)."""
    config = config_for_wrap(config, keywords)
    sharding = parse_strategy(config.data_parallel_sharding_strategy)
    policy = policy_from_config(config, policy)
    meta_init = arguments.init_model_with_meta_device
    device = wrapped_module_device(asked_device, module, dist_index.device_mesh.device_type, meta_init)
    refuse_unsupported(config, dist_index, device)
    refuse_two_grad_wires(config, policy)
    refuse_packed_gathers_where_nothing_is_gathered(config)
    outer = outer_replication(config, dist_index, sharding)
    meta = replace_meta_params(module, device) if meta_init else None
    # Looked for before the move: module.to() swaps copies into a live wrapper's DTensor params.
    # A module held elsewhere is not moved; it is refused below, once every rank agrees.
    owned_elsewhere = first_owned_elsewhere(list(module.named_parameters()), owner)
    if asked_device is not None and owned_elsewhere is None:
        module.to(asked_device)
    named = list(module.named_parameters())
    set_shard_alignments(named, arguments.shard_alignment)
    unit_classes = resolve_unit_classes(unit_modules)
    given = {field.name: getattr(arguments, field.name) for field in dataclasses.fields(arguments)}
    settings = settings_of(
        config,
        mixed_precision_policy=policy,
        fsdp_unit_modules=unit_classes,
        device_type=device.type,
        **given,
        params_owned_by_another_wrapper=owned_elsewhere,
    )
    check_params_match_across_ranks(named, dist_index.get_dp_group(), who="MegatronFSDP", settings=settings)
    refuse_owned_elsewhere(owned_elsewhere, "MegatronFSDP")
    if arguments.init_sync and meta is None:
        dense = [p.data for p in module.parameters() if not is_expert_parallel(p)]
        broadcast_from_first_rank(dense, dist_index.get_dp_group())
    return Prepared(config, sharding, policy, device, outer, meta, named, unit_classes)
