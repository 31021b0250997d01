"""Check, before any gradient collective, that every DP rank wraps the same parameters.

A rank whose model differs (another shape, a missing layer, a frozen param) would post different
collectives and hang the job; comparing names, shapes, dtypes and requires_grad up front turns that into an
error naming the first mismatch and the ranks involved.

Expert params (``allreduce=False``) legitimately differ across expert-parallel ranks, which sit inside one
data-parallel group: the DP check compares only their shapes, and the expert-data-parallel group (whose
ranks hold the same experts) compares them in full.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from gradsync.groups.objects import all_gather_objects, broadcast_object

from .layout import is_expert_parallel

ParamSignature = tuple[str, tuple[int, ...], str, bool]


EXPERT_PLACEHOLDER = "<expert param>"


def param_signatures(
    named_params: Sequence[tuple[str, nn.Parameter]], *, anonymous_experts: bool = False
) -> list[ParamSignature]:
    return [
        (
            EXPERT_PLACEHOLDER if anonymous_experts and is_expert_parallel(p) else name,
            tuple(p.shape),
            str(p.dtype),
            p.requires_grad,
        )
        for name, p in named_params
    ]


def _first_difference(mine: list[ParamSignature], theirs: list[ParamSignature]) -> str:
    for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return f"param #{index}: {_describe(a)} vs {_describe(b)}"
    shorter, longer = (mine, theirs) if len(mine) < len(theirs) else (theirs, mine)
    extra = longer[len(shorter)]
    return f"param count {len(mine)} vs {len(theirs)}; first extra param: {_describe(extra)}"


def _describe(sig: ParamSignature) -> str:
    name, shape, dtype, requires_grad = sig
    return f"{name} (shape {list(shape)}, {dtype}, requires_grad={requires_grad})"


def check_params_match_across_ranks(
    named_params: Sequence[tuple[str, nn.Parameter]],
    group: dist.ProcessGroup,
    expert_group: dist.ProcessGroup | None = None,
    *,
    who: str = "DistributedDataParallel",
) -> None:
    """Raise ``ValueError`` on every rank if any rank of ``group`` wraps different params (experts: any
    rank of ``expert_group``); ``who`` names the wrapper in the message."""
    _check(param_signatures(named_params, anonymous_experts=True), group, "data-parallel", who)
    experts = [(name, p) for name, p in named_params if is_expert_parallel(p)]
    if experts and expert_group is not None:  # every rank of `group` agrees here: the check above passed
        _check(param_signatures(experts), expert_group, "expert-data-parallel", who)


def _check(mine: list[ParamSignature], group: dist.ProcessGroup, kind: str, who: str) -> None:
    """Gather one digest per rank (O(DP), not every rank's list: O(DP x P)); only when they differ are the
    lists of group rank 0 and of the first differing rank broadcast, to name the difference."""
    digests = all_gather_objects(hashlib.sha256(repr(mine).encode()).hexdigest(), group)
    odd = next((r for r, digest in enumerate(digests) if digest != digests[0]), None)
    if odd is None:
        return
    ranks = dist.get_process_group_ranks(group)
    reference = broadcast_object(mine, ranks[0], group)
    theirs = broadcast_object(mine, ranks[odd], group)
    raise ValueError(
        f"{who}: the model differs between {kind} ranks {ranks[0]} and {ranks[odd]}: "
        f"{_first_difference(reference, theirs)}. Every {kind} rank must wrap the same parameters "
        "(names, shapes, dtypes, requires_grad)."
    )
