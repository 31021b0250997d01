"""Allocators of the temporary whole-bucket buffers: the policies on their own, then
through training, where each one's allocation count and peak bytes are predicted from the model's bucket
sizes and the hook schedule, and every allocator must give bit-identical weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_testkit import DIM, VOCAB, Trainer, make_optimizer, shard_index, wrap
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, MixedPrecisionPolicy, fully_shard_model
from gradsync.fsdp.allocators import (
    AllocatorStats,
    BufferRequest,
    DoubleBufferAllocator,
    MaxPoolDoubleBufferAllocator,
    PersistentBucketAllocator,
    StorageResizeBucketAllocator,
    TemporaryBucketAllocator,
    UnitBuckets,
)
from gradsync.groups.testing import run_distributed, test_device

CPU = torch.device("cpu")
LAYERS = 4  # units, so double buffers must rotate


def request(size: int, dtype: torch.dtype = torch.float32) -> BufferRequest:
    return BufferRequest(size, dtype, CPU)


def test_temporary_allocates_per_use_and_frees_the_storage() -> None:
    alloc = TemporaryBucketAllocator()
    first = alloc.allocate(0, request(10))
    assert alloc.allocate(0, request(10)) is first  # held until freed
    view = first[2:5]
    alloc.free(0)
    assert view.untyped_storage().nbytes() == 0  # a surviving view does not keep the memory
    second = alloc.allocate(0, request(10))
    assert second is not first
    alloc.allocate(1, request(6, torch.bfloat16))
    assert alloc.stats == AllocatorStats(allocations=3, live_bytes=40 + 12, peak_bytes=40 + 12)
    alloc.free(0)
    alloc.free(0)  # freeing twice is harmless
    assert alloc.stats.live_bytes == 12


def test_storage_resize_keeps_the_tensor_and_its_views() -> None:
    alloc = StorageResizeBucketAllocator()
    tensor = alloc.allocate(3, request(8))
    view = tensor[4:]
    alloc.free(3)
    assert tensor.untyped_storage().nbytes() == 0
    assert view.untyped_storage().nbytes() == 0
    again = alloc.allocate(3, request(8))
    assert again is tensor
    assert view.untyped_storage().nbytes() == 32
    again.fill_(7.0)
    assert view.eq(7.0).all()  # the old view sees the re-grown storage
    assert alloc.stats == AllocatorStats(allocations=2, live_bytes=32, peak_bytes=32)


def units_of(*signatures: tuple[int, ...]) -> list[UnitBuckets]:
    """Units with consecutive bucket ids, one bucket per size given."""
    units, next_id = [], 0
    for unit_id, sizes in enumerate(signatures):
        ids = tuple(range(next_id, next_id + len(sizes)))
        units.append(UnitBuckets(unit_id, ids, tuple(request(n) for n in sizes)))
        next_id += len(sizes)
    return units


def test_double_buffer_rotates_two_slot_groups_shaped_like_the_mode() -> None:
    # units 0, 2, 3 share the signature (4, 6); unit 1 (5, 6) does not and falls back
    units = units_of((4, 6), (5, 6), (4, 6), (4, 6))
    fallback = StorageResizeBucketAllocator()
    pool = DoubleBufferAllocator("weight", units, fallback)
    assert pool.slot_requests == (request(4), request(6))
    assert pool.stats == AllocatorStats(allocations=4, live_bytes=2 * 40, peak_bytes=2 * 40)
    a0, a1 = pool.allocate(0, request(4)), pool.allocate(1, request(6))  # unit 0 -> group 0
    b0 = pool.allocate(4, request(4))  # unit 2 -> group 1
    assert a0 is pool.slots[0][0]
    assert a1 is pool.slots[0][1]
    assert b0 is pool.slots[1][0]
    pool.allocate(2, request(5))  # unit 1: not the mode's shape, served by the fallback
    assert fallback.stats.allocations == 1
    assert not pool.can_allocate(6)
    with pytest.raises(RuntimeError, match=r"unit #3 needs a weight buffer, but units #0 and #2 hold both"):
        pool.allocate(6, request(4))
    pool.free(0)
    assert not pool.can_allocate(6)  # unit 0 still holds its second bucket
    pool.free(1)
    assert pool.allocate(6, request(4)) is pool.slots[0][0]  # the idle group
    pool.free(6)
    pool.free(4)
    assert pool.allocate(0, request(4)) is pool.slots[0][0]  # unit 0's first group again, both idle
    assert pool.allocate(4, request(4)) is pool.slots[1][0]  # and unit 2's
    assert pool.stats.allocations == 4  # nothing allocated after construction


def test_max_pool_slots_fit_every_unit_largest_bucket_first() -> None:
    """Each unit's buckets, largest first, take the slots by position; a slot is as large as the largest
    bucket that takes it. Every unit bucket is pooled, each gets the head of its slot (the same tensor each
    time), and nothing is allocated after construction."""
    units = units_of((4, 6), (5, 6), (9,), (3, 2, 7))  # largest first: (6, 4), (6, 5), (9,), (7, 3, 2)
    pool = MaxPoolDoubleBufferAllocator("weight", units, StorageResizeBucketAllocator())
    assert pool.slot_requests == (request(9), request(5), request(2))
    assert pool.stats == AllocatorStats(allocations=6, live_bytes=2 * 4 * 16, peak_bytes=2 * 4 * 16)
    assert all(pool.pooled(b) for u in units for b in u.bucket_ids)
    first = pool.allocate(0, request(4))  # unit 0 -> group 0: its 4 is its second largest
    assert first.numel() == 4
    assert first.data_ptr() == pool.slots[0][1].data_ptr()
    assert pool.allocate(1, request(6)).data_ptr() == pool.slots[0][0].data_ptr()
    seven, three, two = (pool.allocate(b, request(n)) for b, n in ((7, 7), (5, 3), (6, 2)))  # unit 3 -> 1
    assert [t.data_ptr() for t in (seven, three, two)] == [s.data_ptr() for s in pool.slots[1]]
    assert [t.numel() for t in (seven, three, two)] == [7, 3, 2]
    for bucket in (0, 1, 5, 6, 7):
        pool.free(bucket)
    assert pool.allocate(0, request(4)) is first  # the same view, so params are not re-pointed
    with pytest.raises(RuntimeError, match=r"bucket 5 asks for 6 torch\.float32 elements"):
        pool.allocate(5, request(6))  # more than its slot (5): refused, not overrun
    pool.free(0)
    assert pool.allocate(4, request(9)) is pool.slots[0][0]  # unit 2, group 0: the whole slot
    assert pool.stats.allocations == 6


def test_max_pool_plans_each_dtype_apart() -> None:
    bf16 = torch.bfloat16
    units = [
        UnitBuckets(0, (0, 1), (request(8), request(3, bf16))),
        UnitBuckets(1, (2, 3, 4), (request(5, bf16), request(2), request(4, bf16))),
    ]
    pool = MaxPoolDoubleBufferAllocator("grad", units, TemporaryBucketAllocator())
    assert pool.slot_requests == (request(8), request(5, bf16), request(4, bf16))
    assert pool.allocate(4, request(4, bf16)).data_ptr() == pool.slots[0][2].data_ptr()
    assert pool.allocate(3, request(2)).data_ptr() == pool.slots[0][0].data_ptr()
    assert pool.allocate(1, request(3, bf16)).data_ptr() == pool.slots[1][1].data_ptr()


def test_persistent_allocator_keeps_each_buffer_for_good() -> None:
    alloc = PersistentBucketAllocator()
    first = alloc.allocate(2, request(10))
    alloc.free(2)
    assert first.untyped_storage().nbytes() == 40  # kept
    assert alloc.allocate(2, request(10)) is first
    alloc.allocate(5, request(3, torch.bfloat16))
    alloc.free(5)
    assert alloc.stats == AllocatorStats(allocations=2, live_bytes=46, peak_bytes=46)


def test_double_buffer_with_persistent_fallback_allocates_a_misfit_once() -> None:
    units = units_of((4,), (5,), (4,))
    fallback = PersistentBucketAllocator()
    pool = DoubleBufferAllocator("grad", units, fallback)
    misfit = pool.allocate(1, request(5))
    for _ in range(3):
        pool.free(1)
        assert pool.allocate(1, request(5)) is misfit
    assert fallback.stats == AllocatorStats(allocations=1, live_bytes=20, peak_bytes=20)
    assert pool.all_stats() == {"double_buffer": pool.stats, "persistent": fallback.stats}


def test_double_buffer_mode_ties_go_to_the_first_unit_and_no_units_is_refused() -> None:
    pool = DoubleBufferAllocator("grad", units_of((3,), (5,)), TemporaryBucketAllocator())
    assert pool.slot_requests == (request(3),)
    with pytest.raises(ValueError, match="no FSDP units to double-buffer grads"):
        DoubleBufferAllocator("grad", [], TemporaryBucketAllocator())


# --- through training ---------------------------------------------------------------------------------
def bucket_bytes(model: MegatronFSDP, *, units: bool, grads: bool = False) -> list[int]:
    sizes = []
    for bucket in model.buckets:
        if (bucket.spec.unit_id is not None) == units and (bucket.spec.requires_grad or not grads):
            dtype = bucket.comm_dtype if grads else bucket.dtype
            sizes.append(bucket.layout.size * torch.empty((), dtype=dtype).element_size())
    return sizes


def stats_by_step(strategy: str, steps: int, **config: Any) -> dict[str, Any]:
    trainer = Trainer.build(strategy, layers=LAYERS, **config)
    model = trainer.model
    counts = []
    for step in range(steps):
        before = {k: s.allocations for k, s in model.memory_stats().items()}
        trainer.step(step, 1)
        counts.append({k: s.allocations - before[k] for k, s in model.memory_stats().items()})
    peak = {k: s.peak_bytes for k, s in model.memory_stats().items()}
    with torch.no_grad():
        for stats in model.memory_stats().values():
            stats.peak_bytes = stats.live_bytes
        model(torch.zeros(1, 4, dtype=torch.long, device=test_device()))  # a forward with no backward
    return {
        "per_step": counts,
        "peak": peak,
        "eval_peak": {k: s.peak_bytes for k, s in model.memory_stats().items()},
        "unit_weights": bucket_bytes(model, units=True),
        "unit_grads": bucket_bytes(model, units=True, grads=True),
        "other_weights": bucket_bytes(model, units=False),
        "other_grads": bucket_bytes(model, units=False, grads=True),
        "weights": exported_weights(model),
        "queue_capacity": model.suggested_RS_queue_capacity,
        "unit_elements": max(b.layout.size for b in model.buckets if b.spec.unit_id is not None),
    }


def exported_weights(model: MegatronFSDP) -> dict[str, torch.Tensor]:
    """Every weight whole, one bucket at a time (double buffers cannot hold all units at once)."""
    full = model.full_state_dict(rank0_only=False)
    return {name: full[name].float() for name, _ in model.module.named_parameters()}


def allocator_runs(strategy: str) -> dict[str, dict[str, Any]]:
    return {
        name: stats_by_step(strategy, 3, **config)
        for name, config in (("dynamic", {}), ("double_buffer", {"fsdp_double_buffer": True}))
    }


@pytest.fixture(scope="module")
def zero3_runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(allocator_runs, 2, args=("optim_grads_params",))


def test_every_allocator_gives_bit_identical_training(zero3_runs: list[dict[str, dict[str, Any]]]) -> None:
    for rank in zero3_runs:
        dynamic, double = rank["dynamic"]["weights"], rank["double_buffer"]["weights"]
        assert dynamic.keys() == double.keys()
        assert all(torch.equal(dynamic[k], double[k]) for k in dynamic)


def test_dynamic_allocators_allocate_per_unit_per_pass(zero3_runs: list[dict[str, dict[str, Any]]]) -> None:
    """Storage-resize weights: the non-unit bucket once per step, every unit in the forward and again in
    the backward except the last (kept gathered into the backward); storage-resize grads: one per bucket."""
    for rank in zero3_runs:
        run = rank["dynamic"]
        units, others = len(run["unit_weights"]), len(run["other_weights"])
        for counts in run["per_step"]:
            assert counts == {
                "weights:storage_resize": others + 2 * units - 1,
                "grads:storage_resize": len(run["unit_grads"]) + len(run["other_grads"]),
            }


def test_dynamic_peaks_follow_the_schedule(zero3_runs: list[dict[str, dict[str, Any]]]) -> None:
    """Grads: the non-unit bucket's unreduced grads live through the whole backward (its first grad, the
    head's, comes first, its last, the embedding's, last); of the units', those of the reductions the
    queue keeps in flight (suggested_RS_queue_capacity: two units by default) plus the unit being filled.
    A forward without backward holds the non-unit buckets, one unit and the next (prefetched)."""
    for rank in zero3_runs:
        run = rank["dynamic"]
        unit, unit_grads = max(run["unit_weights"]), max(run["unit_grads"])
        in_flight = run["queue_capacity"] // run["unit_elements"]
        assert in_flight == 2
        assert run["peak"]["grads:storage_resize"] == sum(run["other_grads"]) + (in_flight + 1) * unit_grads
        assert run["eval_peak"]["weights:storage_resize"] == sum(run["other_weights"]) + 2 * unit


def test_double_buffers_allocate_nothing_after_construction(
    zero3_runs: list[dict[str, dict[str, Any]]],
) -> None:
    """Two slot groups per kind, shaped like one unit, filled once; only the non-unit buckets go to the
    fallback, once per step."""
    for rank in zero3_runs:
        run = rank["double_buffer"]
        for counts in run["per_step"]:
            assert counts == {
                "weights:double_buffer": 0,
                "weights:storage_resize": len(run["other_weights"]),
                "grads:double_buffer": 0,
                "grads:temporary": len(run["other_grads"]),
            }
        assert run["peak"]["weights:double_buffer"] == 2 * max(run["unit_weights"])
        assert run["peak"]["grads:double_buffer"] == 2 * max(run["unit_grads"])


def zero2_counts() -> tuple[list[dict[str, int]], bool]:
    run = stats_by_step("optim_grads", 3, fsdp_double_buffer=True)
    dynamic = stats_by_step("optim_grads", 3)
    same = all(torch.equal(run["weights"][k], dynamic["weights"][k]) for k in run["weights"])
    return run["per_step"], same


def test_zero2_double_buffers_only_the_grads() -> None:
    for per_step, same in run_distributed(zero2_counts, 2):
        assert same
        assert all(c["grads:double_buffer"] == 0 and c["weights:storage_resize"] == 0 for c in per_step)


# --- units of different sizes: the max-pool double buffer and the persistent fallback -----------------
WIDTHS = (2 * DIM + 1, DIM + 1, 2 * DIM + 1, 6 * DIM)
"""Hidden widths of the units: three shapes, the mode (first and third) is not the largest."""


class Layer(nn.Module):
    """A unit of a given hidden width."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UnevenModel(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(width) for width in WIDTHS)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.to(test_device(), dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


UNEVEN_ALLOCATORS: dict[str, dict[str, Any]] = {
    "dynamic": {},
    "double_buffer": {"fsdp_double_buffer": True},
    "max_pool": {"megatron_fsdp_max_pool_double_buffer": True},
    "persistent": {"fsdp_double_buffer": True, "fsdp_db_use_persist_buf_on_alloc_fail": True},
}


def uneven_runs(strategy: str, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Four steps of the uneven model under each allocator choice (each rank its own data): weights,
    allocations per kind at construction and per step, peaks, and which buckets each pool serves."""
    runs = {}
    for name, fields in UNEVEN_ALLOCATORS.items():
        config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=strategy,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            **fields,
        )
        model = MegatronFSDP(
            UnevenModel(dtype),
            shard_index(),
            config,
            fsdp_unit_modules=[Layer],
            mixed_precision_policy=MixedPrecisionPolicy(torch.float32),
        )
        trainer = Trainer(model, make_optimizer(model.parameters()))
        built = {k: s.allocations for k, s in model.memory_stats().items()}
        per_step = []
        for step in range(4):
            before = {k: s.allocations for k, s in model.memory_stats().items()}
            trainer.step(step, 1)
            per_step.append({k: s.allocations - before[k] for k, s in model.memory_stats().items()})
        pooled = {}
        for what, allocator in (("weights", model.allocators.weights), ("grads", model.allocators.grads)):
            if isinstance(allocator, DoubleBufferAllocator):
                pooled[what] = [allocator.pooled(b.bucket_id) for b in model.buckets]
        runs[name] = {
            "weights": exported_weights(model),
            "built": built,
            "per_step": per_step,
            "peak": {k: s.peak_bytes for k, s in model.memory_stats().items()},
            "pooled": pooled,
            "unit": [b.spec.unit_id is not None for b in model.buckets],
            "unit_weights": bucket_bytes(model, units=True),
            "unit_grads": bucket_bytes(model, units=True, grads=True),
        }
    return runs


UNEVEN_CASES = [
    (strategy, dtype)
    for strategy in ("optim_grads_params", "optim_grads")
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.fixture(scope="module", params=UNEVEN_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def uneven(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    strategy, dtype = request.param
    return strategy, run_distributed(uneven_runs, 2, args=(strategy, dtype))


def test_units_of_different_sizes_train_alike_under_every_allocator(
    uneven: tuple[str, list[dict[str, dict[str, Any]]]],
) -> None:
    _, ranks = uneven
    for rank in ranks:
        want = rank["dynamic"]["weights"]
        for name in UNEVEN_ALLOCATORS:
            got = rank[name]["weights"]
            assert all(torch.equal(got[k], want[k]) for k in want), name
    first, second = (rank["dynamic"]["weights"] for rank in ranks)
    assert all(torch.equal(first[k], second[k]) for k in first)  # replicas agree
    start = uneven_initial()
    assert not any(torch.equal(first[k], start[k]) for k in first)  # and they trained


def uneven_initial() -> dict[str, torch.Tensor]:
    model = UnevenModel(torch.float32)
    return {name: p.detach().float().cpu() for name, p in model.named_parameters()}


def test_the_mode_shaped_double_buffer_does_not_fit_every_unit(
    uneven: tuple[str, list[dict[str, dict[str, Any]]]],
) -> None:
    """The model is a fair test of the max pool: the plain double buffer sends two units elsewhere."""
    for rank in uneven[1]:
        run = rank["double_buffer"]
        pooled = run["pooled"]["grads"]
        assert sum(pooled) == 2
        assert sum(run["unit"]) == len(WIDTHS)
        fallback = "grads:temporary"
        assert all(counts[fallback] > sum(not u for u in run["unit"]) for counts in run["per_step"])


def test_the_max_pool_serves_every_unit_from_two_slot_groups(
    uneven: tuple[str, list[dict[str, dict[str, Any]]]],
) -> None:
    """Every unit bucket is pooled; after construction only the buckets outside units allocate (in their
    dynamic fallback, once per step), and the pool holds twice the largest unit per kind."""
    strategy, ranks = uneven
    zero3 = strategy == "optim_grads_params"
    for rank in ranks:
        run = rank["max_pool"]
        others = sum(not u for u in run["unit"])
        for what in ("weights", "grads") if zero3 else ("grads",):
            assert run["pooled"][what] == run["unit"]
        expected = {"grads:max_pool_double_buffer": 0, "grads:temporary": others}
        if zero3:
            expected |= {"weights:max_pool_double_buffer": 0, "weights:storage_resize": others}
        else:
            expected |= {"weights:storage_resize": 0}
        assert run["per_step"] == [expected] * len(run["per_step"])
        assert run["peak"]["grads:max_pool_double_buffer"] == 2 * max(run["unit_grads"])
        if zero3:
            assert run["peak"]["weights:max_pool_double_buffer"] == 2 * max(run["unit_weights"])


def test_the_persistent_fallback_allocates_each_misfit_once(
    uneven: tuple[str, list[dict[str, dict[str, Any]]]],
) -> None:
    """Buckets that do not fit the double buffer (the two odd units and the buckets outside units) get a
    buffer each, once: the weights' at construction, the grads' in the first backward; then nothing."""
    strategy, ranks = uneven
    zero3 = strategy == "optim_grads_params"
    for rank in ranks:
        run = rank["persistent"]
        misfits = sum(not p for p in run["pooled"]["grads"])
        assert misfits == len(run["unit"]) - 2
        assert "grads:persistent" in run["per_step"][0], run["per_step"][0]
        assert run["per_step"][0]["grads:persistent"] == misfits
        if zero3:
            assert run["built"]["weights:persistent"] == sum(not p for p in run["pooled"]["weights"])
        for counts in run["per_step"][1:]:
            assert set(counts.values()) == {0}, counts
        assert all(counts["grads:double_buffer"] == 0 for counts in run["per_step"])


def fully_shard_keywords(strategy: int) -> tuple[set[str], bool]:
    """fully_shard_model's reference keywords: the max pool with the persistent fallback, against the
    default allocators, three steps, each rank its own data."""
    runs = []
    for keywords in ({"maxpool_double_buffer": True, "fsdp_db_use_persist_buf_on_alloc_fail": True}, {}):
        model = fully_shard_model(
            UnevenModel(torch.float32), fsdp_unit_modules=[Layer], zero_dp_strategy=strategy, **keywords
        )
        trainer = Trainer(model, make_optimizer(model.parameters()))
        for step in range(3):
            trainer.step(step, 1)
        runs.append((set(model.memory_stats()), exported_weights(model)))
    (kinds, got), (_, want) = runs
    return kinds, all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_fully_shard_takes_the_reference_allocator_keywords(strategy: int) -> None:
    for kinds, same in run_distributed(fully_shard_keywords, 2, args=(strategy,)):
        assert same
        if strategy < 2:
            assert kinds == {"weights:storage_resize", "grads:storage_resize"}
        else:
            assert {"grads:max_pool_double_buffer", "grads:persistent"} <= kinds
            assert ("weights:max_pool_double_buffer" in kinds) == (strategy == 3)


def third_unit_refused() -> None:
    model = wrap("optim_grads_params", layers=LAYERS, fsdp_double_buffer=True)
    units = [list(unit.parameters()) for unit in model.units]
    model.all_gather_and_wait_parameters_ready(units[0] + units[1], prefetch=False)
    with pytest.raises(RuntimeError, match=r"unit #2 needs a weight buffer, but units #0 and #1 hold both"):
        model.all_gather_and_wait_parameters_ready(units[2], prefetch=False)


def test_a_third_unit_gathered_while_two_are_held_is_refused() -> None:
    run_distributed(third_unit_refused, 2)


def buffering_refusals() -> list[str]:
    messages = []
    for strategy, units, config in (
        ("optim_grads_params", True, {"disable_symmetric_registration": True}),
        ("optim_grads_params", False, {"fsdp_double_buffer": True}),
        ("optim_grads", True, {"fsdp_db_use_persist_buf_on_alloc_fail": True}),
    ):
        with pytest.raises(ValueError, match="MegatronFSDP") as info:
            wrap(strategy, units=units, **config)
        messages.append(str(info.value))
    return messages


def test_buffering_options_that_contradict_are_refused() -> None:
    if test_device().type == "cuda" and dist.is_nccl_available():
        pytest.skip("disable_symmetric_registration is checked off NCCL here")
    symmetric, no_units, persistent = run_distributed(buffering_refusals, 2)[0]
    assert "disable_symmetric_registration=True" in symmetric
    assert "NCCL" in symmetric
    assert "no FSDP units to double-buffer weights" in no_units
    assert "fsdp_db_use_persist_buf_on_alloc_fail=True only chooses" in persistent
    assert "turn fsdp_double_buffer on" in persistent


NO_OP_BUFFERING: dict[str, dict[str, Any]] = {
    "plain": {},
    "double_buffer": {"fsdp_double_buffer": True},
    "max_pool": {"megatron_fsdp_max_pool_double_buffer": True},
    "persistent": {"fsdp_double_buffer": True, "fsdp_db_use_persist_buf_on_alloc_fail": True},
}


def unbuffered_strategy_runs(strategy: str) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, int]]]:
    """no_shard / optim with each double-buffering option (the reference accepts them): three steps,
    the weights and every allocator's allocation count."""
    runs = {}
    for name, config in NO_OP_BUFFERING.items():
        trainer = Trainer.build(strategy, layers=LAYERS, **config)
        for step in range(3):
            trainer.step(step, 1)
        stats = {k: s.allocations for k, s in trainer.model.memory_stats().items()}
        runs[name] = (exported_weights(trainer.model), stats)
    return runs


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_double_buffering_is_accepted_and_a_no_op_where_nothing_is_buffered(strategy: str) -> None:
    for rank in run_distributed(unbuffered_strategy_runs, 2, args=(strategy,)):
        plain, _ = rank["plain"]
        for name, (weights, stats) in rank.items():
            assert stats == {"weights:storage_resize": 0, "grads:storage_resize": 0}, name
            assert all(torch.equal(weights[k], plain[k]) for k in plain), name


def userbuffer_training(symmetric: bool) -> dict[str, Any]:
    """ZeRO-3 with nccl_ub against the dynamic allocators, on one CUDA rank over NCCL. Symmetric windows
    need ncclMemAlloc memory; where torch's NCCL cannot allocate it the request must be refused."""
    device = test_device()
    nccl_memory = dist.group.WORLD._get_backend(device).supports_tensor_alloc(device)  # type: ignore[union-attr]
    if symmetric and not nccl_memory:
        with pytest.raises(NotImplementedError, match="pass disable_symmetric_registration=True"):
            wrap("optim_grads_params", layers=LAYERS, nccl_ub=True)
        return {"refused": True}
    trainer = Trainer.build(
        "optim_grads_params", layers=LAYERS, nccl_ub=True, disable_symmetric_registration=not symmetric
    )
    plain = Trainer.build("optim_grads_params", layers=LAYERS)
    for step in range(3):
        trainer.step(step, 1)
        plain.step(step, 1)
    model, pool = trainer.model, trainer.model.nccl_ub_pool
    assert pool is not None
    slots = [
        tensor
        for allocator in (model.allocators.weights, model.allocators.grads)
        if isinstance(allocator, DoubleBufferAllocator)
        for group in allocator.slots
        for tensor in group
    ]
    segments = pool.segments()
    got, want = exported_weights(model), exported_weights(plain.model)
    return {
        "refused": False,
        "nccl_memory": nccl_memory,
        "slots": len(slots),
        "slots_in_pool": all(any(a <= t.data_ptr() < a + n for a, n in segments) for t in slots),
        "registered": pool.registered,
        "pool_bytes": sum(n for _, n in segments),
        "identical": all(torch.equal(got[k], want[k]) for k in want),
        "stats": {k: (s.allocations, s.peak_bytes) for k, s in model.memory_stats().items()},
    }


@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="NCCL user buffers need CUDA and NCCL",
)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "local"])
def test_nccl_userbuffers_hold_the_double_buffers_on_cuda(symmetric: bool) -> None:
    result = run_distributed(userbuffer_training, 1, args=(symmetric,), device="cuda")[0]
    print(result)  # what the GPU run recorded (pytest -s)
    if result["refused"]:
        return
    assert result["slots"] == 4
    assert result["slots_in_pool"]
    assert result["registered"]
    assert result["identical"]


def slots_by_pass(checkpoint: str | None) -> tuple[list[list[int]], list[list[int]], bool]:
    """Each unit's weight address at every forward (recomputations included) and every backward, over two
    steps of ZeRO-3 with double buffers and without overlap_param_gather (every step ends with an install
    and a param sync), and whether the weights match the dynamic allocators' bit for bit."""
    trainer = Trainer.build(
        "optim_grads_params",
        layers=LAYERS,
        checkpoint=checkpoint,
        fsdp_double_buffer=True,
        overlap_param_gather=False,
    )
    plain = Trainer.build(
        "optim_grads_params", layers=LAYERS, checkpoint=checkpoint, overlap_param_gather=False
    )
    model = trainer.model
    forward: list[list[int]] = [[] for _ in range(LAYERS)]
    backward: list[list[int]] = [[] for _ in range(LAYERS)]
    model._replace_param_with_raw_if_needed()  # the compute params, whose storage moves between slots
    for unit_id, unit in enumerate(model.units):
        params = list(unit.parameters())

        def slot(params: list[torch.Tensor] = params) -> int:  # where the unit's weights start
            return min(p.data_ptr() for p in params)

        unit.register_forward_pre_hook(lambda *_, u=unit_id, s=slot: forward[u].append(s()))
        unit.register_full_backward_pre_hook(lambda *_, u=unit_id, s=slot: backward[u].append(s()))
    for step in range(2):
        trainer.step(step, 1)
        plain.step(step, 1)
    got, want = model.full_state_dict(rank0_only=False), plain.model.full_state_dict(rank0_only=False)
    same = all(torch.equal(got[k], want[k]) for k in want)
    return forward, backward, same


@pytest.mark.parametrize("checkpoint", [None, "reentrant"], ids=["saved", "recomputed"])
def test_a_unit_keeps_its_double_buffer_slot_for_good(checkpoint: str | None) -> None:
    """Autograd reads in backward the weights a unit's forward saved: they must still be there, so a unit
    keeps its slot. Units alternate between the two slots, and the weights match the dynamic allocators'
    bit for bit. With reentrant activation recomputation each unit's forward runs without grad and
    releases its weights, and the backward gathers the last unit again while both slots are idle: it must
    take its own slot (slot 1), not the first idle one, like every unit in every pass."""
    for forward, backward, same in run_distributed(slots_by_pass, 2, args=(checkpoint,)):
        assert all(len(passes) == (4 if checkpoint else 2) for passes in forward)  # recomputed: twice a step
        assert all(len(passes) == 2 for passes in backward)
        slots = [set(f) | set(b) for f, b in zip(forward, backward, strict=True)]
        assert all(len(s) == 1 for s in slots), slots  # one slot per unit, for good
        assert slots[0] == slots[2] != slots[1] == slots[3]
        assert same


class SkipsFirstBlock(torch.nn.Module):
    """Four blocks; the first is never used, so its unit gets no grad at all."""

    def __init__(self) -> None:
        super().__init__()
        from fsdp_testkit import TinyTransformer

        self.inner = TinyTransformer(layers=LAYERS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        x = inner.embedding(tokens)
        for block in list(inner.blocks)[1:]:
            x = block(x)
        logits = inner.head(inner.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def unused_unit_with_double_buffers() -> bool:
    from fsdp_testkit import Block, local_microbatches, shard_index

    from gradsync.buffers import DistributedDataParallelConfig

    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads",
        overlap_grad_reduce=True,
        fsdp_double_buffer=True,
    )
    model = MegatronFSDP(SkipsFirstBlock(), shard_index(), config, fsdp_unit_modules=[Block])
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    model.finish_grad_sync()  # the unused unit's bucket is reduced at the end of backward: zeros
    unused = list(model.module.inner.blocks[0].parameters())  # the optimizer's, between steps
    return all(p.grad is None or not p.grad.to_local().any() for p in unused)


def test_a_unit_without_grads_waits_for_a_double_buffer_slot() -> None:
    assert all(run_distributed(unused_unit_with_double_buffers, 2))
