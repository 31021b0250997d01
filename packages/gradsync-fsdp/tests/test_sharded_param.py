"""The per-param record (:mod:`gradsync.fsdp.sharded_param`): one record per param of the wrapped module,
in its order, reached from either of its tensors; each holds the tensors the wrapper trains with, and a
second wrapper in the same world builds records of its own without touching the first's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.fsdp import fully_shard_model
from gradsync.groups.testing import run_distributed


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
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_records_are_one_per_param_and_a_second_wrapper_leaves_the_first_alone(strategy: str) -> None:
    for first, second in run_distributed(records_across_two_wrappers, 2, args=(strategy,)):
        assert first == second  # the same weights and batch: the two wrappers' models are one
