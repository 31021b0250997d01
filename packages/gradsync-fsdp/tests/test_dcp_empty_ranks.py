"""DCP round trips of Adam's state where some rank owns no element of some param (small params lie whole in
one rank's shard): after a save and a load into a freshly wrapped model, every rank holds the same state
entries (no param missing, empty ones included) with the same values, through the reference's own
``model.state_dict()`` / ``optimizer.state_dict()`` and through torch's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import Block, TinyTransformer, local_microbatches
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from gradsync.fsdp import fully_shard
from gradsync.groups.testing import run_distributed

Snapshot = dict[str, Any]


def adam_model(seed: int, strategy: str) -> tuple[Any, torch.optim.Optimizer]:
    module = TinyTransformer(seed)
    return fully_shard(
        module,
        torch.optim.Adam(module.parameters(), lr=0.01),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )


def local(value: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def snapshot(state: dict[str, Any]) -> Snapshot:
    return {str(key): {k: local(v) for k, v in entry.items()} for key, entry in state["state"].items()}


def state_of(optimizer: torch.optim.Optimizer, model: Any, how: str) -> dict[str, Any]:
    if how == "reference":
        return optimizer.state_dict()
    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False)
    )


def round_trip(strategy: str, how: str, directory: str) -> tuple[Snapshot, Snapshot, int]:
    model, optimizer = adam_model(0, strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    model(local_microbatches(0, rank, world, 1)[0]).backward()
    optimizer.step()
    optimizer.zero_grad()
    empty = sum(p.to_local().numel() == 0 for p in model.parameters() if isinstance(p, DTensor))
    saved = state_of(optimizer, model, how)
    before = snapshot(saved)
    dcp.save({"model": model.state_dict(), "optim": saved}, checkpoint_id=directory)

    model, optimizer = adam_model(1, strategy)  # other weights and fresh state, to be overwritten
    target = {"model": model.state_dict(), "optim": state_of(optimizer, model, how)}
    dcp.load(target, checkpoint_id=directory)
    model.load_state_dict(target["model"])
    if how == "reference":
        optimizer.load_state_dict(target["optim"])
    else:
        set_optimizer_state_dict(
            model, optimizer, target["optim"], options=StateDictOptions(flatten_optimizer_state_dict=False)
        )
    return before, snapshot(state_of(optimizer, model, how)), empty


@pytest.mark.parametrize("how", ["reference", "torch-state-dict"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_optimizer_state_round_trips_on_ranks_that_own_nothing(
    strategy: str, how: str, tmp_path: Path
) -> None:
    results = run_distributed(round_trip, 4, args=(strategy, how, str(tmp_path / "ckpt")))
    assert any(empty for _, _, empty in results), "the layout must leave some rank without some param"
    for rank, (before, after, _) in enumerate(results):
        assert set(after) == set(before), f"rank {rank}: state entries {sorted(set(before) ^ set(after))}"
        for key, entry in before.items():
            assert set(after[key]) == set(entry), (rank, key)
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(after[key][name], value), (rank, key, name)
                else:
                    assert after[key][name] == value, (rank, key, name)
