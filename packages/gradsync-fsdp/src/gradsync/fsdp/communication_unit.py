"""``suggested_communication_unit_size``: how many elements MegatronFSDP communicates at once.

Half of it bounds the all-gather prefetch (how many following units are gathered ahead), all of it the
elements of grad reductions allowed in flight before the oldest is waited for. Unset, it is twice the
average unit for ZeRO-3 (so one unit is prefetched), else ``bucket_size``, else 1e9; and unset, ZeRO-1/2
prefetch every unit (:func:`prefetch_size`). The reference docs
say a smaller value means less prefetching; the reference code floors the value at 1e9 (a min/max
mix-up by its own comment, "Cap to 1B"), which would make any smaller setting meaningless, so gradsync
caps it at 1e9 instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.buffers import DistributedDataParallelConfig

CAP = 1_000_000_000


def communication_unit_size(
    config: DistributedDataParallelConfig, shards_params: bool, unit_sizes: Sequence[int]
) -> int:
    """Elements per communication unit, from the config and the units' sizes (in elements)."""
    value = config.suggested_communication_unit_size
    if value is not None and value < 0:
        raise ValueError(
            f"suggested_communication_unit_size={value} must be >= 0 (0 turns all-gather prefetch off)"
        )
    if value is None:
        if shards_params and unit_sizes:
            value = 2 * sum(unit_sizes) // len(unit_sizes)
        else:
            value = config.bucket_size if config.bucket_size is not None else CAP
    return min(CAP, value)


def prefetch_size(config: DistributedDataParallelConfig, shards_params: bool, unit_size: int) -> int:
    """Elements gathers may prefetch: half the communication unit, or, with the unit size unset and the
    weights kept whole (ZeRO-1/2), everything: prefetching then costs no memory, and a gather waited
    unit by unit would be exposed in full."""
    if config.suggested_communication_unit_size is None and not shards_params:
        return CAP
    return unit_size // 2
