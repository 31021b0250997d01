"""The DDP wrapper: delegation, broadcast, hooks, consistency check, unused params, plain optimizers.

Ranks feed different data (their own micro-batches, or inputs scaled by the rank), and expected grads are
computed without the wrapper: a plain replica of the model run on every rank's input, or a closed form.
A sync that never ran, or did not average, therefore fails."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, flat_params, local_microbatches
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel
from gradsync.groups import ModelParallelConfig, ProcessGroupCollection, initialize_model_parallel
from gradsync.groups.testing import run_distributed, test_device

CONFIG = ModelParallelConfig()


def delegation_and_broadcast() -> None:
    rank = dist.get_rank()
    model = TinyGPT(seed=rank)  # every rank starts differently
    frozen = model.ln_f.bias
    frozen.requires_grad_(False)
    ddp = DistributedDataParallel(CONFIG, DistributedDataParallelConfig(), model)
    assert set(ddp.state_dict()) == set(model.state_dict())
    assert not any(k.startswith("module.") for k in ddp.state_dict())
    ddp.load_state_dict(model.state_dict())
    batch = local_microbatches(0, rank, 2, 1)[0]
    assert torch.equal(ddp(batch), model(batch))
    ddp.broadcast_params()
    params = flat_params(model)
    reference = params.clone()
    dist.broadcast(reference, src=0)
    assert torch.equal(params, reference)  # frozen params included
    assert torch.equal(params, flat_params(TinyGPT(seed=0)))
    assert frozen not in ddp.param_to_bucket_group


def test_delegation_and_broadcast_params() -> None:
    run_distributed(delegation_and_broadcast, 2)


class TwiceUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.to(test_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(torch.tanh(self.shared(x)))).sum()  # type: ignore[no-any-return]


def param_used_twice() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TwiceUsed()
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10)
    ddp = DistributedDataParallel(CONFIG, config, model)
    calls: dict[str, int] = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    for step in range(3):
        ddp.zero_grad_buffer()
        calls.clear()
        x = torch.full((2, 4), float(rank + step), device=test_device())
        ddp(x).backward()
        group = ddp.param_to_bucket_group[model.shared.weight]
        if step > 0:
            assert group.grad_reduce_dispatched  # dispatched from the hooks, before finish_grad_sync
        ddp.finish_grad_sync()
    # Autograd sums both uses before AccumulateGrad runs: one hook call, one readiness count, per backward.
    assert calls["shared.weight"] == 1
    assert group.golden_per_param_grad_ready_counts[model.shared.weight] == 1
    reference = TwiceUsed()
    for r in range(world):
        reference(torch.full((2, 4), float(r + 2), device=test_device())).backward()
    expected = reference.shared.weight.grad / world  # type: ignore[operator]
    assert torch.allclose(model.shared.weight.grad, expected, rtol=1e-6, atol=1e-7)  # type: ignore[arg-type]
    return model.shared.weight.grad.reshape(-1).tolist()  # type: ignore[union-attr]


def test_hook_counts_for_a_param_used_twice() -> None:
    results = run_distributed(param_used_twice, 2)
    assert results[0] == results[1]


def mismatched_models() -> None:
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if rank == 1 else 2)).to(test_device())
    with pytest.raises(
        ValueError,
        match=r"the model differs between data-parallel ranks 0 and 1: param #2: 1\.weight \(shape \[2, 4\]",
    ):
        DistributedDataParallel(CONFIG, DistributedDataParallelConfig(), model)


def test_mismatched_models_fail_before_any_gradient_collective() -> None:
    run_distributed(mismatched_models, 2)


def wrapper_freed_with_the_model_alive() -> tuple[bool, bool]:
    model = TinyGPT()
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600)
    ddp = DistributedDataParallel(CONFIG, config, model)
    ddp.zero_grad_buffer()
    ddp(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    ddp.finish_grad_sync()
    wrapper, bucket_group = weakref.ref(ddp), weakref.ref(ddp.bucket_groups[0])
    del ddp
    gc.collect()
    return wrapper() is None, bucket_group() is None


def test_a_dropped_wrapper_is_freed_with_its_buffers_while_the_model_lives() -> None:
    """Params keep their hooks where the garbage collector cannot look: a hook holding the wrapper
    strongly would keep it, its buffers and its process groups alive as long as the model."""
    assert run_distributed(wrapper_freed_with_the_model_alive, 2) == [(True, True)] * 2


class WithExperts(nn.Module):
    """A dense layer and one expert, named by its global index."""

    def __init__(self, expert_index: int, expert_width: int = 2) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.experts = nn.ModuleDict({str(expert_index): nn.Linear(4, expert_width)})
        for param in self.experts.parameters():
            param.allreduce = False  # type: ignore[attr-defined]
        self.to(test_device())


def experts_checked_over_their_own_group(odd_rank: int | None, odd: str) -> None:
    groups = initialize_model_parallel(expert_model_parallel_size=2)
    ep_rank, rank = groups.ep.rank(), dist.get_rank()  # type: ignore[union-attr]
    is_odd = rank == odd_rank
    model = WithExperts(
        expert_index=ep_rank + 4 if is_odd and odd == "name" else ep_rank,
        expert_width=3 if is_odd and odd == "shape" else 2,
    )
    config = ModelParallelConfig(expert_model_parallel_size=2)
    peers = dist.get_process_group_ranks(groups.expt_dp)  # type: ignore[arg-type]
    if odd_rank is None or (odd == "name" and odd_rank not in peers):
        # Experts differ across EP ranks inside one DP group: that is fine.
        DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=groups)
        return
    # Another shape shows in the DP check already; another expert than the expert-DP peers' only there.
    kind = "data-parallel" if odd == "shape" else "expert-data-parallel"
    with pytest.raises(ValueError, match=rf"differs between {kind} ranks"):
        DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=groups)


@pytest.mark.parametrize(("odd_rank", "odd"), [(None, ""), (3, "shape"), (3, "name")])
def test_expert_params_are_compared_within_their_expert_data_parallel_group(
    odd_rank: int | None, odd: str
) -> None:
    run_distributed(experts_checked_over_their_own_group, 4, args=(odd_rank, odd))


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.to(test_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).sum()  # type: ignore[no-any-return]


def ones() -> torch.Tensor:
    """The unused-param tests' input (one rank: no averaging to check), on the harness device."""
    return torch.ones(2, 4, device=test_device())


def unused_params() -> None:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10)
    ddp = DistributedDataParallel(CONFIG, config, WithUnused())
    ddp.zero_grad_buffer()
    ddp(ones()).backward()
    with pytest.raises(
        RuntimeError, match=r"got no grad in the first iteration: unused\.bias, unused\.weight"
    ):
        ddp.zero_grad_buffer()
    declared = DistributedDataParallel(
        CONFIG, config, WithUnused(), unused_parameters=("unused.weight", "unused.bias")
    )
    for _ in range(3):
        declared.zero_grad_buffer()
        declared(ones()).backward()
        declared.finish_grad_sync()
    assert declared.module.unused.weight.grad is None
    wrong = DistributedDataParallel(CONFIG, config, WithUnused(), unused_parameters=("used.bias",))
    with pytest.raises(
        RuntimeError, match=r"param used\.bias was declared in unused_parameters but received a gradient"
    ):
        wrong(ones()).backward()
    with pytest.raises(
        ValueError, match=r"unused_parameters names params the module does not have: \['nope'\]"
    ):
        DistributedDataParallel(CONFIG, config, WithUnused(), unused_parameters=("nope",))


def test_unused_params_are_named_or_declared() -> None:
    run_distributed(unused_params, 1)


def unused_after_first_iteration() -> None:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10)
    model = WithUnused()
    ddp = DistributedDataParallel(CONFIG, config, model)
    ddp.zero_grad_buffer()
    (ddp.module.used(ones()).sum() + ddp.module.unused(ones()).sum()).backward()
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    ddp(ones()).backward()
    with pytest.raises(RuntimeError, match=r"Params that never got a grad: unused\.(bias|weight)"):
        ddp.finish_grad_sync()


def test_a_param_that_stops_getting_grads_is_named() -> None:
    run_distributed(unused_after_first_iteration, 1)


def mean_of_local_grads(replica: nn.Module, step: int, world: int) -> list[torch.Tensor]:
    """What the sync must give every rank, computed without it: each rank's batch through a plain replica
    (no wrapper, no hooks, no collective), the grads averaged in fp64."""
    total = [torch.zeros_like(p, dtype=torch.float64) for p in replica.parameters()]
    for rank in range(world):
        replica.zero_grad(set_to_none=True)
        replica(local_microbatches(step, rank, world, 1)[0]).backward()
        for acc, param in zip(total, replica.parameters(), strict=True):
            acc.add_(param.grad)  # type: ignore[arg-type]
    replica.zero_grad(set_to_none=True)
    return [acc / world for acc in total]


def plain_optimizer_steps(average_in_collective: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, replica = TinyGPT(), TinyGPT()
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=600, average_in_collective=average_in_collective
    )
    ddp = DistributedDataParallel(CONFIG, config, model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):  # the second step dispatches from the hooks, and must not see the first's grads
        ddp.zero_grad_buffer()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert not ddp.buffers[0].grad_data.any()
        ddp(local_microbatches(step, rank, world, 1)[0]).backward()
        dispatched = [g.grad_reduce_dispatched for g in ddp.bucket_groups]
        assert dispatched == [step > 0] * len(dispatched)  # the first step only counts readiness
        ddp.finish_grad_sync()
        expected = mean_of_local_grads(replica, step, world)
        for param, grad in zip(model.parameters(), expected, strict=True):
            assert param.grad is not None
            assert param.grad.data_ptr() == param.main_grad.data_ptr()  # type: ignore[attr-defined]
            torch.testing.assert_close(param.grad, grad.float(), rtol=1e-5, atol=1e-6)
        opt.step()
        with torch.no_grad():  # the same SGD step, on the replica, from the expected grads
            for param, grad in zip(replica.parameters(), expected, strict=True):
                param.sub_(0.1 * grad.float())
        torch.testing.assert_close(flat_params(model), flat_params(replica), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("average_in_collective", [False, True])
def test_a_plain_optimizer_steps_on_the_averaged_grads(average_in_collective: bool) -> None:
    """``param.grad`` is a view of the synced ``main_grad`` (scaled before the sum, or averaged after it),
    so torch.optim steps on the mean of every rank's grad; zero_grad_buffer starts each step afresh."""
    run_distributed(plain_optimizer_steps, 2, args=(average_in_collective,))


def bf16_grads_for_a_plain_optimizer() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, replica = TinyGPT().to(torch.bfloat16), TinyGPT().to(torch.bfloat16)
    ddp = DistributedDataParallel(CONFIG, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.zero_grad_buffer()
    ddp(local_microbatches(0, rank, world, 1)[0]).backward()
    ddp.finish_grad_sync()
    expected = mean_of_local_grads(replica, 0, world)
    for param, grad in zip(model.parameters(), expected, strict=True):
        assert param.grad is not None
        assert param.grad.dtype == torch.bfloat16
        assert param.main_grad.dtype == torch.float32  # type: ignore[attr-defined]
        torch.testing.assert_close(param.grad, grad.to(torch.bfloat16))  # bf16 tolerances: one rounding


def test_bf16_params_get_the_fp32_reduced_grad_as_a_bf16_copy() -> None:
    run_distributed(bf16_grads_for_a_plain_optimizer, 2)


def explicit_groups_and_single_buckets() -> None:
    rank = dist.get_rank()
    groups = initialize_model_parallel(tensor_model_parallel_size=2)  # dp groups {0,2} and {1,3}
    model = nn.Linear(3, 3, bias=False).to(test_device())
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1)
    ddp = DistributedDataParallel(CONFIG, config, model, pg_collection=groups)
    assert len(ddp.bucket_groups) == 1  # a single param: a single bucket anyway
    ddp.buffers[0].grad_data.fill_(float(rank))
    ddp.finish_grad_sync()
    peers = dist.get_process_group_ranks(groups.dp)  # type: ignore[arg-type]
    assert torch.equal(ddp.buffers[0].grad_data, torch.full((9,), sum(peers) / 2, device=test_device()))
    deep = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    assert len(DistributedDataParallel(CONFIG, config, deep, disable_bucketing=True).bucket_groups) == 1
    pp_later = ProcessGroupCollection(dp=groups.dp, pp=groups.tp)  # tp stands in for a 2-stage pipeline
    single = DistributedDataParallel(
        CONFIG, config, nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), pg_collection=pp_later
    )
    pp_rank = groups.tp.rank()  # type: ignore[union-attr]
    assert len(single.buffers[0].buckets) == (1 if pp_rank > 0 else 4)
    with pytest.raises(ValueError, match="dp process group is required but not provided in pg_collection"):
        DistributedDataParallel(
            CONFIG, config, nn.Linear(2, 2), pg_collection=ProcessGroupCollection(tp=groups.tp)
        )


def test_explicit_groups_pipeline_rank_and_disabled_bucketing() -> None:
    run_distributed(explicit_groups_and_single_buckets, 4)
