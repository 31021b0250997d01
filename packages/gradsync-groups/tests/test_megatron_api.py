"""gradsync.groups against Megatron-Core's public API: a Megatron user swapping imports finds the same names,
parameter order and defaults, every deviation is listed here with its reason, and the options gradsync
does not implement are refused by name before any process group exists."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist

from gradsync.groups import (
    ModelParallelConfig,
    default_embedding_ranks,
    default_position_embedding_ranks,
    destroy_process_groups,
    generate_masked_orthogonal_rank_groups,
    initialize_model_parallel,
)
from gradsync.groups.testing import run_distributed
from gradsync.groups.testing.api_table import REQUIRED, signature_mismatches

# Transcribed by hand from NVIDIA/Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553.
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


class Api(NamedTuple):
    """One Megatron callable: its parameters in order with their defaults, and where gradsync deviates."""

    gradsync: Callable[..., Any]
    megatron: str
    params: tuple[tuple[str, Any], ...]
    keyword_only_from: str | None = None
    """Megatron takes every parameter positionally; gradsync from this one on only by keyword."""
    extras: tuple[str, ...] = ()
    """gradsync-only parameters, keyword-only, after Megatron's."""
    deviations: tuple[str, ...] = ()
    """Why, for each deviation above and for those in behaviour."""


API = [
    Api(
        initialize_model_parallel,
        "megatron/core/parallel_state.py: initialize_model_parallel",
        (
            ("tensor_model_parallel_size", 1),
            ("pipeline_model_parallel_size", 1),
            ("virtual_pipeline_model_parallel_size", None),
            ("pipeline_model_parallel_comm_backend", None),
            ("use_sharp", False),
            ("context_parallel_size", 1),
            ("hierarchical_context_parallel_sizes", None),
            ("hybrid_context_parallel", False),
            ("expert_model_parallel_size", 1),
            ("gtp_remat_size", 1),
            ("expert_gtp_remat_size", 1),
            ("num_distributed_optimizer_instances", 1),
            ("expert_tensor_parallel_size", None),
            ("nccl_communicator_config_path", None),
            ("distributed_timeout_minutes", 30),
            ("order", "tp-cp-ep-dp-pp"),
            ("get_embedding_ranks", None),
            ("get_position_embedding_ranks", None),
            ("create_gloo_process_groups", True),
            ("high_priority_stream_groups", None),
            ("sharp_enabled_group", None),
            ("rank_offset", 0),
            ("local_world_size", None),
        ),
        keyword_only_from="pipeline_model_parallel_comm_backend",
        extras=("create_all_gather_groups",),
        deviations=(
            "Keyword-only after the first three: no call in Megatron at the commit passes more than three "
            "positionally, and 23 positional slots invite silent mix-ups.",
            "Returns the ProcessGroupCollection instead of setting module globals: gradsync keeps no global "
            "state.",
            "create_all_gather_groups=True builds dp_cp_ag/expt_dp_ag, which Megatron builds with its "
            "separate create_all_gather_groups() reading those globals.",
            "Default only, anything else refused (see REFUSED): SHARP, hybrid CP, GTP, NCCL communicator "
            "configs, high-priority streams, rank offsets and the UCC pipeline backend are not implemented.",
            "create_gloo_process_groups is accepted either way, but no gloo twin groups are ever created: "
            "nothing in gradsync reads them.",
        ),
    ),
    Api(
        default_embedding_ranks,
        "megatron/core/parallel_state.py: default_embedding_ranks",
        (("pp_ranks", REQUIRED),),
    ),
    Api(
        default_position_embedding_ranks,
        "megatron/core/parallel_state.py: default_position_embedding_ranks",
        (("pp_ranks", REQUIRED),),
    ),
    Api(
        generate_masked_orthogonal_rank_groups,
        "megatron/core/parallel_state.py: generate_masked_orthogonal_rank_groups",
        (("world_size", REQUIRED), ("parallel_size", REQUIRED), ("mask", REQUIRED)),
    ),
]

# gradsync's ModelParallelConfig field -> (Megatron class declaring it, Megatron's default).
MEGATRON_CONFIG_DEFAULTS: dict[str, tuple[str, Any]] = {
    "tensor_model_parallel_size": ("ModelParallelConfig", 1),
    "pipeline_model_parallel_size": ("ModelParallelConfig", 1),
    "context_parallel_size": ("ModelParallelConfig", 1),
    "expert_model_parallel_size": ("ModelParallelConfig", 1),
    "sequence_parallel": ("ModelParallelConfig", False),
    "calculate_per_token_loss": ("TransformerConfig", False),
    "qk_layernorm": ("TransformerConfig", False),
    "moe_router_enable_expert_bias": ("TransformerConfig", False),
    "moe_router_bias_update_rate": ("TransformerConfig", 1e-3),
    "moe_router_load_balancing_type": ("TransformerConfig", "aux_loss"),
    "mtp_num_layers": ("TransformerConfig", None),
    "barrier_with_L1_time": ("ModelParallelConfig", True),
    "timers": ("ModelParallelConfig", None),
    "pipeline_dtype": ("ModelParallelConfig", None),
}
CONFIG_DEVIATIONS = (
    "A subset of Megatron's ModelParallelConfig and TransformerConfig: the fields gradsync reads, plus "
    "pipeline_dtype, in another order, so construct it by keyword.",
    "pipeline_dtype is not required with pipeline parallelism (Megatron's __post_init__ requires it): "
    "gradsync does no pipeline p2p communication.",
)

# Megatron arguments whose values other than the default gradsync refuses: (name, a value, exception).
REFUSED: list[tuple[str, Any, type[Exception]]] = [
    ("pipeline_model_parallel_comm_backend", "ucc", NotImplementedError),
    ("pipeline_model_parallel_comm_backend", "mpi", ValueError),
    ("use_sharp", True, NotImplementedError),
    ("sharp_enabled_group", "dp", NotImplementedError),
    ("hybrid_context_parallel", True, NotImplementedError),
    ("gtp_remat_size", 2, NotImplementedError),
    ("expert_gtp_remat_size", 2, NotImplementedError),
    ("nccl_communicator_config_path", "nccl_comm.yaml", NotImplementedError),
    ("high_priority_stream_groups", ["dp_cp"], NotImplementedError),
    ("rank_offset", 4, NotImplementedError),
    ("local_world_size", 4, NotImplementedError),
]


@pytest.mark.parametrize("api", API, ids=[a.gradsync.__name__ for a in API])
def test_megatron_parameters_in_order_with_megatron_defaults(api: Api) -> None:
    assert signature_mismatches(api.gradsync, api.params, api.extras, api.keyword_only_from) == []
    if api.keyword_only_from or api.extras:
        assert api.deviations, f"{api.megatron}: list the reason for each deviation"


def test_model_parallel_config_defaults_are_megatron_s() -> None:
    assert CONFIG_DEVIATIONS
    defaults = {f.name: f.default for f in fields(ModelParallelConfig)}
    assert set(defaults) == set(MEGATRON_CONFIG_DEFAULTS), "every field is checked against Megatron"
    for name, (megatron_class, default) in MEGATRON_CONFIG_DEFAULTS.items():
        assert defaults[name] == default, f"{megatron_class}.{name}"


def test_pipeline_dtype_is_carried_for_megatron_code() -> None:
    assert ModelParallelConfig(pipeline_dtype=torch.bfloat16).pipeline_dtype is torch.bfloat16


@pytest.mark.parametrize(("name", "value", "error"), REFUSED, ids=[f"{n}={v}" for n, v, _ in REFUSED])
def test_unsupported_values_are_refused_by_name_before_anything_else(
    name: str, value: Any, error: type[Exception]
) -> None:
    assert not dist.is_initialized()  # the refusal comes before even that check
    with pytest.raises(error, match=rf"\b{name}=" + re.escape(repr(value))):
        initialize_model_parallel(**{name: value})


def refusals_create_no_group() -> None:
    with patch("torch.distributed.new_group") as new_group:
        for name, value, error in REFUSED:
            with pytest.raises(error, match=name):
                initialize_model_parallel(**{name: value})
    new_group.assert_not_called()


def test_refusals_create_no_group_on_an_initialised_world() -> None:
    run_distributed(refusals_create_no_group, 1)


def harmless_values_build_the_default_groups() -> None:
    reference = initialize_model_parallel()
    pgs = initialize_model_parallel(create_gloo_process_groups=False, high_priority_stream_groups=[])
    assert repr(pgs) == repr(reference)
    destroy_process_groups(pgs)
    destroy_process_groups(reference)


def test_harmless_values_are_accepted() -> None:
    run_distributed(harmless_values_build_the_default_groups, 1)


def pipeline_backend_reaches_only_the_pp_groups() -> None:
    real_new_group = dist.new_group

    def on_the_default_backend(*args: Any, **kwargs: Any) -> Any:
        return real_new_group(*args, **{**kwargs, "backend": None})  # no NCCL on a CPU-only machine

    with patch("torch.distributed.new_group", side_effect=on_the_default_backend) as new_group:
        pgs = initialize_model_parallel(pipeline_model_parallel_comm_backend="nccl")
    backends = {c.kwargs["group_desc"]: c.kwargs["backend"] for c in new_group.call_args_list}
    assert backends.pop("pp") == "nccl"
    assert set(backends.values()) == {None}
    destroy_process_groups(pgs)


def test_pipeline_backend_is_passed_to_the_pp_groups_only() -> None:
    run_distributed(pipeline_backend_reaches_only_the_pp_groups, 1)


def nccl_pipeline_beside_gloo() -> list[str]:
    pgs = initialize_model_parallel(pipeline_model_parallel_comm_backend="nccl")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t, group=pgs.pp)
    backends = [str(dist.get_backend(pgs.pp)), str(dist.get_backend(pgs.dp))]
    destroy_process_groups(pgs)
    return backends


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an NCCL pipeline group needs a CUDA device")
def test_nccl_pipeline_groups_on_a_gloo_world() -> None:
    assert run_distributed(nccl_pipeline_beside_gloo, 1, backend="gloo", device="cuda") == [["nccl", "gloo"]]
