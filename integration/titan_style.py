"""torchtitan's llama3 training, small: the model, its ``parallelize`` and its train step, written once and
run with either ``fully_shard`` (torch's or gradsync's, chosen by module name), so two runs differ only by
that import. Written from torchtitan's public code and docs, not copied.

- The model: a Llama (RMSNorm, rotary embeddings in a non-persistent buffer the init computes, grouped-query
  attention, SwiGLU), built under ``torch.device("meta")``, with torchtitan's depth-scaled init in
  ``init_weights()``. ``fused_qkv`` keeps one ``wqkv`` weight and saves it as ``wq``/``wk``/``wv`` keys
  (a state-dict post-hook splits, a load pre-hook merges), so both layouts share checkpoints.
- ``parallelize``: ``fully_shard`` on the embedding, on each block (the last one kept after forward), on
  ``[norm, output]`` together and on the root, ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``;
  then every module's gradient divide factor set to 1 (grads summed over ranks; torch's reductions forced
  to plain sums, which gloo has), then ``to_empty`` and the init on the DTensors.
- ``train_step``: the loss summed over tokens and divided by the global token count, the head and the loss
  over sequence chunks with one backward each before the trunk's (a chunked cross-entropy), gradient
  accumulation over microbatches, grad-norm clipping, AdamW.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradsync.groups.testing import test_device

GRADSYNC, TORCH = "gradsync.fsdp.fsdp2", "torch.distributed.fsdp"


@dataclass(frozen=True)
class Args:
    dim: int = 32
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 61
    ffn_hidden: int = 48
    max_seq_len: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    fused_qkv: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(args: Args, device: torch.device) -> torch.Tensor:
    """cos and sin of every position's rotation angles, stacked: (2, seq, head_dim / 2)."""
    inverse = 1.0 / args.rope_theta ** (
        torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim
    )
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), inverse)
    return torch.stack([angles.cos(), angles.sin()])


def rotate(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (batch, seq, heads, head_dim) by pairs of features."""
    cos, sin = tables[0, : x.shape[1], None, :], tables[1, : x.shape[1], None, :]
    even, odd = x.float().view(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.args = args
        q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.sizes = [q_rows, kv_rows, kv_rows]
        if args.fused_qkv:
            self.wqkv = nn.Linear(args.dim, sum(self.sizes), bias=False)
            self.register_state_dict_post_hook(Attention._split_qkv)  # type: ignore[no-untyped-call]
            self.register_load_state_dict_pre_hook(Attention._merge_qkv)  # type: ignore[no-untyped-call]
        else:
            self.wq = nn.Linear(args.dim, q_rows, bias=False)
            self.wk = nn.Linear(args.dim, kv_rows, bias=False)
            self.wv = nn.Linear(args.dim, kv_rows, bias=False)
        self.wo = nn.Linear(q_rows, args.dim, bias=False)

    @staticmethod
    def _split_qkv(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        fused = state.pop(prefix + "wqkv.weight")
        for name, piece in zip("qkv", fused.split(module.sizes), strict=True):
            state[f"{prefix}w{name}.weight"] = piece

    @staticmethod
    def _merge_qkv(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix + "wq.weight" in state:
            state[prefix + "wqkv.weight"] = torch.cat([state.pop(f"{prefix}w{n}.weight") for n in "qkv"])

    def projections(self) -> list[nn.Linear]:
        return [self.wqkv] if self.args.fused_qkv else [self.wq, self.wk, self.wv]

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        args, (batch, seq, _) = self.args, x.shape
        if args.fused_qkv:
            q, k, v = self.wqkv(x).split(self.sizes, -1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = rotate(q.view(batch, seq, args.n_heads, args.head_dim), tables)
        k = rotate(k.view(batch, seq, args.n_kv_heads, args.head_dim), tables)
        v = v.view(batch, seq, args.n_kv_heads, args.head_dim)
        repeat = args.n_heads // args.n_kv_heads
        k, v = k.repeat_interleave(repeat, 2), v.repeat_interleave(repeat, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected

    def init_weights(self, std: float) -> None:
        for linear in self.projections():
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Args) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # depth-scaled

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), tables)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    """The forward returns the final norm's output: the head runs in the chunked loss."""

    rope: torch.Tensor

    def __init__(self, args: Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_tables(args, torch.device("meta")), persistent=False)

    def init_weights(self) -> None:
        with torch.no_grad():
            self.rope.copy_(rope_tables(self.args, self.rope.device))
            nn.init.normal_(self.tok_embeddings.weight)
            for block in self.layers.values():
                block.init_weights()  # type: ignore[operator]
            self.norm.reset_parameters()
            final_std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, 0.0, final_std, -3 * final_std, 3 * final_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope)
        out: torch.Tensor = self.norm(h)
        return out


def parallelize(
    api: str, args: Args, mesh: DeviceMesh, param_dtype: torch.dtype | None, seed: int
) -> Transformer:
    """torchtitan's meta build and apply_fsdp with either API, then its init on the sharded params.
    gradsync is given torch's own ``Shard(0)`` shards (``shard_alignment="chunk"``): on the CPU each rank
    draws its shard's init from its own generator, so equal shards give equal weights."""
    module = importlib.import_module(api)
    shard, fsdp_module = module.fully_shard, module.FSDPModule
    with torch.device("meta"):
        model = Transformer(args)
    config: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": module.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
    }
    if api == GRADSYNC:
        config["shard_alignment"] = "chunk"
    shard(model.tok_embeddings, **config, reshard_after_forward=True)
    for layer_id, block in model.layers.items():
        shard(block, **config, reshard_after_forward=int(layer_id) < args.n_layers - 1)
    shard([model.norm, model.output], **config, reshard_after_forward=False)
    shard(model, **config)
    for fsdp in model.modules():  # summed grads: the loss is divided by the global token count
        if isinstance(fsdp, fsdp_module):
            fsdp.set_gradient_divide_factor(1.0)
            fsdp.set_force_sum_reduction_for_comms(True)  # torch's reduce-scatter: gloo has no PREMUL_SUM
    model.to_empty(device=test_device())
    torch.manual_seed(seed)
    model.init_weights()
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def microbatches(step: int, args: Args, micro: int = 2, rows: int = 2) -> list[torch.Tensor]:
    """This rank's microbatches of ``step``: (rows, max_seq_len + 1) token ids, different on every rank, each
    row a learnable walk (the next token follows from the last) from a random start."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    starts = torch.randint(0, args.vocab_size, (micro, rows, 1), generator=generator)
    offsets = torch.arange(args.max_seq_len + 1) * 7
    tokens = (starts + offsets) % args.vocab_size
    return list(tokens.to(test_device()).unbind(0))


def train_step(
    model: Transformer, optimizer: torch.optim.Optimizer, step: int, chunks: int = 4, max_norm: float = 1.0
) -> tuple[float, float]:
    """One step; returns the global loss (mean over every token of every rank) and the grad norm."""
    batches = microbatches(step, model.args)
    global_tokens = torch.tensor(float(sum(b[:, 1:].numel() for b in batches)), device=test_device())
    dist.all_reduce(global_tokens)
    total = torch.zeros((), device=test_device())
    for tokens in batches:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        hidden = model(inputs)
        detached = hidden.detach().requires_grad_()
        for piece, targets in zip(detached.chunk(chunks, 1), labels.chunk(chunks, 1), strict=True):
            logits = model.output(piece).float()
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / global_tokens
            loss.backward()  # type: ignore[no-untyped-call]
            total += loss.detach()
        hidden.backward(detached.grad)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(total)
    return float(total), float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def losses_and_norms(
    model: Transformer, optimizer: torch.optim.Optimizer, steps: range
) -> list[tuple[float, float]]:
    return [train_step(model, optimizer, step) for step in steps]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), math.ulp(1.0))
