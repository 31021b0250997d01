"""MixedPrecisionPolicy: the dtypes of main weights, main grads and the grad collectives (Megatron-FSDP's
fields, not torch FSDP2's ``param_dtype`` / ``reduce_dtype``: those are ``gradsync.fsdp.fsdp2``'s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.buffers import DistributedDataParallelConfig


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


def policy_from_config(
    config: DistributedDataParallelConfig, given: MixedPrecisionPolicy | None
) -> MixedPrecisionPolicy:
    """The policy ``config`` describes, or ``given`` after checking the config does not contradict it.
    Without a given policy, the ``megatron_fsdp_*_dtype`` fields make one; Megatron-Core's older fields map
    onto it: ``grad_reduce_in_fp32`` means fp32 main grads (and so fp32 reductions),
    ``preserve_fp32_weights=False`` no separate main weights. A field that contradicts a given policy is
    refused."""
    if given is None:
        main_grads = config.megatron_fsdp_main_grads_dtype
        if config.grad_reduce_in_fp32:
            _refuse_unless(
                main_grads in (None, torch.float32),
                "grad_reduce_in_fp32=True",
                "megatron_fsdp_main_grads_dtype",
                main_grads,
            )
            main_grads = torch.float32
        main_params = config.megatron_fsdp_main_params_dtype
        if not config.preserve_fp32_weights:
            _refuse_unless(
                main_params in (None, torch.float32),
                "preserve_fp32_weights=False",
                "megatron_fsdp_main_params_dtype",
                main_params,
            )
            main_params = None
        return MixedPrecisionPolicy(main_params, main_grads, config.megatron_fsdp_grad_comm_dtype)
    if config.grad_reduce_in_fp32:
        _refuse_unless(
            given.main_grads_dtype == torch.float32,
            "grad_reduce_in_fp32=True",
            "mixed_precision_policy.main_grads_dtype",
            given.main_grads_dtype,
        )
    if not config.preserve_fp32_weights:
        _refuse_unless(
            given.main_params_dtype is None,
            "preserve_fp32_weights=False",
            "mixed_precision_policy.main_params_dtype",
            given.main_params_dtype,
        )
    return given


def _refuse_unless(agrees: bool, asked: str, field: str, value: object) -> None:
    if not agrees:
        raise ValueError(
            f"MegatronFSDP: ddp_config.{asked} contradicts {field}={value}; set one of them so both say the "
            "same (or leave the config field at its default and use the policy)"
        )
