"""``RaggedShard`` and ``RaggedDTensor``: torch's own DTensor calls on pieces of given sizes (one rank may
hold none), each against the same call on the whole tensor in one process. Every rank holds different
rows, so nothing here can pass without the collectives."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import skip_where_torch_gathers_crash
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from gradsync.fsdp.ragged import RaggedDTensor, RaggedShard, checked_order, reshard, shard_placement
from gradsync.fsdp.torch_internals import HAS_SHARD_ORDER, SUBCLASS_DISPATCH
from gradsync.groups.testing import run_distributed, test_device

needs_shard_order = pytest.mark.skipif(
    not HAS_SHARD_ORDER,
    reason="this torch's DTensor specs carry no shard order (2.6): inner-first splits are refused, as "
    "test_inner_first_splits_are_refused_without_a_shard_order checks",
)
needs_subclass_dispatch = pytest.mark.skipif(
    not SUBCLASS_DISPATCH,
    reason="torch 2.11 runs a DTensor subclass's ops in C++: their outputs (zeros_like, arithmetic, torch's "
    "own optimizer state) are plain DTensors, a documented limit",
)
# torch 2.6's DCP plan check takes an empty chunk (a rank holding no rows) of a plain DTensor for an overlap;
# 2.11 and later accept it (versions between were not run)
DCP_TAKES_EMPTY_CHUNKS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 11)

SIZES = {2: (4, 1), 4: (3, 0, 5, 1)}
OTHER_SIZES = {2: (1, 4), 4: (0, 6, 1, 2)}
COLUMNS = 6


def whole(world: int, dtype: torch.dtype) -> torch.Tensor:
    rows = sum(SIZES[world])
    return (torch.arange(rows * COLUMNS, dtype=torch.float32).view(rows, COLUMNS) * 0.25 - 3).to(dtype)


def piece(tensor: torch.Tensor, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
    return tensor[sum(sizes[:rank]) : sum(sizes[: rank + 1])]


def torch_chunk(tensor: torch.Tensor, world: int, rank: int, dim: int = 0) -> torch.Tensor:
    """What ``Shard(dim)`` puts on ``rank`` (``torch.chunk``'s piece, empty past the last one)."""
    chunks = tensor.chunk(world, dim=dim)
    return chunks[rank] if rank < len(chunks) else tensor.narrow(dim, 0, 0)


def ragged(local: torch.Tensor, sizes: tuple[int, ...], shape: torch.Size) -> DTensor:
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [RaggedShard(0, sizes)], run_check=False, shape=shape, stride=stride
    )


def ops(dtype: torch.dtype, directory: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = whole(world, dtype).to(test_device())
    sizes, other = SIZES[world], OTHER_SIZES[world]
    tensor = ragged(piece(full, sizes, rank).clone(), sizes, full.shape)
    mesh = tensor.device_mesh
    out: dict[str, Any] = {"full_tensor": tensor.full_tensor()}
    out["replicate"] = tensor.redistribute(mesh, [Replicate()]).to_local()
    by_column = tensor.redistribute(mesh, [Shard(1)])
    out["by_column"] = (by_column.to_local(), by_column.full_tensor())
    out["from_replicate"] = distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, tensor.placements)
    out["from_replicate"] = out["from_replicate"].to_local()
    sent = full if rank == 0 else torch.zeros_like(full)  # only rank 0's copy may reach the others
    scattered = distribute_tensor(sent, mesh, tensor.placements)  # torch builds its even chunks here
    out["scattered"] = (scattered.full_tensor(), reshard(scattered, tensor.placements).to_local())
    partial = DTensor.from_local(full * (rank + 1), mesh, [Partial()], run_check=False)
    out["reduced"] = partial.redistribute(mesh, tensor.placements).to_local()
    out["to_chunks"] = reshard(tensor, [Shard(0)]).to_local()
    out["to_other"] = reshard(tensor, [RaggedShard(0, other)]).to_local()
    out["column_to_ragged"] = reshard(by_column, tensor.placements).to_local()
    if DCP_TAKES_EMPTY_CHUNKS or 0 not in sizes + other:
        dcp.save({"w": tensor}, checkpoint_id=directory)
        into_chunks = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        into_other = {"w": ragged(torch.zeros_like(piece(full, other, rank)), other, full.shape)}
        dcp.load(into_chunks, checkpoint_id=directory)
        dcp.load(into_other, checkpoint_id=directory)
        out["dcp"] = (into_chunks["w"].full_tensor(), into_other["w"].to_local())
    return {k: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() for k, v in out.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 4])
def test_torch_ops_on_ragged_pieces_equal_the_whole_tensor(
    world: int, dtype: torch.dtype, tmp_path: Path
) -> None:
    skip_where_torch_gathers_crash(world)
    full = whole(world, dtype)
    total = sum(range(1, world + 1))
    for rank, out in enumerate(run_distributed(ops, world, args=(dtype, str(tmp_path / "ckpt")))):
        mine = piece(full, SIZES[world], rank)
        assert torch.equal(out["full_tensor"], full), rank
        assert torch.equal(out["replicate"], full), rank
        assert torch.equal(out["by_column"][0], torch_chunk(full, world, rank, dim=1)), rank
        assert torch.equal(out["by_column"][1], full), rank
        assert torch.equal(out["from_replicate"], mine), rank
        assert torch.equal(out["scattered"][0], full), rank
        assert torch.equal(out["scattered"][1], mine), rank
        assert torch.equal(out["reduced"], mine * total), rank
        assert torch.equal(out["to_chunks"], torch_chunk(full, world, rank)), rank
        assert torch.equal(out["to_other"], piece(full, OTHER_SIZES[world], rank)), rank
        assert torch.equal(out["column_to_ragged"], mine), rank
        assert "dcp" in out or not DCP_TAKES_EMPTY_CHUNKS, rank
        if "dcp" in out:
            assert torch.equal(out["dcp"][0], full), rank
            assert torch.equal(out["dcp"][1], piece(full, OTHER_SIZES[world], rank)), rank


# HFSDP's split on a 2 x 3 (outer, inner) mesh: TABLE[inner][outer] rows, laid out inner shard first. The
# middle inner shard's pieces are torch's chunks (a plain Shard(0) on the outer dim), the others ragged.
TABLE = ((3, 0), (2, 2), (1, 5))
OTHER_TABLE = ((0, 6), (1, 2), (3, 1))
MESH = (2, 3)


def inner_first(local: torch.Tensor, table: tuple[tuple[int, ...], ...], shape: torch.Size) -> RaggedDTensor:
    """On an (outer, inner) mesh: inner shard i is outer pieces i*M ... i*M+M-1 (HFSDP's order)."""
    mesh = init_device_mesh(test_device().type, MESH)
    inner = mesh.get_local_rank(1)
    placements = [shard_placement(table[inner]), shard_placement([sum(row) for row in table])]
    return RaggedDTensor.wrap(local, mesh, shape, placements, mesh_dim_order=(1, 0))


def flat(table: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return tuple(size for row in table for size in row)


def inner_first_rows(full: torch.Tensor, table: tuple[tuple[int, ...], ...], rank: int) -> torch.Tensor:
    """What ``rank`` (mesh coordinate (outer, inner)) holds of ``full``: flat piece inner * M + outer."""
    outer, inner = divmod(rank, MESH[1])
    return piece(full, flat(table), inner * MESH[0] + outer)


def whole_rows(dtype: torch.dtype) -> torch.Tensor:
    rows = sum(flat(TABLE))
    return (torch.arange(rows * COLUMNS, dtype=torch.float32).view(rows, COLUMNS) * 0.25 - 3).to(dtype)


def inner_first_ops(dtype: torch.dtype, directory: str) -> dict[str, Any]:
    rank = dist.get_rank()
    full = whole_rows(dtype).to(test_device())
    tensor = inner_first(inner_first_rows(full, TABLE, rank).clone(), TABLE, full.shape)
    mesh = tensor.device_mesh
    out: dict[str, Any] = {"full_tensor": tensor.full_tensor()}
    out["by_column"] = tensor.redistribute(mesh, [Replicate(), Shard(1)]).to_local()
    out["to_torch"] = tensor.redistribute(mesh, [Shard(0), Shard(0)]).to_local()
    out["reshard_to_torch"] = reshard(tensor, [Shard(0), Shard(0)]).to_local()  # not the label's no-op
    cast = reshard(tensor.ragged_view(), [Replicate(), Replicate()], forward_dtype=torch.float64)
    out["cast"] = cast.to_local()
    other = inner_first(torch.zeros(0), OTHER_TABLE, full.shape)
    out["to_other"] = reshard(tensor, other.ragged_placements, mesh_dim_order=(1, 0)).to_local()
    replicated = distribute_tensor(full, mesh, [Replicate(), Replicate()])
    out["from_whole"] = reshard(replicated, tensor.ragged_placements, mesh_dim_order=(1, 0)).to_local()
    dcp.save({"w": tensor}, checkpoint_id=directory)
    into_torch = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0), Shard(0)])}
    mine = inner_first_rows(full, OTHER_TABLE, rank)
    into_other = {"w": inner_first(torch.zeros_like(mine), OTHER_TABLE, full.shape)}
    dcp.load(into_torch, checkpoint_id=directory)
    dcp.load(into_other, checkpoint_id=directory)
    out["dcp"] = (into_torch["w"].full_tensor(), into_other["w"].to_local())
    return {k: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() for k, v in out.items()}


@needs_shard_order
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inner_first_splits_move_like_the_whole_tensor(dtype: torch.dtype, tmp_path: Path) -> None:
    """HFSDP's layout (inner shard first, ragged at both levels) through torch's own gather, redistribute
    and DCP; cut in torch's left-to-right order, most ranks would hold other rows."""
    skip_where_torch_gathers_crash(6)
    full = whole_rows(dtype)
    for rank, out in enumerate(run_distributed(inner_first_ops, 6, args=(dtype, str(tmp_path / "ckpt")))):
        outer, inner = divmod(rank, MESH[1])
        torch_shard = torch_chunk(torch_chunk(full, MESH[0], outer), MESH[1], inner)
        assert torch.equal(out["full_tensor"], full), rank
        assert torch.equal(out["by_column"], torch_chunk(full, MESH[1], inner, dim=1)), rank
        assert torch.equal(out["to_torch"], torch_shard), rank
        assert torch.equal(out["reshard_to_torch"], torch_shard), rank
        assert out["cast"].dtype == torch.float64, rank
        assert torch.equal(out["cast"], full.double()), rank
        assert torch.equal(out["to_other"], inner_first_rows(full, OTHER_TABLE, rank)), rank
        assert torch.equal(out["from_whole"], inner_first_rows(full, TABLE, rank)), rank
        assert torch.equal(out["dcp"][0], full), rank
        assert torch.equal(out["dcp"][1], inner_first_rows(full, OTHER_TABLE, rank)), rank


def refused_inner_first() -> str:
    with pytest.raises(
        NotImplementedError, match=f"needs a DTensor shard order.*torch {re.escape(torch.__version__)}"
    ) as err:
        inner_first(torch.zeros(0), TABLE, whole_rows(torch.float32).shape)
    return str(err.value)


@pytest.mark.skipif(HAS_SHARD_ORDER, reason="this torch has a shard order: inner-first splits work")
def test_inner_first_splits_are_refused_without_a_shard_order() -> None:
    """On a torch without shard order (2.6), by name and before any collective."""
    assert all("HFSDP" in message for message in run_distributed(refused_inner_first, 6))


def test_a_mesh_dim_order_must_name_every_dim_once() -> None:
    with pytest.raises(ValueError, match=r"mesh_dim_order \(1, 1\) must list each of the mesh's 2 dims once"):
        checked_order(2, (1, 1))
    assert checked_order(2, None) == (0, 1)


def ragged_param(local: torch.Tensor, sizes: tuple[int, ...], shape: torch.Size) -> RaggedDTensor:
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),))
    return RaggedDTensor.wrap(local, mesh, shape, [RaggedShard(0, sizes)])


def optimizer_and_clip(foreach: bool) -> dict[str, Any]:
    """Three AdamW steps on clipped grads of a ragged param: torch's own optimizer and clip, untouched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full, sizes = whole(world, torch.float32).to(test_device()), SIZES[world]
    param = torch.nn.Parameter(ragged_param(piece(full, sizes, rank).clone(), sizes, full.shape))
    optimizer = torch.optim.AdamW([param], lr=0.1, foreach=foreach)
    norm = 0.0
    for step in range(3):
        grad = piece(full, sizes, rank).sin() * (step + 1)
        param.grad = ragged_param(grad, sizes, full.shape)
        total = torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=foreach)
        assert isinstance(total, DTensor)
        norm = float(total.full_tensor())
        optimizer.step()
    moment = optimizer.state[param]["exp_avg"]  # torch's zeros_like of the param: it keeps the split
    assert isinstance(param, RaggedDTensor)
    whole_moment = SUBCLASS_DISPATCH  # else torch's state is a plain DTensor (torch 2.11): no gather
    return {
        "weights": param.full_tensor().cpu(),
        "moment": moment.full_tensor().cpu() if whole_moment else None,
        "arithmetic": (param * 2 - moment).full_tensor().cpu() if whole_moment else None,
        "norm": norm,
        "kind": (type(param).__name__, repr(param.placements), repr(param.ragged_placements)),
        "detached": type(param.detach()).__name__,
    }


@pytest.mark.parametrize("foreach", [True, False])
def test_torch_optimizer_and_clip_on_ragged_params_equal_one_process(foreach: bool) -> None:
    """The param's step and clip hold on every torch; its state and arithmetic gather whole only where the
    subclass sees the ops (not 2.11: see needs_subclass_dispatch)."""
    skip_where_torch_gathers_crash(4)
    full = whole(4, torch.float32)
    param = torch.nn.Parameter(full.clone())
    optimizer = torch.optim.AdamW([param], lr=0.1, foreach=foreach)
    for step in range(3):
        param.grad = full.sin() * (step + 1)
        norm = float(torch.nn.utils.clip_grad_norm_([param], 1.0, foreach=foreach))
        optimizer.step()
    for rank, out in enumerate(run_distributed(optimizer_and_clip, 4, args=(foreach,))):
        assert torch.allclose(out["weights"], param.detach(), rtol=1e-6, atol=1e-6), rank
        assert out["norm"] == pytest.approx(norm, rel=1e-6), rank
        # dispatch sees torch's Shard(0); the param keeps its split through the steps, and detach() too
        assert out["kind"] == (
            "RaggedDTensor",
            "(Shard(dim=0),)",
            f"(RaggedShard(dim=0, sizes={SIZES[4]}),)",
        ), rank
        assert out["detached"] == "RaggedDTensor", rank
        if SUBCLASS_DISPATCH:
            want_moment = optimizer.state[param]["exp_avg"]
            assert torch.allclose(out["moment"], want_moment, rtol=1e-6, atol=1e-7), rank
            assert torch.allclose(
                out["arithmetic"], param.detach() * 2 - want_moment, rtol=1e-6, atol=1e-6
            ), rank


def differentiable_gather() -> dict[str, torch.Tensor]:
    """``full_tensor()`` of a ragged param inside a loss: its grad comes back as this rank's rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full, sizes = whole(world, torch.float32).to(test_device()), SIZES[world]
    param = torch.nn.Parameter(ragged_param(piece(full, sizes, rank).clone(), sizes, full.shape))
    weights = torch.arange(full.numel(), dtype=full.dtype, device=full.device).view(full.shape)
    (param.full_tensor() * weights).sum().backward()
    assert isinstance(param.grad, DTensor)
    by_rows = param.redistribute(placements=[Shard(1)])
    return {"grad": param.grad.to_local().cpu(), "by_rows": by_rows.to_local().cpu()}


def test_ragged_params_gather_differentiably_and_redistribute() -> None:
    skip_where_torch_gathers_crash(4)
    full = whole(4, torch.float32)
    weights = torch.arange(full.numel(), dtype=full.dtype).view(full.shape)
    for rank, out in enumerate(run_distributed(differentiable_gather, 4)):
        assert torch.equal(out["grad"], piece(weights, SIZES[4], rank)), rank
        assert torch.equal(out["by_rows"], torch_chunk(full, 4, rank, dim=1)), rank


def wrong_sizes() -> str:
    full = whole(2, torch.float32).to(test_device())
    tensor = ragged(full[:2].clone(), (2, 2), full.shape)  # 4 rows described, 5 in the global shape
    try:
        tensor.full_tensor()
    except ValueError as error:
        return str(error)
    return "gathered"


def test_sizes_that_do_not_cover_the_tensor_are_refused_before_any_collective() -> None:
    for message in run_distributed(wrong_sizes, 2):
        assert "RaggedShard(dim=0, sizes=(2, 2)) describes 2 pieces of 4 entries" in message
        assert "has 5 entries along dim 0" in message


def test_placement_identity() -> None:
    assert RaggedShard(0, (1, 2)) == Shard(0)  # torch checks a spec's placements against Shard(dim)
    assert Shard(0) == RaggedShard(0, (1, 2))
    assert RaggedShard(0, (1, 2)) != Shard(1)
    assert RaggedShard(0, (1, 2)) != RaggedShard(0, (2, 1))
    assert hash(RaggedShard(0, (1, 2))) != hash(Shard(0))  # no cache takes one for the other
    assert repr(shard_placement([2, 2, 1, 0])) == "Shard(dim=0)"  # torch.chunk's own split of 5 by 4
    assert repr(shard_placement([3, 0, 5, 1])) == "RaggedShard(dim=0, sizes=(3, 0, 5, 1))"
    with pytest.raises(ValueError, match="non-negative"):
        RaggedShard(0, (2, -1))


def foreach_outputs() -> list[torch.Tensor]:
    """Two same-shaped ragged tensors split differently, through one foreach op: output i keeps input i's
    split (on ranks where both hold the same number of rows, only the position tells them apart)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = whole(world, torch.float32).to(test_device())
    first = ragged_param(piece(full, SIZES[world], rank).clone(), SIZES[world], full.shape)
    other = (3, 1, 4, 1)  # ranks 0 and 3 hold as many rows as in SIZES, ranks 1 and 2 do not
    second = ragged_param(piece(full, other, rank).clone(), other, full.shape)
    doubled = torch._foreach_mul([first, second], 2.0)
    assert all(isinstance(t, RaggedDTensor) for t in doubled)
    return [t.full_tensor().cpu() for t in doubled]


@needs_subclass_dispatch
def test_foreach_outputs_keep_each_inputs_split() -> None:
    full = whole(4, torch.float32)
    for rank, outputs in enumerate(run_distributed(foreach_outputs, 4)):
        assert all(torch.equal(out, full * 2) for out in outputs), rank
