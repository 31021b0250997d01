"""Check a callable's signature against a table transcribed from Megatron-Core, for the packages'
``test_megatron_api`` modules: Megatron's parameters must come first, in Megatron's order and kind
(positional, ``*args``, keyword-only), with Megatron's defaults; gradsync may add parameters after them
only where the table names them as deviations.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

REQUIRED = inspect.Parameter.empty
"""A table entry's default for a parameter without one."""

_KIND_PREFIX: dict[inspect._ParameterKind, str] = {
    inspect.Parameter.VAR_POSITIONAL: "*",
    inspect.Parameter.VAR_KEYWORD: "**",
}


def _expected_kinds(names: Sequence[str]) -> list[inspect._ParameterKind]:
    """Kinds as Python gives them: ``*args`` entries are spelled ``"*args"``; what follows is keyword-only."""
    kinds: list[inspect._ParameterKind] = []
    after_star = False
    for name in names:
        if name.startswith("**"):
            kinds.append(inspect.Parameter.VAR_KEYWORD)
        elif name.startswith("*"):
            kinds.append(inspect.Parameter.VAR_POSITIONAL)
            after_star = True
        else:
            kinds.append(
                inspect.Parameter.KEYWORD_ONLY if after_star else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
    return kinds


def signature_mismatches(
    func: Callable[..., Any],
    megatron: Sequence[tuple[str, Any]],
    extra: Sequence[str] = (),
    keyword_only_from: str | None = None,
) -> list[str]:
    """What differs between ``func``'s parameters (``self`` left out) and ``megatron``: ``(name, default)``
    pairs in order (REQUIRED for none; ``"*unused"`` for a var-positional), allowing the parameters named
    in ``extra`` after them (each with a default: Megatron callers never pass it) and, as a listed
    deviation, Megatron's parameters from ``keyword_only_from`` on taken by keyword only."""
    params = [p for p in inspect.signature(func).parameters.values() if p.name != "self"]
    ours = [_KIND_PREFIX.get(p.kind, "") + p.name for p in params]
    wanted = [name for name, _ in megatron]
    problems = []
    if ours[: len(wanted)] != wanted:
        problems.append(f"parameters {ours[: len(wanted)]} where Megatron has {wanted}")
        return problems
    kinds = _expected_kinds(wanted)
    if keyword_only_from is not None:
        start = wanted.index(keyword_only_from)
        kinds[start:] = [inspect.Parameter.KEYWORD_ONLY] * (len(kinds) - start)
    for param, (name, default), kind in zip(params, megatron, kinds, strict=False):
        if param.kind is not kind:
            problems.append(f"{name} is {param.kind.description} where Megatron's is {kind.description}")
        if param.kind not in _KIND_PREFIX and param.default != default:
            problems.append(f"{name} defaults to {param.default!r} where Megatron's is {default!r}")
    unexpected = [name for name in ours[len(wanted) :] if name not in extra]
    if unexpected:
        problems.append(f"extra parameters {unexpected} not listed as deviations")
    required = [p.name for p in params[len(wanted) :] if p.default is REQUIRED and p.kind not in _KIND_PREFIX]
    if required:
        problems.append(f"extra parameters {required} have no default, so Megatron's calls would fail")
    return problems
