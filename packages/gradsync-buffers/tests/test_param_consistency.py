"""The cross-rank model check: one digest per rank is gathered (O(DP)), and only a mismatch fetches the
two differing ranks' lists to name the difference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import check_params_match_across_ranks, param_consistency
from gradsync.groups.testing import run_distributed


def model(rank: int, odd_rank: int | None) -> list[tuple[str, nn.Parameter]]:
    params = [("a", nn.Parameter(torch.zeros(3, 2))), ("b", nn.Parameter(torch.zeros(5)))]
    if rank == odd_rank:
        params[1] = ("b", nn.Parameter(torch.zeros(6)))
    return params


def gathered_payloads(odd_rank: int | None) -> tuple[list[Any], str]:
    """What this rank handed to the all-gather of objects, and the error (empty when none)."""
    sent: list[Any] = []
    gather = param_consistency.all_gather_objects

    def recording(obj: Any, group: Any = None) -> list[Any]:
        sent.append(obj)
        return gather(obj, group)

    param_consistency.all_gather_objects = recording
    try:
        check_params_match_across_ranks(model(dist.get_rank(), odd_rank), dist.group.WORLD)
        return sent, ""
    except ValueError as error:
        return sent, str(error)
    finally:
        param_consistency.all_gather_objects = gather


@pytest.mark.parametrize("odd_rank", [None, 2])
def test_only_a_digest_per_rank_is_gathered(odd_rank: int | None) -> None:
    for sent, error in run_distributed(gathered_payloads, 4, args=(odd_rank,)):
        assert [type(obj) for obj in sent] == [str]
        assert len(sent[0]) == 64  # a sha256 hex digest, whatever the model's size
        if odd_rank is None:
            assert error == ""
        else:
            assert "differs between data-parallel ranks 0 and 2: param #1: b (shape [5]" in error
            assert "vs b (shape [6]" in error
