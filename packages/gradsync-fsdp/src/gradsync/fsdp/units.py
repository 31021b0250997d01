"""FSDP units and buckets: which params are gathered, released and reduced together.

A unit is an instance of one of ``fsdp_unit_modules`` that is not inside another unit (the outermost
wins); all its params form one bucket group. Params outside every unit are grouped by dtype and
requires_grad and split into buckets of ``bucket_size`` elements.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradsync.buffers import is_expert_parallel
from gradsync.buffers.shard_alignment import shard_alignment_of

UnitEntry = type[nn.Module] | str


def resolve_unit_classes(entries: Sequence[UnitEntry] | None) -> tuple[type[nn.Module], ...]:
    """Classes from classes or dotted import paths (``"package.module.Class"``)."""
    classes = []
    for entry in entries or ():
        if isinstance(entry, str):
            module_path, _, name = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_path), name)
            except (ImportError, AttributeError, ValueError) as err:
                raise ValueError(
                    f"fsdp_unit_modules entry {entry!r} does not import ({err}); give a class or a dotted "
                    "path 'package.module.Class'"
                ) from err
        else:
            cls = entry
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"fsdp_unit_modules entry {entry!r} is not an nn.Module subclass")
        classes.append(cls)
    return tuple(classes)


def find_units(root: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The outermost instances of ``classes`` in ``root``, in ``root.modules()`` order; every class must
    match at least one module."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside or not isinstance(module, classes):
            continue
        units.append(module)
        inside.update(id(m) for m in module.modules())
    for cls in classes:
        if not any(isinstance(m, cls) for m in root.modules()):
            raise ValueError(
                f"fsdp_unit_modules names {cls.__module__}.{cls.__qualname__}, which matches no module of "
                f"the model ({type(root).__name__}); remove it or name a class the model uses"
            )
    return units


@dataclass
class BucketSpec:
    """The params of one bucket, in layout order, with their first names."""

    dtype: torch.dtype
    requires_grad: bool
    unit_id: int | None
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def group_into_buckets(
    root: nn.Module, units: Sequence[nn.Module], bucket_size: int | None
) -> list[BucketSpec]:
    """Buckets in first-use order of ``root.named_parameters()``: one per (unit, dtype, requires_grad);
    params outside units (or used across a unit boundary) share buckets per (dtype, requires_grad), split
    at ``bucket_size`` elements. A ``chunk``-aligned param has a bucket of its own."""
    unit_of = _unit_of_params(root, units)
    groups: dict[tuple[torch.dtype, bool, int | None], list[BucketSpec]] = {}
    ordered: list[BucketSpec] = []
    for name, param in root.named_parameters():
        if is_expert_parallel(param):
            raise NotImplementedError(
                f"param {name!r} is expert-parallel (allreduce=False); gradsync-fsdp does not shard "
                "expert params yet: wrap the experts with gradsync-ddp or leave them out of the model"
            )
        unit_id = unit_of.get(param)
        if shard_alignment_of(param).alone:  # torch's chunk rule: a bucket of its own
            ordered.append(BucketSpec(param.dtype, param.requires_grad, unit_id, [name], [param]))
            continue
        key = (param.dtype, param.requires_grad, unit_id)
        buckets = groups.setdefault(key, [])
        full = (
            unit_id is None
            and bucket_size is not None
            and buckets
            and buckets[-1].numel + param.numel() > bucket_size
            and buckets[-1].params
        )
        if not buckets or full:
            buckets.append(BucketSpec(param.dtype, param.requires_grad, unit_id))
            ordered.append(buckets[-1])
        buckets[-1].names.append(name)
        buckets[-1].params.append(param)
    return ordered


def _unit_of_params(root: nn.Module, units: Sequence[nn.Module]) -> dict[nn.Parameter, int]:
    """The unit of every param used only inside one unit. A param also reached on a path outside its
    unit (a head tied to a unit's embedding, a weight shared by two units, a unit's submodule reused
    elsewhere) belongs to no unit: it goes to a non-unit bucket, which stays gathered for the whole
    forward and backward, as every user needs."""
    unit_ids = {id(unit): unit_id for unit_id, unit in enumerate(units)}
    holders: dict[nn.Parameter, set[int | None]] = {}

    def walk(module: nn.Module, unit_id: int | None) -> None:  # every path, shared modules included
        unit_id = unit_ids.get(id(module), unit_id) if unit_id is None else unit_id
        for param in module.parameters(recurse=False):
            holders.setdefault(param, set()).add(unit_id)
        for child in module.children():
            walk(child, unit_id)

    walk(root, None)
    return {param: unit_id for param, (unit_id, *more) in holders.items() if unit_id is not None and not more}
