"""Check, before any other collective, that every DP rank wraps the same parameters with the same settings.

A rank whose model differs (another shape, a missing layer, a frozen param) or whose wrapper is built
differently (another sharding strategy, bucket size, unit list, a NaN check or averaging rule on one rank
only) would post different collectives and hang the job, abort inside the backend, or train replicas apart
silently; comparing names, shapes, dtypes, requires_grad and every setting up front, in one collective,
turns that into an error on every rank naming the first mismatch and the ranks involved.

Expert params (``allreduce=False``) legitimately differ across expert-parallel ranks, which sit inside one
data-parallel group: the DP check compares only their shapes, and the expert-data-parallel group (whose
ranks hold the same experts) compares them in full.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gradsync.groups.objects import all_gather_objects, broadcast_object

from .layout import is_expert_parallel

ParamSignature = tuple[str, tuple[int, ...], str, bool]
Settings = Mapping[str, object]


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
    settings: Settings | None = None,
) -> None:
    """Raise ``ValueError`` on every rank if any rank of ``group`` wraps different params (experts: any
    rank of ``expert_group``) or was given different ``settings`` (name -> value, see
    :func:`settings_of`); ``who`` names the wrapper in the message."""
    stable = {name: stable_value(value) for name, value in (settings or {}).items()}
    _check((stable, param_signatures(named_params, anonymous_experts=True)), group, "data-parallel", who)
    if expert_group is not None:  # every rank of `group` agrees here: the check above passed
        check_experts_match_across_ranks(named_params, expert_group, who=who)


def check_experts_match_across_ranks(
    named_params: Sequence[tuple[str, nn.Parameter]], expert_group: dist.ProcessGroup, *, who: str
) -> None:
    """The expert params' part of :func:`check_params_match_across_ranks` (call it after that one, with no
    ``expert_group``, has passed): it raises on the ranks of ``expert_group`` only."""
    experts = [(name, p) for name, p in named_params if is_expert_parallel(p)]
    if experts:
        _check(({}, param_signatures(experts)), expert_group, "expert-data-parallel", who)


def settings_of(config: object, **extra: object) -> dict[str, object]:
    """A config dataclass's fields by name, plus ``extra`` (the wrapper's own arguments)."""
    fields = (
        {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        if dataclasses.is_dataclass(config)
        else {}
    )
    return {**fields, **extra}


def stable_value(value: object) -> object:
    """``value`` as every rank prints it alike: containers element by element, classes and functions by
    qualified name, other objects by type (their default repr carries a per-process address)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        stable: object = value
    elif isinstance(value, (list, tuple)):
        stable = tuple(stable_value(v) for v in value)
    elif isinstance(value, (set, frozenset, Mapping)):
        items = value.items() if isinstance(value, Mapping) else ((v, None) for v in value)
        stable = tuple(sorted(repr((stable_value(k), stable_value(v))) for k, v in items))
    elif isinstance(value, type) or callable(value):
        stable = (
            f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
        )
    elif dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)
        stable = (
            type(value).__qualname__,
            tuple((f.name, stable_value(getattr(value, f.name))) for f in fields),
        )
    else:
        stable = type(value).__qualname__
    return stable


Described = tuple[dict[str, object], list[ParamSignature]]


def _first_setting_difference(mine: dict[str, object], theirs: dict[str, object]) -> str | None:
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name, "<unset>") != theirs.get(name, "<unset>"):
            return f"{name}={mine.get(name, '<unset>')!r} vs {name}={theirs.get(name, '<unset>')!r}"
    return None


def _check(mine: Described, group: dist.ProcessGroup, kind: str, who: str) -> None:
    """Gather one digest per rank (O(DP), not every rank's description: O(DP x P)); only when they differ
    are the descriptions of group rank 0 and of the first differing rank broadcast, to name the
    difference."""
    digests = all_gather_objects(hashlib.sha256(repr(mine).encode()).hexdigest(), group)
    odd = next((r for r, digest in enumerate(digests) if digest != digests[0]), None)
    if odd is None:
        return
    ranks = dist.get_process_group_ranks(group)
    reference: Described = broadcast_object(mine, ranks[0], group)
    theirs: Described = broadcast_object(mine, ranks[odd], group)
    setting = _first_setting_difference(reference[0], theirs[0])
    if setting is not None:
        raise ValueError(
            f"{who}: {kind} ranks {ranks[0]} and {ranks[odd]} were built with different settings: {setting}. "
            f"Every {kind} rank must construct the wrapper with the same config and arguments "
            "(see docs/troubleshooting.md#at-construction-ranks-disagree)."
        )
    raise ValueError(
        f"{who}: the model differs between {kind} ranks {ranks[0]} and {ranks[odd]}: "
        f"{_first_difference(reference[1], theirs[1])}. Every {kind} rank must wrap the same parameters "
        "(names, shapes, dtypes, requires_grad; see docs/troubleshooting.md#at-construction-ranks-disagree)."
    )


def broadcast_from_first_rank(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with its first rank's values: one broadcast per
    device and dtype, of the tensors flattened together (not one per tensor)."""
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
            dist.broadcast(flat, src=src, group=group)
            for tensor, piece in zip(
                same_kind, torch.split(flat, [t.numel() for t in same_kind]), strict=True
            ):
                tensor.copy_(piece.view_as(tensor))
