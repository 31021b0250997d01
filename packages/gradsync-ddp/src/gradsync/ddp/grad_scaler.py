"""Loss scalers with Megatron-Core's behaviour (``megatron/core/optimizer/grad_scaler.py``), on any device.

Which one an optimizer config asks for follows Megatron's ``get_megatron_optimizer``: a constant scaler
when ``loss_scale`` is set, a dynamic one for ``fp16`` without it, none otherwise (bf16 and fp32 train
unscaled). The scale is a one-element fp32 tensor on the grads' device, so ``scale_loss`` never syncs.
"""

from __future__ import annotations

from typing import Any

import torch


class ConstantGradScaler:
    """A fixed loss scale: never adjusted, whatever the grads hold."""

    def __init__(self, initial_scale: float, device: torch.device) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"the loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([initial_scale], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, taken in double and rounded once to fp32 (as the reference does)."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """Nothing to adjust."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load."""


class DynamicGradScaler(ConstantGradScaler):
    """Backs off by ``backoff_factor`` after ``hysteresis`` iterations with non-finite grads (not below
    ``min_scale``), and grows by ``growth_factor`` after ``growth_interval`` clean iterations in a row
    (which also restores the hysteresis budget)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: torch.device,
    ) -> None:
        super().__init__(initial_scale, device)
        checks = {
            "min_scale > 0": min_scale > 0.0,
            "min_scale <= initial_scale": min_scale <= initial_scale,
            "growth_factor > 1": growth_factor > 1.0,
            "0 < backoff_factor < 1": 0.0 < backoff_factor < 1.0,
            "growth_interval > 0": growth_interval > 0,
            "hysteresis > 0": hysteresis > 0,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"DynamicGradScaler: need {', '.join(failed)}")
        self.min_scale = torch.tensor([min_scale], dtype=torch.float32, device=device)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float32, device=device)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float32, device=device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = state_dict["scale"].to(self._scale.device)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def grad_scaler_for(settings: Any, device: torch.device) -> ConstantGradScaler | None:
    """The scaler an OptimizerConfig-shaped ``settings`` asks for (Megatron's rule), or None."""
    if settings.loss_scale:
        return ConstantGradScaler(settings.loss_scale, device)
    if settings.fp16:
        return DynamicGradScaler(
            initial_scale=settings.initial_loss_scale,
            min_scale=settings.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(settings.loss_scale_window),
            hysteresis=settings.hysteresis,
            device=device,
        )
    return None
