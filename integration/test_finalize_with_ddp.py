"""finalize_model_grads driving real gradsync-ddp wrappers: with the distributed optimizer the DP
reduce-scatter runs before the tied-embedding all-reduce, and the owned shards must still hold the sum."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.finalize import finalize_model_grads
from gradsync.groups import ModelParallelConfig, destroy_process_groups, initialize_model_parallel
from gradsync.groups.testing import run_distributed


class Stage(nn.Module):
    """First stage: embedding + layer; last stage: layer + output weight tied to the embedding."""

    def __init__(self, config: ModelParallelConfig, first: bool, mark_shared: bool) -> None:
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = first, not first
        self.share_embeddings_and_output_weights = True
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 8)
        self.tied = nn.Parameter(torch.randn(50, 8))
        if mark_shared:
            self.tied.shared_embedding = True  # type: ignore[attr-defined]

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.tied


def tied_grads_after_reduce_scatter(mark_shared: bool) -> None:
    rank = dist.get_rank()
    groups = initialize_model_parallel(pipeline_model_parallel_size=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2)
    first = groups.pp.rank() == 0  # type: ignore[union-attr]
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=64
    )
    ddp = DistributedDataParallel(config, ddp_config, Stage(config, first, mark_shared), pg_collection=groups)
    ddp.zero_grad_buffer()
    tied = ddp.module.tied
    tied.main_grad.copy_(torch.arange(tied.numel(), dtype=torch.float32).view_as(tied) * (rank + 1))  # type: ignore[attr-defined]
    ddp.module.layer.weight.main_grad.fill_(1.0)  # type: ignore[attr-defined]
    ddp.module.layer.bias.main_grad.fill_(1.0)  # type: ignore[attr-defined]
    if not mark_shared:
        with pytest.raises(ValueError, match="must carry shared_embedding=True on both pipeline stages"):
            finalize_model_grads([ddp], pg_collection=groups)
        destroy_process_groups(groups)
        return
    finalize_model_grads([ddp], pg_collection=groups)
    # Expected: mean over this stage's DP pair, summed over the two stages (the embedding group).
    factor = torch.tensor([float(rank + 1)])
    dist.all_reduce(factor, group=groups.dp_cp)
    factor /= 2
    dist.all_reduce(factor, group=groups.embd)
    expected = torch.arange(tied.numel(), dtype=torch.float32) * factor
    (bucket,) = ddp.param_to_bucket_group[tied].buckets  # alone in its bucket: same shards on both stages
    dp_rank, shard = groups.dp_cp.rank(), bucket.grad_data.numel() // groups.dp_cp.size()  # type: ignore[union-attr]
    start, end = bucket.param_to_index[tied]
    lo, hi = max(start, dp_rank * shard) - start, min(end, (dp_rank + 1) * shard) - start
    assert hi > lo
    got = tied.main_grad.view(-1)  # type: ignore[attr-defined]
    assert torch.equal(got[lo:hi], expected[lo:hi])
    destroy_process_groups(groups)


@pytest.mark.parametrize("mark_shared", [True, False])
def test_tied_grads_are_right_after_a_reduce_scatter(mark_shared: bool) -> None:
    run_distributed(tied_grads_after_reduce_scatter, 4, args=(mark_shared,))


class SequenceParallelBlock(nn.Module):
    """A layernorm replicated across TP (its grads are summed over TP with sequence parallelism) and a
    dense layer, in bf16."""

    def __init__(self, config: ModelParallelConfig) -> None:
        super().__init__()
        self.config = config
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        for param in self.norm.parameters():
            param.sequence_parallel = True  # type: ignore[attr-defined]
        self.dense = nn.Linear(8, 8)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.norm(x)).float().sum()


def optimizer_grads_are_the_finalized_ones(grad_reduce_in_fp32: bool, with_tokens: bool) -> None:
    rank = dist.get_rank()
    groups = initialize_model_parallel(tensor_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=True
    )
    ddp = DistributedDataParallel(config, ddp_config, SequenceParallelBlock(config), pg_collection=groups)
    ddp.zero_grad_buffer()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    ddp(x).backward()
    unfinished = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}  # type: ignore[attr-defined]
    num_tokens = torch.tensor(5 * (rank + 1))
    finalize_model_grads([ddp], num_tokens=num_tokens if with_tokens else None, pg_collection=groups)
    if with_tokens:
        assert int(num_tokens) == sum(5 * (r + 1) for r in dist.get_process_group_ranks(groups.dp_cp))  # type: ignore[arg-type]
    for name, param in ddp.module.named_parameters():
        main_grad = param.main_grad  # type: ignore[attr-defined]
        assert param.grad is not None
        assert param.grad.dtype == torch.bfloat16
        assert torch.equal(param.grad, main_grad.to(torch.bfloat16)), name  # what torch.optim steps on
        if name.startswith("norm."):
            assert not torch.equal(main_grad, unfinished[name])  # finalize did sum it over TP
    destroy_process_groups(groups)


@pytest.mark.parametrize("with_tokens", [False, True], ids=["tp-sums", "tp-sums-and-num-tokens"])
@pytest.mark.parametrize("grad_reduce_in_fp32", [False, True])
def test_a_plain_optimizer_reads_the_finalized_grads_of_a_bf16_model(
    grad_reduce_in_fp32: bool, with_tokens: bool
) -> None:
    run_distributed(optimizer_grads_are_the_finalized_ones, 4, args=(grad_reduce_in_fp32, with_tokens))
