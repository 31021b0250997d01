"""The fp32 main params and grads a DistributedOptimizer steps, one flat tensor pair per bucket.

Each bucket's part that this rank steps (its shard with the distributed optimizer, the whole bucket
without) is one contiguous range of the buffer, so it is held as one fp32 main tensor and one fp32 grad
tensor in the same coordinates. The per-param main params the inner optimizer sees are views into them,
with their grads attached once, so the per-step work is one grad copy and one weight copy per bucket
(O(buckets)), not one per param. Where the buffers already hold fp32 (the grad buffer with fp32 grads or
``grad_reduce_in_fp32``; the param buffer with fp32 params), the main tensor is that range of the buffer
itself and nothing is copied, as the reference steps fp32 params and grads in place: 8 + 8/d bytes per
param with fp32 params and grads, 6 + 12/d with bf16 params and fp32 grads (d ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import ParamAndGradBuffer
from gradsync.buffers.matrix_optim import mark_param_origin
from gradsync.buffers.shard_alignment import row_size, shard_alignment_of


@dataclass
class ShardPiece:
    """One param's elements that this rank steps, and the fp32 main param (a view) that stands for them."""

    name: str
    param: nn.Parameter
    main: nn.Parameter
    param_range: tuple[int, int]
    buffer_key: int
    group: dist.ProcessGroup
    shape: torch.Size  # of ``main``: flat, or whole rows where the param's shard alignment asks

    def model_slice(self) -> torch.Tensor:
        return self.param.data.view(-1)[self.param_range[0] : self.param_range[1]]


@dataclass
class BucketShard:
    """Buffer range ``[lo, hi)`` of one bucket as fp32 ``main`` and ``grad`` (padding included)."""

    buffer: ParamAndGradBuffer
    lo: int
    hi: int
    main: torch.Tensor
    grad: torch.Tensor
    pieces: list[ShardPiece] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # each piece's range in main / grad

    @property
    def grad_is_buffer(self) -> bool:
        """Whether ``grad`` is the grad buffer's own range (fp32 grads: nothing to copy)."""
        return self.grad.data_ptr() == self.buffer.grad_data[self.lo : self.hi].data_ptr()

    @property
    def main_is_buffer(self) -> bool:
        """Whether ``main`` is the param buffer's own range (fp32 params: nothing to copy)."""
        data = self.buffer.param_data
        return data is not None and self.main.data_ptr() == data[self.lo : self.hi].data_ptr()

    def load_grads(self) -> None:
        """This step's reduced grads (the grad buffer holds them in the grad dtype). If something set the
        main params' grads to None (the inner optimizer's own ``zero_grad``), they are attached again."""
        if not self.grad_is_buffer:
            self.grad.copy_(self.buffer.grad_data[self.lo : self.hi])
        if self.pieces and self.pieces[0].main.grad is None:
            self.attach_grads()

    def attach_grads(self) -> None:
        """Make every piece's grad its view of the flat grad, shaped as its main param."""
        for piece, (a, b) in zip(self.pieces, self.spans, strict=True):
            piece.main.grad = self.grad[a:b].view(piece.shape)

    def write_weights(self) -> None:
        """Copy the stepped main params into the model's weights: one copy into the param buffer, or,
        without one (no distributed optimizer), one fused copy over the pieces."""
        if self.buffer.param_data is not None:
            if not self.main_is_buffer:
                self.buffer.param_data[self.lo : self.hi].copy_(self.main)
        elif self.pieces:
            torch._foreach_copy_(
                [p.model_slice() for p in self.pieces], [p.main.detach().view(-1) for p in self.pieces]
            )

    def read_weights(self) -> None:
        """Adopt the model's current weights as the main params."""
        if self.buffer.param_data is not None:
            if not self.main_is_buffer:
                self.main.copy_(self.buffer.param_data[self.lo : self.hi])
            return
        for piece in self.pieces:
            piece.main.detach().view(-1).copy_(piece.model_slice())


def build_bucket_shards(
    buffers: list[ParamAndGradBuffer], sharded: bool, names: dict[nn.Parameter, str]
) -> list[BucketShard]:
    """For every bucket of every buffer, the range this rank steps and its pieces (views into it)."""
    shards = []
    for key, buffer in enumerate(buffers):
        group = buffer.data_parallel_group
        for bucket_id, (bucket_lo, bucket_hi) in enumerate(buffer.bucket_indices):
            if sharded:
                lo, hi = buffer.layout.shard_range(bucket_id, group.rank(), group.size())
                owned = [
                    (r.param_index, r.param_range, r.local)
                    for r in buffer.layout.shard_param_ranges(bucket_id, group.rank(), group.size())
                ]
            else:
                lo, hi = bucket_lo, bucket_hi
                owned = []
                for index in buffer.layout.bucket_params(bucket_id):
                    start, end, _ = buffer.layout.param_index_map[index]
                    owned.append((index, (0, end - start), (start - lo, end - lo)))
            fp32 = torch.float32
            params_fp32 = buffer.param_data is not None and buffer.param_data.dtype == fp32
            main = (
                buffer.param_data[lo:hi]
                if buffer.param_data is not None and params_fp32
                else torch.zeros(hi - lo, dtype=fp32, device=buffer.grad_data.device)
            )
            grad = buffer.grad_data[lo:hi] if buffer.grad_data.dtype == fp32 else torch.zeros_like(main)
            shard = BucketShard(buffer, lo, hi, main, grad)
            for index, param_range, (a, b) in owned:
                param = buffer.params[index]
                view = main[a:b]
                if not params_fp32:
                    view.copy_(param.detach().view(-1)[param_range[0] : param_range[1]])
                shape = piece_shape(param, param_range)
                piece_main = nn.Parameter(view.view(shape))
                mark_param_origin(piece_main, param.shape, piece_offsets(param, param_range, shape), param)
                shard.pieces.append(
                    ShardPiece(names[param], param, piece_main, param_range, key, group, shape)
                )
                shard.spans.append((a, b))
            shard.attach_grads()
            shards.append(shard)
    return shards


def piece_shape(param: nn.Parameter, param_range: tuple[int, int]) -> torch.Size:
    """The main param's shape for ``param_range`` of ``param``: matrix optimizers (Muon, block Shampoo)
    need the matrix, so a param laid out by a ``tensor`` or ``block`` policy gets its own shape when the
    piece is all of it, and whole rows when it is whole rows; other pieces stay flat, as the reference's."""
    lo, hi = param_range
    if shard_alignment_of(param).kind == "row":
        return torch.Size([hi - lo])
    if (lo, hi) == (0, param.numel()):
        return param.shape
    row = row_size(param.shape)
    if param.dim() > 1 and lo % row == 0 and hi % row == 0:
        return torch.Size([(hi - lo) // row, *param.shape[1:]])
    return torch.Size([hi - lo])


def piece_offsets(param: nn.Parameter, param_range: tuple[int, int], shape: torch.Size) -> tuple[int, ...]:
    """Where a piece of ``shape`` starts in ``param`` (for matrix optimizers): its first row for whole
    rows, else its first element of the flattened param (a flat piece)."""
    if len(shape) == param.dim() and param.dim() > 0:
        return (param_range[0] // row_size(param.shape),) + (0,) * (param.dim() - 1)
    return (param_range[0],)


def read_main_params_from_state_dict(pieces: list[ShardPiece], state_dict: dict[str, torch.Tensor]) -> None:
    """Set every piece's main param from a model state dict keyed by param name (a ``module.`` prefix,
    as Megatron's wrappers write it, is accepted too)."""
    missing = []
    for piece in pieces:
        value = state_dict.get(piece.name, state_dict.get(f"module.{piece.name}"))
        if value is None:
            missing.append(piece.name)
            continue
        lo, hi = piece.param_range
        piece.main.detach().view(-1).copy_(value.detach().reshape(-1)[lo:hi])
    if missing:
        raise KeyError(f"reload_model_params: the state dict has no entry for {sorted(set(missing))}")
