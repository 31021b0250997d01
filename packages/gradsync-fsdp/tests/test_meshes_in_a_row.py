"""Several meshes and ``torch.compile`` in one world: every mesh shape the suite knows (shard only, outer x
shard with each outer strategy, shard x tp) times every strategy, one after another in the same ranks, each
model compiled, torch's mesh state cleared between them (as Megatron-FSDP's own ``test_fully_shard`` runs
them); each trains as one process on its data-parallel batch. A gather lane or cached group that outlived
its mesh would fail a later case's first forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_testkit import (
    MeshWrapped,
    clear_torch_mesh_state,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
)

from gradsync.groups.testing import run_distributed

SHAPES = {  # world -> ((outer, shard, tp), outer strategy; None: no HSDP)
    2: [((1, 2, 1), None), ((2, 1, 1), 0), ((1, 1, 2), None)],
    4: [((1, 4, 1), None), ((2, 2, 1), 0), ((2, 2, 1), 1), ((1, 2, 2), None)],
}
CASES = {
    world: [
        (sizes, outer, strategy)
        for sizes, outer in shapes
        for strategy in range(4)
        if outer != 1 or strategy == 3  # ZeRO-1 over the outer axis needs ZeRO-3 inside
    ]
    for world, shapes in SHAPES.items()
}


def walk(world: int) -> list[dict[str, torch.Tensor]]:
    results = []
    for (outer, shard, tp), outer_strategy, strategy in CASES[world]:
        torch._dynamo.reset()
        wrapped = MeshWrapped.build((outer, shard, tp), strategy, outer_strategy, make_optimizer)
        compiled: Any = torch.compile(wrapped.model, backend="aot_eager")
        mesh = wrapped.mesh
        position = mesh.get_local_rank("outer") * shard + mesh.get_local_rank("shard")
        for step in range(2):
            (batch,) = local_microbatches(step, position, outer * shard, 1)
            compiled(batch).backward()
            wrapped.optimizer.step()
            wrapped.optimizer.zero_grad()
        results.append(full_weights(wrapped.model))
        clear_torch_mesh_state()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_every_mesh_and_strategy_in_a_row_trains_like_one_process(world: int) -> None:
    for rank, runs in enumerate(run_distributed(walk, world, args=(world,), timeout=600)):
        for ((outer, shard, _), outer_strategy, strategy), weights in zip(CASES[world], runs, strict=True):
            want = reference_training(outer * shard, 1, 2)
            assert max_relative_difference(weights, want) <= 1e-5, (
                rank,
                outer,
                shard,
                outer_strategy,
                strategy,
            )
