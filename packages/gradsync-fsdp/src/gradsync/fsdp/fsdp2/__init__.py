"""FSDP2's per-module API over MegatronFSDP: ``from gradsync.fsdp.fsdp2 import fully_shard``.

torchtitan-style code calls ``fully_shard`` bottom-up, on each block and then on the root, and builds the
optimizer afterwards on ``model.parameters()``. gradsync lays out all of a model's buckets at once, so the
calls are read as one plan: a call on a module that holds no marked module marks it as a *unit* (its
params gathered, released and reduced together: one bucket per dtype); the call on a module that holds
marked ones is the *root* call and builds one :class:`MegatronFSDP` over it with those units, at once. As
with torch, the params are then the optimizer's DTensor shards, the module is the same object with its
class swapped to ``FSDP<Class>`` (an :class:`FSDPModule`), and ``model(x)``, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()`` train it: each backward that ends an accumulation cycle
reduces the grads and hands them to the DTensors (auto-sync), the step marks the model (a
post-step hook, :mod:`~gradsync.fsdp.optimizer_facing`), and the next forward zeroes the grad buffers and
installs the updated weights. A marked module that no later call covers becomes a root on its own when
first used (its ``parameters()``, a forward, an FSDPModule method), as ``fully_shard(model)`` alone needs.

docs/fsdp2-migration.md maps every argument and method to gradsync's, and lists what is refused.
"""

from __future__ import annotations

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .api import fully_shard, megatron_fsdp_of
from .module import FSDPModule, GradientReductionHandle, UnshardHandle

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "megatron_fsdp_of",
]
