"""FSDP2's per-module API (``gradsync.fsdp.fsdp2``): torchtitan's loop — ``fully_shard`` on each block, then
on the root, the optimizer built after it on ``model.parameters()``, plain ``backward`` / ``step`` /
``zero_grad``, accumulation with ``set_requires_gradient_sync(False)`` on all but the last microbatch —
equals one process on the global batch (fp32: <= 1e-6 relative) and torch's own
``torch.distributed.fsdp.fully_shard`` running the very same loop (the module is imported by name, so the
two runs differ only by that import), for ZeRO-3 and ZeRO-2 units at 2 and 4 ranks, units with mixed
``reshard_after_forward``, a root alone, and a 2x2 HSDP mesh with the outer axis replicating or sharding
the optimizer state; bf16 ``param_dtype`` as torch's and within its rounding of one process. Then what ``fully_shard`` builds,
the methods that map, and every refusal, by its message.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import (
    Block,
    TinyTransformer,
    cached_reference,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    skip_where_torch_gathers_crash,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from gradsync.buffers.matrix_optim import BlockShampoo, Muon, muon_param_groups
from gradsync.buffers.testing import ABANDONED_BY_RANK_ONE
from gradsync.fsdp import MixedPrecisionPolicy as GradsyncPrecision
from gradsync.fsdp import uneven_dtensor_to_full_tensor
from gradsync.fsdp.fault_tolerance import register_fault_tolerant_hook
from gradsync.fsdp.fsdp2 import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    megatron_fsdp_of,
)
from gradsync.groups.testing import run_distributed, step_abandoned_on_rank_one, test_device

STEPS, MICRO = 4, 2
GRADSYNC, TORCH = "gradsync.fsdp.fsdp2", "torch.distributed.fsdp"
# torch's own fully_shard runs on CPU tensors only where its CPU stream records events (not torch 2.6): there
# the comparisons with torch are left out and gradsync is checked against one process alone
TORCH_FSDP2_RUNS = test_device().type != "cpu" or hasattr(torch.cpu.Stream(), "record_event")
needs_torch_fsdp2 = pytest.mark.skipif(
    not TORCH_FSDP2_RUNS, reason="torch's own fully_shard does not run on this torch's CPU (2.6)"
)


def dp_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh(test_device().type, shape, mesh_dim_names=names)


def torchtitan_loop(
    api_name: str,
    shape: tuple[int, ...],
    reshards: tuple[bool | None, ...] | None,
    param_dtype: torch.dtype | None = None,
    **gradsync_only: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torchtitan's apply_fsdp and train loop, written once for both APIs; ``reshards`` None: the root
    alone. Returns the whole weights (the optimizer's, fp32), each step's grad norm (clipping at a bound
    it never reaches, so the weights stay comparable with the unclipped reference) and, for gradsync,
    what it built."""
    api = importlib.import_module(api_name)
    mesh = dp_mesh(shape)
    mp_policy = api.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = TinyTransformer()
    for block, reshard in zip(model.blocks, reshards or (), strict=False):
        api.fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard, **gradsync_only)
    api.fully_shard(model, mesh=mesh, mp_policy=mp_policy, **gradsync_only)
    optimizer = make_optimizer(model.parameters())
    # the optimizer's weights before any step: with a bf16 param_dtype, still the fp32 values
    initial = whole_weights(model) if api_name == GRADSYNC and param_dtype is not None else None
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = []
    for step in range(STEPS):
        batches = local_microbatches(step, rank, world, MICRO)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            (model(batch) / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
        optimizer.zero_grad()
    built: dict[str, Any] = {
        "initial": initial,
        "grad norms": norms,
        "shards": {name: p.to_local().detach().cpu() for name, p in model.named_parameters()},
    }
    if api_name == GRADSYNC:
        fsdp = megatron_fsdp_of(model)
        built |= {
            "strategy": fsdp.data_parallel_sharding_strategy,
            "units": [u is b for u, b in zip(fsdp.units, model.blocks, strict=False)],
            "kept": fsdp.units_kept_after_forward,
            "placements": {tuple(p.placements) for p in model.parameters()},
            "compute dtype": fsdp.buckets[0].weight.dtype,
        }
    return whole_weights(model), built


def whole_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The optimizer's weights, whole (torch's DTensors and gradsync's uneven ones alike)."""
    return {name: uneven_dtensor_to_full_tensor(p).cpu() for name, p in model.named_parameters()}


def both_apis(*args: Any, **gradsync_only: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
    """The same loop with gradsync's API and with torch's, on the same ranks."""
    ours, built = torchtitan_loop(GRADSYNC, *args, **gradsync_only)
    if not TORCH_FSDP2_RUNS:
        return ours, built, None
    theirs, torch_built = torchtitan_loop(TORCH, *args[:3])  # torch has no outer_dp_sharding_strategy
    built["torch grad norms"] = torch_built["grad norms"]
    return ours, built, theirs


def summed_loop(api_name: str, reshard: bool, on_root: bool) -> dict[str, torch.Tensor]:
    """torchtitan's loss scaling: the divide factor 1 on the FSDP modules (torchtitan sets it on every
    one; ``on_root`` False leaves the root's own params averaged) and the local mean loss divided by the
    ranks, so that the summed grads are the global batch's mean. Returns the whole weights."""
    api = importlib.import_module(api_name)
    mesh = dp_mesh((dist.get_world_size(),))
    model = TinyTransformer()
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    for module in model.modules():
        if isinstance(module, api.FSDPModule) and (on_root or module is not model):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # torch's needs it on gloo (no PREMUL_SUM)
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        batches = local_microbatches(step, rank, world, MICRO)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            (model(batch) / (MICRO * world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return whole_weights(model)


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_divide_factor_one_sums_as_torchtitan_scales_the_loss(reshard: bool) -> None:
    """Every module summing, the loss over the global batch: one process's weights (and torch's)."""
    results = run_distributed(summed_loop, 2, args=(GRADSYNC, reshard, True))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, cached_reference(2, MICRO, STEPS)) <= 1e-6, rank


def replicas_through_the_hook(reshard: bool) -> dict[str, torch.Tensor]:
    """torchft's FSDP2 pattern (torchtitan's ``maybe_set_all_reduce_hook``) on plain groups: two replica
    groups of two ranks, each sharding over its own ranks, every FSDP module's all-reduce hook averaging
    its reduced shard across the groups (rank r with rank r). Returns the whole weights."""
    mesh = dp_mesh((2, 2))
    shard_mesh, across = mesh["dp_shard"], mesh["dp_replicate"].get_group()

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=across)  # gloo has no average: the sum, then divided
        output.div_(across.size())

    model = TinyTransformer()
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        batches = local_microbatches(step, rank, world, MICRO)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            (model(batch) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
    return whole_weights(model)


def test_an_all_reduce_hook_across_replica_groups_trains_like_one_process() -> None:
    """Each group sees half the global batch; the hook makes every group's step the whole batch's
    (ZeRO-3; ZeRO-2's reductions land through the same shard path)."""
    for rank, weights in enumerate(run_distributed(replicas_through_the_hook, 4, args=(True,))):
        assert max_relative_difference(weights, cached_reference(4, MICRO, STEPS)) <= 1e-6, rank


def step_after_a_dropped_cycle(drop_one: bool) -> dict[str, torch.Tensor]:
    """One step on step 1's batch; ``drop_one``: after a backward on step 0's batch whose grads
    ``optimizer.zero_grad()`` dropped with no step between (a step torchft did not commit)."""
    model = TinyTransformer()
    two_units(model)
    fully_shard(model)
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    if drop_one:
        model(local_microbatches(0, rank, world, 1)[0]).backward()
        optimizer.zero_grad()
    model(local_microbatches(1, rank, world, 1)[0]).backward()
    optimizer.step()
    return whole_weights(model)


def test_grads_dropped_without_a_step_start_the_next_cycle_from_none() -> None:
    """As torch's FSDP2: the next backward's grads are the only ones the step applies."""
    dropped = run_distributed(step_after_a_dropped_cycle, 2, args=(True,))
    fresh = run_distributed(step_after_a_dropped_cycle, 2, args=(False,))
    for got, want in zip(dropped, fresh, strict=True):
        assert all(torch.equal(got[name], want[name]) for name in want)


def refuse_fault_tolerance_on_a_unit(model: TinyTransformer) -> None:
    two_units(model)
    fully_shard(model)
    register_fault_tolerant_hook(model.blocks[0], manager=None)  # refused before the manager is read


def refuse_a_hook_stream(model: TinyTransformer) -> None:
    two_units(model)
    fully_shard(model)
    model.set_all_reduce_hook(lambda output: None, stream=object())


def summed_by_both(reshard: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`summed_loop` with the blocks alone summing, by gradsync and by torch, on the same ranks."""
    return summed_loop(GRADSYNC, reshard, False), summed_loop(TORCH, reshard, False)


@needs_torch_fsdp2
@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_divide_factor_on_some_modules_matches_torch(reshard: bool) -> None:
    """The blocks summing and the root's own params averaged (ZeRO-2 coalesces buckets of both kinds
    into one reduction): the same weights as torch's fully_shard given the same calls."""

    for rank, (ours, theirs) in enumerate(run_distributed(summed_by_both, 2, args=(reshard,))):
        assert max_relative_difference(ours, theirs) <= 1e-6, rank
        assert max_relative_difference(ours, cached_reference(2, MICRO, STEPS)) > 1e-3, rank  # not averaged


def chunked_shards(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each rank's local shards after the loop: gradsync with ``shard_alignment="chunk"`` and torch."""
    _, ours = torchtitan_loop(GRADSYNC, (world,), (True, True), shard_alignment="chunk")
    _, theirs = torchtitan_loop(TORCH, (world,), (True, True))
    return ours["shards"], theirs["shards"]


@needs_torch_fsdp2
@pytest.mark.parametrize("world", [2, 4])
def test_chunk_alignment_gives_torch_own_shards(world: int) -> None:
    """torch's FSDP2 shards each param by ``torch.chunk`` of its rows; with ``shard_alignment="chunk"``
    every rank holds exactly those rows (37 rows over 4 ranks: 10, 10, 10, 7), with the same values."""
    for rank, (ours, theirs) in enumerate(run_distributed(chunked_shards, world, args=(world,))):
        assert ours.keys() == theirs.keys()
        for name, shard in theirs.items():
            assert ours[name].shape == shard.shape, (rank, name)
        assert max_relative_difference(ours, theirs) <= 1e-6, rank  # fp32 sums in another order


@pytest.mark.parametrize(
    ("world", "reshards", "strategy", "kept"),
    [
        (2, (True, True), "optim_grads_params", set()),
        (4, (True, True), "optim_grads_params", set()),
        (2, (False, False), "optim_grads", set()),
        (4, (False, False), "optim_grads", set()),
        (2, (False, True), "optim_grads_params", {0}),  # mixed: unit 0 stays gathered until its backward
        (2, (True, False), "optim_grads_params", {1}),  # torchtitan's default: the last block kept
        (2, None, "optim_grads_params", set()),  # fully_shard(model) alone
    ],
)
def test_torchtitan_loop_matches_one_process_and_torch(
    world: int, reshards: tuple[bool, ...] | None, strategy: str, kept: set[int]
) -> None:
    for rank, (ours, built, theirs) in enumerate(
        run_distributed(both_apis, world, args=((world,), reshards))
    ):
        assert built["strategy"] == strategy, rank
        assert built["units"] == ([True, True] if reshards else [])
        assert built["kept"] == kept
        assert built["placements"] == {(Shard(0),)}
        assert max_relative_difference(ours, cached_reference(world, MICRO, STEPS)) <= 1e-6, rank
        if theirs is not None:
            assert max_relative_difference(ours, theirs) <= 1e-6, rank
            assert built["grad norms"] == pytest.approx(built["torch grad norms"], rel=1e-6)


@pytest.mark.parametrize(
    ("outer", "placements"),
    [("no_shard", (Replicate(), Shard(0))), ("optim", (Shard(0), Shard(0)))],
)
def test_hsdp_mesh_matches_one_process_and_torch(outer: str, placements: tuple[Any, ...]) -> None:
    """A (replicate 2, shard 2) mesh: torch's HSDP, and a per-axis placement (ZeRO-1 over the
    outer axis, ZeRO-3 inside) through gradsync's ``outer_dp_sharding_strategy``; torch runs plain HSDP,
    which computes the same weights."""
    results = run_distributed(
        both_apis, 4, args=((2, 2), (True, True)), kwargs={"outer_dp_sharding_strategy": outer}
    )
    for rank, (ours, built, theirs) in enumerate(results):
        assert built["placements"] == {placements}, rank
        assert max_relative_difference(ours, cached_reference(4, MICRO, STEPS)) <= 1e-6, rank
        assert theirs is None or max_relative_difference(ours, theirs) <= 1e-6, rank


BF16_BOUND = 3e-3


@pytest.mark.parametrize("reshard", [True, False])
def test_bf16_param_dtype_matches_torch_and_rounds_like_it(reshard: bool) -> None:
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: bf16 compute weights over fp32
    optimizer weights (kept from the fp32 values, not their bf16 rounding), reduced in fp32, as torch
    does: 8.3e-4 from the fp32 one-process run (each rank's bf16 forward rounds; the bound leaves 3.6x)."""
    args = ((2,), (reshard, reshard), torch.bfloat16)
    for rank, (ours, built, theirs) in enumerate(run_distributed(both_apis, 2, args=args)):
        assert built["compute dtype"] == torch.bfloat16, rank
        assert {w.dtype for w in ours.values()} == {torch.float32}
        fp32_init = TinyTransformer().state_dict()  # the main weights start from these, not their rounding
        assert all(torch.equal(w, fp32_init[k].cpu()) for k, w in built["initial"].items()), rank
        # bit-identical to torch 2.13's run, 5.8e-5 from torch 2.15's (it rounds elsewhere): two bf16
        # computations, held to the bound they both meet against one fp32 process
        assert theirs is None or max_relative_difference(ours, theirs) <= BF16_BOUND, rank
        assert 0 < max_relative_difference(ours, cached_reference(2, MICRO, STEPS)) <= BF16_BOUND, rank


# --- what fully_shard builds -------------------------------------------------------------------------


def built_model() -> dict[str, Any]:
    model = TinyTransformer()
    blocks = list(model.blocks)
    returned = [fully_shard(block) for block in blocks]
    before_root = {
        "block class": type(blocks[0]).__name__,
        "block params plain": not isinstance(blocks[0].up.weight, DTensor),  # blocks[0].parameters()
        # would make the block a root of its own (its first use), as the test below checks
    }
    root = fully_shard(model)
    fsdp = megatron_fsdp_of(model)
    return {
        **before_root,
        "same objects": root is model and all(r is b for r, b in zip(returned, blocks, strict=True)),
        "root class": type(model).__name__,
        "still their classes": isinstance(model, TinyTransformer)
        and all(isinstance(b, Block) for b in blocks),
        "fsdp modules": isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in blocks),
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "state dict keys": list(model.state_dict()) == list(TinyTransformer().state_dict()),
        "one wrapper": all(megatron_fsdp_of(m) is fsdp for m in (model, *blocks)),
        "constructing the class": type(type(blocks[0])()).__name__,
    }


def test_fully_shard_keeps_the_modules_and_swaps_their_classes() -> None:
    for facts in run_distributed(built_model, 2):
        assert facts == {
            "block class": "FSDPBlock",
            "block params plain": True,  # a unit's params wait for the root call
            "same objects": True,
            "root class": "FSDPTinyTransformer",
            "still their classes": True,
            "fsdp modules": True,
            "dtensors": True,
            "state dict keys": True,
            "one wrapper": True,
            "constructing the class": "Block",  # as containers rebuild themselves when sliced
        }


def gathers() -> dict[str, Any]:
    """Unit 0's bucket status at the forward of unit 1, and after unshard() / reshard()."""
    model = TinyTransformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    fsdp = megatron_fsdp_of(model)
    first, second = model.blocks
    unit = [b for b in fsdp.buckets if b.spec.unit_id == fsdp.units.index(first)]
    seen: list[str] = []
    second.register_forward_pre_hook(lambda *_: seen.append(unit[0].status.name))
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    first.set_reshard_after_forward(False)
    model(batch).backward()
    model.set_reshard_after_forward(True)  # recursive from the root: every unit again
    model(batch).backward()
    facts: dict[str, Any] = {"at the next unit's forward": seen}
    first.unshard()
    facts["unshard"] = unit[0].status.name
    first.reshard()
    facts["reshard"] = unit[0].status.name
    handle = first.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    facts["unshard async, waited"] = unit[0].status.name
    first.reshard()
    return facts


def test_unshard_reshard_and_set_reshard_after_forward() -> None:
    for facts in run_distributed(gathers, 2):
        assert facts == {
            "at the next unit's forward": ["EMPTY", "READY_TO_USE", "EMPTY"],
            "unshard": "READY_TO_USE",
            "reshard": "EMPTY",
            "unshard async, waited": "READY_TO_USE",
        }


def ignored_and_loaded() -> dict[str, Any]:
    """The final norm's weight ignored: a plain param with this rank's own, unreduced grad. Then a
    state dict loaded into the sharded model, which must compute what the source model computes (ZeRO-2
    units: each rank loads its rows, and the whole weights must be gathered again)."""
    model = TinyTransformer()
    twin = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, ignored_params={model.norm.weight})
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    twin(batch).backward()
    ignored = model.norm.weight
    facts: dict[str, Any] = {
        "ignored plain": not isinstance(ignored, DTensor),
        "others sharded": all(isinstance(p, DTensor) for p in model.parameters() if p is not ignored),
        "local grad": ignored.grad is not None
        and torch.allclose(ignored.grad, twin.norm.weight.grad, rtol=1e-5, atol=1e-7),
    }
    other = TinyTransformer(seed=7)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        facts["loaded"] = float((model(batch) - other(batch)).abs())
    return facts


def test_ignored_params_stay_local_and_load_state_dict_installs() -> None:
    results = run_distributed(ignored_and_loaded, 2)
    for facts in results:
        assert facts["ignored plain"]
        assert facts["others sharded"]
        assert facts["local grad"]
        assert facts["loaded"] <= 1e-6


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def cast_at_boundaries() -> tuple[torch.dtype, torch.dtype]:
    """fp32 inputs reach bf16 weights only through ``cast_forward_inputs``; ``output_dtype`` casts the
    root's output back."""
    model = Tower().to(test_device())
    compute = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model.first, mp_policy=compute)
    fully_shard(model.second, mp_policy=compute)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    seen: list[torch.dtype] = []
    model.second.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    out = model(torch.randn(2, 4, device=test_device()))
    out.sum().backward()
    return seen[0], out.dtype


def test_mixed_precision_casts_inputs_and_outputs() -> None:
    for inner, outer in run_distributed(cast_at_boundaries, 2):
        assert (inner, outer) == (torch.bfloat16, torch.float32)


# --- refusals ----------------------------------------------------------------------------------------


def two_units(model: TinyTransformer, **kwargs: Any) -> None:
    for block in model.blocks:
        fully_shard(block, **kwargs)


def refuse_forgotten_zero_grad(model: TinyTransformer) -> None:
    two_units(model)
    fully_shard(model)
    optimizer = make_optimizer(model.parameters())
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    optimizer.step()
    model(batch)


def refuse_forgotten_root(model: TinyTransformer) -> None:
    two_units(model)
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0])


def refuse_nested(model: TinyTransformer) -> None:
    fully_shard(model.blocks[0].up)
    fully_shard(model.blocks[0])
    fully_shard(model)


def refuse_on_built(model: TinyTransformer, method: str, *args: Any) -> None:
    two_units(model)
    fully_shard(model)
    target = model.blocks[0] if method.startswith("unit.") else model
    getattr(target, method.removeprefix("unit."))(*args)


def refuse_zero2_resharding(model: TinyTransformer) -> None:
    two_units(model, reshard_after_forward=False)
    fully_shard(model)
    model.set_reshard_after_forward(True)


def refuse_mixed_dtypes(model: TinyTransformer) -> None:
    model.blocks[0].to(torch.float64)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    list(model.parameters())  # a lone call is built at the first use


def refuse_to_empty_elsewhere(model: TinyTransformer) -> None:
    fully_shard(model)
    model.to_empty(device="meta")


REFUSALS: dict[str, tuple[Any, str]] = {  # what to do, and the message's fragments
    "offload_policy": (
        lambda m: fully_shard(m, offload_policy=CPUOffloadPolicy()),
        "offload_policy=CPUOffloadPolicy(pin_memory=True) is not supported … drop offload_policy",
    ),
    "shard_placement_fn": (
        lambda m: fully_shard(m, shard_placement_fn=lambda p: Shard(p.dim() - 1)),
        "shard_placement_fn returned Shard(dim=1) for 'embedding.weight' … return None or Shard(0)",
    ),
    "reshard_after_forward int": (
        lambda m: fully_shard(m, reshard_after_forward=2),
        "reshard_after_forward=2 … pass True … or False",
    ),
    "dp_mesh_dims without a mesh": (
        lambda m: fully_shard(m, dp_mesh_dims=object()),
        "dp_mesh_dims names dims of mesh=; pass the whole SPMD mesh",
    ),
    "3-D mesh": (
        lambda m: fully_shard(m, mesh=init_device_mesh(test_device().type, (2, 1, 1))),
        "mesh has 3 dims … 1-D … or a 2-D",
    ),
    "outer optim on a 1-D mesh": (
        lambda m: fully_shard(m, outer_dp_sharding_strategy="optim"),
        "outer_dp_sharding_strategy='optim' shards over the outer axis of a 2-D … mesh",
    ),
    "outer optim over ZeRO-2": (
        lambda m: (
            two_units(
                m, mesh=dp_mesh((1, 2)), reshard_after_forward=False, outer_dp_sharding_strategy="optim"
            ),
            fully_shard(m, mesh=dp_mesh((1, 2)), outer_dp_sharding_strategy="optim"),
        ),
        "needs ZeRO-3 inside: pass reshard_after_forward=True to at least one unit",
    ),
    "unknown outer strategy": (
        lambda m: fully_shard(m, outer_dp_sharding_strategy="optim_grads"),
        "outer_dp_sharding_strategy='optim_grads' … 'no_shard' … 'optim'",
    ),
    "gradsync's policy class": (
        lambda m: fully_shard(m, mp_policy=GradsyncPrecision()),
        "must be torch's MixedPrecisionPolicy",
    ),
    "units and root disagree": (
        lambda m: (
            two_units(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
            fully_shard(m),
        ),
        "root call's mp_policy.param_dtype=None differs from torch.bfloat16 … pass the same value to every call",
    ),
    "twice": (
        lambda m: (fully_shard(m), fully_shard(m)),
        "TinyTransformer was already passed to fully_shard",
    ),
    "top-down": (
        lambda m: (fully_shard(m), fully_shard(m.blocks[0])),
        "TinyTransformer, which holds this Block, was already passed … bottom-up",
    ),
    "nested units": (
        refuse_nested,
        "FSDPBlock, inside this TinyTransformer, is already a root … do not nest",
    ),
    "after the root": (
        lambda m: (fully_shard(m), list(m.parameters()), fully_shard(m.blocks[0])),
        "Block belongs to a model that is already sharded … before the root",
    ),
    "list holding units": (
        lambda m: (fully_shard(m.blocks[0]), fully_shard([m])),
        "a list groups units … call fully_shard on the root module alone",
    ),
    "to_empty elsewhere": (
        refuse_to_empty_elsewhere,
        "to_empty(device='meta') … offloads nothing; pass device=",
    ),
    "mixed dtypes": (refuse_mixed_dtypes, "param_dtype=torch.bfloat16 over params of several dtypes"),
    "forgotten root call": (
        refuse_forgotten_root,
        "other module(s) passed to fully_shard … wait for a root call",
    ),
    "forgotten zero_grad": (
        refuse_forgotten_zero_grad,
        "grads still set … call optimizer.zero_grad() after",
    ),
    "to() after": (
        lambda m: (fully_shard(m), list(m.parameters()), m.to(torch.float64)),
        "moving or casting … after fully_shard is not supported … do it before fully_shard",
    ),
    "sync on a unit": (
        lambda m: refuse_on_built(m, "unit.set_requires_gradient_sync", False),
        "FSDPBlock.set_requires_gradient_sync on a unit … call model.set_requires_gradient_sync(flag) on the root",
    ),
    "custom collectives": (
        lambda m: refuse_on_built(m, "set_custom_all_gather", None),
        "set_custom_all_gather() is not supported by gradsync … collectives come from gradsync-buffers",
    ),
    "reduce-scatter input buffers": (
        lambda m: refuse_on_built(m, "set_reduce_scatter_max_input_buffers", 2),
        "set_reduce_scatter_max_input_buffers() is not supported … suggested_RS_queue_capacity",
    ),
    "all-reduce hook": (
        lambda m: refuse_on_built(m, "set_all_reduce_hook", None),
        "FSDPTinyTransformer.set_all_reduce_hook: hook must be callable, got NoneType",
    ),
    "all-reduce hook on a stream": (
        refuse_a_hook_stream,
        "FSDPTinyTransformer.set_all_reduce_hook(stream=...): gradsync runs the hook on the stream its "
        "reduction waits on",
    ),
    "fault tolerance on a unit": (
        refuse_fault_tolerance_on_a_unit,
        "register_fault_tolerant_hook: FSDPBlock is one unit of a fully_shard model; pass its root module",
    ),
    "reset_iter_state": (
        lambda m: refuse_on_built(m, "reset_iter_state"),
        "reset_iter_state() is not supported … rebuild the model and optimizer",
    ),
    "divide factor": (
        lambda m: refuse_on_built(m, "set_gradient_divide_factor", 0.0),
        "set_gradient_divide_factor(0.0): the factor divides the ranks' summed grads and must be positive",
    ),
    "keep after backward": (
        lambda m: refuse_on_built(m, "set_reshard_after_backward", False),
        "set_reshard_after_backward(False): this root releases its weights after every backward",
    ),
    "reshard a ZeRO-2 root": (refuse_zero2_resharding, "set_reshard_after_forward(True) … ZeRO-2"),
    "mp_policy on one rank": (
        lambda m: given_on_rank_one(
            m, *[{"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}] * 2
        ),
        "fully_shard: data-parallel ranks 0 and 1 were built with different settings: mp_policy= … "
        "param_dtype', None … param_dtype', torch.bfloat16",
    ),
    "reshard_after_forward on one rank": (
        lambda m: given_on_rank_one(m, {"reshard_after_forward": False}, {}),
        "fully_shard: data-parallel ranks 0 and 1 were built with different settings: "
        "reshard_after_forward=(None, None, None) vs reshard_after_forward=(None, False, False)",
    ),
}


def given_on_rank_one(model: TinyTransformer, units: dict[str, Any], root: dict[str, Any]) -> None:
    """``fully_shard`` with these arguments on rank 1 only: the error names them as the user wrote them."""
    first = dist.get_rank() != 1
    two_units(model, **({} if first else units))
    fully_shard(model, **({} if first else root))


def refusal(case: str) -> str:
    build, _ = REFUSALS[case]
    try:
        build(TinyTransformer())
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_argument_and_the_fix(case: str) -> None:
    _, pattern = REFUSALS[case]
    fragments = pattern.split(" … ")  # each in the message, in this order
    for message in run_distributed(refusal, 2, args=(case,)):
        assert re.search(".*".join(map(re.escape, fragments)), message), message


def grads_handed_over() -> list[bool]:
    """After each backward: do the optimizer's params have grads? Only a backward with gradient sync
    that is also the last ends the cycle (without sync, torch leaves the sharded grads unset too)."""
    model = TinyTransformer()
    two_units(model)
    fully_shard(model)
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    seen = []
    for sync, last in [(False, True), (True, False), (True, True)]:
        model.set_requires_gradient_sync(sync)
        model.set_is_last_backward(last)
        model(batch).backward()
        seen.append(any(p.grad is not None for p in model.parameters()))
    return seen


def test_gradient_sync_flags_decide_when_grads_are_handed_over() -> None:
    for seen in run_distributed(grads_handed_over, 2):
        assert seen == [False, False, True]


def accepted_methods() -> dict[str, float]:
    """The methods that map onto gradsync's own behaviour are accepted, and training still matches."""
    model = TinyTransformer()
    two_units(model)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    model.set_requires_all_reduce(True)
    model.set_reshard_after_backward(True)
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        batches = local_microbatches(step, rank, world, MICRO)
        for i, batch in enumerate(batches):
            model.set_is_last_backward(i == len(batches) - 1)  # reduced every time, handed over once
            (model(batch) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zeroed in place: a new cycle as well
    return whole_weights(model)


def test_set_is_last_backward_and_zeroed_in_place_grads_train_like_one_process() -> None:
    for rank, weights in enumerate(run_distributed(accepted_methods, 2)):
        assert max_relative_difference(weights, cached_reference(2, MICRO, STEPS)) <= 1e-6, rank


def titan_model(world: int, seed: int, optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """SGD with momentum (state from torch's own ops on the DTensors), or Muon on whole matrices (state
    from gradsync's local optimizer)."""
    model = TinyTransformer(seed)
    mesh = dp_mesh((world,))
    alignment = {"muon": "tensor", "shampoo": "block:4x6"}.get(optimizer)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_alignment=alignment)
    fully_shard(model, mesh=mesh, shard_alignment=alignment)
    if optimizer == "muon":
        return model, Muon(muon_param_groups(model), lr=0.02, weight_decay=0.1, adamw_eps=1e-4)
    if optimizer == "shampoo":
        return model, BlockShampoo(model.parameters(), lr=0.05, block_size=(4, 6), eps=1e-6)
    return model, make_optimizer(model.parameters())


def titan_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """DP-size-independent: every step's global batch (4 microbatches) is the same however many ranks
    share it, each rank accumulating its microbatches as torchtitan does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = 4 // world
    for step in steps:
        batches = local_microbatches(step, rank, world, micro)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            (model(batch) / micro).backward()
        optimizer.step()
        optimizer.zero_grad()


def titan_save(directory: str, name: str) -> dict[str, torch.Tensor]:
    """torchtitan's checkpoint: DCP of ``get_model_state_dict`` / ``get_optimizer_state_dict``."""
    model, optimizer = titan_model(dist.get_world_size(), 0, name)
    titan_steps(model, optimizer, range(3))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=directory)
    titan_steps(model, optimizer, range(3, 5))
    return {name: p.full_tensor().cpu() for name, p in model.named_parameters()}


def titan_load(directory: str, name: str) -> dict[str, torch.Tensor]:
    model, optimizer = titan_model(dist.get_world_size(), 1, name)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    titan_steps(model, optimizer, range(3, 5))
    return {name: p.full_tensor().cpu() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("saved", "loaded", "name"),
    [
        (2, 2, "sgd"),
        (2, 4, "sgd"),
        (4, 2, "sgd"),
        (2, 4, "muon"),
        (4, 2, "muon"),
        (2, 2, "shampoo"),
        (2, 4, "shampoo"),
    ],
)
def test_torchtitan_checkpoints_reshard_across_dp_sizes(
    saved: int, loaded: int, name: str, tmp_path: Path
) -> None:
    """torch's own state-dict API and DCP on the per-module API's params and a plain torch optimizer's
    state: saved at one DP size, loaded at another, two more steps equal two more steps of the run that
    saved (SGD: AdamW's update of a grad near zero can flip with the reduction order of another DP size)."""
    skip_where_torch_gathers_crash(max(saved, loaded))
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(titan_save, saved, args=(directory, name))[0]
    for rank, weights in enumerate(run_distributed(titan_load, loaded, args=(directory, name))):
        assert max_relative_difference(weights, uninterrupted) <= 1e-6, rank


def compiled_loop(where: str) -> dict[str, torch.Tensor]:
    """torchtitan's loop with ``torch.compile`` (aot_eager: no C++ toolchain needed): each block compiled
    before ``fully_shard`` (torchtitan's order), or the whole sharded model after it."""
    torch._dynamo.reset()
    model = TinyTransformer()
    if where == "blocks":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block, backend="aot_eager")  # type: ignore[assignment]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    runnable: nn.Module = torch.compile(model, backend="aot_eager") if where == "model" else model  # type: ignore[assignment]
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        batches = local_microbatches(step, rank, world, MICRO)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)  # type: ignore[operator]
            (runnable(batch) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
    # a compiled block's params are named through its wrapper (torch's OptimizedModule), as without gradsync
    return {name.replace("_orig_mod.", ""): value for name, value in whole_weights(model).items()}


@pytest.mark.parametrize("where", ["model", "blocks"])
def test_torch_compile_trains_like_one_process(where: str) -> None:
    for rank, weights in enumerate(run_distributed(compiled_loop, 2, args=(where,))):
        assert max_relative_difference(weights, cached_reference(2, MICRO, STEPS)) <= 1e-6, rank


def abandoned_then_retried(skip: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A torch-style loop (no zero_grad_buffer(): the next forward starts each step); step 1 abandoned on
    rank 1 (its backward or its loss raised, the loop catches it and goes on with the next batch's
    forward; or it steps the optimizer after a forward with no backward); every rank catches what it raised, zeroes the grads and takes step 1 again, then step 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyTransformer()
    two_units(model)
    fully_shard(model)
    optimizer = make_optimizer(model.parameters())

    def step(index: int) -> None:
        model(local_microbatches(index, rank, world, 1)[0]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    batch = local_microbatches(1, rank, world, 1)[0]
    raised = step_abandoned_on_rank_one(
        skip, model.blocks[0], lambda: model(batch), optimizer.step, lambda: model(batch)
    )
    optimizer.zero_grad()
    step(1)
    step(2)
    return f"{type(raised).__name__}: {raised}", whole_weights(model)


@pytest.mark.parametrize("skip", ["raised", "loss_raised", "no_backward"])
def test_an_abandoned_step_makes_every_rank_raise_and_leaves_no_trace(skip: str) -> None:
    """The next forward settles a step whose backward or loss raised, as zero_grad_buffer() does for
    MegatronFSDP's loops, and the optimizer step one whose forward had no backward (a batch skipped after
    its forward): every rank raises by name, and retried, training matches one process."""
    runs = run_distributed(abandoned_then_retried, 2, args=(skip,), timeout=15)
    who = "AbandonedStepError: MegatronFSDP"
    (waited, first), (abandoned, second) = runs
    reason = ABANDONED_BY_RANK_ONE["step_without_backward" if skip == "no_backward" else skip]
    assert waited.startswith(f"{who}: rank(s) [1] of the data-parallel group abandoned this step"), waited
    assert abandoned.startswith(f"{who}: rank 1 abandoned this step: {reason}"), abandoned
    for weights in (first, second):
        assert max_relative_difference(weights, cached_reference(2, 1, 3)) <= 1e-6
