"""torch's ``MixedPrecisionPolicy`` on gradsync's buckets: the compute cast, the boundary casts, and the
ignored params kept out of the buckets while they are laid out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..mixed_precision import MixedPrecisionPolicy as GradsyncPrecision
from ..torch_internals import pytree


def _cast_for_compute(
    policy: MixedPrecisionPolicy, managed: list[tuple[str, nn.Parameter]]
) -> tuple[GradsyncPrecision, dict[str, torch.Tensor]]:
    """torch's policy as gradsync's: compute weights in ``param_dtype`` (cast here, before the buckets
    are laid out) over main weights, main grads and their accumulation in the original dtype, reduced in
    ``reduce_dtype`` (else ``param_dtype``). Returns the original values, for the main weights."""
    floating = {p.dtype for _, p in managed if p.is_floating_point()}
    compute = policy.param_dtype
    if compute is None or floating <= {compute}:
        return GradsyncPrecision(None, None, policy.reduce_dtype), {}
    if len(floating) > 1:
        raise NotImplementedError(
            f"fully_shard: mp_policy.param_dtype={compute} over params of several dtypes "
            f"{sorted(map(str, floating))}: gradsync keeps one main dtype; cast the model to one dtype first"
        )
    (original,) = floating
    originals = {}
    with torch.no_grad():
        for name, param in managed:
            if param.is_floating_point() and param.dtype != compute:
                originals[name] = param.data
                param.data = param.data.to(compute)
    return GradsyncPrecision(original, original, policy.reduce_dtype or compute), originals


@contextlib.contextmanager
def _params_hidden(root: nn.Module, hidden: frozenset[nn.Parameter]) -> Iterator[None]:
    """``ignored_params`` leave their modules while MegatronFSDP (which manages every param it finds) is
    built, and come back in their places: unsharded, never moved, their grads never reduced."""
    saved = []
    for owner in root.modules():
        params = owner._parameters
        if any(p is not None and p in hidden for p in params.values()):
            saved.append((owner, dict(params)))
            for leaf in [leaf for leaf, p in params.items() if p is not None and p in hidden]:
                del params[leaf]
    try:
        yield
    finally:
        for owner, original in saved:
            params = owner._parameters  # the registry may have swapped the others: keep those
            restored = {leaf: params.get(leaf, value) for leaf, value in original.items()}
            params.clear()
            params.update(restored)


def _cast_at_boundaries(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """``cast_forward_inputs`` / ``output_dtype``: floating inputs to ``param_dtype``, outputs to
    ``output_dtype``, at this module's forward, as torch does for every fully_shard module."""
    compute, output = policy.param_dtype, policy.output_dtype
    if compute is not None and policy.cast_forward_inputs:
        module.register_forward_pre_hook(
            lambda module, args, kwargs: _cast_floating((args, kwargs), compute), with_kwargs=True
        )
    if output is not None:
        module.register_forward_hook(lambda module, args, out: _cast_floating(out, output))


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)
