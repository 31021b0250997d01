"""gradsync-ddp against Megatron-Core's ``DistributedDataParallel`` API (HEAD d98e8a64, transcribed from
the reference docs and the source): names, argument order and defaults, then what the Megatron-named
methods do. Deviations are listed in the table with their reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, Trainer, flat_params, local_microbatches

from gradsync.buffers import DistributedDataParallelConfig, ensure_params_ready
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer, _BaseDataParallel
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed
from gradsync.groups.testing.api_table import REQUIRED, signature_mismatches

R = REQUIRED
DDP = DistributedDataParallel
TABLE: list[tuple[Any, list[tuple[str, Any]], dict[str, str]]] = [
    (_BaseDataParallel.__init__, [("config", R), ("module", R)], {}),
    (
        DDP.__init__,
        [
            ("config", R),
            ("ddp_config", R),
            ("module", R),
            ("disable_bucketing", False),
            ("pg_collection", None),
            ("full_param_layout", None),
        ],
        {
            "unused_parameters": "keyword-only: params that never get a grad, refused if they do",
            "shard_alignment": "keyword-only: where the distributed optimizer's shards may cut each param",
            "init_sync": "keyword-only: replicas start from the first DP rank's params, as torch's DDP",
        },
    ),
    (DDP.state_dict, [("prefix", ""), ("keep_vars", False), ("destination", None)], {}),
    (DDP.state_dict_for_save_checkpoint, [("prefix", ""), ("keep_vars", False)], {}),
    (DDP.load_state_dict, [("state_dict", R), ("strict", True)], {"assign": "torch's own argument"}),
    (DDP.enable_forward_pre_hook, [], {}),
    (DDP.disable_forward_pre_hook, [("param_sync", True)], {}),
    (DDP.no_sync, [], {}),
    (DDP.start_param_sync, [("*unused", R), ("force_sync", False), ("force_dispatch", False)], {}),
    (DDP.reset_param_sync_dispatch_state, [], {}),
    (DDP.start_grad_sync, [("*unused", R)], {}),
    (DDP.finish_grad_sync, [("force_all_reduce", False)], {}),
    (DDP.free_overlap_buffers, [], {}),
    (DDP.scale_gradients, [("scaling_factor", R)], {}),
    (DDP.zero_grad_buffer, [], {}),
    (DDP.broadcast_params, [], {}),
    (DDP.offload_grad_buffers, [("synchronize", True), ("empty_cache", True)], {}),
    (DDP.restore_grad_buffers, [("synchronize", True)], {}),
    (DDP._start_bucket_group_param_sync, [("bucket_group", R), ("force_sync", R)], {}),
    (DistributedOptimizer.step, [], {"closure": "torch.optim.Optimizer's argument; refused when given"}),
    (DistributedOptimizer.zero_grad, [("set_to_none", True)], {}),
    (DistributedOptimizer.scale_loss, [("loss", R)], {}),
    (DistributedOptimizer.get_loss_scale, [], {}),
    (DistributedOptimizer.reload_model_params, [("state_dict", None)], {}),
    (DistributedOptimizer.prepare_grads, [], {}),
    (DistributedOptimizer.step_with_ready_grads, [], {}),
    (DistributedOptimizer.count_zeros, [], {}),
    (
        DistributedOptimizer.compute_full_param_layout,
        [
            ("params", R),
            ("bucket_size", R),
            ("data_parallel_world_size", R),
            ("ddp_config", R),
            ("expert_data_parallel_world_size", None),
        ],
        {},
    ),
]


@pytest.mark.parametrize(("func", "megatron", "extra"), TABLE, ids=[t[0].__qualname__ for t in TABLE])
def test_signature_matches_megatron(
    func: Any, megatron: list[tuple[str, Any]], extra: dict[str, str]
) -> None:
    assert signature_mismatches(func, megatron, list(extra)) == []


def wrap(**config: Any) -> DistributedDataParallel:
    return DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(**config), TinyGPT())


class SavesItsOwnWay(TinyGPT):
    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        return {f"{prefix}saved": keep_vars}


def state_dicts() -> None:
    ddp = wrap()
    by_position = ddp.state_dict("pre.", True)  # Megatron's order: prefix, keep_vars
    assert all(key.startswith("pre.") for key in by_position)
    assert isinstance(by_position["pre.embedding.weight"], torch.nn.Parameter)
    saved, plain = ddp.state_dict_for_save_checkpoint(), ddp.module.state_dict()
    assert saved.keys() == plain.keys()
    assert all(saved[k] is plain[k] or torch.equal(saved[k], plain[k]) for k in plain)
    own = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), SavesItsOwnWay())
    assert own.state_dict_for_save_checkpoint("x.", True) == {"x.saved": True}


def test_state_dicts_take_megatrons_arguments() -> None:
    run_distributed(state_dicts, 2)


def full_param_layouts() -> None:
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=1000)
    model = TinyGPT()
    trainable = [p for p in model.parameters() if p.requires_grad]
    world = dist.get_world_size()
    small = DistributedOptimizer.compute_full_param_layout(trainable, 300, world, config)
    (key,) = small.layouts
    index_map = small.layouts[key].param_index_map
    # Megatron's keying: by the Parameter itself, last param first.
    assert [id(param) for param in index_map] == [id(param) for param in reversed(trainable)]
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model, full_param_layout=small)
    assert ddp.buffers[0].param_index_map == index_map
    assert ddp.buffers[0].bucket_indices == small.layouts[key].bucket_indices  # 300, not the config's 1000
    assert len(ddp.buffers[0].buckets) > len(
        wrap(use_distributed_optimizer=True, bucket_size=1000).buffers[0].buckets
    )
    with pytest.raises(ValueError, match=r"Params for .* do not match between grouping and layout"):
        # keyed by another module's params
        DistributedDataParallel(ModelParallelConfig(), config, TinyGPT(), full_param_layout=small)
    other = TinyGPT()
    trainable = [p for p in other.parameters() if p.requires_grad]
    reordered = DistributedOptimizer.compute_full_param_layout(trainable[::-1], 300, world, config)
    with pytest.raises(ValueError, match=r"Params for .* do not match between grouping and layout"):
        DistributedDataParallel(ModelParallelConfig(), config, other, full_param_layout=reordered)
    fp32 = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    other_keys = DistributedOptimizer.compute_full_param_layout(trainable, 300, world, fp32)
    bf16_model = TinyGPT().to(torch.bfloat16)
    with pytest.raises(ValueError, match="Buffer keys from param grouping"):
        DistributedDataParallel(ModelParallelConfig(), config, bf16_model, full_param_layout=other_keys)


def test_a_precomputed_layout_is_used_and_checked() -> None:
    run_distributed(full_param_layouts, 2)


def offload_round_trip() -> dict[str, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    kept, offloaded = (Trainer.build(DistributedDataParallelConfig(), "sgd") for _ in range(2))
    for buffer in offloaded.ddp.buffers:
        buffer.grad_data.fill_(float(rank + 1))  # stale grads: they must not survive the round trip
    offloaded.ddp.offload_grad_buffers()
    freed = all(b.grad_data.untyped_storage().nbytes() == 0 for b in offloaded.ddp.buffers)
    views = [p.main_grad for p in offloaded.ddp.params_with_grad]  # type: ignore[attr-defined]
    offloaded.ddp.restore_grad_buffers()
    zeroed = all(bool(v.eq(0).all()) for v in views)
    for trainer in (kept, offloaded):
        trainer.step(0, rank, world, 1)
    same_views = all(p.main_grad is v for p, v in zip(offloaded.ddp.params_with_grad, views, strict=True))  # type: ignore[attr-defined]
    return {
        "freed": freed,
        "zeroed": zeroed,
        "same_views": same_views,
        "same_training": torch.equal(flat_params(kept.model), flat_params(offloaded.model)),
    }


def test_offloaded_grad_buffers_come_back_zeroed_and_training_goes_on() -> None:
    for result in run_distributed(offload_round_trip, 2):
        assert result == {"freed": True, "zeroed": True, "same_views": True, "same_training": True}


def dispatch_state() -> None:
    ddp = wrap(use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=500)
    ddp.start_param_sync(force_dispatch=True)
    assert any(g.param_gather_handle is not None for g in ddp.bucket_groups)
    with pytest.raises(RuntimeError, match="while an asynchronous parameter all-gather is still in flight"):
        ddp.reset_param_sync_dispatch_state()
    for bucket in (b for g in ddp.bucket_groups for b in g.buckets):  # Megatron's layer-wise gather views
        bucket.layerwise_gather_list = [bucket.grad_data[:1]]
    ddp.free_overlap_buffers()
    assert all(g.param_gather_handle is None for g in ddp.bucket_groups)
    assert all(b.layerwise_gather_list is None for g in ddp.bucket_groups for b in g.buckets)
    ddp.reset_param_sync_dispatch_state()
    assert not any(g.param_gather_dispatched for g in ddp.bucket_groups)


def test_dispatch_state_resets_only_with_no_gather_in_flight() -> None:
    run_distributed(dispatch_state, 2)


def params_ready_on_demand() -> dict[str, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=500
    )
    asked, reference, idle = (Trainer.build(config, "sgd") for _ in range(3))
    for trainer in (asked, reference, idle):
        trainer.step(0, rank, world, 1)
    stale = flat_params(asked.model)
    ensure_params_ready(asked.model.parameters())
    idle.ddp.disable_forward_pre_hook(param_sync=False)
    ensure_params_ready(idle.model.parameters())  # no pre-hooks and nothing in flight: nothing to do
    gathered = [torch.empty_like(stale) for _ in range(world)]
    dist.all_gather(gathered, flat_params(asked.model))
    return {
        "changed": not torch.equal(stale, flat_params(asked.model)),
        "current": torch.equal(flat_params(asked.model), reference.full_params()),
        "same_on_every_rank": all(torch.equal(g, gathered[0]) for g in gathered),
        "idle_untouched": torch.equal(flat_params(idle.model), stale),
        "forward_works": bool(torch.isfinite(asked.ddp(local_microbatches(1, rank, world, 1)[0]))),
    }


def test_ensure_params_ready_finishes_the_gathers_of_those_params() -> None:
    for result in run_distributed(params_ready_on_demand, 2):
        assert all(result.values()), result
