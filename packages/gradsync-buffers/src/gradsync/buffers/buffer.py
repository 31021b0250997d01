"""Flat param/grad buffers and their buckets: the storage that collectives operate on.

A buffer owns one contiguous grad tensor (and, with the distributed optimizer, one contiguous param
tensor) for params sharing dtypes and expert-ness. ``param.main_grad`` is a view into the grad buffer; with
the distributed optimizer ``param.data`` becomes a view into the param buffer, so the all-gather of that
buffer updates the module's weights in place. Buckets are contiguous slices that are communicated as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch.nn import Parameter

from gradsync.groups import get_backend_capabilities

from .config import DistributedDataParallelConfig
from .layout import PerBufferParamLayout, compute_param_layout


class ParamAndGradBucket:
    """A contiguous slice of a buffer, reduced (and gathered) as one piece.

    ``param_to_index[p]`` is the param's (start, end) relative to the bucket start ``offset``.
    """

    def __init__(
        self,
        params: list[Parameter],
        param_data: torch.Tensor | None,
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
        param_index_map: dict[Parameter, tuple[int, int, int]],
        params_with_extra_main_grads: list[Parameter],
        param_names: dict[Parameter, str],
    ) -> None:
        self.params_list = params
        self.params = set(params)
        if len(self.params) != len(params):
            raise ValueError(f"bucket {bucket_id} lists a param twice")
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_index = {
            p: (param_index_map[p][0] - offset, param_index_map[p][1] - offset) for p in params
        }
        self.params_with_extra_main_grads = params_with_extra_main_grads
        self.param_names = {p: param_names[p] for p in params}


class ParamAndGradBuffer:
    """Contiguous param and grad storage for params of one (param dtype, grad dtype, expert) key."""

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params_with_names: Sequence[tuple[Parameter, str]],
        data_parallel_group: dist.ProcessGroup,
        bucket_size: int | None,
        gradient_scaling_factor: float,
        *,
        param_layout: PerBufferParamLayout | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.ddp_config = ddp_config
        self.params = [p for p, _ in params_with_names]
        self.param_to_name = {p: name for p, name in params_with_names}
        if len(self.param_to_name) != len(self.params):
            raise ValueError("a parameter was given twice to one buffer")
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_group.size()
        self.gradient_scaling_factor = gradient_scaling_factor
        self.device = device if device is not None else self.params[0].device
        _refuse_cuda_only_features(ddp_config, self.device, data_parallel_group)

        distopt = ddp_config.use_distributed_optimizer
        if param_layout is None:
            param_layout = compute_param_layout(
                [p.numel() for p in self.params],
                bucket_size,
                padded=distopt,
                data_parallel_world_size=self.data_parallel_world_size,
                pad_for_high_nccl_busbw=ddp_config.pad_buckets_for_high_nccl_busbw,
                shared_embedding=[bool(getattr(p, "shared_embedding", False)) for p in self.params],
            )
        if distopt and param_layout.num_optimizer_shards != self.data_parallel_world_size:
            raise ValueError(
                f"Parameter layout was built for {param_layout.num_optimizer_shards} optimizer shards but "
                f"the buffer's data-parallel group has {self.data_parallel_world_size} ranks: compute the "
                "layout with the buffer's group size"
            )
        self.layout = param_layout
        self.param_index_map = {self.params[i]: r for i, r in param_layout.param_index_map.items()}
        self.bucket_indices = list(param_layout.bucket_indices)
        self.numel = param_layout.numel
        self.numel_unpadded = sum(param_layout.per_bucket_numel_unpadded)

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=self.device) if distopt else None
        self.extra_main_grads: list[torch.Tensor] = []
        promoted = self._attach_views(ddp_config.param_name_patterns_for_fp32_local_accumulation)
        self.buckets = [
            ParamAndGradBucket(
                params=[self.params[i] for i in param_layout.bucket_params(b)],
                param_data=self.param_data[start:end] if self.param_data is not None else None,
                grad_data=self.grad_data[start:end],
                offset=start,
                numel_unpadded=param_layout.per_bucket_numel_unpadded[b],
                gradient_scaling_factor=gradient_scaling_factor,
                bucket_id=b,
                param_index_map=self.param_index_map,
                params_with_extra_main_grads=[
                    self.params[i] for i in param_layout.bucket_params(b) if self.params[i] in promoted
                ],
                param_names=self.param_to_name,
            )
            for b, (start, end) in enumerate(self.bucket_indices)
        ]
        self.param_to_bucket = {p: bucket for bucket in self.buckets for p in bucket.params_list}

    def _attach_views(self, fp32_patterns: tuple[str, ...]) -> set[Parameter]:
        """Point ``main_grad`` (and, with a param buffer, ``data``) of every param into the buffers."""
        promoted: set[Parameter] = set()
        for param in reversed(self.params):
            start, end, _ = self.param_index_map[param]
            if self.param_data is not None:
                view = self.param_data[start:end].view(param.shape)
                view.copy_(param.data)
                param.data = view
            grad_view = self.grad_data[start:end].view(param.shape)
            name = self.param_to_name[param]
            if any(p == "all" or fnmatch(name, p) for p in fp32_patterns):
                # Accumulate locally in fp32; the grad-dtype view is only the communication copy.
                param.main_grad_copy_in_grad_buffer = grad_view  # type: ignore[attr-defined]
                param.main_grad = torch.zeros_like(grad_view, dtype=torch.float32)  # type: ignore[attr-defined]
                self.extra_main_grads.append(param.main_grad)  # type: ignore[attr-defined]
                promoted.add(param)
            else:
                param.main_grad = grad_view  # type: ignore[attr-defined]
        return promoted

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiply every gradient in the buffer (and the fp32 extra main grads) by ``scaling_factor``."""
        self.grad_data *= scaling_factor
        for grad in self.extra_main_grads:
            grad.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the grad buffer and the fp32 extra main grads."""
        self.grad_data.zero_()
        for grad in self.extra_main_grads:
            grad.zero_()


def _refuse_cuda_only_features(
    config: DistributedDataParallelConfig, device: torch.device, group: dist.ProcessGroup
) -> None:
    """CUDA-only features fail loudly off CUDA/NCCL instead of being ignored."""
    caps = get_backend_capabilities(group, device)
    if (config.nccl_ub or config.fsdp_manual_registration) and not (
        caps.userbuffers and device.type == "cuda"
    ):
        raise RuntimeError(
            f"nccl_ub=True (NCCL user buffers) needs CUDA tensors on an NCCL group; this buffer is on "
            f"{device} over the {caps.name} backend. Set nccl_ub=False."
        )
    if config.nccl_ub:
        raise NotImplementedError(
            "nccl_ub=True: allocating DDP grad/param buffers from an NCCL memory pool is not implemented "
            "in gradsync-buffers. Set nccl_ub=False."
        )
    for name in ("fp8_param_gather", "fp4_param_gather", "reuse_grad_buf_for_mxfp8_param_ag"):
        if getattr(config, name):
            raise NotImplementedError(
                f"{name}=True needs Transformer Engine quantized params on CUDA, which gradsync-buffers "
                f"does not support yet. Set {name}=False."
            )
