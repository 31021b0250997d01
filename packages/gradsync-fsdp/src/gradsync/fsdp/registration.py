"""Which params the wrapped module's attributes hold: the compute params, or the optimizer's DTensors.

A parent module, ``torch.compile``'s wrapper or any code walking ``module.parameters()`` reads the
modules' registered params directly, never ``MegatronFSDP.parameters()``. As in the reference, the
modules hold the optimizer's DTensor params outside forward and backward (so such code finds the params
that get grads and get stepped) and the compute params from the root forward until the backward ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .sharded_param import ShardedParams


class ParamRegistry:
    """Which of each record's two params its module slots hold, and the swap between the two sets."""

    def __init__(self, params: ShardedParams) -> None:
        self._params = params
        self.showing_compute = True

    def show_compute(self) -> None:
        if not self.showing_compute:
            for record in self._params:
                for owner, leaf in record.slots:
                    owner._parameters[leaf] = record.compute
            self.showing_compute = True

    def show_optimizer(self) -> None:
        if self.showing_compute:
            for record in self._params:
                for owner, leaf in record.slots:
                    owner._parameters[leaf] = record.sharded
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
