"""The builder on 1, 2, 4 and 8 real ranks: membership equals the pure layout, and an all_reduce over
each group gives the sum over exactly its ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync.groups import (
    ParallelLayoutError,
    ProcessGroupCollection,
    compute_rank_layout,
    destroy_process_groups,
    initialize_model_parallel,
)
from gradsync.groups.testing import run_distributed, test_device

CASES: list[tuple[int, dict[str, Any]]] = [
    (1, {}),
    (2, {}),
    (2, {"tensor_model_parallel_size": 2}),
    (2, {"pipeline_model_parallel_size": 2}),
    (4, {"tensor_model_parallel_size": 2}),
    (4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    (4, {"context_parallel_size": 2, "num_distributed_optimizer_instances": 2}),
    (4, {"num_distributed_optimizer_instances": 2, "create_all_gather_groups": True}),
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (8, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    (
        8,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
        },
    ),
    (8, {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 2}),
    (8, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}),
    (8, {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2, "order": "tp-pp-dp"}),
]


def sum_over(group: dist.ProcessGroup) -> float:
    t = torch.tensor([float(dist.get_rank() + 1)], device=test_device())
    dist.all_reduce(t, group=group)
    return t.item()


def build_and_check(kwargs: dict[str, Any]) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    pgs = initialize_model_parallel(**kwargs)
    layout_kwargs = {k: v for k, v in kwargs.items() if k != "create_all_gather_groups"}
    layout = compute_rank_layout(world, **layout_kwargs)
    for kind in ProcessGroupCollection.field_names():
        group = getattr(pgs, kind)
        if kind == "hcp":
            expected_levels = [next(g for g in level if rank in g) for level in layout.hcp]
            got = [dist.get_process_group_ranks(g) for g in group or []]
            assert got == [list(g) for g in expected_levels], (kind, got)
            continue
        source = {
            "dp_cp_gtp_remat": "dp_cp",
            "expt_dp_gtp_remat": "expt_dp",
            "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
            "dp_cp_ag": "dp_cp" if kwargs.get("create_all_gather_groups") else None,
            "expt_dp_ag": "expt_dp" if kwargs.get("create_all_gather_groups") else None,
        }.get(kind, kind)
        expected = layout.group_of(source, rank) if source in layout.groups else None
        if expected is None:
            assert group is None, f"rank {rank}: {kind} should be None, got {group}"
            continue
        assert dist.get_process_group_ranks(group) == list(expected), kind
        assert sum_over(group) == sum(r + 1 for r in expected), kind
    # Aliases the reference keeps: one optimizer instance means intra groups are the very same objects.
    if layout.num_distributed_optimizer_instances == 1:
        assert pgs.intra_dp_cp is pgs.dp_cp
        assert pgs.intra_expt_dp is pgs.expt_dp
    else:
        assert pgs.intra_dp_cp is not pgs.dp_cp
    assert pgs.dp_cp_gtp_remat is pgs.dp_cp
    if kwargs.get("create_all_gather_groups"):
        assert pgs.dp_cp_ag is not pgs.dp_cp
    text = repr(pgs)
    destroy_process_groups(pgs)
    return text


@pytest.mark.parametrize(
    ("world_size", "kwargs"),
    CASES,
    ids=[f"w{w}-{'-'.join(map(str, k.values())) or 'dp'}" for w, k in CASES],
)
def test_builder_matches_layout(world_size: int, kwargs: dict[str, Any]) -> None:
    reprs = run_distributed(build_and_check, world_size, args=(kwargs,))
    assert all(r.startswith("ProcessGroupCollection(") for r in reprs)


def bad_sizes_fail_alike_then_world_still_works() -> float:
    with pytest.raises(ParallelLayoutError, match=r"world_size \(4\) is not divisible by 3"):
        initialize_model_parallel(tensor_model_parallel_size=3)
    # Nothing was created and no rank is stuck: the next collective still lines up.
    return sum_over(dist.group.WORLD)  # type: ignore[arg-type]


def test_invalid_sizes_raise_on_every_rank_before_any_collective() -> None:
    assert run_distributed(bad_sizes_fail_alike_then_world_still_works, 4) == [10.0] * 4


def test_builder_requires_an_initialized_default_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        initialize_model_parallel()
