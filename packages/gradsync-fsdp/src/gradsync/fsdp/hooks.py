"""The autograd plumbing of MegatronFSDP and the names of its phases in a profiler trace.

Names for MegatronFSDP's phases in a ``torch.profiler`` trace (``MegatronFSDP::pre_forward``, ...), as
torch FSDP2's hooks carry theirs, so a profile says which of gradsync's phases the host time goes to. A
phase is labelled only while a profiler runs: outside one, a label would cost every unit a
``record_function`` call in every phase.

The autograd plumbing of MegatronFSDP: per-module training state, the post-backward trigger on a
unit's inputs, and the hooks that fire on the first grad of a module's outputs.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from enum import Enum, auto
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn
from torch.autograd import profiler as autograd_profiler

from .torch_internals import pytree

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


H = TypeVar("H", bound=Callable[..., Any])


def outside_compile(hook: H) -> H:
    """``hook`` run eagerly, never traced by ``torch.compile``, as torch's FSDP2 runs its own hooks (it
    disables dynamo on them). The hooks launch collectives over process groups and read
    the step's Python state: a traced hook would bake a group's ranks or a flag into the compiled frame as
    constants, and a model wrapped later over another mesh in the same process would run on the first
    one's (a broadcast from a rank outside its group, seen at the second mesh)."""
    return torch.compiler.disable(hook)  # type: ignore[no-untyped-call,no-any-return]


class TrainingState(Enum):
    """Where a module is in the step: FORWARD → PRE_BACKWARD → POST_BACKWARD → IDLE."""

    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
    IDLE = auto()


def set_state(modules: Sequence[nn.Module], state: TrainingState) -> None:
    """Set ``state`` on each of ``modules``: a module and every module inside it, listed once at
    construction (walking the tree in every phase of every unit was a measurable part of a small
    model's step). Written to the instance dict: ``nn.Module.__setattr__`` would first look for a param,
    buffer or submodule of that name, for every module in every phase."""
    for sub in modules:
        sub.__dict__["_training_state"] = state


def get_state(module: nn.Module) -> TrainingState:
    state = getattr(module, "_training_state", TrainingState.IDLE)
    assert isinstance(state, TrainingState)
    return state


class RegisterFSDPBackwardFunction(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``post_backward``: once grads reach a unit's
    inputs, the unit's own backward is done and its weights can be released."""

    @staticmethod
    def forward(ctx: Any, post_backward: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.post_backward = post_backward
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.post_backward()
        return (None, *grads)


def attach_post_backward(
    args: tuple[Any, ...], kwargs: dict[str, Any], post_backward: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Route the grad-requiring tensors of ``(args, kwargs)`` through the post-backward trigger."""
    if not torch.is_grad_enabled():
        return args, kwargs
    # the usual call, ``unit(x)``, skips the pytree walk, most of this function's cost (every unit, step)
    flat = not kwargs and not any(isinstance(x, (list, tuple, dict)) for x in args)
    leaves, spec = (list(args), None) if flat else pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    outputs = RegisterFSDPBackwardFunction.apply(post_backward, *(leaves[i] for i in positions))  # type: ignore[no-untyped-call]
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    if spec is None:
        return tuple(leaves), kwargs
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    return new_args, new_kwargs


def on_first_output_grad(output: Any, handler: Callable[[], None]) -> None:
    """Call ``handler`` once, when backward computes the first grad of any tensor in ``output``."""
    if not torch.is_grad_enabled():
        return
    leaves, _ = pytree.tree_flatten(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]

    def call(_grads: Any) -> None:  # returns None: the grad passes unchanged
        handler()

    if len(tensors) == 1:  # the usual case, and a plain tensor hook costs a fraction of a multi-grad one
        tensors[0].register_hook(call)  # type: ignore[no-untyped-call]
    elif tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, call, mode="any")


def weak_method(owner: Any, name: str, *bound: Any) -> Callable[..., Any]:
    """A hook calling ``owner.<name>(*bound, *hook_args)`` that holds ``owner`` weakly: a param's hooks are
    not seen by the garbage collector, so a strong reference from them would keep a dropped wrapper (its
    buffers and groups) alive for good. The hook does nothing once ``owner`` is gone."""
    ref = weakref.ref(owner)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return None if target is None else getattr(target, name)(*bound, *args, **kwargs)

    return call


def replace_module_parameter(module: nn.Module, name: str, new_param: nn.Parameter) -> None:
    """Set the param at dotted path ``name`` of ``module`` to ``new_param``."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    setattr(owner, leaf, new_param)
