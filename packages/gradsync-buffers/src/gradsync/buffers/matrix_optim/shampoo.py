"""Block-diagonal Shampoo (Gupta, Koren and Singer, "Shampoo: Preconditioned Stochastic Tensor
Optimization", arXiv 1802.09568), with the blocking, exponential averages and Adam grafting of Distributed
Shampoo (Shi et al., arXiv 2309.06497).

Each param is viewed as a matrix: (shape[0], -1) for two or more dims, one row for a 1-D param. The
matrix is cut into ``r x c`` tiles from its top-left corner (ragged at the right and bottom edges), and
each tile is preconditioned on its own, so a rank holding whole tiles needs nothing from other ranks. At
step t, with grad G, for every tile (subscript omitted):

    M <- b1 M + (1 - b1) G,          M^ = M / (1 - b1^t)                 (momentum, whole param)
    L <- b2 L + (1 - b2) G G^T,      R <- b2 R + (1 - b2) G^T G          (b2 = 1: sums, as Shampoo)
    every ``precondition_frequency`` steps (first at t = 1), with L^ = L / (1 - b2^t) (L when b2 = 1):
        L^(-1/4) = Q diag((max(l, 0) + eps)^(-1/4)) Q^T  from  L^ = Q diag(l) Q^T  (torch.linalg.eigh)
        and R^(-1/4) likewise
    P = L^(-1/4) M^ R^(-1/4)
    grafting "adam":  V <- b2 V + (1 - b2) G*G (b2 = 1: sum),  A = M^ / (sqrt(V / (1 - b2^t)) + graft_eps),
                      D = P ||A||_F / ||P||_F  (per tile: Shampoo's direction, Adam's step size)
    grafting "none":  D = P
    W <- W (1 - lr wd) - lr D

With one tile and one step, P is the orthogonal polar factor of G (Muon's direction); grafting carries
AdamW's per-tile step size over, so AdamW's learning rate works. Tiles of equal shape are batched
(eigh runs on a batch), each tile computed exactly as on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..checkpointing import contiguous_stride, describe_chunk
from ..shard_alignment import ShardAlignment, row_size
from ..torch_internals import local_tensor
from .local import LocalOptimizer, LocalPiece, apply_update, local_offsets, zeros_like_param

Grafting = Literal["adam", "none"]


def block_shape(block_size: int | Sequence[int]) -> tuple[int, int]:
    """``k`` -> (k, k); ``(r, c)`` as it is; ValueError for anything else."""
    shape = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(shape) != 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(f"block_size must be a positive int or (rows, cols), got {block_size!r}")
    return shape[0], shape[1]


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a param is preconditioned as: (shape[0], rest) for two or more dims, one row else."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def inverse_fourth_root(stats: torch.Tensor, eps: float) -> torch.Tensor:
    """``(stats + eps I)^(-1/4)`` of a batch of symmetric PSD matrices, through their eigendecomposition
    (eigenvalues below 0 from rounding count as 0)."""
    eigenvalues, vectors = torch.linalg.eigh(stats)
    roots = (eigenvalues.clamp(min=0) + eps).pow(-0.25)
    root: torch.Tensor = (vectors * roots.unsqueeze(-2)) @ vectors.mT
    return root


def _runs(length: int, block: int) -> Iterator[tuple[int, int, int]]:
    """The tiles along one side of ``length`` as runs of equal extent: (first tile, count, extent)."""
    full, rest = divmod(length, block)
    if full:
        yield 0, full, block
    if rest:
        yield full, 1, rest


def _tiles(matrix: torch.Tensor, run: tuple[int, int, int, int]) -> torch.Tensor:
    """(count_r * rows, count_c * cols) -> (count_r, count_c, rows, cols) tiles, ``run`` being
    (count_r, rows, count_c, cols)."""
    count_r, rows, count_c, cols = run
    return matrix.reshape(count_r, rows, count_c, cols).transpose(1, 2)


def _untiles(tiles: torch.Tensor) -> torch.Tensor:
    count_r, count_c, rows, cols = tiles.shape
    return tiles.transpose(1, 2).reshape(count_r * rows, count_c * cols)


def _accumulate(stat: torch.Tensor, new: torch.Tensor, beta2: float) -> None:
    if beta2 == 1:
        stat.add_(new)
    else:
        stat.mul_(beta2).add_(new, alpha=1 - beta2)


class BlockShampoo(LocalOptimizer):
    """Shampoo with block-diagonal preconditioners over ``block_size`` tiles (``k`` or ``(r, c)``), Adam
    grafting by default, and decoupled weight decay (formulas in the module docstring). A block larger
    than a param's matrix is clipped to it.

    Each rank updates only its local part of each param, without communication. The local part must be
    whole tiles: its first row (a DTensor's chunk offset, from the chunk gradsync-fsdp attaches or
    torch's even split) on a multiple of ``r``, its last at a multiple of ``r`` or the matrix's end, and
    likewise for columns (gradsync-fsdp: ``shard_alignment='block:RxC'``); a plain tensor is a whole param.

    State per param: ``step``; ``exp_avg`` and, with Adam grafting, ``exp_avg_sq``, shaped like the param;
    ``L``, ``R``, ``L_inv_root``, ``R_inv_root``: one matrix per tile, as (tile rows, tile cols, r, r) and
    (..., c, c) tensors (ragged tiles use the top-left corner). For a sharded DTensor param these are
    DTensors whose chunk (in tiles) is described for ``torch.distributed.checkpoint``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-12,
        block_size: int | tuple[int, int] = 128,
        precondition_frequency: int = 1,
        weight_decay: float = 0.0,
        grafting: Grafting = "adam",
        grafting_eps: float = 1e-8,
    ) -> None:
        beta1, beta2 = betas
        if min(lr, weight_decay, grafting_eps) < 0 or eps <= 0 or not (0 <= beta1 < 1 and 0 < beta2 <= 1):
            raise ValueError(
                "BlockShampoo: need lr >= 0, weight_decay >= 0, eps > 0, grafting_eps >= 0, "
                f"0 <= betas[0] < 1 and 0 < betas[1] <= 1; got lr={lr}, weight_decay={weight_decay}, "
                f"eps={eps}, grafting_eps={grafting_eps}, betas={betas}"
            )
        if precondition_frequency < 1:
            raise ValueError(
                f"BlockShampoo: precondition_frequency must be >= 1, got {precondition_frequency}"
            )
        if grafting not in ("adam", "none"):
            raise ValueError(f"BlockShampoo: grafting must be 'adam' or 'none', got {grafting!r}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "block_size": block_shape(block_size),
            "precondition_frequency": precondition_frequency,
            "weight_decay": weight_decay,
            "grafting": grafting,
            "grafting_eps": grafting_eps,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, with the group's ``block_size`` normalised to (r, c)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["block_size"] = block_shape(group["block_size"])

    def check_policy(
        self, index: int, param: torch.Tensor, policy: ShardAlignment, group: dict[str, Any]
    ) -> None:
        r, c = group["block_size"]
        tile = r * row_size(param.shape) if param.dim() >= 2 else c  # elements of one row of tiles
        if (
            policy.whole
            or param.dim() == 0
            or (policy.kind == "block" and policy.flat_multiple(param.shape) % tile == 0)
        ):
            return
        raise ValueError(
            f"BlockShampoo: param {index} of shape {tuple(param.shape)} is sharded with shard_alignment "
            f"'{policy}', which may cut its {r}x{c} tiles: shard it with shard_alignment='block:{r}x{c}' "
            "(or 'tensor')"
        )

    def _state_of(self, piece: LocalPiece, group: dict[str, Any]) -> dict[str, Any]:
        """The param's state, made at its first step: moments shaped like it, statistics per tile."""
        param, layout, local = piece.param, piece.layout, piece.local
        state: dict[str, Any] = self.state[param]
        if not state:
            if local.numel():
                block, origin = _local_tiling(piece, group["block_size"])
            else:  # no tile here, so none to check: the statistics are empty
                whole_rows, whole_cols = matrix_shape(layout.shape)
                size = group["block_size"]
                block, origin = (min(size[0], whole_rows), min(size[1], whole_cols)), (0, 0)
            r, c = block
            rows, cols = matrix_shape(local.shape)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = zeros_like_param(param, local)
            grid = (math.ceil(rows / r), math.ceil(cols / c))
            for name, side in (("L", r), ("R", c), ("L_inv_root", r), ("R_inv_root", c)):
                state[name] = _tile_stats(layout, local, (*grid, side, side), origin, block)
        if group["grafting"] == "adam" and "exp_avg_sq" not in state:
            state["exp_avg_sq"] = zeros_like_param(param, local)
        return state

    def step_empty_piece(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        """Empty state (no tiles here) and a step counter that moves with the other ranks'."""
        self._state_of(piece, group)["step"] += 1

    def step_piece(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        local = piece.local
        block = _local_tiling(piece, group["block_size"])[0]
        r, c = block
        rows, cols = matrix_shape(local.shape)
        state = self._state_of(piece, group)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        stats_correction = 1 - beta2**step if beta2 < 1 else 1.0
        refresh = (step - 1) % group["precondition_frequency"] == 0

        grad = piece.grad.reshape(rows, cols)
        exp_avg = local_tensor(state["exp_avg"]).view(rows, cols)
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        momentum = exp_avg / (1 - beta1**step)
        adam = None
        if group["grafting"] == "adam":
            exp_avg_sq = local_tensor(state["exp_avg_sq"]).view(rows, cols)
            _accumulate(exp_avg_sq, grad * grad, beta2)
            adam = momentum / ((exp_avg_sq / stats_correction).sqrt() + group["grafting_eps"])
        left, right, left_root, right_root = (
            local_tensor(state[k]) for k in ("L", "R", "L_inv_root", "R_inv_root")
        )
        update = torch.empty_like(grad)
        for first_r, count_r, extent_r in _runs(rows, r):
            for first_c, count_c, extent_c in _runs(cols, c):
                where = (
                    slice(first_r * r, first_r * r + count_r * extent_r),
                    slice(first_c * c, first_c * c + count_c * extent_c),
                )
                tiles = (slice(first_r, first_r + count_r), slice(first_c, first_c + count_c))
                run = (count_r, extent_r, count_c, extent_c)
                g = _tiles(grad[where], run)
                lhs = left[tiles][..., :extent_r, :extent_r]
                rhs = right[tiles][..., :extent_c, :extent_c]
                _accumulate(lhs, g @ g.mT, beta2)
                _accumulate(rhs, g.mT @ g, beta2)
                lhs_root = left_root[tiles][..., :extent_r, :extent_r]
                rhs_root = right_root[tiles][..., :extent_c, :extent_c]
                if refresh:
                    lhs_root.copy_(inverse_fourth_root(lhs / stats_correction, eps))
                    rhs_root.copy_(inverse_fourth_root(rhs / stats_correction, eps))
                direction = lhs_root @ _tiles(momentum[where], run) @ rhs_root
                if adam is not None:
                    direction = _graft(direction, _tiles(adam[where], run))
                update[where] = _untiles(direction)
        lr = float(group["lr"])
        apply_update(local, update, lr, lr * float(group["weight_decay"]))


def _graft(direction: torch.Tensor, graft: torch.Tensor) -> torch.Tensor:
    """``direction`` scaled, tile by tile, to the Frobenius norm of ``graft`` (zero tiles stay zero)."""
    norm = torch.linalg.matrix_norm(direction, keepdim=True)
    scale = torch.where(norm > 0, torch.linalg.matrix_norm(graft, keepdim=True) / norm, 0.0)
    return direction * scale


def _local_tiling(piece: LocalPiece, block_size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The param's tile shape (``block_size`` clipped to its matrix) and the tile where this rank's part
    starts; ValueError when the part cuts a tile."""
    param, local = piece.layout, piece.local
    rows, cols = matrix_shape(param.shape)
    block = (min(block_size[0], rows), min(block_size[1], cols))
    policy = f"shard_alignment='block:{block_size[0]}x{block_size[1]}'"
    if local.dim() != param.dim():
        raise ValueError(
            f"BlockShampoo: param {piece.index} of shape {tuple(param.shape)} is a flat piece of "
            f"{local.numel()} elements on this rank (gradsync-ddp's default layout); shard it with {policy} "
            "(or 'tensor') so its pieces are whole rows"
        )
    offsets = local_offsets(param)
    if param.dim() > 2 and local.shape[1:] != param.shape[1:]:
        raise ValueError(
            f"BlockShampoo: param {piece.index} of shape {tuple(param.shape)} is cut on this rank along a "
            f"dim other than the first (local shape {tuple(local.shape)}); shard it by rows with {policy} "
            "(or 'tensor')"
        )
    if param.dim() >= 2:
        start = (offsets[0], offsets[1] if param.dim() == 2 else 0)
    else:
        start = (0, offsets[0] if param.dim() else 0)
    held = matrix_shape(local.shape)
    for side, what in ((0, "rows"), (1, "columns")):
        first, end, size, total = start[side], start[side] + held[side], block[side], (rows, cols)[side]
        if first % size or (end % size and end != total):
            raise ValueError(
                f"BlockShampoo: param {piece.index} of shape {tuple(param.shape)} (a {rows}x{cols} matrix) "
                f"is cut on this rank, which holds its {what} {first} to {end - 1}, through its "
                f"{block[0]}x{block[1]} blocks; shard it with {policy} (or 'tensor')"
            )
    return block, (start[0] // block[0], start[1] // block[1])


def _tile_stats(
    param: torch.Tensor,
    local: torch.Tensor,
    shape: tuple[int, int, int, int],
    origin: tuple[int, int],
    block: tuple[int, int],
) -> torch.Tensor:
    """fp32 zeros for one statistic over this rank's tiles; for a sharded DTensor param, a DTensor over
    every tile of the param whose chunk starts at this rank's first tile, so that checkpoints reshard it
    on tile boundaries."""
    zeros = torch.zeros(shape, dtype=torch.float32, device=local.device)
    if not isinstance(param, DTensor) or all(isinstance(p, Replicate) for p in param.placements):
        return zeros
    rows, cols = matrix_shape(param.shape)
    tiles = torch.Size((math.ceil(rows / block[0]), math.ceil(cols / block[1]), *shape[2:]))
    placements: list[Placement] = [
        p if isinstance(p, Replicate) else Shard(1 if param.dim() == 1 else min(getattr(p, "dim", 0), 1))
        for p in param.placements
    ]
    stats = DTensor.from_local(
        zeros, param.device_mesh, placements, run_check=False, shape=tiles, stride=contiguous_stride(tiles)
    )
    return describe_chunk(stats, [*origin, 0, 0])
