"""Gradient scaling factors: what each buffer's grads are multiplied by before the reduction.

The goal is the mean over the full dp x cp group. Without average_in_collective grads are pre-divided by
dp x cp and summed; with it, dense grads are averaged by the collective and expert grads are pre-scaled by
expert_dp / (dp x cp), so that averaging over expert DP also ends at the dp x cp mean (an expert sees
ep x etp times more tokens than a dense replica). A per-token loss is summed as is and normalised later by
the global token count.
"""

from __future__ import annotations

from .config import DistributedDataParallelConfig


def gradient_scaling_factors(
    ddp_config: DistributedDataParallelConfig,
    *,
    calculate_per_token_loss: bool,
    data_parallel_cp_size: int,
    expert_data_parallel_size: int,
) -> tuple[float, float]:
    """(dense factor, expert factor)."""
    if calculate_per_token_loss:
        if ddp_config.average_in_collective:
            raise ValueError(
                "average_in_collective=True cannot be combined with calculate_per_token_loss=True: per-token "
                "losses are summed and normalised by the token count; set average_in_collective=False"
            )
        return 1.0, 1.0
    if ddp_config.average_in_collective:
        return 1.0, expert_data_parallel_size / data_parallel_cp_size
    return 1.0 / data_parallel_cp_size, 1.0 / data_parallel_cp_size
