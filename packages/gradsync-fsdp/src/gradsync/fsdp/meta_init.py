"""Materialising a model built on the meta device one module at a time, straight into its shards (spec §6).

A model too large for one device is built on ``torch.device("meta")``. Its meta params cannot be
re-pointed into real memory (a meta tensor's data cannot be swapped), so each is first replaced, in every
module that holds it, by a placeholder of the same shape, dtype and attributes whose storage is empty;
tied params stay tied (one placeholder for all their owners). The buckets are then laid out from those
shapes without reading values. Last, module by module in ``named_modules()`` order, the module's own
params get real storage, its init runs (``param_init_fn(module)``, else its ``reset_parameters()`` or
``_reset_parameters()``), each param's value is written into the parts of the buckets this rank keeps,
and the storage is dropped again. So at most one module's params exist whole at a time, and a model whose
constructor initialised its modules in ``named_modules()`` order with the same seed gets the same values:
each init draws the same random numbers in the same order. A param shared by several modules keeps the
value of the first module that holds it; the later ones still run their init, so the random stream
stays aligned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ParamInitFn = Callable[[nn.Module], None]
WriteParam = Callable[[nn.Parameter, torch.Tensor], None]


def replace_meta_params(module: nn.Module, device: torch.device) -> dict[nn.Parameter, nn.Parameter]:
    """Swap every meta param of ``module`` for an empty placeholder on ``device``, and give every meta
    buffer uninitialised storage there (the modules' init fills it). Returns {meta param: placeholder}."""
    replaced: dict[nn.Parameter, nn.Parameter] = {}
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
    return replaced


def materialize(
    module: nn.Module,
    placeholders: set[nn.Parameter],
    write: WriteParam,
    param_init_fn: ParamInitFn | None = None,
) -> None:
    """Initialise the placeholders module by module and hand each value to ``write`` once (see above)."""
    pending = set(placeholders)
    for name, owner in module.named_modules():
        direct = [p for p in owner._parameters.values() if p is not None and p in placeholders]
        if not direct:
            continue
        init = param_init_fn or _reset_method(name, owner)
        views = [p.data for p in direct]  # the params' views into the buckets
        for param in direct:
            param.data = torch.empty(param.shape, dtype=param.dtype, device=views[0].device)
        with torch.no_grad():
            init(owner)
        for param, view in zip(direct, views, strict=True):
            if param in pending:
                write(param, param.data)
                pending.discard(param)
            param.data = view


def _reset_method(name: str, owner: nn.Module) -> ParamInitFn:
    for method in ("reset_parameters", "_reset_parameters"):
        reset = getattr(owner, method, None)
        if callable(reset):
            return lambda module: reset()
    raise ValueError(
        f"MegatronFSDP(init_model_with_meta_device=True): module {name or '<root>'!r} "
        f"({type(owner).__name__}) holds params on the meta device but has no reset_parameters() or "
        "_reset_parameters() to initialise them; add one, or pass param_init_fn=fn (fn(module) initialises "
        "the module's own params in place)"
    )
