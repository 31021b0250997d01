"""The four sharding strategies and what each one shards: ``no_shard`` nothing, ``optim`` (ZeRO-1) the main
weights and optimizer state, ``optim_grads`` (ZeRO-2) also the grads, ``optim_grads_params`` (ZeRO-3) also the
compute weights."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


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
