"""Low-precision wire formats for gradient collectives: what one row of values becomes on the wire.

A row is one rank's piece of a bucket. In bf16 or fp16 it travels as that dtype. In fp8 (e4m3 or e5m2) it
is cut into blocks of ``block_size`` elements, each with one fp32 scale (the block's largest magnitude
over the format's largest finite value), so a block of small grads keeps its precision beside a block of
large ones. Plain torch casts are enough (no Transformer Engine). Every format is packed into bytes, so
one collective carries payload and scales together, and any backend that moves uint8 (gloo, NCCL) can
carry fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
HALF_WIRE_DTYPES = (torch.bfloat16, torch.float16)


def fp8_wire_dtypes() -> tuple[torch.dtype, ...]:
    """The fp8 dtypes this torch has (every supported torch has both; the lookup keeps that a check)."""
    return tuple(getattr(torch, name) for name in _FP8_NAMES if hasattr(torch, name))


def is_wire_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one a wire can carry (bf16, fp16, the fp8 dtypes)."""
    return dtype in (*HALF_WIRE_DTYPES, *fp8_wire_dtypes())


def wire_dtype_names() -> str:
    return ", ".join(f"torch.{name}" for name in ("bfloat16", "float16", *_FP8_NAMES))


def wire_problem(dtype: object, block_size: object, dtype_name: str, block_name: str) -> str | None:
    """What is wrong with a wire of ``dtype`` and fp8 ``block_size`` (named as the caller's arguments), or
    None: checked where the wire is set up, since packing would fail only inside the first reduction."""
    if not isinstance(dtype, torch.dtype) or not is_wire_dtype(dtype):
        return f"{dtype_name}={dtype} is not a wire dtype; use one of {wire_dtype_names()}"
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        return f"{block_name} must be a positive number of elements, got {block_size!r}"
    return None


@dataclass(frozen=True)
class WireFormat:
    """How a row of values is packed for the wire, and unpacked into fp32 on arrival."""

    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_value(self) -> float:
        """Wire bytes per value, padding aside: the payload and, for fp8, its share of a block's scale."""
        return self.dtype.itemsize + (4 / self.block_size if self.scaled else 0.0)

    @property
    def scaled(self) -> bool:
        """Whether blocks carry a scale (fp8: too few exponent bits to send grads unscaled)."""
        return self.dtype.itemsize == 1

    def padded_length(self, elements: int) -> int:
        """A row's length once padded to whole blocks."""
        if not self.scaled:
            return elements
        return -(-elements // self.block_size) * self.block_size

    def row_bytes(self, elements: int) -> int:
        """Bytes a row of ``elements`` values takes on the wire (payload, then fp32 scales)."""
        length = self.padded_length(elements)
        scales = length // self.block_size * 4 if self.scaled else 0
        return length * self.dtype.itemsize + scales

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Pack a ``(rows, padded_length)`` float tensor into ``(rows, row_bytes)`` uint8."""
        count, length = rows.shape
        if not self.scaled:
            return rows.to(self.dtype).view(torch.uint8).view(count, -1)
        blocks = rows.float().view(count, length // self.block_size, self.block_size)
        largest = torch.finfo(self.dtype).max
        scales = blocks.abs().amax(dim=-1, keepdim=True) / largest
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
        payload = (blocks / scales).clamp_(-largest, largest).to(self.dtype)
        packed = torch.empty(count, self.row_bytes(length), dtype=torch.uint8, device=rows.device)
        packed[:, :length] = payload.view(torch.uint8).view(count, length)
        packed[:, length:] = scales.view(count, -1).view(torch.uint8)
        return packed

    def decode(self, packed: torch.Tensor, length: int) -> torch.Tensor:
        """Unpack ``(rows, row_bytes(length))`` uint8 into a ``(rows, length)`` fp32 tensor."""
        count = packed.shape[0]
        if packed.numel() == 0:  # empty rows (a rank that owns no shard) have no strides to view
            return torch.zeros(count, length, dtype=torch.float32, device=packed.device)
        if not self.scaled:
            return packed.contiguous().view(self.dtype).float()
        payload = packed[:, :length].contiguous().view(self.dtype).float()
        scales = packed[:, length:].contiguous().view(torch.float32)
        return (payload.view(count, -1, self.block_size) * scales.unsqueeze(-1)).view(count, length)

    def pack_row(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (flat, any float dtype) as one packed row: flat uint8 of ``row_bytes(len)``."""
        padded = F.pad(values.float(), (0, self.padded_length(values.numel()) - values.numel()))
        return self.encode(padded.view(1, -1)).view(-1)

    def unpack_row(self, packed: torch.Tensor, length: int) -> torch.Tensor:
        """One packed row of ``length`` values back to flat fp32."""
        return self.decode(packed.view(1, -1), self.padded_length(length))[0, :length]
