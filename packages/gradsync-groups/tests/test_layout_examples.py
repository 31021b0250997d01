"""Worked layouts (TP, PP, CP, EP and several optimizer instances over 8 to 16 ranks), group by group,
against rank lists written out by hand."""

from __future__ import annotations

import pytest

from gradsync.groups import (
    RankGenerator,
    compute_rank_layout,
    generate_masked_orthogonal_rank_groups,
)
from gradsync.groups.layout import RankLayout, hierarchical_rank_groups


def groups(layout: RankLayout, kind: str) -> list[list[int]]:
    return [list(g) for g in layout.groups[kind]]


def singletons(n: int) -> list[list[int]]:
    return [[r] for r in range(n)]


def test_a_world8_tp2_pp2() -> None:
    layout = compute_rank_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (layout.data_parallel_size, layout.expert_data_parallel_size) == (2, 2)
    assert layout.expert_tensor_parallel_size == 2
    assert groups(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for kind in ("dp", "dp_cp", "intra_dp_cp"):
        assert groups(layout, kind) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "cp") == singletons(8)
    assert groups(layout, "mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups(layout, "tp_cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "tp_dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "embd") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(layout, "pos_embd") == [[0], [1], [2], [3]]
    assert layout.group_of("pos_embd", 5) is None
    assert groups(layout, "ep") == singletons(8)
    assert groups(layout, "expt_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "tp_ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "tp_ep_pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups(layout, "expt_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "intra_dist_opt") == [list(range(8))]
    assert "inter_dist_opt" not in layout.groups


def test_b_order_tp_pp_dp() -> None:
    layout = compute_rank_layout(
        8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp"
    )
    assert groups(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(layout, "mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "embd") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "pos_embd") == [[0], [1], [4], [5]]
    tp_dp = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp").get_ranks("tp-dp")
    assert tp_dp == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_c_tp2_ep2() -> None:
    layout = compute_rank_layout(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert (layout.data_parallel_size, layout.expert_data_parallel_size) == (4, 2)
    assert groups(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(layout, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(layout, "tp_dp_cp") == [list(range(8))]
    assert groups(layout, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "expt_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "tp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "tp_ep_pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "expt_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_c_ep4_with_etp1() -> None:
    layout = compute_rank_layout(
        8, tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1
    )
    assert groups(layout, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "expt_tp") == singletons(8)
    assert groups(layout, "expt_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_d_tp2_pp2_ep2_etp1() -> None:
    layout = compute_rank_layout(
        8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    assert groups(layout, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "expt_tp") == singletons(8)
    assert groups(layout, "tp_ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "tp_ep_pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups(layout, "expt_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_e_cp2_pp2_ep2() -> None:
    layout = compute_rank_layout(
        8, context_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2
    )
    assert groups(layout, "cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "expt_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_f_two_optimizer_instances_pure_dp() -> None:
    layout = compute_rank_layout(8, num_distributed_optimizer_instances=2)
    assert groups(layout, "intra_dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "intra_expt_dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(layout, "inter_dist_opt") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(layout, "intra_dist_opt") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_f_two_optimizer_instances_with_tp2() -> None:
    layout = compute_rank_layout(8, tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    assert groups(layout, "intra_dp_cp") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups(layout, "inter_dist_opt") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert groups(layout, "intra_dist_opt") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_f_two_optimizer_instances_with_tp2_ep2() -> None:
    layout = compute_rank_layout(
        8,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        num_distributed_optimizer_instances=2,
    )
    assert sorted(groups(layout, "intra_expt_dp")) == singletons(8)
    assert sorted(groups(layout, "inter_dist_opt")) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_g_world16_tp2_pp4() -> None:
    layout = compute_rank_layout(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert groups(layout, "pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups(layout, "embd") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert groups(layout, "dp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert groups(layout, "mp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_custom_embedding_ranks() -> None:
    layout = compute_rank_layout(
        8,
        pipeline_model_parallel_size=4,
        get_embedding_ranks=lambda pp: [pp[-1], pp[0], pp[1]],
        get_position_embedding_ranks=lambda pp: [pp[0], pp[1]],
    )
    # new_group sorts member ranks, so the layout keeps every group sorted.
    assert groups(layout, "embd") == [[0, 2, 6], [1, 3, 7]]
    assert groups(layout, "pos_embd") == [[0, 2], [1, 3]]


def test_hierarchical_context_parallel_split() -> None:
    assert hierarchical_rank_groups([0, 2, 4, 6], [2, 2]) == [[[0, 2], [4, 6]], [[0, 4], [2, 6]]]
    layout = compute_rank_layout(8, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    assert [list(map(list, level)) for level in layout.hcp] == [
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
    ]


def test_masked_orthogonal_groups_first_unmasked_axis_fastest() -> None:
    # sizes (2, 3, 2): rank = a + 2b + 6c; groups over the middle axis.
    assert generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [False, True, False]) == [
        [0, 2, 4],
        [1, 3, 5],
        [6, 8, 10],
        [7, 9, 11],
    ]


def test_token_order_does_not_matter_in_get_ranks() -> None:
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("dp-cp") == gen.get_ranks("cp-dp")
    assert gen.order == "tp-cp-ep-dp-pp"
    assert RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="TP-DP").order == "tp-dp-pp-ep-cp"


@pytest.mark.parametrize("world", [1, 2, 8])
def test_pure_data_parallel(world: int) -> None:
    layout = compute_rank_layout(world)
    assert groups(layout, "dp") == [list(range(world))]
    assert groups(layout, "tp") == singletons(world)
