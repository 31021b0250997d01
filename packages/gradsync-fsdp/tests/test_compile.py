"""A MegatronFSDP inside a parent module or under ``torch.compile``: the parent's ``parameters()`` are the
optimizer's DTensor params (the modules hold them between steps, as in the reference), so an optimizer
built from them gets every grad, and training through the wrapper equals one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    Block,
    MeshWrapped,
    TinyTransformer,
    clear_torch_mesh_state,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
)
from torch import nn

from gradsync.fsdp import fully_shard_model, fully_shard_optimizer
from gradsync.groups.testing import run_distributed

STEPS = 3


class Parent(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.child(tokens)  # type: ignore[no-any-return]


def train_through(strategy: str, outside: str, micro: int) -> dict[str, torch.Tensor]:
    model = fully_shard_model(TinyTransformer(), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    outer: nn.Module = Parent(model)
    if outside == "compile":
        torch._dynamo.reset()
        outer = torch.compile(model, backend="aot_eager")  # type: ignore[assignment]
    assert {id(p) for p in outer.parameters()} == {id(p) for p in model.parameters()}
    optimizer = fully_shard_optimizer(make_optimizer(outer.parameters()))
    for step in range(STEPS):
        batches = local_microbatches(step, dist.get_rank(), dist.get_world_size(), micro)
        for i, batch in enumerate(batches):  # auto-sync: every microbatch reduces, the last one too
            (outer(batch) / micro).backward()
            has_grads = [p.grad is not None for p in outer.parameters()]
            assert any(has_grads), f"no grad reached the parent's params after microbatch {i}"
        optimizer.step()
        optimizer.zero_grad()
    return full_weights(model)


@pytest.mark.parametrize("outside", ["parent", "compile"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_through_a_parent_or_torch_compile(strategy: str, outside: str) -> None:
    want = reference_training(2, 2, STEPS)
    for rank, weights in enumerate(run_distributed(train_through, 2, args=(strategy, outside, 2))):
        assert max_relative_difference(weights, want) <= 1e-6, rank


MESHES = [((1, 4, 1), None), ((2, 2, 1), 0), ((1, 2, 2), None)]
"""(outer, shard, tp) sizes and the outer strategy (None: no HSDP): the sequence Megatron-FSDP's own
``test_fully_shard`` runs in one world, one mesh after another."""


def compiled_over_meshes_in_a_row(strategy: int) -> list[dict[str, torch.Tensor]]:
    """For each of :data:`MESHES`: wrap a fresh model over a fresh mesh, ``torch.compile`` it, train two
    steps on the batch rows of this rank's data-parallel position; the weights of each."""
    results = []
    for (outer, shard, tp), outer_strategy in MESHES:
        wrapped = MeshWrapped.build((outer, shard, tp), strategy, outer_strategy, make_optimizer)
        model, optimizer, mesh = wrapped.model, wrapped.optimizer, wrapped.mesh
        compiled = torch.compile(model, backend="aot_eager")
        position = mesh.get_local_rank("outer") * shard + mesh.get_local_rank("shard")
        for step in range(2):
            (batch,) = local_microbatches(step, position, outer * shard, 1)
            compiled(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(full_weights(model))
        clear_torch_mesh_state()
    return results


@pytest.mark.parametrize("strategy", [0, 1, 3])
def test_models_compiled_over_one_mesh_after_another_train_like_one_process(strategy: int) -> None:
    """Each mesh's model trains as one process on its data-parallel batch. The hooks ran traced, a compiled
    frame kept the first mesh's group ranks, and the second mesh's forward broadcast from a rank outside its
    group."""
    for rank, runs in enumerate(
        run_distributed(compiled_over_meshes_in_a_row, 4, args=(strategy,), timeout=240)
    ):
        for ((outer, shard, _), _), weights in zip(MESHES, runs, strict=True):
            want = reference_training(outer * shard, 1, 2)
            assert max_relative_difference(weights, want) <= 1e-5, (rank, outer, shard)
