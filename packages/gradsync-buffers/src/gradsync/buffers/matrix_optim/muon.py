"""Muon in Moonlight's formulation (Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982).

For a matrix param W (m x n; a param of more dims is viewed as (shape[0], -1)) with grad G:

    B <- mu B + G                                  (momentum buffer)
    M  = G + mu B  (nesterov)   or   M = B
    O  = NS5(M)                                    (approximately U V^T of M = U S V^T)
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) O

NS5 is five steps of the quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X with A = X X^T,
(a, b, c) = (3.4445, -4.7750, 2.0315), started from M / ||M||_F (Jordan et al., "Muon: An optimizer for
hidden layers", 2024). These coefficients trade exact convergence for speed: the result keeps M's
singular vectors, and singular values of M above 1/500 of its Frobenius norm come out in [0.68, 1.21],
not at 1. The 0.2 sqrt(max(m, n)) factor gives the update the RMS of a typical AdamW update (Moonlight
section 2.2), so AdamW's learning rate and weight decay carry over. Params in groups with
``use_muon=False`` (embeddings, the output head, 1-D params) take AdamW: for fp32 params, bit for bit
``torch.optim.AdamW``'s single-tensor step with ``betas=adamw_betas`` and ``eps=adamw_eps``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..shard_alignment import ShardAlignment
from ..torch_internals import local_tensor
from .local import LocalOptimizer, LocalPiece, apply_update, zeros_like_param

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic Newton-Schulz step; the polynomial's slope at 0 is a, so small singular values
grow fast (up to a^5, about 490 times, in 5 steps), at the price of oscillating within [0.68, 1.21]
instead of converging to 1."""

TP_MODES = ("duplicated", "blockwise")
"""How Muon treats a matrix split over tensor-parallel ranks (Megatron's ``tensor_model_parallel`` params):
``duplicated`` gathers the TP shards of its update and every TP rank orthogonalises the whole matrix (the
same step as one process on the unsplit model); ``blockwise`` orthogonalises each shard on its own, with
no communication (a different, block-diagonal optimizer)."""

EMBEDDING_OR_HEAD_NAMES = ("embed", "lm_head", "output_layer")
"""Substrings of param names that :func:`muon_param_groups` leaves to AdamW."""


def newton_schulz(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately the orthogonal polar factor U V^T of ``matrix`` (U S V^T), by ``steps`` quintic
    Newton-Schulz steps computed in ``dtype``; returned in fp32. Odd polynomials keep the singular
    vectors, so only the singular values are approximate."""
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz takes a matrix, got shape {tuple(matrix.shape)}")
    a, b, c = NS_COEFFICIENTS
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.to(dtype)
    if tall:
        x = x.mT  # the Gram matrix X X^T on the short side is the cheaper one
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)  # every singular value in [0, 1]
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    result: torch.Tensor = x.mT if tall else x
    return result.float()


def muon_param_groups(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
    exclude: Iterable[str] = EMBEDDING_OR_HEAD_NAMES,
) -> list[dict[str, Any]]:
    """Moonlight's split: ``[{"params": hidden matrices, "use_muon": True}, {"params": the rest,
    "use_muon": False}]``. A hidden matrix has two or more dims, no ``exclude`` substring in its name,
    and no Megatron ``is_embedding_or_output_parameter`` flag; the rest (embeddings, the output head, 1-D
    params) take AdamW. Both groups are returned even when empty, so group indices are stable."""
    named = (
        model_or_named_params.named_parameters()
        if isinstance(model_or_named_params, nn.Module)
        else model_or_named_params
    )
    excluded = tuple(exclude)
    hidden: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for name, param in named:
        if not param.requires_grad:
            continue
        is_hidden = (
            param.dim() >= 2
            and not any(word in name for word in excluded)
            and not getattr(param, "is_embedding_or_output_parameter", False)
        )
        (hidden if is_hidden else rest).append(param)
    return [{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}]


class Muon(LocalOptimizer):
    """Muon for the hidden matrices, AdamW for groups with ``use_muon=False`` (see the module docstring
    for the formulas). Every group's ``use_muon`` defaults to True; :func:`muon_param_groups` splits a
    model as Moonlight does.

    Each rank updates only its local part of each param, without communication over data parallelism: a
    Muon param's local tensor must be the whole matrix (gradsync's ``shard_alignment='tensor'``) or empty
    (skipped). A matrix split by tensor parallelism (``tensor_model_parallel`` and ``partition_dim`` on it,
    as Megatron marks them) is stepped per ``tp_mode`` (:data:`TP_MODES`) over ``tp_group``: with
    ``duplicated`` (the default) the TP ranks all-gather its update and each takes its own rows or columns
    of the whole matrix's Newton-Schulz result.
    Moonlight's learning rates are AdamW's (its update RMS is matched to AdamW's); the default ``lr`` is
    Muon's original 0.02. The Newton-Schulz iteration runs in ``ns_dtype`` (Moonlight uses bf16 on GPUs);
    state and the rest of the math are fp32, the result cast back into the param.

    State per param, shaped like it: ``momentum_buffer`` (Muon), or ``step``, ``exp_avg``, ``exp_avg_sq``
    (AdamW, as torch's AdamW names them).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.float32,
        use_muon: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        tp_mode: str = "duplicated",
    ) -> None:
        if tp_mode not in TP_MODES:
            raise ValueError(f"Muon: tp_mode must be one of {', '.join(TP_MODES)}, got {tp_mode!r}")
        self.tp_group = tp_group
        """The tensor-parallel group of ``tensor_model_parallel`` params (None: no TP, or ``blockwise``)."""
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or ns_steps < 0 or adamw_eps < 0:
            raise ValueError(
                "Muon: need lr >= 0, weight_decay >= 0, 0 <= momentum < 1, ns_steps >= 0 and "
                f"adamw_eps >= 0; got lr={lr}, weight_decay={weight_decay}, momentum={momentum}, "
                f"ns_steps={ns_steps}, adamw_eps={adamw_eps}"
            )
        if not all(0 <= beta < 1 for beta in adamw_betas):
            raise ValueError(f"Muon: adamw_betas must lie in [0, 1), got {adamw_betas}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "weight_decay": weight_decay,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "ns_dtype": ns_dtype,
            "use_muon": use_muon,
            "tp_mode": tp_mode,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, refusing at once a Muon param whose gradsync shard-alignment policy may cut it (every
        rank alike), then one that is not a matrix or not whole on this rank."""
        first = sum(len(g["params"]) for g in self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.check_policies()
        if group["use_muon"]:
            for offset, param in enumerate(group["params"]):
                _check_muon_param(first + offset, self.layout_of(param), local_tensor(param))

    def check_policy(
        self, index: int, param: torch.Tensor, policy: ShardAlignment, group: dict[str, Any]
    ) -> None:
        if group["use_muon"] and param.dim() >= 2 and not policy.whole:
            raise ValueError(
                f"Muon: param {index} of shape {tuple(param.shape)} is sharded with shard_alignment "
                f"'{policy}', which may cut it, and Muon orthogonalises whole matrices without "
                "communicating: shard it with shard_alignment='tensor', or put it in a use_muon=False group"
            )

    def step_piece(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        if group["use_muon"]:
            self._muon(piece, group)
        else:
            self._adamw(piece, group)

    def step_empty_piece(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        if not group["use_muon"]:
            self._adamw(piece, group)  # element-wise: empty tensors step as any, and the counter moves
        elif not self.state[piece.param]:
            self.state[piece.param]["momentum_buffer"] = zeros_like_param(piece.param, piece.local)

    def _muon(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        _check_muon_param(piece.index, piece.layout, piece.local)
        state = self.state[piece.param]
        if not state:
            state["momentum_buffer"] = zeros_like_param(piece.param, piece.local)
        grad = piece.grad.reshape(piece.grad.shape[0], -1)
        buffer = local_tensor(state["momentum_buffer"]).view(grad.shape)
        momentum = group["momentum"]
        buffer.mul_(momentum).add_(grad)
        direction = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
        split = self._tensor_parallel_dim(piece, group)
        if split is None:
            update = newton_schulz(direction, group["ns_steps"], group["ns_dtype"])
            matrix_shape = direction.shape
        else:
            assert self.tp_group is not None
            whole = _gather_along(direction, split, self.tp_group)
            width = direction.shape[split]
            orthogonal = newton_schulz(whole, group["ns_steps"], group["ns_dtype"])
            update = orthogonal.narrow(split, self.tp_group.rank() * width, width)
            matrix_shape = whole.shape
        lr = float(group["lr"])
        scaled_lr = lr * 0.2 * math.sqrt(max(matrix_shape))
        apply_update(piece.local, update, scaled_lr, lr * float(group["weight_decay"]))

    def _tensor_parallel_dim(self, piece: LocalPiece, group: dict[str, Any]) -> int | None:
        """The dim of the (rows, -1) matrix view along which TP splits the param, when its shards are to be
        gathered (``duplicated``, a TP group of more than one rank, a ``tensor_model_parallel`` param)."""
        tp = self.tp_group
        if tp is None or tp.size() == 1 or group["tp_mode"] != "duplicated":
            return None
        if not getattr(piece.layout, "tensor_model_parallel", False):
            return None
        dim = int(getattr(piece.layout, "partition_dim", 0))
        if dim != 0 and not (dim == 1 and piece.layout.dim() == 2):
            raise ValueError(
                f"Muon: param {piece.index} of shape {tuple(piece.layout.shape)} is split by tensor "
                f"parallelism along dim {dim}; Muon views a param as (shape[0], -1), so only dim 0 or a "
                "matrix's dim 1 can be gathered: use tp_mode='blockwise' or a use_muon=False group"
            )
        return dim

    def _adamw_state(self, piece: LocalPiece) -> dict[str, Any]:
        state: dict[str, Any] = self.state[piece.param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = zeros_like_param(piece.param, piece.local)
            state["exp_avg_sq"] = zeros_like_param(piece.param, piece.local)
        return state

    def _adamw(self, piece: LocalPiece, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's single-tensor step (decoupled decay, bias-corrected moments), in fp32."""
        state = self._adamw_state(piece)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["adamw_betas"]
        lr = float(group["lr"])
        grad = piece.grad
        exp_avg = local_tensor(state["exp_avg"])
        exp_avg_sq = local_tensor(state["exp_avg_sq"])
        weights = piece.local.float()
        weights.mul_(1 - lr * float(group["weight_decay"]))
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["adamw_eps"])
        weights.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        if weights is not piece.local:
            piece.local.copy_(weights)


def _gather_along(shard: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole matrix from every TP rank's ``shard`` (the same shape on each), in TP-rank order."""
    pieces = [torch.empty_like(shard) for _ in range(group.size())]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    return torch.cat(pieces, dim)


def _check_muon_param(index: int, param: torch.Tensor, local: torch.Tensor) -> None:
    if param.dim() < 2:
        raise ValueError(
            f"Muon: param {index} of shape {tuple(param.shape)} is not a matrix; put it in a group with "
            "use_muon=False (AdamW), as muon_param_groups(model) does, or, if it is a matrix flattened by "
            "gradsync-ddp's DistributedOptimizer, wrap the model with shard_alignment='tensor'"
        )
    if local.numel() and local.shape != param.shape:
        raise ValueError(
            f"Muon: param {index} of shape {tuple(param.shape)} is cut on this rank (local shape "
            f"{tuple(local.shape)}), and Muon orthogonalises whole matrices without communicating: shard "
            "it with shard_alignment='tensor' (whole on one rank), or put it in a use_muon=False group"
        )
