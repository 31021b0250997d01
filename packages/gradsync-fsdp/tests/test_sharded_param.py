"""The per-param record (:mod:`gradsync.fsdp.sharded_param`): one record per param of the wrapped module,
in its order, reached from either of its tensors; each holds the tensors the wrapper trains with, and a
second wrapper in the same world builds records of its own without touching the first's. The grads it
hands out are its own views, built once. A param's state
survives its wrapper's process groups being destroyed: a checkpoint taken through the records (ranks that
own nothing of a param included) loads into a model wrapped over new groups, which trains on exactly as
the first one did."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import MeshWrapped, clear_torch_mesh_state, full_weights, local_microbatches
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync.fsdp import fully_shard_model
from gradsync.groups.testing import run_distributed
from gradsync.groups.testing.replica_groups import free_port


def build() -> nn.Module:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    module[0].bias.requires_grad_(False)
    return module


def check_records(model: nn.Module, names: list[str]) -> None:
    records = list(model.params)  # type: ignore[attr-defined]
    assert [r.name for r in records] == names
    optimizer_params = list(model.parameters())
    assert [r.sharded for r in records] == optimizer_params  # the module's order, one record each
    for record in records:
        assert model.params.of(record.compute) is record  # type: ignore[attr-defined]
        assert model.params.of(record.sharded) is record  # type: ignore[attr-defined]
        assert record.bucket.spec.params[record.index] is record.compute
        (slot,) = record.slots  # the module attribute holding it, which shows the optimizer's param now
        assert slot[0]._parameters[slot[1]] is record.sharded
        assert record.frozen_at_wrap == (record.name == "0.bias")
        assert record.sharded.requires_grad != record.frozen_at_wrap


def records_across_two_wrappers(strategy: str) -> list[float]:
    first_module = build()
    names = [name for name, _ in first_module.named_parameters()]
    first = fully_shard_model(first_module, zero_dp_strategy=strategy, fsdp_unit_modules=[])
    check_records(first, names)
    kept = [(r.compute, r.sharded, r.bucket) for r in first.params]
    second = fully_shard_model(build(), zero_dp_strategy=strategy, fsdp_unit_modules=[])
    check_records(second, names)
    assert not {id(r.sharded) for r in second.params} & {id(r.sharded) for r in first.params}
    assert [(r.compute, r.sharded, r.bucket) for r in first.params] == kept  # the first's records stand
    # each wrapper still trains through its own records: rank-different batches, grads reduced
    losses = []
    for model in (first, second):
        inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
        loss = model(inputs).square().mean()
        loss.backward()
        model.finish_grad_sync()
        for record in model.params:
            assert (record.sharded.grad is None) == record.frozen_at_wrap, record.name
            assert record.sharded.grad is record.optimizer_grad  # built at wrap, not every step
            if strategy == "no_shard" and not record.frozen_at_wrap:  # Megatron's code reads main_grad
                assert record.compute.main_grad is record.main_grad
                buffer = record.bucket.grad.untyped_storage()  # (a slice of a coalesced group's, maybe)
                assert record.main_grad.untyped_storage().data_ptr() == buffer.data_ptr()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_records_are_one_per_param_and_a_second_wrapper_leaves_the_first_alone(strategy: str) -> None:
    for first, second in run_distributed(records_across_two_wrappers, 2, args=(strategy,)):
        assert first == second  # the same weights and batch: the two wrappers' models are one


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def layout(model: nn.Module) -> list[tuple[str, int | None, int]]:
    """Each record's name, first row and local elements on this rank."""
    return [(r.name, r.first_row, r.local.numel()) for r in model.params]  # type: ignore[attr-defined]


def optimizer_locals(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {k: (v.to_local() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}
        for state in (optimizer.state[p] for group in optimizer.param_groups for p in group["params"])
    ]


def train_step(wrapped: MeshWrapped, step: int) -> None:
    (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)  # rank-different rows
    wrapped.model(batch).backward()
    wrapped.optimizer.step()
    wrapped.optimizer.zero_grad()


def reinit_world() -> None:
    """Destroy the world's process groups and build a new world over the same ranks, as test suites,
    notebooks and elastic restarts do (the new world's store is rank 0's)."""
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port[0], world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def records_across_a_group_reinit(strategy: int, directory: str) -> dict[str, object]:
    """Train a step, checkpoint through the records, train a second step (what is wanted); destroy every
    process group and build a new world, wrap a fresh model over a new mesh, load the checkpoint and take
    the second step there."""
    first = MeshWrapped.build((1, 2, 1), strategy, None, adam)
    train_step(first, 0)
    saved_layout = layout(first.model)
    dcp.save(
        {"model": first.model.state_dict(), "optim": first.optimizer.state_dict()}, checkpoint_id=directory
    )
    train_step(first, 1)
    want_weights, want_state = full_weights(first.model), optimizer_locals(first.optimizer)
    del first
    reinit_world()
    clear_torch_mesh_state()

    second = MeshWrapped.build((1, 2, 1), strategy, None, adam)
    target = {"model": second.model.state_dict(), "optim": second.optimizer.state_dict()}
    dcp.load(target, checkpoint_id=directory)
    second.model.load_state_dict(target["model"])
    second.optimizer.load_state_dict(target["optim"])
    assert layout(second.model) == saved_layout
    tied = second.model.params.of(second.model.module.head.weight)  # the head's weight is the embedding's
    assert [(type(owner).__name__, leaf) for owner, leaf in tied.slots] == [
        ("Embedding", "weight"),
        ("Linear", "weight"),
    ]
    assert not any(r.swapped_for_a_copy for r in second.model.params)
    train_step(second, 1)
    got_weights, got_state = full_weights(second.model), optimizer_locals(second.optimizer)
    return {
        "empty": [name for name, _, numel in saved_layout if numel == 0],
        "weights": all(torch.equal(got_weights[k], v) for k, v in want_weights.items()),
        "state": len(got_state) == len(want_state)
        and all(
            g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
            for g, w in zip(got_state, want_state, strict=True)
        ),
    }


@pytest.mark.parametrize("strategy", [1, 3])
def test_records_survive_a_process_group_reinit_through_a_checkpoint_with_empty_ranks(
    strategy: int, tmp_path: Path
) -> None:
    results = run_distributed(records_across_a_group_reinit, 2, args=(strategy, str(tmp_path)))
    assert any(result["empty"] for result in results), "the layout must leave some rank without some param"
    for rank, result in enumerate(results):
        assert result["weights"], rank
        assert result["state"], rank
