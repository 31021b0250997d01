"""init_model_with_meta_device: a model built on the meta device is materialised module by
module into the shards. Seeded like the normal construction, every strategy (and HFSDP) holds exactly the
normally initialised weights, and trains like one process; under ZeRO-3 no more than one module's params
exist whole at any time (measured from the params' storage sizes at every init call)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    Block,
    TinyTransformer,
    Trainer,
    full_weights,
    make_optimizer,
    max_relative_difference,
    named_weights,
    reference_training,
    shard_index,
)
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, fully_shard
from gradsync.groups.testing import run_distributed, test_device

SEED = 3


def meta_model(seed: int = SEED) -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer(seed)


def normally_initialised() -> dict[str, torch.Tensor]:
    """Built on the device the meta model is materialised on: its random generator draws the values."""
    with torch.device(test_device()):
        return named_weights(TinyTransformer(SEED))


def wrap_meta(strategy: str, outer: int = 1, outer_strategy: str = "no_shard", **kwargs: Any) -> MegatronFSDP:
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer_strategy,
    )
    module = meta_model()
    torch.manual_seed(SEED)  # as TinyTransformer's constructor seeds before building its modules
    return MegatronFSDP(
        module,
        shard_index(outer, outer_strategy),
        config,
        fsdp_unit_modules=[Block],
        init_model_with_meta_device=True,
        **kwargs,
    )


def weights_after_meta_init(strategy: str, outer: int, outer_strategy: str) -> dict[str, torch.Tensor]:
    model = wrap_meta(strategy, outer, outer_strategy)
    assert not any(p.is_meta for p in model.module.parameters())
    assert model.module.head.weight is model.module.embedding.weight  # still tied
    return full_weights(model)


@pytest.mark.parametrize(
    ("strategy", "world", "outer", "outer_strategy"),
    [(s, 2, 1, "no_shard") for s in STRATEGIES] + [("optim_grads_params", 4, 2, "optim")],
)
def test_equals_the_normally_initialised_model(
    strategy: str, world: int, outer: int, outer_strategy: str
) -> None:
    want = normally_initialised()
    for rank, got in enumerate(
        run_distributed(weights_after_meta_init, world, args=(strategy, outer, outer_strategy))
    ):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), rank


def seeded_per_rank(strategy: str, outer: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each rank seeds its meta init differently; the compute weights after wrapping, and after the
    optimizer's weights are installed over them (ZeRO-1/2 and HSDP keep other copies there)."""
    with torch.device("meta"):
        module = TinyTransformer()
    torch.manual_seed(SEED + dist.get_rank())
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    model = MegatronFSDP(
        module, shard_index(outer), config, fsdp_unit_modules=[Block], init_model_with_meta_device=True
    )
    wrapped = full_weights(model)
    model.install_optimized_model_weights()
    return wrapped, full_weights(model)


@pytest.mark.parametrize(("strategy", "outer"), [("no_shard", 1), ("optim", 1), ("optim_grads_params", 2)])
def test_replicas_seeded_apart_start_as_the_first_rank(strategy: str, outer: int) -> None:
    """no_shard, ZeRO-1's compute weights and HSDP's outer replicas (world 2 as 2 replicas of one shard)
    hold copies of the same rows: each rank materialised its own, and they trained apart, silently."""
    want = normally_initialised()  # rank 0's seed
    for rank, weights in enumerate(run_distributed(seeded_per_rank, 2, args=(strategy, outer))):
        for got in weights:
            assert all(torch.equal(got[k], want[k]) for k in want), rank


class Mixed(nn.Module):
    """A module whose init sets a child's param (MultiheadAttention zeroes out_proj.bias after out_proj's
    own init drew it) and one with buffers its init fills (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)


def mixed_after_meta_init(strategy: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with torch.device("meta"):
        module = Mixed()
    torch.manual_seed(SEED)
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    model = MegatronFSDP(module, shard_index(), config, init_model_with_meta_device=True)
    buffers = {n: b.detach().cpu().clone() for n, b in model.module.named_buffers()}
    return full_weights(model), buffers


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_inits_of_parents_and_buffers_run_as_in_the_constructor(strategy: str) -> None:
    torch.manual_seed(SEED)
    with torch.device(test_device()):  # drawn by the generator of the device the wrapper materialises on
        reference = Mixed()
    assert not torch.equal(reference.norm.running_var, torch.zeros(8, device=test_device()))
    for weights, buffers in run_distributed(mixed_after_meta_init, 2, args=(strategy,)):
        assert weights.keys() == named_weights(reference).keys()
        assert all(torch.equal(weights[k], v) for k, v in named_weights(reference).items())
        assert torch.equal(weights["attention.out_proj.bias"], torch.zeros(8))  # the parent's init won
        assert all(torch.equal(buffers[n], b.cpu()) for n, b in reference.named_buffers())


def train_from_meta(steps: int) -> dict[str, torch.Tensor]:
    """fully_shard with an optimizer built on the meta model's params, as a user would write it."""
    module = meta_model(0)
    optimizer = make_optimizer(module.parameters())
    torch.manual_seed(0)
    model, optimizer = fully_shard(
        module,
        optimizer,
        fsdp_unit_modules=[Block],
        zero_dp_strategy=3,
        init_model_with_meta_device=True,
        sync_model_each_microbatch=False,
        device=test_device(),  # a gloo group with CUDA tensors: the group alone would say the CPU
    )
    trainer = Trainer(model, optimizer)
    for step in range(steps):
        trainer.step(step, 1)
    return full_weights(model)


def test_trains_like_one_process() -> None:
    want = reference_training(2, 1, 6, init_device=str(test_device()))  # the meta init draws there
    for rank, got in enumerate(run_distributed(train_from_meta, 2, args=(6,))):
        assert max_relative_difference(got, want) <= 1e-6, rank


def live_param_bytes(module: nn.Module) -> int:
    """Bytes of distinct storage behind ``module``'s params (a released ZeRO-3 view holds none)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


def peak_while_materialising() -> tuple[int, int, int, int]:
    """(most param bytes alive at any init call, the largest module's own param bytes, the whole model's
    param bytes, what the wrapper keeps per rank afterwards)."""
    seen: list[int] = []
    module = meta_model()

    def init(owner: nn.Module) -> None:
        seen.append(live_param_bytes(module))
        owner.reset_parameters()  # type: ignore[operator]

    torch.manual_seed(SEED)
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = MegatronFSDP(
        module,
        shard_index(),
        config,
        fsdp_unit_modules=[Block],
        init_model_with_meta_device=True,
        param_init_fn=init,
    )
    assert full_weights(model).keys() == normally_initialised().keys()
    reference = TinyTransformer(SEED)
    largest = max(
        sum(p.numel() * p.element_size() for p in owner.parameters(recurse=False))
        for owner in reference.modules()
    )
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    kept = sum(
        b.weight_shard.numel() * b.weight_shard.element_size()
        for b in model.buckets
        if b.weight_shard is not None
    )
    return max(seen), largest, whole, kept


def test_zero3_never_holds_more_than_one_module() -> None:
    for peak, largest, whole, kept in run_distributed(peak_while_materialising, 4):
        assert peak == largest  # the module being initialised, nothing else
        assert largest < whole / 4
        assert kept < whole / 2  # this rank's shards (a quarter, plus row-alignment padding)


class Scale(nn.Module):
    """A module with its own param and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def refusals() -> None:
    config = DistributedDataParallelConfig(use_megatron_fsdp=True)
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"module '1' \(Scale\) .* no reset_parameters\(\) .* param_init_fn"):
        MegatronFSDP(module, shard_index(), config, init_model_with_meta_device=True)
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="init_model_with_meta_device=True"):
        MegatronFSDP(module, shard_index(), config)
    model = MegatronFSDP(
        nn.Sequential(nn.Linear(4, 4), Scale()).to("meta"),
        shard_index(),
        config,
        init_model_with_meta_device=True,
        param_init_fn=lambda m: [nn.init.constant_(p, 2.0) for p in m.parameters(recurse=False)],
    )
    assert model.module[1].gain.device.type == test_device().type
    assert all(torch.equal(w, torch.full_like(w, 2.0)) for w in full_weights(model).values())
    dist.barrier()


def test_a_module_without_an_init_is_named() -> None:
    run_distributed(refusals, 2)
