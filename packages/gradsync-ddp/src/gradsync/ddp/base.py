"""`_BaseDataParallel`: the template every data-parallel wrapper follows (Megatron-Core's API).

It holds the model config and the wrapped module, delegates forward and state dicts to the module (so
checkpoint keys carry no ``module.`` prefix), and defines the sync methods as no-ops for subclasses.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from gradsync.groups import ModelParallelConfigProtocol


class _BaseDataParallel(nn.Module):
    """A module wrapper with the data-parallel sync interface; every sync method is a no-op here."""

    def __init__(self, config: ModelParallelConfigProtocol, module: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.module = module

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the gradient reduction (no-op in the base class)."""

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiply every gradient by ``scaling_factor`` (no-op in the base class)."""

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Complete the gradient reduction (no-op in the base class)."""

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers (no-op in the base class)."""

    def broadcast_params(self) -> None:
        """Make every replica's params equal to rank 0's (no-op in the base class)."""

    def state_dict(  # type: ignore[override]
        self, prefix: str = "", keep_vars: bool = False, destination: Any = None
    ) -> dict[str, Any]:
        """The module's state dict (no ``module.`` prefix), in Megatron's argument order."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The module's checkpoint state: its own ``state_dict_for_save_checkpoint`` where it has one (as
        Megatron modules do), else its state dict."""
        save = getattr(self.module, "state_dict_for_save_checkpoint", None)
        if save is not None:
            return save(prefix=prefix, keep_vars=keep_vars)  # type: ignore[no-any-return]
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
