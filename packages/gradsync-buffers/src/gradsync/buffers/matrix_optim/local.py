"""What a matrix optimizer may touch of each param: this rank's local tensor, nothing else.

Both wrappers hand optimizers pieces of params: gradsync-fsdp a DTensor per param (dim-0 ``Shard`` over
the shard mesh, uneven, possibly empty; ``Replicate`` for no_shard; 2-D placements on HSDP meshes),
gradsync-ddp plain fp32 main params. Matrix optimizers need whole matrices (Muon) or whole tiles
(block Shampoo), and must not communicate, so they work on the local tensor and check that it is whole
enough; where it starts in the param comes from metadata already on the rank, never a collective.

State tensors shaped like a param are DTensors with the param's layout when the param is one, as torch's
own optimizers make them, so the wrappers' checkpoint code describes and reshards them like the param.

gradsync-fsdp's ``fully_shard_optimizer`` lends an optimizer its DTensor params' local tensors (and
their state's) for the duration of each step, to spare DTensor dispatch. A local tensor does not know
its param's shape or placement, so these optimizers remember, for every DTensor param they are given,
which local tensor is its, and check a lent one as the DTensor it belongs to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..shard_alignment import SHARD_ALIGNMENT_ATTR, ShardAlignment
from ..torch_internals import even_chunk_shape_and_offset, local_tensor


def _sharded(param: torch.Tensor) -> bool:
    """A DTensor cut along some mesh dimension of more than one rank."""
    if not isinstance(param, DTensor):
        return False
    return any(p.is_shard() and param.device_mesh.size(dim) > 1 for dim, p in enumerate(param.placements))


PARAM_ORIGIN_ATTR = "_gradsync_param_origin"
"""Set on a plain tensor that holds part of a larger param (gradsync-ddp's fp32 main params): the
whole param's shape and where the part starts, as a :class:`ParamOrigin`."""


@dataclass(frozen=True)
class ParamOrigin:
    """The whole param a plain tensor is a part of: its shape, and the part's offset along each dim."""

    shape: torch.Size
    offsets: tuple[int, ...]


TENSOR_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim")
"""Megatron's marks of a param split by tensor parallelism, which Muon reads to gather its shards."""


def mark_param_origin(
    part: torch.Tensor, shape: torch.Size, offsets: tuple[int, ...], param: torch.Tensor | None = None
) -> None:
    """Record on ``part`` which param it belongs to, so a matrix optimizer can check it is whole enough
    (and, given the ``param``, its tensor-parallel marks, so Muon can gather its TP shards)."""
    setattr(part, PARAM_ORIGIN_ATTR, ParamOrigin(torch.Size(shape), tuple(offsets)))
    for name in TENSOR_PARALLEL_ATTRS:
        if param is not None and hasattr(param, name):
            setattr(part, name, getattr(param, name))


def _origin_stand_in(part: torch.Tensor) -> torch.Tensor | None:
    """A meta tensor shaped like the whole param ``part`` belongs to (carrying the origin), or None."""
    origin = getattr(part, PARAM_ORIGIN_ATTR, None)
    if not isinstance(origin, ParamOrigin) or origin.shape == part.shape:
        return None
    stand_in = torch.empty(origin.shape, device="meta")
    setattr(stand_in, PARAM_ORIGIN_ATTR, origin)
    return stand_in


def local_offsets(param: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's local tensor of ``param`` starts in the whole param, found without
    communication: the chunk gradsync attached (``gradsync.buffers.checkpointing.describe_chunk``, which
    gradsync-fsdp puts on every sharded param), a plain part's :class:`ParamOrigin`, else torch's even
    ``torch.chunk`` split when the local shape matches it. Raises ValueError when neither tells."""
    origin = getattr(param, PARAM_ORIGIN_ATTR, None)
    if isinstance(origin, ParamOrigin):
        return origin.offsets
    if not isinstance(param, DTensor) or all(isinstance(p, Replicate) for p in param.placements):
        return (0,) * param.dim()
    local: Any = local_tensor(param)
    described = getattr(local, "__create_chunk_list__", None)
    if described is not None:
        return tuple(int(o) for o in described()[0].offsets)
    shape, offsets = even_chunk_shape_and_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(
            f"cannot tell where this rank's shard (local shape {tuple(local.shape)}) of a param of shape "
            f"{tuple(param.shape)} starts: it is not torch.chunk's split; describe it with "
            "gradsync.buffers.checkpointing.describe_chunk(param, offsets)"
        )
    return tuple(offsets)


def zeros_like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """fp32 zeros shaped like ``param`` (the tensor in the param group): for a DTensor param, torch's
    ``zeros_like`` of it, so a DTensor subclass that carries its split (gradsync-fsdp's ``RaggedDTensor``)
    keeps it; a plain tensor shaped like ``local`` otherwise, a lent local tensor included (gradsync-fsdp
    makes such state a DTensor after the step, as for torch's optimizers)."""
    if isinstance(param, DTensor):
        return torch.zeros_like(param, dtype=torch.float32)
    return torch.zeros(local.shape, dtype=torch.float32, device=local.device)


@dataclass(frozen=True)
class LocalPiece:
    """One param's part on this rank, to be stepped."""

    index: int
    """The param's position among the optimizer's params (as ``state_dict`` numbers them)."""
    param: torch.Tensor
    """The tensor in the param group (its state's key): the param, or its lent local tensor."""
    layout: torch.Tensor
    """The param as given to the optimizer: a DTensor's global shape and placements, or the plain param."""
    local: torch.Tensor
    """This rank's elements of the param (a view of it)."""
    grad: torch.Tensor
    """The local grad, in fp32."""


def apply_update(local: torch.Tensor, update: torch.Tensor, step_size: float, decay: float) -> None:
    """``local <- local * (1 - decay) - step_size * update`` (decoupled weight decay: ``decay`` is
    lr * weight_decay), in fp32, cast back into ``local``."""
    weights = local.float()
    weights.mul_(1 - decay).add_(update.view(local.shape), alpha=-step_size)
    if weights is not local:
        local.copy_(weights)


class LocalOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that steps each param's local part on its own; state in fp32."""

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]
    ) -> None:
        self._dtensor_of_local: dict[int, DTensor] = {}
        """Every DTensor param by the id of its local tensor, which a wrapper may lend in its place."""
        self._policies_checked: set[int] = set()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._remember_dtensors(self.param_groups[-1]["params"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # torch pickles only defaults, state and param_groups
        self._dtensor_of_local = {}
        self._policies_checked = set()
        self._remember_dtensors([p for g in self.param_groups for p in g["params"]])

    def _remember_dtensors(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            if isinstance(param, DTensor):
                self._dtensor_of_local[id(local_tensor(param))] = param

    def layout_of(self, param: torch.Tensor) -> torch.Tensor:
        """The DTensor ``param`` is the local tensor of; for a part of a larger param
        (:func:`mark_param_origin`), a meta stand-in shaped like that param; else ``param`` itself."""
        owner = self._dtensor_of_local.get(id(param))
        if owner is not None and local_tensor(owner) is param:
            return owner
        stand_in = _origin_stand_in(param)
        return param if stand_in is None else stand_in

    def indexed_params(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Every param with its position among all params (as ``state_dict`` numbers them)."""
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                yield index, param
                index += 1

    def pieces(self, group: dict[str, Any], indices: dict[torch.Tensor, int]) -> Iterator[LocalPiece]:
        """The params of ``group`` with a grad, those this rank holds no element of included."""
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = local_tensor(param.grad).float()
            yield LocalPiece(indices[param], param, self.layout_of(param), local_tensor(param), grad)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_policies()
        indices = {param: index for index, param in self.indexed_params()}
        for group in self.param_groups:
            for piece in self.pieces(group, indices):
                if piece.local.numel():
                    self.step_piece(piece, group)
                else:
                    self.step_empty_piece(piece, group)
        return loss

    def step_piece(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def step_empty_piece(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        """The step of a param this rank holds no element of: its state (empty, like the param) and step
        counters, as torch's optimizers keep them for FSDP2's empty shards (torch's
        ``set_optimizer_state_dict`` wants state for every param with a grad, and takes a plain ``step``
        tensor from any one rank). Nothing by default."""

    def check_policy(
        self, index: int, param: torch.Tensor, policy: ShardAlignment, group: dict[str, Any]
    ) -> None:
        """Refuse a param whose shard-alignment ``policy`` can cut it where this optimizer cannot step a
        part. Decided from the policy alone, which every rank knows for every param, so every rank raises
        alike before any collective (a check of the local part would stop only the ranks holding one)."""

    def check_policies(self) -> None:
        """:meth:`check_policy` for every param sharded by a gradsync wrapper (a DTensor with a Shard
        placement that carries its policy), once per param."""
        for group in self.param_groups:
            for param in group["params"]:
                layout = self.layout_of(param)
                if id(layout) in self._policies_checked or not _sharded(layout):
                    continue
                policy = getattr(layout, SHARD_ALIGNMENT_ATTR, None)
                if isinstance(policy, ShardAlignment):
                    index = next(i for i, p in self.indexed_params() if p is param)
                    self.check_policy(index, layout, policy, group)
                self._policies_checked.add(id(layout))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but fp32 state stays fp32: torch casts loaded state to each param's dtype, which
        would round a bf16 param's fp32 state to bf16."""
        super().load_state_dict(state_dict)
        saved_ids: Iterable[int] = (i for g in state_dict["param_groups"] for i in g["params"])
        for saved_id, (_, param) in zip(saved_ids, self.indexed_params(), strict=True):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                    continue
                if self.state[param][key].dtype != torch.float32:
                    self.state[param][key] = value.to(device=param.device)
