"""finalize_model_grads on real gloo ranks with toy chunks: TP sequence-parallel sums, PP-tied embeddings
(with virtual chunks), DP x PP x TP on 8 ranks, token-count scaling, expert biases, and group checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from finalize_testkit import ToyDataParallel, ToyStage
from torch import nn

from gradsync.finalize import EmbeddingOwner, FinalizableChunk, finalize_model_grads
from gradsync.groups import (
    ModelParallelConfig,
    ProcessGroupCollection,
    destroy_process_groups,
    initialize_model_parallel,
)
from gradsync.groups.testing import run_distributed, test_device


def fill(chunk: ToyDataParallel, value: float) -> None:
    for param in chunk.module.parameters():
        param.main_grad.fill_(value)  # type: ignore[attr-defined]


def mean_over(group: dist.ProcessGroup, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=test_device())
    dist.all_reduce(t, group=group)
    return float(t.item()) / group.size()


def dp_tp_pp(tp: int, pp: int, virtual: int) -> None:
    rank = dist.get_rank()
    groups = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=True
    )
    stage = groups.pp.rank()  # type: ignore[union-attr]
    chunks = [
        ToyDataParallel(
            ToyStage(
                config, pre_process=stage == 0 and v == 0, post_process=stage == pp - 1 and v == virtual - 1
            ),
            groups.dp_cp,
        )
        for v in range(virtual)
    ]
    assert isinstance(chunks[0], FinalizableChunk)
    assert isinstance(chunks[0].module, EmbeddingOwner)
    value = float(rank + 1)
    for chunk in chunks:
        fill(chunk, value)
    finalize_model_grads(chunks, pg_collection=groups)
    dp_mean = mean_over(groups.dp_cp, value)  # type: ignore[arg-type]
    tp_sum_of_dp_means = mean_over(groups.tp, dp_mean) * tp  # type: ignore[arg-type]
    for chunk in chunks:
        module = chunk.module
        assert chunk.finished == 1
        assert torch.equal(
            module.norm.weight.main_grad, torch.full_like(module.norm.weight, tp_sum_of_dp_means)
        )
        assert torch.equal(module.dense.weight.main_grad, torch.full_like(module.dense.weight, dp_mean))
    tied = chunks[0].module.embedding if stage == 0 else chunks[-1].module.output
    if pp > 1 and tied is not None:
        embd_sum = mean_over(groups.embd, dp_mean) * 2  # type: ignore[arg-type]
        assert torch.equal(tied.main_grad, torch.full_like(tied, embd_sum))  # type: ignore[union-attr]
        with torch.no_grad():  # one SGD step on each copy: they stay identical
            tied -= 0.1 * tied.main_grad  # type: ignore[operator,union-attr]
        other = tied.detach().clone()
        dist.broadcast(other, src=dist.get_process_group_ranks(groups.embd)[0], group=groups.embd)  # type: ignore[arg-type]
        assert torch.equal(other, tied.detach())
    destroy_process_groups(groups)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "virtual"),
    [(4, 2, 1, 1), (4, 1, 2, 1), (4, 1, 2, 2), (8, 2, 2, 1), (8, 2, 2, 2)],
    ids=["tp2", "pp2-tied", "pp2-virtual", "dp2-pp2-tp2", "dp2-pp2-tp2-virtual"],
)
def test_tp_sums_and_tied_embeddings(world: int, tp: int, pp: int, virtual: int) -> None:
    run_distributed(dp_tp_pp, world, args=(tp, pp, virtual))


def untied_and_averaged() -> None:
    groups = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    stage = groups.pp.rank()  # type: ignore[union-attr]
    chunk = ToyDataParallel(ToyStage(config, stage == 0, stage == 1, tied=False), groups.dp_cp)
    chunk.module.dense.bias.average_gradients_across_tp_domain = True  # type: ignore[attr-defined]
    value = float(dist.get_rank())
    fill(chunk, value)
    finalize_model_grads([chunk], pg_collection=groups)
    dp_mean = mean_over(groups.dp_cp, value)  # type: ignore[arg-type]
    weight = chunk.module.shared_embedding_or_output_weight()
    assert torch.equal(weight.main_grad, torch.full_like(weight, dp_mean))  # type: ignore[union-attr]
    tp_mean = mean_over(groups.tp, dp_mean)  # type: ignore[arg-type]
    assert torch.equal(chunk.module.dense.bias.main_grad, torch.full_like(chunk.module.dense.bias, tp_mean))
    # sequence_parallel is off in this config: the layernorm is not summed across TP
    assert torch.equal(chunk.module.norm.weight.main_grad, torch.full_like(chunk.module.norm.weight, dp_mean))
    destroy_process_groups(groups)


def test_untied_embeddings_are_skipped_and_tp_averaging() -> None:
    run_distributed(untied_and_averaged, 8)


def per_token_scaling() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(test_device())
    for param in model.parameters():
        param.main_grad = torch.zeros_like(param)  # type: ignore[attr-defined]
    model.config = ModelParallelConfig(calculate_per_token_loss=True)  # type: ignore[assignment]
    chunk = ToyDataParallel(model, None, per_token_loss=True)
    generator = torch.Generator().manual_seed(5)
    data = torch.randn(world * 6, 3, generator=generator).to(test_device())
    counts = [2 + r for r in range(world)]  # ranks see different numbers of tokens
    start = sum(counts[:rank])
    mine = data[start : start + counts[rank]]
    model(mine).pow(2).sum().backward()  # a summed per-token loss
    for param in model.parameters():
        param.main_grad.copy_(param.grad)  # type: ignore[attr-defined]
    num_tokens = torch.tensor(counts[rank], device=test_device())
    finalize_model_grads([chunk], num_tokens=num_tokens)
    assert int(num_tokens) == sum(counts)
    reference = nn.Linear(3, 1).to(test_device())
    reference.load_state_dict(model.state_dict())
    reference(data[: sum(counts)]).pow(2).mean().backward()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=1e-6, atol=1e-7)  # type: ignore[attr-defined]
    for param in model.parameters():
        param.main_grad.fill_(3.0)  # type: ignore[attr-defined]
    no_tokens = torch.tensor(0, device=test_device())
    finalize_model_grads([chunk], num_tokens=no_tokens)  # no tokens anywhere: scale by 1, not inf
    assert all(torch.equal(p.main_grad, torch.full_like(p, 3.0 * world)) for p in model.parameters())  # type: ignore[attr-defined]


def test_num_tokens_scaling_matches_a_per_token_loss_reference() -> None:
    run_distributed(per_token_scaling, 4)


class Router(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts))


def expert_bias_update() -> None:
    rank = dist.get_rank()
    model = nn.Module()
    model.router = Router(2).to(test_device())
    model.config = ModelParallelConfig(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25)  # type: ignore[assignment]
    chunk = ToyDataParallel(model, None)
    model.router.local_tokens_per_expert.copy_(torch.tensor([0.0, 2.0] if rank == 0 else [0.0, 0.0]))
    pgs = ProcessGroupCollection(tp_dp_cp=dist.group.WORLD, dp_cp=dist.group.WORLD)
    finalize_model_grads([chunk], pg_collection=pgs)
    assert model.router.expert_bias.tolist() == [0.25, -0.25]
    assert not model.router.local_tokens_per_expert.any()
    model.eval()
    model.router.local_tokens_per_expert.fill_(1.0)
    finalize_model_grads([chunk], pg_collection=pgs)
    assert model.router.expert_bias.tolist() == [0.25, -0.25]  # eval mode: no update, counts still reset
    assert not model.router.local_tokens_per_expert.any()
    with pytest.raises(
        ValueError, match=r"pg_collection\.tp_dp_cp is required because moe_router_enable_expert_bias"
    ):
        finalize_model_grads([chunk], pg_collection=ProcessGroupCollection(dp_cp=dist.group.WORLD))
    assert chunk.finished == 2  # the failing call raised before finish_grad_sync


def test_router_expert_bias_update() -> None:
    run_distributed(expert_bias_update, 2)


def centred_index(group: dist.ProcessGroup) -> float:
    """This rank's index in ``group`` minus the mean index: ``1 + centred_index`` differs on every rank of the
    group and averages to exactly 1 over it."""
    ranks = dist.get_process_group_ranks(group)
    return ranks.index(dist.get_rank()) - (len(ranks) - 1) / 2


def expert_grads_norm() -> None:
    groups = initialize_model_parallel(expert_model_parallel_size=2)
    config = ModelParallelConfig(expert_model_parallel_size=2)
    torch.manual_seed(0)
    dense, expert = nn.Linear(4, 4).to(test_device()), nn.Linear(4, 3).to(test_device())
    for param in [*dense.parameters(), *expert.parameters()]:
        param.main_grad = torch.zeros_like(param)  # type: ignore[attr-defined]

    class ExpertChunk(ToyDataParallel):
        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            # dense grads averaged over dp_cp; expert grads (ep x etp times the tokens) over expert DP
            for param in dense.parameters():
                dist.all_reduce(param.main_grad, group=groups.dp_cp)  # type: ignore[attr-defined]
                param.main_grad /= groups.dp_cp.size()  # type: ignore[attr-defined,union-attr]
            for param in expert.parameters():
                param.main_grad /= groups.dp_cp.size()  # type: ignore[attr-defined,union-attr]
                dist.all_reduce(param.main_grad, group=groups.expt_dp)  # type: ignore[attr-defined]

    holder = nn.Module()
    holder.dense, holder.expert, holder.config = dense, expert, config  # type: ignore[assignment]
    chunk = ExpertChunk(holder, groups.dp_cp)
    # Different on every rank, unit grads once each group's reduction has run (expert ones: ep x etp = 2).
    dense_grad = 1.0 + centred_index(groups.dp_cp)  # type: ignore[arg-type]
    expert_grad = 2.0 * (1.0 + centred_index(groups.expt_dp))  # type: ignore[arg-type]
    for param in dense.parameters():
        param.main_grad.fill_(dense_grad)  # type: ignore[attr-defined]
    for param in expert.parameters():
        param.main_grad.fill_(expert_grad)  # type: ignore[attr-defined]
    finalize_model_grads([chunk], pg_collection=groups)
    for param in [*dense.parameters(), *expert.parameters()]:
        assert torch.equal(param.main_grad, torch.ones_like(param))  # type: ignore[attr-defined]
    dense_sq = sum(float(p.main_grad.pow(2).sum()) for p in dense.parameters())  # type: ignore[attr-defined]
    expert_sq = torch.tensor(
        [sum(float(p.main_grad.pow(2).sum()) for p in expert.parameters())],  # type: ignore[attr-defined]
        device=test_device(),
    )
    dist.all_reduce(expert_sq, group=groups.ep)
    numel = sum(p.numel() for p in dense.parameters()) + 2 * sum(p.numel() for p in expert.parameters())
    assert (dense_sq + float(expert_sq)) ** 0.5 == pytest.approx(numel**0.5, rel=1e-12)
    destroy_process_groups(groups)


def test_expert_dp_scaling_gives_unit_grads() -> None:
    run_distributed(expert_grads_norm, 4)


def missing_groups() -> None:
    config = ModelParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    stage = ToyStage(config, True, False)
    chunk = ToyDataParallel(stage, None)
    world = dist.group.WORLD
    with pytest.raises(
        ValueError, match=r"pg_collection\.tp is required because tensor_model_parallel_size > 1"
    ):
        finalize_model_grads([chunk], pg_collection=ProcessGroupCollection(dp_cp=world, pp=world))
    with pytest.raises(
        ValueError, match=r"pg_collection\.pp is required because pipeline_model_parallel_size > 1"
    ):
        finalize_model_grads([chunk], pg_collection=ProcessGroupCollection(dp_cp=world, tp=world))
    with pytest.raises(ValueError, match=r"pg_collection\.embd must be set with pipeline parallelism"):
        finalize_model_grads([chunk], pg_collection=ProcessGroupCollection(dp_cp=world, tp=world, pp=world))
    with pytest.raises(ValueError, match=r"pg_collection\.dp_cp is required because num_tokens is summed"):
        finalize_model_grads(
            [chunk],
            num_tokens=torch.tensor(3, device=test_device()),
            pg_collection=ProcessGroupCollection(tp=world, pp=world, embd=None, pos_embd=None),
        )
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2, .* but neither the pg_collection"):
        finalize_model_grads([chunk])  # a model-parallel config and no groups anywhere
    assert chunk.finished == 0  # every check came before any communication


def test_missing_groups_are_named_before_any_communication() -> None:
    run_distributed(missing_groups, 2)
