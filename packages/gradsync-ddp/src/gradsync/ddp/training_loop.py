"""The training-loop API of Megatron-Core's optimizers, for gradsync's DistributedOptimizer.

``megatron/training/training.py`` (and Megatron's schedules) drive an optimizer through: ``scale_loss``
(the schedules' ``grad_scale_func``), ``get_loss_scale``, ``zero_grad(set_to_none)``, ``step()``
returning ``(update_successful, grad_norm, num_zeros_in_grad)``, ``reload_model_params``,
``prepare_model_params_for_param_sync`` and ``is_stub_optimizer``. :class:`MegatronTrainingLoop` gives
gradsync's optimizer those, with ``step()`` in Megatron's order (``MixedPrecisionOptimizer.step``):

1. ``prepare_grads()``: read the reduced grads; with a loss scaler, unscale them, check them for inf/NaN
   across the grad-stats group and update the scale. Non-finite grads skip the step:
   ``(False, None, None)``, weights and optimizer state untouched.
2. clip with ``config.clip_grad`` when it is > 0 (the norm is returned; 0.0 when not clipping);
3. count zero grads when ``config.log_num_zeros_in_grad`` (else 0);
4. ``step_with_ready_grads()``: step, write the weights, gather the params.

The config is any OptimizerConfig-shaped object (Megatron's own included); only the fields below are read,
with Megatron's defaults where a field is missing. Hyper-parameters (lr, weight decay, betas) come from
the wrapped torch optimizer, not the config. Without a config nothing is clipped or scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .grad_scaler import ConstantGradScaler, grad_scaler_for

StepResult = tuple[bool, float | None, int | None]
"""``(update_successful, grad_norm, num_zeros_in_grad)``, as Megatron's ``optimizer.step()``."""


@dataclass(frozen=True)
class OptimizerSettings:
    """The fields of Megatron's ``OptimizerConfig`` that the training loop needs, with its defaults."""

    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    @classmethod
    def of(cls, config: Any) -> OptimizerSettings:
        """Read an OptimizerConfig-shaped object; None means gradsync's plain behaviour (no clipping)."""
        if config is None:
            return cls(clip_grad=0.0)
        defaults = cls()
        return cls(
            **{name: getattr(config, name, getattr(defaults, name)) for name in cls.__dataclass_fields__}
        )


class MegatronTrainingLoop:
    """Megatron's optimizer training-loop methods over the hooks a gradsync optimizer provides:
    ``_ensure_grads_loaded``, ``_main_grads`` (the flat fp32 grads this rank steps), ``_counted_grads``
    (the grads each counted once across the grad-stats group), ``clip_grad_norm`` and
    ``step_with_ready_grads``."""

    config: Any
    settings: OptimizerSettings
    grad_scaler: ConstantGradScaler | None
    norm_group: dist.ProcessGroup | None
    _device: torch.device
    _grads_loaded: bool
    is_stub_optimizer = False
    """Megatron's flag for a rank without parameters to optimize; gradsync has no stub optimizers."""

    def _init_training_loop(self, config: Any) -> None:
        self.config = config
        self.settings = OptimizerSettings.of(config)
        self.grad_scaler = grad_scaler_for(self.settings, self._device)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=self._device)

    # --- hooks the optimizer implements ----------------------------------------------------------

    def _ensure_grads_loaded(self) -> None:
        raise NotImplementedError

    def _main_grads(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _counted_grads(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        raise NotImplementedError

    def step_with_ready_grads(self) -> bool:
        raise NotImplementedError

    # --- Megatron's API --------------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale, a one-element fp32 tensor (1.0 without a scaler)."""
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (what Megatron's schedules call as ``grad_scale_func``)."""
        return self.get_loss_scale() * loss

    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup | None:
        """The group grad norms and zero counts are reduced over (None: the default group)."""
        return self.norm_group

    def prepare_model_params_for_param_sync(self) -> None:
        """Megatron stages MXFP8 params here; gradsync has none, so nothing to do."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Read this step's reduced grads; with a loss scaler, unscale them and report (on every rank)
        whether any is inf or NaN, updating the scale. Returns True when the step must be skipped."""
        self._ensure_grads_loaded()
        if self.grad_scaler is None:
            return False
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._device)
        grads = self._main_grads()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.grad_scaler.inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.norm_group)
        found = bool(found_inf.item() > 0)
        self.grad_scaler.update(found)
        return found

    @torch.no_grad()
    def count_zeros(self) -> int:
        """Zero entries across every grad this optimizer steps, each counted once across the group."""
        zeros = torch.zeros((), dtype=torch.int64, device=self._device)
        for grad in self._counted_grads():
            zeros += grad.numel() - torch.count_nonzero(grad)
        dist.all_reduce(zeros, group=self.norm_group)
        return int(zeros.item())

    def step(self, closure: Any = None) -> StepResult:
        """Megatron's step: ``(update_successful, grad_norm, num_zeros_in_grad)``; see the module doc."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        if self.prepare_grads():
            self._grads_loaded = False  # the next iteration reads its own grads
            return False, None, None
        grad_norm = 0.0
        if self.settings.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.settings.clip_grad)
        num_zeros = self.count_zeros() if self.settings.log_num_zeros_in_grad else 0
        return self.step_with_ready_grads(), grad_norm, num_zeros
