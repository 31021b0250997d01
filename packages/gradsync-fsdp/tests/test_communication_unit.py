"""suggested_communication_unit_size: half of it is how far all-gathers prefetch (in whole units), all of
it how many elements of grad reductions may be in flight. Checked by counting the gathers started before
the first unit runs and the reductions in flight during backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import local_microbatches, wrap

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp.bucket import BucketStatus
from gradsync.fsdp.schedule import CAP, communication_unit_size
from gradsync.groups.testing import run_distributed

LAYERS = 4


@pytest.mark.parametrize(
    ("fields", "shards_params", "expected"),
    [
        ({"suggested_communication_unit_size": 1234}, True, 1234),
        ({"suggested_communication_unit_size": 5 * CAP}, True, CAP),  # capped, not floored
        ({}, True, 300),  # twice the average unit, (100 + 200) / 2
        ({"bucket_size": 777}, False, 777),
        ({}, False, CAP),
    ],
)
def test_the_unit_size_is_resolved_as_documented(
    fields: dict[str, Any], shards_params: bool, expected: int
) -> None:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, **fields)
    assert communication_unit_size(config, shards_params, [100, 200]) == expected


def test_a_negative_unit_size_is_refused() -> None:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, suggested_communication_unit_size=-1)
    with pytest.raises(ValueError, match="suggested_communication_unit_size=-1 must be >= 0"):
        communication_unit_size(config, True, [10])


def unit_elements() -> int:
    model = wrap("optim_grads_params", layers=LAYERS)
    return max(b.layout.size for b in model.buckets if b.spec.unit_id is not None)


def units_gathered_when_the_first_runs(units_ahead: int) -> int:
    unit = unit_elements()
    model = wrap(
        "optim_grads_params", layers=LAYERS, suggested_communication_unit_size=2 * units_ahead * unit
    )
    seen: list[int] = []

    def count(*_: object) -> None:
        gathered = [
            any(b.status is not BucketStatus.EMPTY for b in bs) for bs in model._hooks.buckets.of_unit
        ]
        seen.append(sum(gathered))

    model.units[0].register_forward_pre_hook(count)
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    return seen[0]


@pytest.mark.parametrize("units_ahead", [0, 1, 2, 3])
def test_prefetch_depth_follows_the_unit_size(units_ahead: int) -> None:
    for gathered in run_distributed(units_gathered_when_the_first_runs, 2, args=(units_ahead,)):
        assert gathered == 1 + units_ahead


def most_reductions_in_flight(units: int | None) -> int:
    size = None if units is None else units * unit_elements()
    # a bucket size of one unit keeps the units' reductions apart (coalesce.py groups them up to it)
    bucket_size = None if units is None else unit_elements()
    model = wrap(
        "optim_grads", layers=LAYERS, suggested_communication_unit_size=size, bucket_size=bucket_size
    )
    most = 0
    reductions = model._hooks.reductions
    launch = reductions.launch

    def counted(bucket: Any) -> None:
        nonlocal most
        launch(bucket)
        most = max(most, len(reductions.in_flight))

    reductions.launch = counted  # type: ignore[method-assign]
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    with torch.no_grad():
        model.finish_grad_sync()
    return most


@pytest.mark.parametrize(("units", "expected"), [(1, 1), (2, 2), (None, 1)])
def test_reductions_in_flight_are_bounded_by_the_unit_size(units: int | None, expected: int) -> None:
    """ZeRO-2 without a setting: bucket_size is None, so 1e9 elements: every bucket (4 units and the
    non-unit bucket) reduced at once, by one coalesced collective."""
    for most in run_distributed(most_reductions_in_flight, 2, args=(units,)):
        assert most == expected


def zero1_units_gathered_when_the_first_runs(units_ahead: int | None) -> int:
    """ZeRO-1 after an optimizer step (every replica stale), with ``bucket_size`` one unit and the unit
    size set to ``units_ahead`` units' worth of prefetch, or unset."""
    unit = unit_elements()
    size = None if units_ahead is None else 2 * units_ahead * unit
    model = wrap("optim", layers=LAYERS, bucket_size=unit, suggested_communication_unit_size=size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model(local_microbatches(0, rank, world, 1)[0]).backward()
    model.finish_grad_sync()
    optimizer.step()
    model.zero_grad_buffer()
    seen: list[int] = []

    def count(*_: object) -> None:
        seen.append(
            sum(any(b.status is not BucketStatus.EMPTY for b in bs) for bs in model._hooks.buckets.of_unit)
        )

    model.units[0].register_forward_pre_hook(count)
    model(local_microbatches(1, rank, world, 1)[0]).backward()
    return seen[0]


@pytest.mark.parametrize(("units_ahead", "expected"), [(None, LAYERS), (1, 2), (0, 1)])
def test_zero1_prefetches_every_unit_unless_told_otherwise(units_ahead: int | None, expected: int) -> None:
    """ZeRO-1/2 keep every weight whole, so prefetching costs no memory: with the unit size unset every
    unit's gather starts at the model's forward (not half of ``bucket_size``'s worth)."""
    for gathered in run_distributed(zero1_units_gathered_when_the_first_runs, 2, args=(units_ahead,)):
        assert gathered == expected
