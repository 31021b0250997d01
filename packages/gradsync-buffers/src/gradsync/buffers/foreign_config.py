"""`as_ddp_config`: any DDP config object (Megatron-Core's, of any recent version) as gradsync's own.

Megatron-Core's ``DistributedDataParallelConfig`` gains and loses fields from release to release (0.19.2
has no ``megatron_fsdp_version``; HEAD no longer has ``preserve_fp32_weights``), so its objects are read
field by field instead of being used as they are:

- a field gradsync knows is copied (and validated again by gradsync's ``__post_init__``);
- a field gradsync knows that the object lacks (a newer field, an older object) takes gradsync's default;
- a field gradsync does not know is refused by name when it is set away from its default, and dropped
  otherwise. For a dataclass the default is the field's own declared default; for a plain object, which
  declares none, only ``None``, ``False`` and empty containers count as "at its default".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import DistributedDataParallelConfig

_NEUTRAL_TYPES = (tuple, list, dict, set, frozenset, str)


def as_ddp_config(config: Any) -> DistributedDataParallelConfig:
    """gradsync's :class:`DistributedDataParallelConfig` for ``config``: returned as it is when it already
    is one; otherwise built from the object's fields (a dataclass, such as Megatron-Core's config of any
    recent version) or public attributes (any other object). Raises ``ValueError`` naming every field
    gradsync does not know that is set away from its default."""
    if isinstance(config, DistributedDataParallelConfig):
        return config
    known = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    values, defaults = _fields_of(config, known)
    unknown = [
        f"{name}={value!r}"
        for name, value in values.items()
        if name not in known and not _at_default(name, value, defaults)
    ]
    if unknown:
        kind = type(config).__qualname__
        raise ValueError(
            f"as_ddp_config: {kind} sets {', '.join(unknown)}, which gradsync's "
            "DistributedDataParallelConfig does not know and would ignore. Set them back to their defaults, "
            "or leave them out."
        )
    kwargs = {name: value for name, value in values.items() if name in known}
    patterns = kwargs.get("param_name_patterns_for_fp32_local_accumulation")
    if isinstance(patterns, list):
        kwargs["param_name_patterns_for_fp32_local_accumulation"] = tuple(patterns)
    return DistributedDataParallelConfig(**kwargs)


def _fields_of(config: Any, known: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The object's field values and, for a dataclass, each field's declared default. A plain object's
    values are its public instance attributes, plus class attributes and properties gradsync knows."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        values: dict[str, Any] = {}
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(config):
            values[f.name] = getattr(config, f.name)
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory()
        return values, defaults
    try:
        attributes = vars(config)
    except TypeError as error:
        raise TypeError(
            f"as_ddp_config: expected a DistributedDataParallelConfig, a dataclass or an object with "
            f"attributes, got {type(config).__qualname__}"
        ) from error
    values = {k: v for k, v in attributes.items() if not k.startswith("_")}
    for name in sorted(known - values.keys()):
        if hasattr(config, name):
            values[name] = getattr(config, name)
    return values, {}


def _at_default(name: str, value: Any, defaults: dict[str, Any]) -> bool:
    if name in defaults:
        try:
            return bool(defaults[name] == value)
        except Exception:
            return defaults[name] is value
    return value is None or value is False or (isinstance(value, _NEUTRAL_TYPES) and not value)
