"""Which params the wrapped module's attributes hold: the compute params, or the optimizer's DTensors.

A parent module, ``torch.compile``'s wrapper or any code walking ``module.parameters()`` reads the
modules' registered params directly, never ``MegatronFSDP.parameters()``. As in the reference, the
modules hold the optimizer's DTensor params outside forward and backward (so such code finds the params
that get grads and get stepped) and the compute params from the root forward until the backward ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn


class ParamRegistry:
    """Every ``(module, attribute)`` that holds a compute param, and the swap between the two sets."""

    def __init__(self, root: nn.Module, optimizer_param_of: Mapping[nn.Parameter, nn.Parameter]) -> None:
        self._slots = [
            (owner, leaf, param)
            for owner in root.modules()
            for leaf, param in owner._parameters.items()
            if param is not None and param in optimizer_param_of
        ]
        self._optimizer_param_of = dict(optimizer_param_of)
        self._compute_param_of: dict[torch.Tensor, torch.Tensor] = {
            dist_p: raw for raw, dist_p in self._optimizer_param_of.items()
        }
        self.showing_compute = True

    def compute_param(self, param: torch.Tensor) -> torch.Tensor:
        """The compute param of ``param`` (itself when it is one)."""
        return self._compute_param_of.get(param, param)

    def show_compute(self) -> None:
        if not self.showing_compute:
            for owner, leaf, raw in self._slots:
                owner._parameters[leaf] = raw
            self.showing_compute = True

    def show_optimizer(self) -> None:
        if self.showing_compute:
            for owner, leaf, raw in self._slots:
                owner._parameters[leaf] = self._optimizer_param_of[raw]
            self.showing_compute = False

    @contextlib.contextmanager
    def compute_shown(self) -> Iterator[None]:
        """The compute params in the modules for the duration, then whatever was there before."""
        before = self.showing_compute
        self.show_compute()
        try:
            yield
        finally:
            if not before:
                self.show_optimizer()
