"""Every validation error of the layout, raised before any group exists, with a message naming sizes."""

from __future__ import annotations

import pytest

from gradsync.groups import ParallelLayoutError, RankGenerator, compute_rank_layout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tensor_model_parallel_size": 16},
            r"world_size \(8\) is not divisible by 16 \(tensor_model_parallel_size 16 x "
            r"pipeline_model_parallel_size 1 x context_parallel_size 1\)",
        ),
        ({"pipeline_model_parallel_size": 16}, r"world_size \(8\) is not divisible by 16"),
        (
            {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 8},
            r"world_size \(8\) is not divisible by 64",
        ),
        (
            {"tensor_model_parallel_size": 3},
            r"world_size \(8\) is not divisible by 3 \(tensor_model_parallel_size 3",
        ),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            r"pipeline-model-parallel size should be greater than 1 with interleaved schedule "
            r"\(virtual_pipeline_model_parallel_size 2, pipeline_model_parallel_size 1\)",
        ),
        (
            {"expert_model_parallel_size": 3},
            r"world_size \(8\) is not divisible by expert_tensor_model_pipeline_parallel size \(3\) "
            r"\(expert_tensor_parallel_size 1 x expert_model_parallel_size 3",
        ),
        (
            {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8},
            r"expert_tensor_model_pipeline_parallel size \(16\)",
        ),
        (
            {"num_distributed_optimizer_instances": 3},
            r"data_parallel_size x context_parallel_size \(8 x 1\) is not divisible by "
            r"num_distributed_optimizer_instances \(3\)",
        ),
        (
            {"expert_model_parallel_size": 8, "num_distributed_optimizer_instances": 2},
            r"expert data parallel size \(1\) is not divisible by num_distributed_optimizer_instances "
            r"\(2\)",
        ),
        (
            {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 3]},
            r"hierarchical_context_parallel_sizes \[2, 3\] must multiply to context_parallel_size \(4\)",
        ),
        (
            {
                "pipeline_model_parallel_size": 2,
                "expert_model_parallel_size": 2,
                "order": "tp-pp-ep-dp",
            },
            r"When not using pp-last rank ordering, the data parallel size of the attention and moe "
            r"layers must be the same \(order 'tp-pp-ep-dp': data parallel 4, expert data parallel 2\)",
        ),
        (
            {"pipeline_model_parallel_size": 2, "order": "tp-dp"},
            r"The size of \(pp\) is \(2\), but you haven't specified the order \(tp-dp\)\.",
        ),
        ({"order": "tp-xx-dp"}, r"Unknown token 'xx' in order 'tp-xx-dp'"),
        ({"order": "tp-dp-tp"}, r"Order 'tp-dp-tp' repeats tp"),
        (
            {"tensor_model_parallel_size": 0},
            r"tensor_model_parallel_size must be a positive integer",
        ),
        ({"expert_tensor_parallel_size": -1}, r"expert_tensor_parallel_size must be a positive"),
    ],
)
def test_invalid_sizes_raise_before_any_group(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ParallelLayoutError, match=message):
        compute_rank_layout(8, **kwargs)  # type: ignore[arg-type]


def test_layout_error_is_both_runtime_and_value_error() -> None:
    # Megatron raises RuntimeError for these; ValueError is what bad input raises in gradsync.
    with pytest.raises(RuntimeError):
        compute_rank_layout(8, tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="world_size"):
        compute_rank_layout(8, tensor_model_parallel_size=3)


def test_rank_generator_rejects_ep_and_cp_together() -> None:
    with pytest.raises(ParallelLayoutError, match=r"Both EP \(2\) and CP \(2\) > 1"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")


def test_rank_generator_rejects_unknown_axis_in_query() -> None:
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    with pytest.raises(ParallelLayoutError, match="Unknown axis 'zz'"):
        gen.get_ranks("tp-zz")


def test_order_token_is_not_matched_as_substring() -> None:
    # "tp" must not satisfy "pp" or any other token just by appearing inside a name.
    with pytest.raises(ParallelLayoutError, match=r"The size of \(dp\) is \(2\)"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-pp")
