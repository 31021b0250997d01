"""The uneven-DTensor helpers (Megatron-FSDP's ``uneven_dtensor`` API) on MegatronFSDP's optimizer params,
whose dim-0 shards are uneven and empty on some ranks (checked by each test: torch's own ``full_tensor()``
fails on them). On 2, 3 and 4 gloo ranks: every param gathered whole equals the unwrapped model built with
the same seed (fp32 and bf16 shards, ZeRO-1 and ZeRO-3, HSDP and HFSDP meshes), and after optimizer steps on
different data per rank equals ``full_state_dict()`` and one process on the global batch; the chunk offsets
the helpers compute by collectives equal the first rows gradsync records; ``validate_uneven_dtensor`` raises
on every rank for overlapping, out-of-bounds and gapped chunk layouts; ``split_dtensor`` pieces equal
``torch.split`` of the whole param, locally and gathered; ``preprocess_state_dict_for_uneven_dtensor``
attaches true chunks in sorted key order, so a DCP checkpoint of uneven DTensors reloads into another uneven
layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import (
    Block,
    TinyTransformer,
    Trainer,
    max_relative_difference,
    reference_training,
    shard_index,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import (
    MegatronFSDP,
    MixedPrecisionPolicy,
    fully_shard_optimizer,
    gather_uneven_dtensor_to_full_tensor,
    preprocess_state_dict_for_uneven_dtensor,
    split_dtensor,
    uneven_dtensor_to_full_tensor,
    validate_uneven_dtensor,
)
from gradsync.fsdp.ragged import describe_shard
from gradsync.fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
from gradsync.groups.testing import run_distributed, test_device

PREFIX = "module."


def build(
    strategy: str, dtype: torch.dtype, outer: int = 1, outer_strategy: str = "no_shard"
) -> MegatronFSDP:
    """The test transformer wrapped with optimizer DTensors of ``dtype`` (bf16: no fp32 main copy, the
    optimizer's shards are the bf16 compute weights' own)."""
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer_strategy,
    )
    main = torch.float32 if dtype == torch.float32 else None
    return MegatronFSDP(
        TinyTransformer(0).to(dtype),
        shard_index(outer, outer_strategy),
        config,
        fsdp_unit_modules=[Block],
        mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=main),
    )


def unwrapped(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The independent oracle: the plain model built with the same seed, on the CPU."""
    return {n: p.detach().cpu() for n, p in TinyTransformer(0).to(dtype).named_parameters()}


def native_full_tensor_fails(param: DTensor) -> bool:
    """Whether torch's own full_tensor() refuses this uneven DTensor (it fails only if rows differ across
    ranks; gloo may abort on mismatched sizes, so the sizes are compared first and it is not called)."""
    rows = torch.tensor([param.to_local().shape[0]], device=param.device)
    every = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(every, rows)
    return len({int(r) for r in every}) > 1


def full_tensors_at_init(
    strategy: str, dtype: torch.dtype, outer: int, outer_strategy: str
) -> dict[str, Any]:
    model = build(strategy, dtype, outer, outer_strategy)
    full, replicated, rows, computed, recorded = {}, {}, {}, {}, {}
    for name, param in model.named_parameters():
        key = name.removeprefix(PREFIX)
        full[key] = uneven_dtensor_to_full_tensor(param).cpu()
        gathered = gather_uneven_dtensor_to_full_tensor(param)
        assert isinstance(gathered, DTensor)
        assert all(isinstance(p, Replicate) for p in gathered.placements)
        replicated[key] = gathered.to_local().cpu()
        rows[key] = param.to_local().shape[0] if param.dim() else 1
        offset = int(gather_and_compute_chunk_metadata(param).offsets[0]) if param.dim() else 0
        if rows[key]:  # an empty chunk's offset means nothing
            computed[key], recorded[key] = offset, model.params.first_row(param) or 0
    return {
        "full": full,
        "replicated": replicated,
        "rows": rows,
        "computed": computed,
        "recorded": recorded,
        "placements": [type(p).__name__ for p in next(iter(model.parameters())).placements],
    }


def check_layout_is_uneven(results: list[dict[str, Any]]) -> None:
    """The premise: some param's rows split unevenly among ranks that all own some, and some rank owns
    no rows of some param."""
    rows = [r["rows"] for r in results]
    names = rows[0].keys()
    assert any(len({r[n] for r in rows}) > 1 and min(r[n] for r in rows) > 0 for n in names), rows
    assert any(r[n] == 0 for r in rows for n in names), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("world", [2, 3])
def test_full_tensor_equals_the_unwrapped_model(world: int, strategy: str, dtype: torch.dtype) -> None:
    results = run_distributed(full_tensors_at_init, world, args=(strategy, dtype, 1, "no_shard"))
    check_layout_is_uneven(results)
    want = unwrapped(dtype)
    for rank, result in enumerate(results):
        assert result["full"].keys() == want.keys()
        for name, tensor in want.items():
            assert result["full"][name].dtype == dtype
            assert torch.equal(result["full"][name], tensor), (rank, name)
            assert torch.equal(result["replicated"][name], tensor), (rank, name)
        assert result["computed"] == result["recorded"], rank  # the collective metadata = the layout's


def test_full_tensor_on_hybrid_meshes() -> None:
    """4 ranks as 2 outer x 2 shard: HSDP's (Replicate, Shard(0)) and HFSDP's (Shard(0), Shard(0)), whose
    chunks lie in (inner, outer) order."""
    want = unwrapped(torch.float32)
    for strategy, outer_strategy, placements in [
        ("optim_grads", "no_shard", ["Replicate", "Shard"]),
        ("optim_grads_params", "optim", ["Shard", "Shard"]),
    ]:
        results = run_distributed(full_tensors_at_init, 4, args=(strategy, torch.float32, 2, outer_strategy))
        check_layout_is_uneven(results)
        for rank, result in enumerate(results):
            assert result["placements"] == placements
            for name, tensor in want.items():
                assert torch.equal(result["full"][name], tensor), (outer_strategy, rank, name)
            assert result["computed"] == result["recorded"], (outer_strategy, rank)


def full_tensors_after_training(strategy: str, dtype: torch.dtype, steps: int) -> dict[str, Any]:
    trainer = Trainer.build(strategy, dtype=dtype)  # fp32 main weights: the DTensors are fp32
    for step in range(steps):  # each rank its own rows of every global batch
        trainer.step(step, 1)
    params = dict(trainer.model.named_parameters())
    uneven = any(native_full_tensor_fails(p) for p in params.values())
    full = {n.removeprefix(PREFIX): uneven_dtensor_to_full_tensor(p).cpu() for n, p in params.items()}
    exported = trainer.model.full_state_dict(rank0_only=False)
    return {"full": full, "exported": {k: exported[k] for k in full}, "uneven": uneven}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("world", [2, 3])
def test_full_tensor_after_optimizer_steps(world: int, strategy: str, dtype: torch.dtype) -> None:
    steps = 3
    results = run_distributed(full_tensors_after_training, world, args=(strategy, dtype, steps))
    for rank, result in enumerate(results):
        assert result["uneven"], rank
        for name, tensor in result["exported"].items():  # the compute weights are the mains, rounded
            assert torch.equal(result["full"][name].to(dtype), tensor), (rank, name)
        if dtype == torch.float32:
            assert max_relative_difference(result["full"], reference_training(world, 1, steps)) <= 1e-6


def validation_outcomes() -> dict[str, str]:
    """What validate_uneven_dtensor (and uneven_dtensor_to_full_tensor) say on this rank, case by case."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("optim_grads_params", torch.float32)
    params = dict(model.named_parameters())
    outcomes: dict[str, str] = {}

    def attempt(case: str, check: Any, value: DTensor) -> None:
        try:
            check(value)
            outcomes[case] = "ok"
        except (AssertionError, ValueError) as error:
            outcomes[case] = f"{type(error).__name__}: {error}"

    for name, param in params.items():
        attempt(f"gradsync {name}", validate_uneven_dtensor, param)
    replicated = build("no_shard", torch.float32)
    for name, param in replicated.named_parameters():
        attempt(f"no_shard {name}", validate_uneven_dtensor, param)

    weight = params[PREFIX + "embedding.weight"]  # 24 rows: 13 + 11 on 2 ranks
    first = model.params.first_row(weight)
    assert first is not None
    rows = weight.to_local().shape[0]
    overlapping = describe_shard(weight.detach(), 0 if rank == world - 1 else first)
    attempt("overlap", validate_uneven_dtensor, overlapping)
    outside = describe_shard(weight.detach(), weight.shape[0] - rows + 1 if rank == world - 1 else first)
    attempt("outside", validate_uneven_dtensor, outside)
    attempt("outside full", uneven_dtensor_to_full_tensor, outside)
    mesh = weight.device_mesh
    local = torch.zeros(rows - (rank == 0), 12, device=test_device())  # one row short: a gap at the end
    gap = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=(12, 1))
    attempt("gap", validate_uneven_dtensor, gap)
    local = torch.zeros(rows + 1, 12, device=test_device())
    excess = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=(12, 1))
    attempt("excess", validate_uneven_dtensor, excess)
    two = weight.detach()
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=two.to_local().shape)
    two._local_tensor.__create_chunk_list__ = lambda: [chunk, chunk]  # type: ignore[attr-defined]
    attempt("two chunks", uneven_dtensor_to_full_tensor, two)
    return outcomes


def test_validate_uneven_dtensor_raises_on_every_rank_for_a_corrupted_layout() -> None:
    results = run_distributed(validation_outcomes, 2)
    expected = {
        "overlap": "AssertionError: [gradsync-fsdp] DTensor chunk metadata is invalid: chunks overlap",
        "outside": "AssertionError: [gradsync-fsdp] DTensor chunk metadata is invalid: a chunk lies outside",
        "outside full": "ValueError: uneven_dtensor_to_full_tensor: a rank's chunk lies outside",
        "gap": "AssertionError: [gradsync-fsdp] DTensor chunk metadata boundary check failed: the chunks "
        "cover 276 of 288",
        "excess": "AssertionError: [gradsync-fsdp] DTensor chunk metadata is invalid: a chunk lies outside",
        "two chunks": "ValueError: Expected exactly one chunk metadata per rank, got 2.",
    }
    for rank, outcomes in enumerate(results):
        gradsync_cases = {k: v for k, v in outcomes.items() if k.startswith(("gradsync ", "no_shard "))}
        assert len(gradsync_cases) == 2 * 15
        assert set(gradsync_cases.values()) == {"ok"}, (rank, gradsync_cases)
        for case, message in expected.items():
            assert outcomes[case].startswith(message), (rank, case, outcomes[case])


def test_full_tensor_refuses_a_plain_tensor() -> None:
    with pytest.raises(TypeError, match="Input must be a DTensor, got Tensor"):
        uneven_dtensor_to_full_tensor(torch.zeros(3))  # type: ignore[arg-type]


SPLITS: list[tuple[str, int | list[int], int]] = [
    ("embedding.weight", 5, 0),
    ("embedding.weight", [3, 0, 10, 11], 0),
    ("blocks.0.up.weight", 4, 0),
    ("blocks.0.up.weight", 5, 1),
    ("blocks.1.down.weight", [20, 17], -1),
    ("blocks.0.up.bias", 16, 0),
]


def split_pieces(strategy: str, update: bool) -> dict[str, Any]:
    model = build(strategy, torch.float32)
    params = {n.removeprefix(PREFIX): p for n, p in model.named_parameters()}
    out: dict[str, Any] = {"local": [], "full": [], "offsets": [], "first": {}, "rows": {}}
    for name, size_or_sections, dim in SPLITS:
        param = params[name]
        out["first"][name] = model.params.first_row(param) or 0
        out["rows"][name] = param.to_local().shape[0]
        pieces = list(split_dtensor(param, size_or_sections, dim, update_uneven_dtensor_chunk_meta=update))
        out["local"].append([p.to_local().cpu() for p in pieces])
        out["offsets"].append(
            [
                tuple(p._local_tensor.__create_chunk_list__()[0].offsets)
                if hasattr(p._local_tensor, "__create_chunk_list__")
                else None
                for p in pieces
            ]
        )
        out["full"].append([uneven_dtensor_to_full_tensor(p).cpu() for p in pieces])
    try:
        next(split_dtensor(params["embedding.weight"], [10, 10], 0))
        out["bad sections"] = "accepted"
    except ValueError as error:
        out["bad sections"] = str(error)
    return out


@pytest.mark.parametrize("update", [True, False], ids=["with-chunk-meta", "without"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_split_dtensor_matches_torch_split(strategy: str, update: bool) -> None:
    results = run_distributed(split_pieces, 3, args=(strategy, update))
    want = unwrapped(torch.float32)
    for rank, result in enumerate(results):
        assert result["bad sections"].startswith("split_dtensor: sections [10, 10] sum to 20"), rank
        for i, (name, size_or_sections, dim) in enumerate(SPLITS):
            expected = torch.split(want[name], size_or_sections, dim)
            assert len(result["full"][i]) == len(expected), (rank, name)
            first, rows = result["first"][name], result["rows"][name]
            split_dim = dim % want[name].dim()
            start = 0
            for j, piece in enumerate(expected):
                assert torch.equal(result["full"][i][j], piece), (rank, name, j)
                # the local part: this rank's rows of the piece, without any communication
                stop = start + piece.shape[split_dim]
                if split_dim == 0:
                    lo, hi = max(start, first), min(stop, first + rows)
                    mine = want[name][lo:hi] if lo < hi else want[name][:0]
                else:
                    mine = want[name][first : first + rows].narrow(split_dim, start, stop - start)
                assert torch.equal(result["local"][i][j], mine), (rank, name, j)
                if update and strategy != "no_shard" and mine.numel():
                    expected_offset = [first, 0][: want[name].dim()]
                    expected_offset[split_dim] = max(first, start) - start if split_dim == 0 else 0
                    assert result["offsets"][i][j] == tuple(expected_offset), (rank, name, j)
                elif not update:
                    assert result["offsets"][i][j] is None or strategy == "no_shard", (rank, name, j)
                start = stop


ROWS_SAVED = [5, 0, 2]  # rows per rank of the saved 7 x 3 tensor (rank 1 owns none)
ROWS_LOADED = [2, 2, 3]


def uneven(mesh: DeviceMesh, rows: list[int], values: torch.Tensor) -> DTensor:
    rank = dist.get_rank()
    start = sum(rows[:rank])
    local = values[start : start + rows[rank]].clone().to(test_device())
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=values.shape, stride=(3, 1))


def checkpoint_round_trip(directory: str, preprocess: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),))
    a = torch.arange(21.0).reshape(7, 3)
    b = -torch.arange(21.0).reshape(7, 3)
    # insertion orders differ across ranks: the collectives must still run in one (sorted) order
    saved: dict[str, Any] = (
        {"model": {"a": uneven(mesh, ROWS_SAVED, a), "step": 3}, "b": uneven(mesh, ROWS_LOADED, b)}
        if rank % 2 == 0
        else {"b": uneven(mesh, ROWS_LOADED, b), "model": {"step": 3, "a": uneven(mesh, ROWS_SAVED, a)}}
    )
    if preprocess:
        assert preprocess_state_dict_for_uneven_dtensor(saved) is saved
    offsets = {
        k: tuple(t._local_tensor.__create_chunk_list__()[0].offsets)
        for k, t in (("a", saved["model"]["a"]), ("b", saved["b"]))
        if hasattr(t._local_tensor, "__create_chunk_list__")
    }
    dcp.save(saved, checkpoint_id=directory)
    loaded = {
        "model": {"a": uneven(mesh, ROWS_LOADED, torch.zeros(7, 3)), "step": 0},
        "b": uneven(mesh, ROWS_SAVED, torch.zeros(7, 3)),
    }
    preprocess_state_dict_for_uneven_dtensor(loaded)
    dcp.load(loaded, checkpoint_id=directory)
    return {
        "offsets": offsets,
        "a": uneven_dtensor_to_full_tensor(loaded["model"]["a"]).cpu(),
        "b": uneven_dtensor_to_full_tensor(loaded["b"]).cpu(),
        "step": loaded["model"]["step"],
    }


def test_preprocess_state_dict_makes_uneven_dtensors_checkpointable(tmp_path: Any) -> None:
    results = run_distributed(checkpoint_round_trip, 3, args=(str(tmp_path), True))
    for rank, result in enumerate(results):
        assert result["offsets"] == {
            "a": (sum(ROWS_SAVED[:rank]), 0),
            "b": (sum(ROWS_LOADED[:rank]), 0),
        }, rank
        assert torch.equal(result["a"], torch.arange(21.0).reshape(7, 3)), rank
        assert torch.equal(result["b"], -torch.arange(21.0).reshape(7, 3)), rank
        assert result["step"] == 3


def plain_layouts() -> dict[str, Any]:
    """DTensors built by hand on 3 ranks: chunks in reverse rank order (rank 1 empty) described by a chunk
    on the local tensor; an uneven Shard(1) with an empty rank and no metadata; integer and bool dtypes."""
    rank = dist.get_rank()
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),))
    values = torch.arange(21).reshape(7, 3)
    first, rows = [(5, 2), (0, 0), (0, 5)][rank]
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.int64, torch.bool):
        want = values.to(dtype)
        local = want[first : first + rows].clone().to(test_device())
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=want.shape, stride=(3, 1))
        describe_shard(dt, first)
        validate_uneven_dtensor(dt)
        out[f"{dtype} chunk"] = torch.equal(uneven_dtensor_to_full_tensor(dt).cpu(), want)
        # preprocess keeps the described layout (rank order would say otherwise)
        preprocess_state_dict_for_uneven_dtensor({"x": dt})
        out[f"{dtype} preprocessed"] = tuple(dt._local_tensor.__create_chunk_list__()[0].offsets)
    columns = torch.arange(14.0).reshape(2, 7)
    start, width = [(0, 4), (4, 0), (4, 3)][rank]
    local = columns[:, start : start + width].clone().to(test_device())
    dt = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=columns.shape, stride=(7, 1))
    validate_uneven_dtensor(dt)
    out["shard(1)"] = torch.equal(uneven_dtensor_to_full_tensor(dt).cpu(), columns)
    return out


def test_full_tensor_follows_the_recorded_layout_of_any_dtype() -> None:
    for rank, result in enumerate(run_distributed(plain_layouts, 3)):
        firsts = [5, 0, 0]
        for key, value in result.items():
            want = (firsts[rank], 0) if key.endswith("preprocessed") else True
            assert value == want, (rank, key, value)


def preprocess_gradsync_checkpoint() -> dict[str, Any]:
    """MegatronFSDP's model and optimizer state dicts after a step: ranks owning no rows of a param hold
    an empty grad and empty optimizer state for it (as FSDP2's shards), so every rank's dict has the same
    entries; preprocessing keeps the recorded chunks without a collective."""
    trainer = Trainer.build("optim_grads_params")
    optimizer = fully_shard_optimizer(trainer.optimizer)
    trainer.step(0, 1)
    state = {"model": trainer.model.state_dict(), "optim": optimizer.state_dict()}
    before = {k: v._local_tensor.__create_chunk_list__()[0].offsets for k, v in state["model"].items()}
    assert preprocess_state_dict_for_uneven_dtensor(state) is state
    after = {k: v._local_tensor.__create_chunk_list__()[0].offsets for k, v in state["model"].items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_offsets = {
        (index, name): (
            int(value._local_tensor.__create_chunk_list__()[0].offsets[0]),
            trainer.model.params.first_row(params[index]),
        )
        for index, entry in state["optim"]["state"].items()
        for name, value in entry.items()
        if isinstance(value, DTensor)
    }
    full = {k.removeprefix(PREFIX): uneven_dtensor_to_full_tensor(v).cpu() for k, v in state["model"].items()}
    exported = trainer.model.full_state_dict(rank0_only=False)
    return {
        "same": before == after,
        "states": sorted(state["optim"]["state"]),
        "optim offsets": optim_offsets,
        "equal": all(torch.equal(full[k], exported[k]) for k in full),
    }


def test_preprocess_keeps_gradsync_chunks_of_model_and_optimizer_state() -> None:
    results = run_distributed(preprocess_gradsync_checkpoint, 3, timeout=60)
    assert len({tuple(r["states"]) for r in results}) == 1, results  # every rank: state for every param
    for rank, result in enumerate(results):
        assert result["same"], (rank, result)
        assert result["equal"], (rank, result)
        assert result["optim offsets"], rank
        for key, (offset, first_row) in result["optim offsets"].items():
            assert offset == first_row, (rank, key)
