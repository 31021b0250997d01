"""DistributedOptimizer: sharded state, grad clipping, checkpoints (bit-exact resume, other DP sizes),
and results that do not depend on collective timing (the race probe of gradsync.groups.testing)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import (
    TinyGPT,
    Trainer,
    flat_params,
    global_batch,
    make_optimizer,
    max_relative_difference,
    reference_training,
)

from gradsync.buffers import DistributedDataParallelConfig, collectives
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import delayed_collectives, run_distributed

DISTOPT = DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=600
)
GATHER = DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=600
)
# Module attributes gradsync.buffers.collectives looks up at call time, besides torch.distributed's own.
COLLECTIVE_ALIASES = ((collectives, "dist_reduce_scatter_func"), (collectives, "dist_all_gather_func"))


def adamw_params_after_three_steps() -> torch.Tensor:
    trainer = Trainer.build(DISTOPT, "adamw")
    for step in range(3):
        trainer.step(step, dist.get_rank(), dist.get_world_size(), 1)
    return trainer.full_params()


def test_wraps_adamw_with_its_weight_decay() -> None:
    got = run_distributed(adamw_params_after_three_steps, 2)[0]
    assert max_relative_difference(got, reference_training("adamw", 2, 1, 3)) < 1e-5


def zero_grad_leaves_the_buffers_to_the_model() -> tuple[bool, bool]:
    trainer = Trainer.build(DISTOPT, "sgd")
    trainer.step(0, dist.get_rank(), dist.get_world_size(), 1)
    grads = trainer.ddp.buffers[0].grad_data
    trainer.optimizer.zero_grad()
    kept = bool(grads.any())
    trainer.ddp.zero_grad_buffer()
    return kept, not grads.any()


def test_optimizer_zero_grad_leaves_the_grad_buffers_to_zero_grad_buffer() -> None:
    """As in the reference, the loop calls both every iteration: one pass over the buffers, not two."""
    assert run_distributed(zero_grad_leaves_the_buffers_to_the_model, 2) == [(True, True)] * 2


def state_numel() -> tuple[int, int, int]:
    trainer = Trainer.build(DISTOPT, "adam")
    trainer.step(0, dist.get_rank(), dist.get_world_size(), 1)
    state = trainer.optimizer.optimizer.state
    per_rank = sum(v.numel() for s in state.values() for v in s.values() if v.dim() > 0)
    total = sum(p.numel() for p in trainer.model.parameters())
    padded = trainer.ddp.buffers[0].numel
    return per_rank, total, padded


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_state_per_rank_is_about_one_over_dp(world: int) -> None:
    results = run_distributed(state_numel, world)
    total, padded = results[0][1], results[0][2]
    assert sum(r[0] for r in results) == 2 * total  # exp_avg and exp_avg_sq, each element owned once
    for per_rank, _, _ in results:
        assert per_rank <= 2 * padded // world


def clipped_training(max_norm: float) -> tuple[list[float], torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(DISTOPT, "sgd")
    norms = []
    for step in range(5):
        trainer.ddp.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        rows = global_batch(step, world, 1).chunk(world)[rank]
        trainer.ddp(rows).backward()
        trainer.ddp.finish_grad_sync()
        norms.append(trainer.optimizer.clip_grad_norm(max_norm))
        trainer.optimizer.step()
    return norms, trainer.full_params()


def test_grad_norm_clipping_matches_one_process() -> None:
    world, max_norm = 4, 0.5
    norms, params = run_distributed(clipped_training, world, args=(max_norm,))[0]
    model = TinyGPT()
    opt = make_optimizer("sgd", model.parameters())
    for step in range(5):
        opt.zero_grad()
        model(global_batch(step, world, 1)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert norms[step] == pytest.approx(float(norm), rel=1e-5)
        opt.step()
    assert max(norms) > max_norm  # clipping was active
    assert max_relative_difference(params, flat_params(model)) <= 1e-6


def run_steps(trainer: Trainer, steps: range, world: int) -> None:
    for step in steps:
        trainer.step(step, dist.get_rank(), world, 1)


def saved_on_rank_0(state: dict[str, Any]) -> bytes:
    """What rank 0 writes to its checkpoint file, as every rank then reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    everyone: list[Any] = [buffer.getvalue() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(everyone, src=0)
    return everyone[0]  # type: ignore[no-any-return]


def resume_is_bit_exact(config: DistributedDataParallelConfig, optimizer: str, sharded: bool) -> None:
    world = dist.get_world_size()
    uninterrupted = Trainer.build(config, optimizer)
    run_steps(uninterrupted, range(20), world)
    first = Trainer.build(config, optimizer)
    run_steps(first, range(10), world)
    model_state = {k: v.clone() for k, v in first.ddp.state_dict().items()}
    if config.use_distributed_optimizer:
        if sharded:
            mine = first.optimizer.sharded_state_dict()
            shards: list[Any] = [None] * world
            dist.all_gather_object(shards, mine)
        else:
            saved = saved_on_rank_0(first.optimizer.state_dict())
    else:
        saved = saved_on_rank_0(first.optimizer.state_dict())
    resumed = Trainer.build(
        config, optimizer, seed=123
    )  # different init: everything must come from the checkpoint
    resumed.ddp.load_state_dict(model_state)
    if config.use_distributed_optimizer and sharded:
        resumed.optimizer.load_sharded_state_dict(shards)
    else:
        resumed.optimizer.load_state_dict(
            torch.load(io.BytesIO(saved), map_location="cpu", weights_only=False)
        )
    run_steps(resumed, range(10, 20), world)
    assert torch.equal(resumed.full_params(), uninterrupted.full_params())


@pytest.mark.parametrize(
    ("config", "optimizer", "sharded"),
    [
        (DISTOPT, "sgd", False),
        (DISTOPT, "adam", False),
        (DISTOPT, "adam", True),
        (GATHER, "adam", False),
        (DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600), "adam", False),
    ],
    ids=["distopt-sgd", "distopt-adam", "distopt-adam-sharded", "param-gather-adam", "plain-adam"],
)
def test_resume_at_step_10_is_bit_identical(
    config: DistributedDataParallelConfig, optimizer: str, sharded: bool
) -> None:
    run_distributed(resume_is_bit_exact, 2, args=(config, optimizer, sharded))


def save_at_dp(path: str, sharded: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(DISTOPT, "adam")
    run_steps(trainer, range(10), world)
    if sharded:
        torch.save(trainer.optimizer.sharded_state_dict(), f"{path}.shard{rank}")
    state = trainer.optimizer.state_dict()
    if rank == 0:
        torch.save({"model": trainer.ddp.state_dict(), "optimizer": state}, path)


def load_at_dp(path: str, saved_world: int, sharded: bool) -> torch.Tensor:
    world = dist.get_world_size()
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    trainer = Trainer.build(DISTOPT, "adam", seed=7)
    trainer.ddp.load_state_dict(checkpoint["model"])
    if sharded:
        trainer.optimizer.load_sharded_state_dict(
            [
                torch.load(f"{path}.shard{r}", map_location="cpu", weights_only=False)
                for r in range(saved_world)
            ]
        )
    else:
        trainer.optimizer.load_state_dict(checkpoint["optimizer"])
    run_steps(trainer, range(10, 20), world)
    return trainer.full_params()


@pytest.mark.parametrize("sharded", [False, True])
def test_reload_at_another_dp_size(tmp_path: Path, sharded: bool) -> None:
    path = str(tmp_path / "checkpoint.pt")
    run_distributed(save_at_dp, 4, args=(path, sharded))
    params = run_distributed(load_at_dp, 2, args=(path, 4, sharded))[0]
    model = TinyGPT()
    opt = make_optimizer("adam", model.parameters())
    for step in range(20):  # 10 steps at the dp=4 global batch, then 10 at the dp=2 one
        opt.zero_grad()
        model(global_batch(step, 4 if step < 10 else 2, 1)).backward()
        opt.step()
    assert max_relative_difference(params, flat_params(model)) <= 1e-6


def train_plain_then_probed(config: DistributedDataParallelConfig) -> None:
    """Train twice from the same start: plainly, then under the race probe, whose asynchronous collectives
    run only inside ``wait()`` (until then their outputs hold local, unreduced or ungathered values) and
    start late, by different amounts on each rank. Any read before its wait changes the result."""
    world = dist.get_world_size()

    def train() -> torch.Tensor:
        trainer = Trainer.build(config, "adam")
        run_steps(trainer, range(3), world)  # step 0 counts readiness, later steps dispatch from hooks
        return trainer.full_params()

    plain = train()
    with delayed_collectives(seed=0, extra_targets=COLLECTIVE_ALIASES) as probe:
        probed = train()
    assert probe.deferred > 0, "no asynchronous collective went through the race probe"
    assert probe.completed == probe.deferred
    assert torch.equal(plain, probed)


RACE_CONFIGS = {
    "ddp": DistributedDataParallelConfig(bucket_size=600),
    "ddp-overlap": DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600),
    "distopt": DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=600),
    "distopt-overlap": DISTOPT,
    "distopt-gather": DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=600
    ),
    "distopt-overlap-gather": GATHER,
}


@pytest.mark.parametrize("config", list(RACE_CONFIGS.values()), ids=list(RACE_CONFIGS))
def test_collectives_completing_only_when_waited_change_no_result(
    config: DistributedDataParallelConfig,
) -> None:
    run_distributed(train_plain_then_probed, 2, args=(config,))


def steps_without_optimizer_zero_grad(call_zero_grad: bool) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyGPT().to(torch.bfloat16)  # bf16 main_grad: the shard grads are fp32 copies, not views
    ddp = DistributedDataParallel(ModelParallelConfig(), DISTOPT, model)
    trainer = Trainer(model, ddp, DistributedOptimizer(make_optimizer("sgd", ddp.parameters()), ddp))
    for step in range(3):
        trainer.ddp.zero_grad_buffer()
        if call_zero_grad:
            trainer.optimizer.zero_grad()
        rows = global_batch(step, world, 1).chunk(world)[rank]
        trainer.ddp(rows).float().backward()
        trainer.ddp.finish_grad_sync()
        trainer.optimizer.step()
    return trainer.full_params()


def test_each_step_reads_fresh_grads_even_without_optimizer_zero_grad() -> None:
    with_zero_grad = run_distributed(steps_without_optimizer_zero_grad, 2, args=(True,))[0]
    without = run_distributed(steps_without_optimizer_zero_grad, 2, args=(False,))[0]
    assert torch.equal(with_zero_grad, without)


def main_param_storage(sharded: bool) -> dict[str, bool]:
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, overlap_grad_reduce=True, bucket_size=700
    )
    trainer = Trainer.build(config, "adamw")
    if not sharded:  # the fp32-main-params recipe without sharding
        trainer.optimizer = DistributedOptimizer(
            make_optimizer("adamw", trainer.ddp.parameters()), trainer.ddp
        )
    opt = trainer.optimizer
    buckets = sum(len(b.buckets) for b in trainer.ddp.grad_buffers.all_buffers)

    def inside(view: torch.Tensor | None, flat: torch.Tensor) -> bool:
        return view is not None and view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()

    trainer.step(0, dist.get_rank(), dist.get_world_size(), 1)
    return {
        "one_pair_per_bucket": len(opt.shards) == buckets > 1,
        "mains_are_views": all(inside(p.main, s.main) for s in opt.shards for p in s.pieces),
        "grads_are_views": all(inside(p.main.grad, s.grad) for s in opt.shards for p in s.pieces),
        "owned_elements": sum(p.main.numel() for p in opt.pieces),
        "trainable_elements": sum(p.numel() for p in trainer.ddp.params_with_grad),
    }


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "unsharded"])
def test_main_params_and_grads_are_one_flat_pair_per_bucket(sharded: bool) -> None:
    results = run_distributed(main_param_storage, 2, args=(sharded,))
    for result in results:
        assert result["one_pair_per_bucket"]
        assert result["mains_are_views"]
        assert result["grads_are_views"]
    owned = [r["owned_elements"] for r in results]
    total = results[0]["trainable_elements"]
    assert (sum(owned) if sharded else owned[0]) == total  # every element stepped once, by one rank


def inner_zero_grad_then_step() -> bool:
    """The inner torch optimizer's own zero_grad() drops the main params' grads; the next step attaches
    them again instead of silently stepping nothing."""
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    trainer, reference = (Trainer.build(config, "sgd") for _ in range(2))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer.step(0, rank, world, 1)
    reference.step(0, rank, world, 1)
    trainer.optimizer.optimizer.zero_grad(set_to_none=True)
    trainer.step(1, rank, world, 1)
    reference.step(1, rank, world, 1)
    return torch.equal(flat_params(trainer.model), flat_params(reference.model))


def test_grads_come_back_after_the_inner_optimizer_drops_them() -> None:
    assert all(run_distributed(inner_zero_grad_then_step, 2))


def storage_beside_the_buffers(dtype_name: str) -> dict[str, int]:
    """Bytes the distributed optimizer's main params and their grads hold outside the model's buffers,
    after a step, and the elements of this rank's bucket shards."""
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=700, grad_reduce_in_fp32=True
    )
    model = TinyGPT().to(getattr(torch, dtype_name))
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model)
    trainer = Trainer(model, ddp, DistributedOptimizer(make_optimizer("adamw", ddp.parameters()), ddp))
    trainer.step(0, dist.get_rank(), dist.get_world_size(), 1)
    buffers = {
        flat.untyped_storage().data_ptr()
        for buffer in ddp.grad_buffers.all_buffers
        for flat in (buffer.param_data, buffer.grad_data)
        if flat is not None
    }
    beside: dict[int, int] = {}
    for piece in trainer.optimizer.pieces:
        for tensor in (piece.main, piece.main.grad):
            assert tensor is not None
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in buffers:
                beside[storage.data_ptr()] = storage.nbytes()
    return {"beside": sum(beside.values()), "shards": sum(s.hi - s.lo for s in trainer.optimizer.shards)}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_fp32_buffers_are_stepped_in_place(dtype_name: str) -> None:
    """As the reference: fp32 params are their own main params and fp32 grads their own main grads (8 + 8/d
    bytes per param with fp32 params, 6 + 12/d with bf16 params and fp32 grads); only bf16 params get
    fp32 main copies, one flat tensor per bucket shard."""
    for result in run_distributed(storage_beside_the_buffers, 2, args=(dtype_name,)):
        assert result["beside"] == (0 if dtype_name == "float32" else 4 * result["shards"])
