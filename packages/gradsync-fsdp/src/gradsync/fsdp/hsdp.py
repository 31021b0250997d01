"""Hybrid sharding: the DP-outer stage that runs after the shard group's collectives.

The model is sharded over the shard (inner) group of N ranks and replicated over the outer group of M
ranks. With outer ``no_shard`` (HSDP) the outer group only all-reduces the grads this rank's optimizer
steps, once per optimisation cycle. With outer ``optim`` (HFSDP) the main weights, their grads and the
optimizer state are sharded over all N·M ranks as well: the buffers are laid out over N·M shards in the
order (inner, outer), i.e. shard ``i·M + o`` for inner rank i and outer rank o, so inner shard i is the
M consecutive outer pieces ``i·M … i·M+M-1``. Each rank keeps its inner shard of the compute weights and
grads; the outer stage reduce-scatters the accumulated inner grad shard into its piece at the end of a
cycle, and all-gathers the pieces into the inner shard before the first gather after an optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor import Placement, Replicate, Shard

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups import FSDPDistributedIndex

from .strategy import Sharding, parse_strategy


@dataclass(frozen=True)
class OuterReplication:
    """The DP-outer group and whether the optimizer's state is sharded over it too (outer ``optim``)."""

    group: dist.ProcessGroup
    hybrid_group: dist.ProcessGroup
    shard: bool

    @property
    def pieces(self) -> int:
        """Outer pieces an inner shard is cut into: M with outer ``optim``, else 1."""
        return self.group.size() if self.shard else 1

    @property
    def piece(self) -> int:
        return self.group.rank() if self.shard else 0


def outer_replication(
    config: DistributedDataParallelConfig, dist_index: FSDPDistributedIndex, sharding: Sharding
) -> OuterReplication | None:
    """The outer stage ``config`` and ``dist_index`` ask for, or None without hybrid sharding; raises,
    naming the field, for combinations the reference does not support."""
    outer = parse_strategy(config.outer_dp_sharding_strategy, "outer_dp_sharding_strategy")
    if outer.name not in ("no_shard", "optim"):
        raise ValueError(
            f"MegatronFSDP: outer_dp_sharding_strategy={config.outer_dp_sharding_strategy!r}; the outer "
            "group can only replicate ('no_shard') or shard the optimizer state ('optim')"
        )
    if not dist_index.use_hybrid_fsdp:
        if outer.name != "no_shard":
            raise ValueError(
                f"MegatronFSDP: outer_dp_sharding_strategy={outer.name!r} needs hybrid sharding: build the "
                "index with dp_outer_dim and hybrid_fsdp_group (FSDPDistributedIndex.from_sizes(dp_shard, "
                "dp_outer))"
            )
        return None
    if outer.name == "optim" and sharding.name != "optim_grads_params":
        raise ValueError(
            "MegatronFSDP: outer_dp_sharding_strategy='optim' needs data_parallel_sharding_strategy="
            f"'optim_grads_params' inside the shard group, not {sharding.name!r}"
        )
    if dist_index.hsdp_outer_dp_shard != (outer.name == "optim"):
        raise ValueError(
            f"MegatronFSDP: outer_dp_sharding_strategy={outer.name!r} but the index was built with "
            f"hsdp_outer_dp_shard={dist_index.hsdp_outer_dp_shard}; build it with hsdp_outer_dp_shard="
            f"{outer.name == 'optim'}"
        )
    group = dist_index.get_outer_fsdp_group()
    assert group is not None  # use_hybrid_fsdp guarantees it
    return OuterReplication(group, dist_index.get_dp_group(), shard=outer.name == "optim")


def optimizer_placements(sharding: Sharding, outer: OuterReplication | None) -> list[Placement]:
    """How the optimizer's DTensors lie on their mesh: (shard) or (outer, shard), as the reference."""
    inner: Placement = Shard(0) if sharding.shard_main else Replicate()
    if outer is None:
        return [inner]
    return [Shard(0) if outer.shard else Replicate(), inner]
