"""Hook behaviour: each unit's weights are gathered once per backward, also when its forward is
recomputed (activation checkpointing); TrainingState moves FORWARD -> PRE_BACKWARD -> POST_BACKWARD ->
IDLE; and delaying every collective's launch and completion changes no result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    LAYERS,
    STRATEGIES,
    Block,
    TinyTransformer,
    Trainer,
    full_weights,
    local_microbatches,
    shard_index,
    wrap,
)

from gradsync.buffers import collectives
from gradsync.fsdp import MegatronFSDP, TrainingState
from gradsync.groups.testing import delayed_collectives, run_distributed

COLLECTIVE_ALIASES = ((collectives, "dist_reduce_scatter_func"), (collectives, "dist_all_gather_func"))


def bucket_gathers(calls: dict[str, int]) -> float:
    """Whole-bucket gathers among the intercepted calls (gloo gathers by one broadcast per shard)."""
    world = dist.get_world_size()
    return (
        calls.get("broadcast", 0) / world
        + calls.get("all_gather_into_tensor", 0)
        + calls.get("all_gather_single", 0)
    )


def gathers_in_backward(checkpoint: str | None) -> float:
    model = wrap("optim_grads_params", checkpoint=checkpoint)
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    loss = model(batch)
    with delayed_collectives(seed=0, max_delay_s=0.0, extra_targets=COLLECTIVE_ALIASES) as probe:
        loss.backward()
    return bucket_gathers(probe.calls)


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_each_unit_is_gathered_once_per_backward(checkpoint: str | None) -> None:
    """Non-unit weights stay gathered from forward to the end of backward; each Block unit is released
    after its forward and gathered again exactly once for its backward and its recomputation; the last
    unit is kept for the backward that starts with it, unless its forward ran without grad (reentrant
    checkpointing)."""
    for gathers in run_distributed(gathers_in_backward, 2, args=(checkpoint,)):
        assert gathers == (LAYERS if checkpoint == "reentrant" else LAYERS - 1)


def train_checkpointed(steps: int, checkpoint: str) -> dict[str, torch.Tensor]:
    trainer = Trainer.build("optim_grads_params", checkpoint=checkpoint)
    for step in range(steps):
        trainer.step(step, 1)
    return full_weights(trainer.model)


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_checkpointed_training_matches_plain_training(checkpoint: str) -> None:
    checkpointed = run_distributed(train_checkpointed, 2, args=(3, checkpoint))
    reference = run_distributed(train_plain, 2, args=(3,))
    for got, want in zip(checkpointed, reference, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name


def train_plain(steps: int) -> dict[str, torch.Tensor]:
    trainer = Trainer.build("optim_grads_params")
    for step in range(steps):
        trainer.step(step, 1)
    return full_weights(trainer.model)


def training_states() -> list[TrainingState]:
    model = wrap("optim_grads_params")
    unit = model.module.blocks[0]
    seen: list[TrainingState] = []

    def record(*_: object) -> None:
        seen.append(unit._training_state)

    unit.register_forward_hook(lambda *_: record())  # runs after MegatronFSDP's own hooks
    unit.up.register_full_backward_hook(lambda *_: record())  # inside the unit's backward

    # the embedding's output grad exists once the unit's backward reached its inputs
    def watch_input_grad(module: object, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: record())

    model.module.embedding.register_forward_hook(watch_input_grad)
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    record()
    return seen


def test_training_state_order() -> None:
    for seen in run_distributed(training_states, 2):
        assert seen == [
            TrainingState.FORWARD,
            TrainingState.PRE_BACKWARD,
            TrainingState.POST_BACKWARD,
            TrainingState.IDLE,
        ]


def train_probed(strategy: str, delayed: bool) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(strategy)
    if not delayed:
        for step in range(3):
            trainer.step(step, 2)
        return full_weights(trainer.model)
    with delayed_collectives(seed=dist.get_rank() + 7, extra_targets=COLLECTIVE_ALIASES) as probe:
        for step in range(3):
            trainer.step(step, 2)
        weights = full_weights(trainer.model)
    assert probe.deferred > 0, "no asynchronous collective went through the race probe"
    assert probe.completed == probe.deferred
    return weights


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_late_launches_and_late_completions_change_nothing(strategy: str) -> None:
    plain = run_distributed(train_probed, 2, args=(strategy, False))
    probed = run_distributed(train_probed, 2, args=(strategy, True))
    for got, want in zip(probed, plain, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name


def units_by_path() -> list[int]:
    by_class = wrap("optim_grads_params")
    by_path = MegatronFSDP(
        TinyTransformer(), shard_index(), by_class.ddp_config, fsdp_unit_modules=["fsdp_testkit.Block"]
    )
    assert [type(u) for u in by_path.units] == [Block] * LAYERS
    return [b.spec.unit_id if b.spec.unit_id is not None else -1 for b in by_path.buckets]


def test_units_named_by_dotted_path() -> None:
    for unit_ids in run_distributed(units_by_path, 2):
        assert unit_ids == [-1, 0, 1]  # the non-unit params first (embedding, first used), then each Block
