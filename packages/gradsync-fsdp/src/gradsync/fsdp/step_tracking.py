"""Which MegatronFSDP models an optimizer step has updated, so their next forward installs the weights.

The optimizer's in-place updates of the DTensor shards leave no trace a model could read on every rank
alike (a rank owning no rows of a bucket sees nothing change, and DTensor updates do not bump the flat
buffer's version counter). A post-step hook of each optimizer holding a model's params
(:mod:`gradsync.fsdp.optimizer_hooks`) marks the model after every step, on every rank: a
rank-consistent "stepped" flag, cleared by ``install_optimized_model_weights()``.
"""

from __future__ import annotations


class StepMarks:
    """What an optimizer step leaves on a model, recorded in this one place: the updated weights await
    their install (until ``install_optimized_model_weights()``), and the grad buffers hold the grads the
    step consumed, so no grad may be added to them (until ``zero_grad_buffer()`` starts a new cycle)."""

    __slots__ = ("grads_consumed", "weights_uninstalled")

    def __init__(self) -> None:
        self.weights_uninstalled = False
        self.grads_consumed = False

    def mark(self) -> None:
        self.weights_uninstalled = self.grads_consumed = True
