"""A small GPT in plain torch, with toy tensor/sequence, pipeline and expert parallelism.

One :class:`GPTStage` is what one rank holds: the whole model on a single process, or its share of it
under a layout. Every parameter's name is its name in the full model (layers and experts are keyed by
their global index), and every full tensor is drawn from a generator seeded by that name, so any layout
starts from exactly the weights of the single-process model. The embedding is tied to the output: with two
pipeline stages the last stage holds a copy (``output_weight``) that ``finalize_model_grads`` keeps in step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.groups import ModelParallelConfig, ProcessGroupCollection

from .parallel_ops import collective, gather_without_grad, group_rank, group_size


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 32
    d_model: int = 64
    n_head: int = 4
    n_layer: int = 2
    moe: bool = False  # every MLP becomes a top-1 mixture of `num_experts` experts
    num_experts: int = 2
    seed: int = 1234


TIED_COPY = "output_weight"  # the last stage's copy of wte.weight


class TensorParallel:
    """Where activations enter and leave the tensor-parallel region (sequence parallel or not)."""

    def __init__(self, group: torch.distributed.ProcessGroup | None, sequence_parallel: bool) -> None:
        self.group, self.size = group, group_size(group)
        self.sequence_parallel = sequence_parallel and self.size > 1

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Full input of column-parallel layers; each rank's grad to it is partial, hence the sum."""
        if self.sequence_parallel:
            return collective(x, self.group, 1, "all_gather", "reduce_scatter")
        return collective(x, self.group, 1, "identity", "all_reduce")

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the row-parallel partial outputs (scattered along the sequence with SP)."""
        if self.sequence_parallel:
            return collective(x, self.group, 1, "reduce_scatter", "all_gather")
        return collective(x, self.group, 1, "all_reduce", "identity")

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated activations -> this rank's part of the sequence (SP only)."""
        if not self.sequence_parallel:
            return x
        return collective(x, self.group, 1, "split", "all_gather")

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part -> the whole sequence, consumed identically by every rank (SP only)."""
        if not self.sequence_parallel:
            return x
        return collective(x, self.group, 1, "all_gather", "split")


def _parameter(
    *shape: int, init: str, partition_dim: int | None = None, sequence_parallel: bool = False
) -> nn.Parameter:
    """An uninitialised param tagged the way Megatron tags them, plus how :func:`initialise` fills it."""
    param = nn.Parameter(torch.empty(shape))
    param.init_kind = init  # type: ignore[attr-defined]
    if partition_dim is not None:
        param.tensor_model_parallel = True  # type: ignore[attr-defined]
        param.partition_dim = partition_dim  # type: ignore[attr-defined]
    if sequence_parallel:
        param.sequence_parallel = True  # type: ignore[attr-defined]
    return param


class LayerNorm(nn.Module):
    def __init__(self, d: int, tp: TensorParallel) -> None:
        super().__init__()
        # Under sequence parallelism each TP rank sees part of the sequence: its grads are partial sums.
        self.weight = _parameter(d, init="ones", sequence_parallel=tp.sequence_parallel)
        self.bias = _parameter(d, init="zeros", sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over TP; the input must be the full activation (``TensorParallel.enter``)."""

    def __init__(self, d_in: int, d_out: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = _parameter(d_out // tp.size, d_in, init="normal", partition_dim=0)
        self.bias = _parameter(d_out // tp.size, init="zeros", partition_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split over TP; partial outputs summed, then the (replicated) bias added."""

    def __init__(self, d_in: int, d_out: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        # Scaled down like GPT-2's residual projections.
        self.weight = _parameter(d_out, d_in // tp.size, init="scaled", partition_dim=1)
        self.bias = _parameter(d_out, init="zeros", sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.leave(F.linear(x, self.weight)) + self.bias


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.heads, self.head_dim = tp, cfg.n_head // tp.size, cfg.d_model // cfg.n_head
        self.q, self.k, self.v = (ColumnParallelLinear(cfg.d_model, cfg.d_model, tp) for _ in range(3))
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp.enter(x)
        b, t, _ = x.shape
        q, k, v = (
            lin(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.fc = ColumnParallelLinear(cfg.d_model, 4 * cfg.d_model, tp)
        self.proj = RowParallelLinear(4 * cfg.d_model, cfg.d_model, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(self.tp.enter(x))))
        return out


class MoE(nn.Module):
    """Top-1 mixture of experts; expert parallelism gathers every EP rank's tokens, lets each rank's
    experts process the tokens routed to them, and reduce-scatters the outputs back to their owners."""

    def __init__(self, cfg: GPTConfig, ep: torch.distributed.ProcessGroup | None) -> None:
        super().__init__()
        self.ep = ep
        local = cfg.num_experts // group_size(ep)
        first = group_rank(ep) * local
        self.router = nn.Linear(cfg.d_model, cfg.num_experts)
        unsharded = TensorParallel(None, sequence_parallel=False)
        self.experts = nn.ModuleDict({str(first + i): MLP(cfg, unsharded) for i in range(local)})
        for param in self.experts.parameters():
            param.allreduce = False  # type: ignore[attr-defined]  # reduced over expt_dp only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gate, choice = F.softmax(self.router(tokens), dim=-1).max(dim=-1)
        everyone = collective(tokens, self.ep, 0, "all_gather", "reduce_scatter")
        chosen = gather_without_grad(choice, self.ep)
        out = torch.zeros_like(everyone)
        for index, expert in self.experts.items():
            rows = (chosen == int(index)).nonzero().squeeze(1)
            out = out.index_copy(0, rows, expert(everyone[rows]))
        mine = collective(out, self.ep, 0, "reduce_scatter", "all_gather")
        return (mine * gate.unsqueeze(1)).view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: TensorParallel, ep: torch.distributed.ProcessGroup | None) -> None:
        super().__init__()
        self.ln1, self.attn = LayerNorm(cfg.d_model, tp), Attention(cfg, tp)
        self.ln2 = LayerNorm(cfg.d_model, tp)
        self.mlp: nn.Module = MoE(cfg, ep) if cfg.moe else MLP(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPTStage(nn.Module):
    """This rank's pipeline stage: embeddings on the first, final norm and tied output on the last.

    ``groups`` None is the single-process model. Carries the attributes ``finalize_model_grads`` reads:
    ``config``, ``pre_process``/``post_process`` and ``shared_embedding_or_output_weight()``.
    """

    def __init__(
        self, cfg: GPTConfig, groups: ProcessGroupCollection | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        tp_group, pp_group, ep_group = (
            (None, None, None) if groups is None else (groups.tp, groups.pp, groups.ep)
        )
        self.cfg, self.tp = cfg, TensorParallel(tp_group, sequence_parallel)
        pp, stage = group_size(pp_group), group_rank(pp_group)
        check_divisible(cfg, tp=self.tp.size, pp=pp, ep=group_size(ep_group))
        self.config = ModelParallelConfig(
            tensor_model_parallel_size=self.tp.size,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=group_size(ep_group),
            sequence_parallel=self.tp.sequence_parallel,
        )
        self.pre_process, self.post_process = stage == 0, stage == pp - 1
        self.share_embeddings_and_output_weights = True
        if self.pre_process:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        per_stage = cfg.n_layer // pp
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, self.tp, ep_group) for i in layers})
        if self.post_process:
            self.ln_f = LayerNorm(cfg.d_model, self.tp)
            if not self.pre_process:
                self.output_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        if pp > 1:  # both copies in a bucket of their own, with the same shard ranges (distributed optimizer)
            self.shared_embedding_or_output_weight().shared_embedding = True  # type: ignore[attr-defined]
        initialise(self, cfg, tp_rank=group_rank(tp_group))

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.wte.weight if self.pre_process else self.output_weight

    def activation_shape(self, rows: int) -> tuple[int, int, int]:
        """What one stage hands the next for ``rows`` sequences (this rank's part of it with SP)."""
        seq = self.cfg.seq_len // self.tp.size if self.tp.sequence_parallel else self.cfg.seq_len
        return rows, seq, self.cfg.d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [batch, seq] on the first stage, else hidden states; logits on the last stage."""
        if self.pre_process:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tp.scatter_sequence(self.wte(x) + self.wpe(positions))
        for block in self.blocks.values():
            x = block(x)
        if not self.post_process:
            return x
        h = self.tp.gather_sequence(self.ln_f(x))
        return F.linear(h, self.shared_embedding_or_output_weight())


def next_token_loss(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each window's bytes 1..n from the logits over bytes 0..n-1."""
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def check_divisible(cfg: GPTConfig, *, tp: int, pp: int, ep: int) -> None:
    problems = []
    if cfg.n_head % tp or cfg.seq_len % tp:
        problems.append(f"n_head ({cfg.n_head}) and seq_len ({cfg.seq_len}) must be divisible by tp ({tp})")
    if cfg.n_layer % pp:
        problems.append(f"n_layer ({cfg.n_layer}) must be divisible by pp ({pp})")
    if ep > 1 and not cfg.moe:
        problems.append(f"expert parallelism (ep={ep}) needs the MoE model (moe=True)")
    if cfg.moe and (cfg.num_experts % ep):
        problems.append(f"num_experts ({cfg.num_experts}) must be divisible by ep ({ep})")
    if cfg.moe and tp > 1:
        problems.append("the toy MoE does not split experts over tensor parallelism: use tp=1 with moe")
    if problems:
        raise ValueError("GPT layout: " + "; ".join(problems))


def full_name(name: str) -> str:
    """A param's name in the single-process model."""
    return "wte.weight" if name == TIED_COPY else name


def full_tensor(name: str, param: nn.Parameter, shape: tuple[int, ...], cfg: GPTConfig) -> torch.Tensor:
    """The single-process value of param ``name``: a pure function of its name, init kind and the seed."""
    kind = getattr(param, "init_kind", "zeros" if name.endswith("bias") else "normal")
    if kind in ("ones", "zeros"):
        return torch.ones(shape) if kind == "ones" else torch.zeros(shape)
    generator = torch.Generator().manual_seed(cfg.seed ^ zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if kind == "scaled" else 0.02
    return torch.randn(shape, generator=generator) * std


def full_shape(param: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    dim = getattr(param, "partition_dim", None)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


@torch.no_grad()
def initialise(stage: GPTStage, cfg: GPTConfig, tp_rank: int) -> None:
    for name, param in stage.named_parameters():
        full = full_tensor(full_name(name), param, full_shape(param, stage.tp.size), cfg)
        dim = getattr(param, "partition_dim", None)
        param.copy_(full if dim is None else full.chunk(stage.tp.size, dim=dim)[tp_rank])
