"""The single-process reference every parallel run must reproduce, and the layouts the suite runs.

The reference is the whole model on one process, stepped by a plain torch optimizer on the whole global
batch: no gradsync, no pipeline schedule, no microbatches, no collectives.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch
from toygpt.data import Corpus
from toygpt.model import GPTConfig, GPTStage, next_token_loss
from train import Options, make_optimizer, param_dtype

# Small enough for 8 gloo ranks on 2 cores; SGD with momentum, which shows scale errors Adam would hide.
BASE = Options(
    steps=12,
    global_batch=8,
    seq_len=16,
    d_model=32,
    n_head=4,
    n_layer=2,
    optimizer="sgd",
    lr=0.2,
    bucket_size=3000,
    eval_every=0,
    corpus_bytes=256 << 10,
    quiet=True,
    collect_params=True,
)

# name -> (world size, options); CI runs LAYOUTS, `nox -s integration-full` adds FULL_LAYOUTS.
LAYOUTS: dict[str, tuple[int, dict[str, object]]] = {
    "dp2": (2, {}),
    "dp2xtp2-sp": (4, {"tp": 2, "sequence_parallel": True}),
    "dp2xpp2": (4, {"pp": 2, "microbatches": 2}),
    "dp4-moe-ep2": (4, {"moe": True, "ep": 2}),
    "dp2xtp2xpp2-sp": (8, {"tp": 2, "pp": 2, "sequence_parallel": True, "microbatches": 2}),
}
FULL_LAYOUTS: dict[str, tuple[int, dict[str, object]]] = {
    "dp4": (4, {}),
    "dp8": (8, {}),
    "dp2-microbatches4": (2, {"microbatches": 4}),
    "tp2": (2, {"tp": 2}),
    "tp4-sp": (4, {"tp": 4, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2, "microbatches": 2}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2, "microbatches": 2}),
    "dp2xtp2xpp2": (8, {"tp": 2, "pp": 2, "microbatches": 2}),
    "dp2-moe-ep2": (2, {"moe": True, "ep": 2}),
    "dp4xpp2-moe-ep2": (8, {"moe": True, "ep": 2, "pp": 2, "microbatches": 2}),
}


def options(strategy: str, overrides: dict[str, object]) -> Options:
    return dataclasses.replace(BASE, strategy=strategy, **overrides)  # type: ignore[arg-type]


@lru_cache(maxsize=8)
def reference(opts: Options) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and final params of the single-process run (layout fields of ``opts`` ignored)."""
    return reordered_reference(opts, 1, torch.get_num_threads())


def reordered_reference(
    opts: Options, pieces: int, threads: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference with only its summation order changed: each step's global batch backpropagated in
    ``pieces`` equal pieces (grads accumulated), on ``threads`` intra-op threads. The same math; how far it
    lands from :func:`reference` is the rounding spread the parity tolerances are set from."""
    cfg = GPTConfig(
        seq_len=opts.seq_len, d_model=opts.d_model, n_head=opts.n_head, n_layer=opts.n_layer, moe=opts.moe
    )
    model = GPTStage(cfg).to(param_dtype(opts))
    params = list(model.parameters())
    # bf16: the same recipe as the parallel runs, fp32 main params stepped with the grads in fp32.
    mains = [torch.nn.Parameter(p.detach().float()) for p in params] if opts.bf16 else params
    names = [name for name, _ in model.named_parameters()]
    optimizer = make_optimizer(opts)(zip(names, mains, strict=True))
    corpus = Corpus.from_stdlib(opts.corpus_bytes)
    losses = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(opts.steps):
            batch = corpus.batch(step, opts.global_batch, opts.seq_len, seed=opts.seed)
            optimizer.zero_grad()
            model.zero_grad()
            loss = torch.zeros(())
            for piece in batch.chunk(pieces):
                piece_loss = next_token_loss(model(piece[:, :-1]), piece) * (len(piece) / len(batch))
                piece_loss.backward()  # type: ignore[no-untyped-call]
                loss += piece_loss.detach().float()
            for main, param in zip(mains, params, strict=True):
                if main is not param:
                    main.grad = None if param.grad is None else param.grad.float()
            optimizer.step()
            with torch.no_grad():
                for main, param in zip(mains, params, strict=True):
                    if main is not param:
                        param.copy_(main)
            losses.append(float(loss))
    finally:
        torch.set_num_threads(before)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_key(opts: Options) -> Options:
    """The reference depends on the model, data and optimizer only, not on strategy or layout."""
    return dataclasses.replace(
        opts,
        strategy=BASE.strategy,
        tp=1,
        pp=1,
        ep=1,
        sequence_parallel=False,
        microbatches=1,
        hsdp=1,
        hsdp_outer="no_shard",
    )
