"""Quick start A: Megatron-Core's data-parallel stack through gradsync, with no Megatron installed.

The process groups, the DDP config and wrapper, the distributed optimizer and finalize_model_grads, as a
Megatron-LM training loop drives them, over a small MLP. Prints the mean loss over the ranks each step.

    torchrun --nproc-per-node 2 examples/megatron_ddp.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.finalize import finalize_model_grads
from gradsync.groups import ModelParallelConfig, initialize_model_parallel

STEPS, ROWS_PER_RANK, LR = 5, 4, 1e-2


def build_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (the wrapper checks they agree)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch: each rank sees different data."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(ROWS_PER_RANK, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    # Megatron's parallel_state.initialize_model_parallel, returning the groups instead of setting globals
    pgs = initialize_model_parallel(tensor_model_parallel_size=1)
    # Megatron's TransformerConfig: gradsync reads only its model-parallel fields, which these defaults hold
    transformer_config = ModelParallelConfig()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    model = DistributedDataParallel(transformer_config, ddp_config, build_model(), pg_collection=pgs)
    # The third argument is Megatron's OptimizerConfig (clip_grad, ...); None: no clipping
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model, None)
    for step in range(STEPS):
        inputs, targets = batch(step, rank)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        finalize_model_grads([model], pg_collection=pgs)
        update_successful, _grad_norm, _num_zeros_in_grad = optimizer.step()  # Megatron's return
        assert update_successful, "no loss scaler here, so every step applies"
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step} loss {float(mean_loss) / world:.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
