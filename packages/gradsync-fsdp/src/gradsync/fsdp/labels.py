"""Names for MegatronFSDP's phases in a ``torch.profiler`` trace (``MegatronFSDP::pre_forward``, ...), as
torch FSDP2's hooks carry theirs, so a profile says which of gradsync's phases the host time goes to. A
phase is labelled only while a profiler runs: outside one, a label would cost every unit a
``record_function`` call in every phase."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch.autograd import profiler as autograd_profiler

P = ParamSpec("P")
R = TypeVar("R")


def labelled(phase: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the decorated function inside ``record_function("MegatronFSDP::<phase>")`` while profiling."""
    label = f"MegatronFSDP::{phase}"

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if not autograd_profiler._is_profiler_enabled:  # set by torch.profiler.profile too
                return function(*args, **kwargs)
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)

        return call

    return decorate
