"""The param-readiness protocol (Megatron-Core's ``ensure_params_ready``): code about to read weights
outside the module's own forward (an optimizer hook, a custom kernel, an eval path) asks every param's
owner to finish whatever all-gather of that param is still in flight.

An owner, such as DistributedDataParallel with ``overlap_param_gather``, sets a callback on each param
under :data:`PARAM_READY_CALLBACK_ATTR`; params share one callback per bucket group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PARAM_READY_CALLBACK_ATTR = "_ensure_param_ready_callback"


def ensure_params_ready(params: Iterable[Any]) -> None:
    """Call each distinct readiness callback of ``params`` once, in first-seen order."""
    called: set[int] = set()
    for param in params:
        callback = getattr(param, PARAM_READY_CALLBACK_ATTR, None)
        if callback is None or id(callback) in called:
            continue
        called.add(id(callback))
        callback()
