"""What a rank holds between steps, counted from tensor sizes (not RSS), per kind: compute weights, grads
and optimizer state (SGD momentum), fp32. Each is the strategy's share of Psi (the model's elements) plus
at most the layout's padding; momentum covers exactly the rows a rank owns, so it sums to Psi over the
ranks; and ZeRO-3's total stays within Psi*(b_p + b_g + b_o)/N plus two units."""

from __future__ import annotations

import pytest
import torch
from fsdp_testkit import STRATEGIES, Trainer
from torch.distributed.tensor import DTensor

from gradsync.groups.testing import run_distributed

WORLD = 4
BYTES = 4


def _elements(*tensors: torch.Tensor | None) -> int:
    """Elements of the storages behind ``tensors`` (0 for released ones), each storage counted once:
    coalesced buckets' grads share one (gradsync.fsdp.coalesce)."""
    storages = {t.untyped_storage().data_ptr(): t for t in tensors if t is not None}
    return sum(t.untyped_storage().nbytes() // t.element_size() for t in storages.values())


def held_after_two_steps(strategy: str) -> dict[str, int]:
    trainer = Trainer.build(strategy)
    for step in range(2):
        trainer.step(step, 1)
    model = trainer.model
    assert all(record.compute.grad is None for record in model.params), "per-param grads left behind"
    assert all(b.main_weight is None for b in model.buckets), "fp32 needs no separate main weights"
    momentum = [
        s["momentum_buffer"] for s in trainer.optimizer.state.values() if s.get("momentum_buffer") is not None
    ]
    return {
        "params": sum(_elements(b.weight) + _elements(b.weight_shard) for b in model.buckets),
        "grads": _elements(*(b.grad for b in model.buckets)),
        "momentum": sum(m._local_tensor.numel() if isinstance(m, DTensor) else m.numel() for m in momentum),
        "psi": sum(record.compute.numel() for record in model.params),
        "padding": sum(b.layout.size - b.spec.numel for b in model.buckets),
        "unit": max(b.layout.size for b in model.buckets if b.spec.unit_id is not None),
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_holds_its_share(strategy: str) -> None:
    ranks = run_distributed(held_after_two_steps, WORLD, args=(strategy,))
    psi, padding = ranks[0]["psi"], ranks[0]["padding"]
    level = STRATEGIES.index(strategy)  # 0 no_shard ... 3 ZeRO-3
    shares = {"momentum": level >= 1, "grads": level >= 2, "params": level >= 3}
    for held in ranks:
        for kind in ("params", "grads"):
            share = psi / WORLD if shares[kind] else psi
            assert share - padding <= held[kind] <= share + padding, (kind, held[kind], share, padding)
        if not shares["momentum"]:
            assert held["momentum"] == psi
    if shares["momentum"]:
        assert sum(held["momentum"] for held in ranks) == psi  # every row owned by exactly one rank
    if strategy == "optim_grads_params":
        for held in ranks:
            total = (held["params"] + held["grads"] + held["momentum"]) * BYTES
            assert total <= psi * 3 * BYTES / WORLD + 2 * held["unit"] * 3 * BYTES
