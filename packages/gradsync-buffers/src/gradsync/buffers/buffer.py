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
from .foreign_config import as_ddp_config
from .layout import PerBufferParamLayout, compute_param_layout, shard_cut
from .shard_alignment import shard_alignment_of


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
        param_names: dict[Parameter, str] | None = None,
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
        self.layerwise_gather_list: list[torch.Tensor] | None = None
        """Megatron-Core's per-rank receive views of its layer-wise optimizer's param gather. gradsync
        gathers straight into the param buffer and never fills it; ``free_overlap_buffers`` drops it."""
        # Names only make messages readable (Megatron's bucket has none); unnamed params get their shape.
        self.param_names = {
            p: param_names[p] if param_names is not None else f"<param of shape {tuple(p.shape)}>"
            for p in params
        }


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
        param_layout: PerBufferParamLayout[int] | PerBufferParamLayout[torch.Tensor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``param_layout``: a precomputed layout, keyed by the params (Megatron-Core's form) or by their
        position in ``params_with_names``; by default the buffer computes its own."""
        self.ddp_config = ddp_config = as_ddp_config(ddp_config)
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
        layout: PerBufferParamLayout[int]
        if param_layout is None:
            layout = compute_param_layout(
                [p.numel() for p in self.params],
                bucket_size,
                padded=distopt,
                data_parallel_world_size=self.data_parallel_world_size,
                pad_for_high_nccl_busbw=ddp_config.pad_buckets_for_high_nccl_busbw,
                shared_embedding=[bool(getattr(p, "shared_embedding", False)) for p in self.params],
                shard_cuts=[shard_cut(shard_alignment_of(p), p.shape) for p in self.params],
            )
        else:
            layout = param_layout.by_position(self.params)
        if distopt and layout.num_optimizer_shards != self.data_parallel_world_size:
            raise ValueError(
                f"Parameter layout was built for {layout.num_optimizer_shards} optimizer shards but "
                f"the buffer's data-parallel group has {self.data_parallel_world_size} ranks: compute the "
                "layout with the buffer's group size"
            )
        self.layout = layout
        """The layout keyed by position in ``params`` (``param_index_map`` is the same keyed by param)."""
        self.num_optimizer_shards = layout.num_optimizer_shards
        """The DP size the layout was padded for (None when unpadded): Megatron's DistributedOptimizer
        checks it against the buffer's group before sharding."""
        self.param_index_map = {self.params[i]: r for i, r in layout.param_index_map.items()}
        self.bucket_indices = list(layout.bucket_indices)
        self.numel = layout.numel
        self.numel_unpadded = sum(layout.per_bucket_numel_unpadded)

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=self.device) if distopt else None
        self.extra_main_grads: list[torch.Tensor] = []
        promoted = self._attach_views(ddp_config.param_name_patterns_for_fp32_local_accumulation)
        self.buckets = [
            ParamAndGradBucket(
                params=[self.params[i] for i in layout.bucket_params(b)],
                param_data=self.param_data[start:end] if self.param_data is not None else None,
                grad_data=self.grad_data[start:end],
                offset=start,
                numel_unpadded=layout.per_bucket_numel_unpadded[b],
                gradient_scaling_factor=gradient_scaling_factor,
                bucket_id=b,
                param_index_map=self.param_index_map,
                params_with_extra_main_grads=[
                    self.params[i] for i in layout.bucket_params(b) if self.params[i] in promoted
                ],
                param_names=self.param_to_name,
            )
            for b, (start, end) in enumerate(self.bucket_indices)
        ]
        self.param_to_bucket = {p: bucket for bucket in self.buckets for p in bucket.params_list}
        self.param_indices = list(layout.param_indices) or list(range(len(self.params)))
        self.param_data_cpu: torch.Tensor | None = None
        self.grad_data_size = 0

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

    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """Free the device memory of the buffers while keeping every view object (``main_grad``,
        ``param.data``): grads are dropped (they are zeroed on reload), params are copied to the CPU
        first (pinned when they live on an accelerator)."""
        if move_grads and self.grad_data.untyped_storage().nbytes():
            self.grad_data_size = self.grad_data.untyped_storage().nbytes()
            self.grad_data.untyped_storage().resize_(0)
        if move_params and self.param_data is not None and self.param_data.untyped_storage().nbytes():
            if self.param_data_cpu is None:
                pin = self.param_data.device.type != "cpu"
                self.param_data_cpu = torch.empty(
                    self.param_data.shape, dtype=self.param_data.dtype, device="cpu", pin_memory=pin
                )
            self.param_data_cpu.copy_(self.param_data, non_blocking=False)
            self.param_data.untyped_storage().resize_(0)

    def reload_from_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """Undo :meth:`offload_to_cpu`: params get their CPU copy back, grads come back zeroed."""
        params, saved = self.param_data, self.param_data_cpu
        offloaded = params is not None and params.untyped_storage().nbytes() == 0
        if move_params and offloaded and params is not None and saved is not None:
            params.untyped_storage().resize_(params.numel() * params.element_size())
            params.copy_(saved)
        if move_grads and self.grad_data_size:
            self.grad_data.untyped_storage().resize_(self.grad_data_size)
            self.grad_data.zero_()
            self.grad_data_size = 0


class _ParamAndGradBuffer(ParamAndGradBuffer):
    """Megatron-Core's constructor for :class:`ParamAndGradBuffer`, argument for argument.

    ``param_to_name`` and ``pg_collection`` only feed Megatron's logging (names come from
    ``params_with_names`` here); ``param_indices`` are kept as the buffer's ``param_indices``; ``nccl_ub``
    must agree with ``ddp_config.nccl_ub``, which gradsync refuses (see the buffers README).
    """

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params_with_names: Sequence[tuple[Parameter, str]],
        data_parallel_group: dist.ProcessGroup,
        bucket_size: int | None,
        param_to_name: dict[Parameter, str],
        gradient_scaling_factor: float,
        param_indices: list[int],
        nccl_ub: bool,
        pg_collection: object | None = None,
        param_layout: PerBufferParamLayout[int] | PerBufferParamLayout[torch.Tensor] | None = None,
    ) -> None:
        ddp_config = as_ddp_config(ddp_config)
        if nccl_ub != ddp_config.nccl_ub:
            raise ValueError(
                f"_ParamAndGradBuffer: nccl_ub={nccl_ub} but ddp_config.nccl_ub={ddp_config.nccl_ub}; pass "
                "ddp_config.nccl_ub, as DistributedDataParallel does"
            )
        if len(param_indices) != len(params_with_names):
            raise ValueError(
                f"_ParamAndGradBuffer: {len(param_indices)} param_indices for {len(params_with_names)} params"
            )
        super().__init__(
            ddp_config,
            param_dtype,
            grad_dtype,
            params_with_names,
            data_parallel_group,
            bucket_size,
            gradient_scaling_factor,
            param_layout=param_layout,
        )
        self.param_indices = list(param_indices)


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
