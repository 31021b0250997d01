"""Bad input is refused at construction, before any collective, naming the field and the fix; misuse
during training raises instead of corrupting grads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import STRATEGIES, Block, TinyTransformer, local_microbatches, shard_index, wrap
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, fully_shard_model, fully_shard_optimizer
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed, test_device


def config(**fields: object) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(use_megatron_fsdp=True, **fields)  # type: ignore[arg-type]


def refused(units: object = None, **fields: object) -> str:
    with pytest.raises((ValueError, NotImplementedError)) as caught:
        MegatronFSDP(TinyTransformer(), shard_index(), config(**fields), fsdp_unit_modules=units)  # type: ignore[arg-type]
    return str(caught.value)


def construction_errors() -> None:
    assert "data_parallel_sharding_strategy='zero3'" in refused(data_parallel_sharding_strategy="zero3")
    assert "optim_grads_params" in refused(data_parallel_sharding_strategy="zero3")
    assert "matches no module" in refused(units=[nn.Conv1d])
    assert "does not import" in refused(units=["no_such_package.Block"])
    assert "nccl_ub=True needs CUDA" in refused(nccl_ub=True)
    assert "fp8_param_gather=True needs CUDA" in refused(fp8_param_gather=True)
    assert "fsdp_db_use_persist_buf_on_alloc_fail=True only chooses" in refused(
        fsdp_db_use_persist_buf_on_alloc_fail=True
    )
    assert "use_distributed_optimizer=True" in refused(use_distributed_optimizer=True)


def test_bad_config_and_units_are_named() -> None:
    run_distributed(construction_errors, 2)


def models_differ() -> None:
    model = TinyTransformer()
    if dist.get_rank() == 1:
        model.extra = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match="MegatronFSDP: the model differs between data-parallel ranks 0 and 1"
    ):
        MegatronFSDP(model, shard_index(), config())


def test_models_that_differ_across_ranks_are_refused_on_every_rank() -> None:
    run_distributed(models_differ, 2)


def index_outside_the_world() -> None:
    if dist.get_rank() == 0:
        return
    unused_group = dist.group.WORLD  # the mesh check refuses first; a subgroup would cost a new_group
    mesh = DeviceMesh(test_device().type, [0], mesh_dim_names=("dp_shard",), _init_backend=False)
    index = FSDPDistributedIndex.__new__(FSDPDistributedIndex)
    index.device_mesh, index.use_hybrid_fsdp, index.fsdp_group = mesh, False, unused_group
    with pytest.raises(ValueError, match="does not fit the world"):
        MegatronFSDP(TinyTransformer(), index, config())


def test_a_dist_index_that_does_not_cover_this_rank_is_refused() -> None:
    run_distributed(index_outside_the_world, 2)


def foreign_optimizer() -> None:
    with pytest.raises(ValueError, match="not MegatronFSDP's"):
        fully_shard_optimizer(torch.optim.SGD(TinyTransformer().parameters(), lr=0.1))
    # built on the module's own params before wrapping: the wrapper holds them, but never steps them
    model = wrap("optim_grads_params")
    with pytest.raises(ValueError, match="not MegatronFSDP's"):
        fully_shard_optimizer(torch.optim.SGD([r.compute for r in model.params], lr=0.1))


def test_fully_shard_optimizer_refuses_an_optimizer_on_other_params() -> None:
    run_distributed(foreign_optimizer, 1)


def nan_on_rank_1(strategy: str) -> None:
    """NaN in rank 1's first microbatch (under no_sync()): every rank raises at finish_grad_sync, naming
    rank 1; after zero_grad_buffer() a clean cycle passes (the recorded norms were reset)."""
    model = wrap(strategy, check_for_nan_in_grad=True)
    rank = dist.get_rank()
    first, second = local_microbatches(0, rank, 2, 2)
    loss = model(first)
    if rank == 1:
        loss = loss * float("nan")
    with model.no_sync():
        loss.backward()
    model(second).backward()
    with pytest.raises(
        RuntimeError, match=r"NaN or Inf in the grads of bucket \d+ \(.*\) on rank\(s\) \[1\]"
    ):
        model.finish_grad_sync()
    model.zero_grad_buffer()
    model(second).backward()
    model.finish_grad_sync()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_grads_raise_on_every_rank_naming_the_rank(strategy: str) -> None:
    run_distributed(nan_on_rank_1, 2, args=(strategy,))


def nan_in_one_param_on_rank_1() -> str:
    model = fully_shard_model(TinyTransformer(), fsdp_unit_modules=[Block], report_nan_in_param_grad=True)
    batch = local_microbatches(0, dist.get_rank(), 2, 1)[0]
    if dist.get_rank() == 1:
        poisoned = next(r.compute for r in model.params if r.name == "blocks.1.down.bias")
        poisoned.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(RuntimeError, match=r"on rank\(s\) \[1\]") as caught:
        model(batch).backward()
    return str(caught.value)


def test_report_nan_in_param_grad_names_the_param_on_its_rank() -> None:
    ok, named = run_distributed(nan_in_one_param_on_rank_1, 2)
    assert "blocks.1.down.bias" in named
    assert "on this rank" not in ok


def eval_forward_releases() -> None:
    model = wrap("optim_grads_params")
    with torch.no_grad():
        model(local_microbatches(0, dist.get_rank(), 2, 1)[0])
    assert all(b.weight.untyped_storage().nbytes() == 0 for b in model.buckets)


def test_a_forward_without_grad_leaves_nothing_gathered() -> None:
    run_distributed(eval_forward_releases, 2)
