"""Materialising a model built on the meta device one module at a time, straight into its shards.

A model too large for one device is built on ``torch.device("meta")``. Its meta params cannot be
re-pointed into real memory (a meta tensor's data cannot be swapped), so each is first replaced, in every
module that holds it, by a placeholder of the same shape, dtype and attributes whose storage is empty;
tied params stay tied (one placeholder for all their owners). The buckets are then laid out from those
shapes without reading values. Last, unit by unit in ``named_modules()`` order, where a unit is the
outermost module that itself holds meta params or buffers, with its subtree: the unit's params get real
storage, the inits of its modules run children first, as in a constructor (``param_init_fn(module)``,
else the module's ``reset_parameters()`` or ``_reset_parameters()``; a module without one is refused by
name), each param's value is written into the parts of the buckets this rank keeps, and the storage is
dropped again. So at most one unit's params exist whole at a time (for models whose params sit in leaf
modules, one leaf module), and a model whose constructor ran those inits in the same order with the same
seed gets the same values: each init draws the same random numbers in the same order. A param shared by
several modules keeps the value of the first unit that holds it; the later ones still run their init, so
the random stream stays aligned. Meta buffers are given memory and left to their module's init.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

ParamInitFn = Callable[[nn.Module], None]
WriteParam = Callable[[nn.Parameter, torch.Tensor], None]


@dataclass
class MetaReplacement:
    """What :func:`replace_meta_params` swapped: {meta param: placeholder}, and the modules whose buffers
    were on the meta device."""

    params: dict[nn.Parameter, nn.Parameter] = field(default_factory=dict)
    buffer_owners: set[nn.Module] = field(default_factory=set)
    placeholders: set[nn.Parameter] = field(default_factory=set)

    def needs_init(self, owner: nn.Module) -> bool:
        """Whether ``owner`` itself holds a placeholder or a buffer that was on the meta device."""
        own = any(p is not None and p in self.placeholders for p in owner._parameters.values())
        return own or owner in self.buffer_owners


def replace_meta_params(module: nn.Module, device: torch.device) -> MetaReplacement:
    """Swap every meta param of ``module`` for an empty placeholder on ``device``, and give every meta
    buffer uninitialised storage there (its module's init fills it)."""
    done = MetaReplacement()
    replaced = done.params
    for owner in module.modules():
        for leaf, param in owner._parameters.items():
            if param is None or not param.is_meta:
                continue
            if param not in replaced:
                placeholder = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad
                )
                placeholder.untyped_storage().resize_(0)
                placeholder.__dict__.update(param.__dict__)  # Megatron's attributes (sequence_parallel, ...)
                replaced[param] = placeholder
            owner._parameters[leaf] = replaced[param]
        for leaf, buffer in owner._buffers.items():
            if buffer is not None and buffer.is_meta:
                owner._buffers[leaf] = torch.empty_like(buffer, device=device)
                done.buffer_owners.add(owner)
    done.placeholders = set(replaced.values())
    return done


def materialize(
    module: nn.Module,
    replacement: MetaReplacement,
    write: WriteParam,
    param_init_fn: ParamInitFn | None = None,
) -> None:
    """Initialise the placeholders and hand each value to ``write`` once (see the module docstring).

    The unit of work is the outermost module that holds placeholders or meta buffers itself, with its
    whole subtree: a module's init may set its children's params (``nn.MultiheadAttention`` zeroes its
    ``out_proj.bias``), and it runs after theirs, children first, as in a constructor."""
    placeholders = replacement.placeholders
    pending = set(placeholders)

    def visit(name: str, owner: nn.Module) -> None:
        if not replacement.needs_init(owner):
            for child_name, child in owner.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            return
        params = list(dict.fromkeys(p for p in owner.parameters() if p in placeholders))
        views = [p.data for p in params]  # the params' views into the buckets
        for param in params:
            param.data = torch.empty(param.shape, dtype=param.dtype, device=views[0].device)
        with torch.no_grad():
            for sub_name, sub in _children_first(name, owner):
                if replacement.needs_init(sub):
                    (param_init_fn or _reset_method(sub_name, sub))(sub)
        for param, view in zip(params, views, strict=True):
            if param in pending:  # a param tied to an earlier subtree keeps that subtree's value
                write(param, param.data)
                pending.discard(param)
            param.data = view

    visit("", module)


def _children_first(name: str, owner: nn.Module) -> list[tuple[str, nn.Module]]:
    ordered: list[tuple[str, nn.Module]] = []
    for child_name, child in owner.named_children():
        ordered += _children_first(f"{name}.{child_name}" if name else child_name, child)
    return [*ordered, (name, owner)]


def _reset_method(name: str, owner: nn.Module) -> ParamInitFn:
    for method in ("reset_parameters", "_reset_parameters"):
        reset = getattr(owner, method, None)
        if callable(reset):
            return lambda module: reset()
    raise ValueError(
        f"MegatronFSDP(init_model_with_meta_device=True): module {name or '<root>'!r} "
        f"({type(owner).__name__}) holds params or buffers on the meta device but has no reset_parameters() "
        "or _reset_parameters() to initialise them; add one, or pass param_init_fn=fn (fn(module) "
        "initialises the module's own params and buffers in place)"
    )
