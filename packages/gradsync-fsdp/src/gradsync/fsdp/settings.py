"""What a wrapper is asked for: the sharding strategies, the mixed-precision policy, and the device its
buffers live on.

The four sharding strategies and what each one shards: ``no_shard`` nothing, ``optim`` (ZeRO-1) the main
weights and optimizer state, ``optim_grads`` (ZeRO-2) also the grads, ``optim_grads_params`` (ZeRO-3) also the
compute weights.

MixedPrecisionPolicy: the dtypes of main weights, main grads and the grad collectives (Megatron-FSDP's
fields, not torch FSDP2's ``param_dtype`` / ``reduce_dtype``: those are ``gradsync.fsdp.fsdp2``'s).

Where a wrapper's buffers live, chosen the same way by every entry point (``MegatronFSDP``,
``fully_shard_model`` and the FSDP2-style ``fully_shard``): the device the caller named, else the mesh's
when the params cannot tell (on the meta device, or the FSDP2 API, which moves the module to its mesh as
torch does), else the params' own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups.backend import current_device


class ShardingStrategy(IntEnum):
    """``fully_shard``'s integer names for ``data_parallel_sharding_strategy``."""

    NO_SHARD = 0
    OPTIM = 1
    OPTIM_GRADS = 2
    OPTIM_GRADS_PARAMS = 3


STRATEGY_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Sharding:
    """What a strategy keeps as this rank's shard only, and how its grads are reduced.

    ``shard_main``: main weights and optimizer state (ZeRO-1 and up). ``shard_grads``: grads are
    reduce-scattered after every backward and accumulated in the shard (ZeRO-2 and up); otherwise they
    accumulate whole and are reduced once per optimisation cycle. ``shard_params``: compute weights exist
    whole only between a unit's gather and its release (ZeRO-3).
    """

    name: str
    shard_main: bool
    shard_grads: bool
    shard_params: bool


def parse_strategy(value: str | int, field: str = "data_parallel_sharding_strategy") -> Sharding:
    """The strategy named by a string or a :class:`ShardingStrategy` integer, or a ValueError naming
    ``field`` and the choices."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(STRATEGY_NAMES):
        name = STRATEGY_NAMES[value]
    elif isinstance(value, str) and value in STRATEGY_NAMES:
        name = value
    else:
        raise ValueError(
            f"{field}={value!r} is not a sharding strategy; use one of {', '.join(STRATEGY_NAMES)} (or 0-3)"
        )
    level = STRATEGY_NAMES.index(name)
    return Sharding(name, shard_main=level >= 1, shard_grads=level >= 2, shard_params=level >= 3)


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


def choose_device(
    asked: torch.device | None, params: Iterable[torch.Tensor], mesh_type: str | None = None
) -> torch.device | None:
    """``asked``, else the device of a mesh of ``mesh_type``, else the first param's; None without any."""
    if asked is not None:
        return asked
    if mesh_type is not None:
        return current_device(mesh_type)
    return next((param.device for param in params), None)


def wrapped_module_device(
    asked: torch.device | None, module: nn.Module, mesh_type: str, meta_init: bool
) -> torch.device:
    """Where MegatronFSDP's buffers live: ``asked``, else the params' device; a meta model goes to the
    mesh's device (the current accelerator, or the CPU). Meta params without ``meta_init`` are refused."""
    on_meta = [name for name, p in module.named_parameters() if p.is_meta]
    if on_meta and not meta_init:
        raise ValueError(
            f"MegatronFSDP: {len(on_meta)} params are on the meta device (first {on_meta[0]!r}); pass "
            "init_model_with_meta_device=True to materialise them shard by shard, or build the model on "
            "a real device"
        )
    return choose_device(asked, module.parameters(), mesh_type if on_meta else None) or torch.device("cpu")
