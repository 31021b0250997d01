"""MixedPrecisionPolicy: the dtypes of main weights, main grads and the grad collectives (spec §5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``main_params_dtype``: the weights the optimizer steps (None: it steps the compute weights).
    ``main_grads_dtype``: where grads accumulate (None: the param dtype). ``grad_comm_dtype``: the dtype
    grads travel in (None: the main grad dtype)."""

    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{field}={dtype} must be a floating-point dtype")

    def main_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.main_params_dtype or param_dtype

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.main_grads_dtype or param_dtype

    def comm_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.grad_comm_dtype or self.grad_dtype(param_dtype)
