"""State without collectives: state_dict() gives the optimizer's DTensor shards, load_state_dict() takes
them back (same layout) or takes whole tensors (each rank keeps its rows); broadcast_params() makes every
rank start from DP rank 0's weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import STRATEGIES, TinyTransformer, Trainer, full_weights, named_weights, shard_index, wrap
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
    model = wrap(strategy, seed=dist.get_rank(), init_sync=False)  # every rank starts elsewhere, as the
    model.broadcast_params()  # reference leaves them until this call
    return full_weights(model)


def initial(seed: int) -> dict[str, torch.Tensor]:
    return named_weights(TinyTransformer(seed=seed))


def assert_mix_of(weights: dict[str, torch.Tensor], seeds: tuple[int, int]) -> None:
    """Every element is one of the two seeds' initial values at that place, and each seed gives some: the
    gathered model of a shard group whose two ranks started from these seeds (computed here, apart from
    any broadcast)."""
    a, b = initial(seeds[0]), initial(seeds[1])
    assert all(((weights[k] == a[k]) | (weights[k] == b[k])).all() for k in a)
    assert any((weights[k] == a[k]).any() for k in a)
    assert any(((weights[k] == b[k]) & (a[k] != b[k])).any() for k in a)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_broadcast_params_gives_every_rank_rank_0s_weights(strategy: str) -> None:
    """Without ZeRO-3 every rank gets rank 0's initial model. Under ZeRO-3 no rank keeps its whole initial
    model (each keeps its shard of it), so what rank 0 holds, and every rank gets, is its shard group's
    gathered model: rank 0's rows of seed 0 and rank 1's of seed 1. (On one shard group the gather alone
    makes the ranks agree; the test below, with two replicas, is the one a broadcast that does nothing
    fails.)"""
    ranks = run_distributed(broadcast, 2, args=(strategy,))
    for weights in ranks:
        if strategy == "optim_grads_params":
            assert_mix_of(weights, (0, 1))
            assert all(torch.equal(weights[k], ranks[0][k]) for k in weights)
        else:
            want = initial(0)
            assert all(torch.equal(weights[k], want[k]) for k in want)


def replicas_broadcast() -> dict[str, dict[str, Any]]:
    """Two replicas of a 2-rank shard group (HSDP, outer no_shard), every rank from its own seed (shard
    rank + 10 x replica), broadcast; and, as the oracle, another build in which every replica starts as
    replica 0 does (seed = shard rank) and nothing is broadcast."""
    index = shard_index(outer=2)
    outer = index.get_outer_fsdp_group()
    assert outer is not None
    shard_rank, replica = index.get_fsdp_group().rank(), outer.rank()
    results: dict[str, dict[str, Any]] = {"where": {"shard": shard_rank, "replica": replica}}
    for strategy in STRATEGIES:
        model = wrap(strategy, seed=shard_rank + 10 * replica, outer=2, init_sync=False)
        model.broadcast_params()
        oracle = wrap(strategy, seed=shard_rank, outer=2, init_sync=False)
        results[strategy] = {"got": full_weights(model), "oracle": full_weights(oracle)}
    return results


def test_broadcast_params_reaches_every_replica() -> None:
    """DP rank 0 (shard rank 0 of replica 0) started from seed 0, its shard peer from seed 1, replica 1's
    ranks from seeds 10 and 11. After the broadcast every rank of both replicas holds what rank 0 held:
    seed 0's model without ZeRO-3, the seed-0 / seed-1 gathered model under ZeRO-3 (the oracle build,
    itself checked here against the seeds)."""
    ranks = run_distributed(replicas_broadcast, 4)
    assert ranks[0]["where"] == {"shard": 0, "replica": 0}
    assert sorted((r["where"]["replica"], r["where"]["shard"]) for r in ranks) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    for strategy in STRATEGIES:
        if strategy == "optim_grads_params":
            want = ranks[0][strategy]["oracle"]
            assert_mix_of(want, (0, 1))
        else:
            want = initial(0)
        for rank in ranks:
            got = rank[strategy]["got"]
            assert all(torch.equal(got[k], want[k]) for k in want), strategy


def load_across_layouts(strategy: str) -> tuple[str, bool]:
    """Shards saved by a model whose buckets all kept module order, loaded into one that balanced them."""
    from gradsync.fsdp import bucket_set

    balanced = bucket_set.balance_param_order
    bucket_set.balance_param_order = lambda specs, layout_of: [layout_of(spec) for spec in specs]
    try:
        old = wrap(strategy, seed=1, layers=4)
    finally:
        bucket_set.balance_param_order = balanced
    new = wrap(strategy, seed=2, layers=4)
    before = full_weights(new)
    with pytest.raises(ValueError, match="load_state_dict") as refused:
        new.load_state_dict(old.state_dict())
    after = full_weights(new)
    return str(refused.value), all(torch.equal(after[k], v) for k, v in before.items())


def test_shards_of_another_layout_are_refused() -> None:
    """Every rank refuses by the split, which every rank sees whole (a rank whose own rows match in both
    layouts refuses too), and the refused state dict changes no weight, not even those of the params
    before the first mismatched one."""
    results = run_distributed(load_across_layouts, 2, args=("optim",))
    assert all("laid out differently" in message for message, _ in results), results
    assert all(unchanged for _, unchanged in results)


def raw_params() -> dict[str, Any]:
    model = wrap("optim_grads_params")
    shown = dict(model.module.named_parameters())  # the optimizer's DTensors until a forward
    return {
        "names": list(model.raw_param) == list(shown),
        "compute params, whole shape": all(
            not isinstance(param, DTensor) and param.shape == shown[name].shape
            for name, param in model.raw_param.items()
        ),
        "inverse": all(model.param_to_name[param] == name for name, param in model.raw_param.items()),
    }


def test_raw_param_and_param_to_name_are_megatron_fsdps_maps() -> None:
    """Megatron-FSDP's own tests read ``raw_param[name]`` (the wrapped module's params by name)."""
    for facts in run_distributed(raw_params, 2):
        assert facts == {"names": True, "compute params, whole shape": True, "inverse": True}
