"""Uneven shards torch's own DTensor machinery can gather, scatter and checkpoint.

gradsync-fsdp cuts its flat buckets where the layout says (whole rows, whole matrices, whole blocks), so a
param's rows per rank rarely follow ``torch.chunk``, the only split ``Shard(dim)`` knows: ``full_tensor()``
and ``redistribute()`` on such a shard send mismatched byte counts inside torch (on gloo the transport
aborts). Two pieces fix that:

- :class:`RaggedShard` ``(dim, sizes)``: a ``Shard(dim)`` whose piece on mesh coordinate ``i`` has
  ``sizes[i]`` entries along ``dim`` (veScale-FSDP's ``RaggedShard``, Megatron-FSDP v2's uneven ``DBuffer``
  placement). It overrides the hooks torch's redistribute and checkpoint code calls on a shard placement,
  so on a DTensor placed with it ``full_tensor()``, ``redistribute()`` (to ``Replicate``, to ``Shard(k)``
  with ``k != dim``, from ``Replicate``, from ``Partial``), DCP save / load (to and from any other
  sharding) run natively and exactly. It is a placement for moving data, not for computing on: torch's C++
  op-dispatch cache keys a placement by kind and dim only, so ops on two DTensors whose splits differ can
  share a cached output placement. Compute on the param, whose label stays torch's ``Shard(dim)``.
- :class:`RaggedDTensor`: a DTensor (gradsync's optimizer params, their grads and state) labelled
  ``Shard(dim)`` for op dispatch, exactly as before, whose ``full_tensor()``, ``redistribute()`` and DCP
  metadata use its true ``ragged_placements``, cut in its ``mesh_dim_order``. Optimizer steps,
  ``clip_grad_norm_`` and every other op run as on a plain DTensor; outputs shaped like a ragged input
  (``detach``, ``zeros_like``, arithmetic) keep its split.

``mesh_dim_order`` is the order in which mesh dims cut a sharded dim (torch's ``shard_order``). torch
reads placements left to right: on an (outer, inner) mesh the outer dim cuts first. HFSDP's shards lie the
other way round, the inner dim first (inner rank ``i``'s shard is the outer pieces ``i*M ... i*M+M-1``), so
their order is ``(1, 0)`` and the outer ``RaggedShard``'s sizes are those of this rank's inner shard: torch's
redistribute planner follows a spec's shard order, and these hooks only ever see their own inner shard.

Limits of torch's redistribute executor that this module cannot reach (it calls the *source* placement's
hook, or none): a move from a ragged split to ``Shard(dim)`` on the same ``dim``, or from ``Shard(k)`` into
a ragged split, is not carried out by ``DTensor.redistribute`` on a ``RaggedShard`` DTensor;
:func:`reshard` (and ``RaggedDTensor.redistribute``) go through ``Replicate`` there.
``distribute_tensor(t, mesh, [RaggedShard(...)])`` scatters torch's even chunks and labels them so.
:func:`reshard` moves into a ragged split, or one in another order, by cutting a whole copy locally.
"""

from __future__ import annotations

import torch

from .mesh_dim_order import (
    checked_order,
    left_to_right,
    local_sizes_and_offsets,
    placed,
    shard_order,
    torch_describes,
)
from .ragged_dtensor import RaggedDTensor, reshard, split_of
from .ragged_shard import RaggedShard, shard_placement

# the public API, and the split helpers the package's other modules import from here
__all__ = [
    "RaggedDTensor",
    "RaggedShard",
    "checked_order",
    "left_to_right",
    "local_sizes_and_offsets",
    "placed",
    "reshard",
    "shard_order",
    "shard_placement",
    "split_of",
    "torch_describes",
]

# gradsync's params, grads and optimizer state are RaggedDTensors placed with RaggedShard; torch.load, whose
# default since torch 2.6 is weights_only=True, rebuilds only the classes allowlisted here.
torch.serialization.add_safe_globals([RaggedDTensor, RaggedShard])
