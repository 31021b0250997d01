"""The hooks and callbacks a DistributedDataParallel leaves on its params and module.

Each holds the wrapper weakly: params keep their hooks in C++, where the garbage collector cannot see a
cycle back to the wrapper, so a strong reference would keep the wrapper, its buffers and its process
groups (each with polling gloo threads) alive for as long as the params live.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradsync.buffers import PARAM_READY_CALLBACK_ATTR

from .param_ready import BucketParamReadyCallback

if TYPE_CHECKING:
    from .distributed_data_parallel import DistributedDataParallel


def register_grad_hooks(
    ddp: DistributedDataParallel,
    named: Sequence[tuple[str, nn.Parameter]],
    unused_parameters: Collection[str],
) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every param: the main-grad hook on those with a grad buffer, one
    that refuses the grad on those declared unused."""
    post_hook = _main_grad_hook(weakref.ref(ddp))
    hooks = [(p, post_hook) for p in ddp.params_with_grad]
    hooks += [(p, _refuse_grad(n)) for n, p in named if n in unused_parameters]
    return [
        p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        for p, hook in hooks
    ]


def _main_grad_hook(wrapper: weakref.ref[DistributedDataParallel]) -> Callable[[torch.Tensor], None]:
    """The hook moves a param's grad into main_grad and reports it ready."""

    def hook(param: torch.Tensor) -> None:
        ddp = wrapper()
        if ddp is None:
            return  # the wrapper is gone: the grad stays in param.grad, as without one
        grad = param.grad
        main_grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
        # A grad that aliases main_grad (left from finish_grad_sync) was accumulated in place already.
        aliased = grad is not None and grad.data_ptr() == main_grad.data_ptr()
        fused_already = param.grad_added_to_main_grad and not getattr(param, "zero_out_wgrad", False)  # type: ignore[attr-defined]
        if grad is not None and not aliased and not fused_already:
            main_grad.add_(grad)
        param.grad = None
        ddp._step.grad_arrived()
        if ddp.ddp_config.overlap_grad_reduce:
            owned = cast(nn.Parameter, param)  # the hook is handed the param itself
            ddp.param_to_bucket_group[owned].register_grad_ready(owned, ddp.force_all_reduce)

    return hook


def _refuse_grad(name: str) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        raise RuntimeError(
            f"param {name} was declared in unused_parameters but received a gradient; its grad would not "
            "be synchronised. Remove it from unused_parameters."
        )

    return hook


def count_weight_loads(ddp: DistributedDataParallel) -> None:
    """Bump ``ddp.model_params_version`` at every ``load_state_dict`` on the module or any submodule."""
    wrapper = weakref.ref(ddp)

    def loaded(_module: nn.Module, _keys: Any) -> None:
        owner = wrapper()
        if owner is not None:
            owner.model_params_version += 1

    for module in ddp.module.modules():
        module.register_load_state_dict_post_hook(loaded)  # type: ignore[no-untyped-call]


def set_param_ready_callbacks(ddp: DistributedDataParallel) -> None:
    """With overlap_param_gather, let ``ensure_params_ready`` finish a param's gather on demand (one
    callback per bucket group); otherwise drop callbacks a previous wrapper left on the params."""
    for group in ddp.grad_buffers.all_bucket_groups:
        callback = BucketParamReadyCallback(ddp, group) if ddp.ddp_config.overlap_param_gather else None
        for param in group.params:
            if callback is not None:
                setattr(param, PARAM_READY_CALLBACK_ATTR, callback)
            elif hasattr(param, PARAM_READY_CALLBACK_ATTR):
                delattr(param, PARAM_READY_CALLBACK_ATTR)
