"""Quick start B: a HuggingFace Llama, built from a config (no download), sharded with gradsync's
FSDP2-style ``fully_shard`` per decoder layer and on the root, trained with AdamW, saved with DCP and
resumed into a fresh model. Run with ``torchrun --nproc-per-node 2 examples/fsdp2_llama.py``; it prints the
loss of every step, the mean over the ranks, and of the two steps after the resume."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import LlamaConfig, LlamaForCausalLM

from gradsync.fsdp.fsdp2 import fully_shard  # was: from torch.distributed.fsdp import fully_shard

STEPS, LR, ROWS, TOKENS = 3, 1e-3, 2, 16
CONFIG = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=TOKENS,
)


def build_model() -> LlamaForCausalLM:
    """The same initial weights on every rank and in the one-process check, on the CPU (a model goes to
    its device before ``fully_shard``: moving it after is refused)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG)


def batch(step: int, rank: int) -> torch.Tensor:
    """This rank's token ids for ``step``: every rank reads other rows."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, CONFIG.vocab_size, (ROWS, TOKENS), generator=generator)


def sharded(model: LlamaForCausalLM) -> torch.optim.Optimizer:
    """Shard each decoder layer, then the root; the optimizer comes after the last call."""
    layer_class = type(model.model.layers[0])  # LlamaDecoderLayer, Qwen2DecoderLayer, ...
    for module in model.modules():
        if isinstance(module, layer_class):
            fully_shard(module)  # one unit per decoder layer
    fully_shard(model)  # the root, last: sharded from here on
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after the last call
    return optimizer


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, step: int) -> float:
    tokens = batch(step, dist.get_rank())
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def main() -> None:
    dist.init_process_group("gloo")
    model = build_model()
    optimizer = sharded(model)
    for step in range(STEPS):
        loss = train_step(model, optimizer, step)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.6f}")

    where = [os.environ.get("CHECKPOINT_DIR") or tempfile.mkdtemp(prefix="fsdp2_llama_")]
    dist.broadcast_object_list(where, src=0)  # one directory for every rank: rank 0's
    checkpoint = where[0]
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=checkpoint)

    resumed = build_model()  # to resume: build as above, load, then set the state
    resumed_optimizer = sharded(resumed)
    model_state = get_model_state_dict(resumed)
    optim_state = get_optimizer_state_dict(resumed, resumed_optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    set_model_state_dict(resumed, model_state)
    set_optimizer_state_dict(resumed, resumed_optimizer, optim_state)
    for step in range(STEPS, STEPS + 2):  # the second step's loss shows the optimizer state came back
        loss = train_step(resumed, resumed_optimizer, step)
        if dist.get_rank() == 0:
            print(f"resumed step {step} loss {loss:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
