"""Where a wrapper's buffers live, chosen the same way by every entry point (``MegatronFSDP``,
``fully_shard_model`` and the FSDP2-style ``fully_shard``): the device the caller named, else the mesh's
when the params cannot tell (on the meta device, or the FSDP2 API, which moves the module to its mesh as
torch does), else the params' own."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gradsync.groups.backend import current_device


def choose_device(
    asked: torch.device | None, params: Iterable[torch.Tensor], mesh_type: str | None = None
) -> torch.device | None:
    """``asked``, else the device of a mesh of ``mesh_type``, else the first param's; None without any."""
    if asked is not None:
        return asked
    if mesh_type is not None:
        return current_device(mesh_type)
    return next((param.device for param in params), None)


def wrapped_module_device(
    asked: torch.device | None, module: nn.Module, mesh_type: str, meta_init: bool
) -> torch.device:
    """Where MegatronFSDP's buffers live: ``asked``, else the params' device; a meta model goes to the
    mesh's device (the current accelerator, or the CPU). Meta params without ``meta_init`` are refused."""
    on_meta = [name for name, p in module.named_parameters() if p.is_meta]
    if on_meta and not meta_init:
        raise ValueError(
            f"MegatronFSDP: {len(on_meta)} params are on the meta device (first {on_meta[0]!r}); pass "
            "init_model_with_meta_device=True to materialise them shard by shard, or build the model on "
            "a real device"
        )
    return choose_device(asked, module.parameters(), mesh_type if on_meta else None) or torch.device("cpu")
