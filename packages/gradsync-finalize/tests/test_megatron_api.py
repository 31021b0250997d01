"""gradsync.finalize against Megatron-Core's megatron.core.distributed.finalize_model_grads: the public
functions a Megatron user imports from there exist in gradsync.finalize with the same parameter names,
order and defaults, and every deviation is listed here with its reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import gradsync.finalize
from gradsync.finalize import finalize_model_grads, get_model_config, reset_model_temporary_tensors
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing.api_table import REQUIRED, signature_mismatches

# Transcribed by hand from NVIDIA/Megatron-LM at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553.
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


class Api(NamedTuple):
    """One Megatron function: its parameters in order with their defaults, and where gradsync deviates."""

    gradsync: Callable[..., Any]
    megatron: str
    params: tuple[tuple[str, Any], ...]
    deviations: tuple[str, ...] = ()
    """Why, for each deviation in behaviour."""


# Every public function of megatron/core/distributed/finalize_model_grads.py (the _allreduce_* and
# _update_* helpers are private), and get_model_config, which that module imports from megatron.core.utils.
API = [
    Api(
        finalize_model_grads,
        "megatron/core/distributed/finalize_model_grads.py: finalize_model_grads",
        (
            ("model", REQUIRED),
            ("num_tokens", None),
            ("pg_collection", None),
            ("force_all_reduce", False),
        ),
        (
            "pg_collection=None takes the first chunk's pg_collection, else pure data parallelism over the "
            "default group: there are no global parallel-state groups to fall back on.",
            "A group an active axis needs but the collection lacks raises ValueError naming the field, "
            "before any communication, where Megatron asserts.",
            "Not implemented: the flextron router sync, the quantile-balancing beta update and the GTP "
            "weight-remat reductions.",
        ),
    ),
    Api(
        reset_model_temporary_tensors,
        "megatron/core/distributed/finalize_model_grads.py: reset_model_temporary_tensors",
        (("config", REQUIRED), ("model", REQUIRED)),
        (
            "Does not zero the quantile-balancing accumulators (qb_beta_accum, qb_beta_count): quantile "
            "balancing is not implemented.",
        ),
    ),
    Api(
        get_model_config,
        "megatron/core/utils.py: get_model_config",
        (("model", REQUIRED),),
    ),
]


@pytest.mark.parametrize("api", API, ids=[a.gradsync.__name__ for a in API])
def test_importable_from_gradsync_finalize(api: Api) -> None:
    name = api.gradsync.__name__
    assert name in gradsync.finalize.__all__
    assert getattr(gradsync.finalize, name) is api.gradsync


@pytest.mark.parametrize("api", API, ids=[a.gradsync.__name__ for a in API])
def test_megatron_parameters_in_order_with_megatron_defaults(api: Api) -> None:
    assert signature_mismatches(api.gradsync, api.params) == [], api.megatron


class Router(nn.Module):
    local_tokens_per_expert: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(2))
        self.register_buffer("local_tokens_per_expert", torch.tensor([3.0, 1.0]))


def test_reset_model_temporary_tensors_takes_config_then_model() -> None:
    router = Router()
    model = nn.Sequential(router)
    reset_model_temporary_tensors(ModelParallelConfig(moe_router_enable_expert_bias=True), [model])
    assert not router.local_tokens_per_expert.any()
