"""State without collectives: state_dict() gives the optimizer's DTensor shards, load_state_dict() takes
them back (same layout) or takes whole tensors (each rank keeps its rows); broadcast_params() makes every
rank start from DP rank 0's weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import STRATEGIES, TinyTransformer, Trainer, full_weights, named_weights, wrap
from torch.distributed.tensor import DTensor

from gradsync.groups.testing import run_distributed


def round_trips(strategy: str) -> None:
    trained = Trainer.build(strategy)
    for step in range(2):
        trained.step(step, 1)
    saved = {
        k: v.to_local().clone() if isinstance(v, DTensor) else v
        for k, v in trained.model.state_dict().items()
    }
    shards = trained.model.state_dict()
    assert all(isinstance(v, DTensor) for v in shards.values())
    assert shards["module.head.weight"] is not None  # the tied alias is saved too
    want = full_weights(trained.model)

    fresh = wrap(strategy, seed=1)  # other weights
    fresh.load_state_dict(shards)
    assert all(torch.equal(full_weights(fresh)[k], want[k]) for k in want)

    plain = TinyTransformer(seed=2)
    whole = wrap(strategy, seed=1)
    whole.load_state_dict({f"module.{k}": v for k, v in plain.state_dict().items()})
    got, expected = full_weights(whole), named_weights(plain)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(torch.equal(trained.model.state_dict()[k].to_local(), v) for k, v in saved.items())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_round_trips(strategy: str) -> None:
    run_distributed(round_trips, 2, args=(strategy,))


def broadcast(strategy: str) -> dict[str, torch.Tensor]:
    model = wrap(strategy, seed=dist.get_rank())  # every rank starts elsewhere
    model.broadcast_params()
    return full_weights(model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_broadcast_params_gives_every_rank_rank_0s_weights(strategy: str) -> None:
    """Under ZeRO-3 no rank keeps its whole initial model (each keeps its shard of it), so the ranks agree
    on the gathered model; the others replicate rank 0's."""
    ranks = run_distributed(broadcast, 2, args=(strategy,))
    want = ranks[0] if strategy == "optim_grads_params" else named_weights(TinyTransformer(seed=0))
    rank_1_init = named_weights(TinyTransformer(seed=1))
    for weights in ranks:
        assert all(torch.equal(weights[k], want[k]) for k in want)
        assert not all(torch.equal(weights[k], rank_1_init[k]) for k in want)
