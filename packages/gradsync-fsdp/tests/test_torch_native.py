"""torch's own DTensor ops on gradsync's shards, each against the same op on the whole tensors of one
process: ``clip_grad_norm_`` for every strategy and shard-alignment policy (every rank holds a grad, empty
where it owns no rows, so torch's collectives line up); ``full_tensor()``, ``redistribute()`` and torch's
own scatter for every policy (``chunk`` shards follow torch's ``Shard(0)`` rule, the others are
``RaggedDTensor``s); plain DCP across policies and sizes; and the refusals where the chunk rule cannot
hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_testkit import (
    STRATEGIES,
    TinyTransformer,
    full_weights,
    global_batch,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    skip_where_torch_gathers_crash,
    wrap,
)
from test_dcp import train  # the same DP-size-independent global batches
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from gradsync.buffers.shard_alignment import CHUNK
from gradsync.fsdp import compute_bucket_layout, fully_shard_optimizer, uneven_dtensor_to_full_tensor
from gradsync.fsdp.ragged import RaggedDTensor, reshard
from gradsync.fsdp.torch_internals import HAS_SHARD_ORDER
from gradsync.groups.testing import run_distributed

MAX_NORM = 0.05  # below the grads' norm, so clipping scales them
POLICIES = {
    "row": None,
    "tensor": "tensor",
    "mixed": {"blocks.*.up.weight": "block:4x6", "blocks.*.down.weight": "tensor", "*.bias": "chunk"},
    "chunk": "chunk",
    "matrices": {"blocks.*.up.weight": "block:4x6", "blocks.*.down.weight": "tensor"},  # HFSDP: no chunk
}

NEEDS_SHARD_ORDER = pytest.mark.skipif(
    not HAS_SHARD_ORDER,
    reason="HFSDP's shards are plain DTensors on a torch without shard order (2.6): torch's full_tensor() "
    "cannot gather them (gradsync.fsdp.uneven_dtensor does, as test_uneven_dtensor checks)",
)


def reference_clipped(world: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole global batch: the total norm and the clipped grads."""
    model = TinyTransformer()
    model(global_batch(0, world, 1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(norm), grads


def clipped(strategy: str, alignment: Any) -> tuple[float, dict[str, torch.Tensor]]:
    model = wrap(strategy, shard_alignment=alignment)
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    model.finish_grad_sync()
    params = list(model.parameters())
    assert all(isinstance(p.grad, DTensor) for p in params), "a rank without a grad desynchronises torch"
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    assert isinstance(norm, DTensor)
    grads = {
        n.removeprefix("module."): uneven_dtensor_to_full_tensor(p.grad).cpu()
        for n, p in model.named_parameters()
    }
    return float(norm.full_tensor()), grads


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_grad_norm_equals_one_process(strategy: str, policy: str) -> None:
    want_norm, want_grads = reference_clipped(2)
    for rank, (norm, grads) in enumerate(run_distributed(clipped, 2, args=(strategy, POLICIES[policy]))):
        assert norm == pytest.approx(want_norm, rel=1e-6), rank
        assert max_relative_difference(grads, want_grads) <= 1e-6, rank


def native_ops(strategy: str, alignment: Any, outer: str | None) -> dict[str, Any]:
    """After two steps: torch's own ops on every param, and the whole weights gathered gradsync's way to
    compare them with."""
    config = {"outer_dp_sharding_strategy": outer} if outer else {}
    outer_ranks = dist.get_world_size() // 2 if outer else 1  # a 3 x 2 mesh at 6 ranks
    model = wrap(strategy, shard_alignment=alignment, outer=outer_ranks, **config)
    optimizer = fully_shard_optimizer(make_optimizer(model.parameters()))
    for step in range(2):
        model(local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    out: dict[str, Any] = {"whole": full_weights(model), "kinds": set(), "ops": {}, "state": {}}
    for prefixed, param in model.named_parameters():
        name = prefixed.removeprefix("module.")
        mesh = param.device_mesh
        ragged = isinstance(param, RaggedDTensor)
        split = list(param.ragged_placements if ragged else param.placements)
        order = param.mesh_dim_order if ragged else None
        full = param.full_tensor().detach()
        replicated = param.redistribute(mesh, [Replicate()] * mesh.ndim)
        again = reshard(replicated, split, mesh_dim_order=order)
        # torch's own chunking of the whole tensor, then into this param's split: exactly this rank's shard
        by_rows = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
        native = reshard(distribute_tensor(full, mesh, by_rows), split, mesh_dim_order=order)
        by_column = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
        by_column = param.redistribute(mesh, by_column).full_tensor() if param.ndim > 1 else full
        out["kinds"].add(type(param).__name__)
        momentum = optimizer.state[param]["momentum_buffer"]  # fully_shard_optimizer's state keeps the split
        out["state"][name] = (momentum.full_tensor().cpu(), uneven_dtensor_to_full_tensor(momentum).cpu())
        out["ops"][name] = (
            full.cpu(),
            replicated.to_local().detach().cpu(),
            by_column.detach().cpu(),
            torch.equal(native.to_local(), param.to_local())
            and torch.equal(again.to_local(), param.to_local()),
        )
    return out


@pytest.mark.parametrize(
    ("world", "strategy", "policy", "outer"),
    [
        (2, "optim", "chunk", None),
        (4, "optim_grads", "chunk", None),
        (2, "optim_grads_params", "chunk", None),
        (4, "optim_grads_params", "row", None),
        (2, "optim", "tensor", None),
        (2, "optim_grads", "mixed", None),
        (4, "optim_grads_params", "mixed", None),
        (4, "optim_grads_params", "row", "no_shard"),  # HSDP: (Replicate, shard) over a 2 x 2 mesh
        pytest.param(4, "optim_grads_params", "row", "optim", marks=NEEDS_SHARD_ORDER),  # HFSDP: (shard,
        # shard), the inner dim cutting first
        pytest.param(
            6, "optim_grads_params", "matrices", "optim", marks=NEEDS_SHARD_ORDER
        ),  # 3 outer x 2 inner
    ],
)
def test_native_ops_on_every_policy(world: int, strategy: str, policy: str, outer: str | None) -> None:
    """``full_tensor()``, ``redistribute()`` (to Replicate, to Shard(1), back) and torch's own scatter on
    the optimizer's params equal the whole weights; ``chunk`` shards are torch's ``Shard(0)`` DTensors, the
    other policies' uneven ones (and all of HFSDP's) ``RaggedDTensor``s."""
    skip_where_torch_gathers_crash(world)
    for rank, out in enumerate(run_distributed(native_ops, world, args=(strategy, POLICIES[policy], outer))):
        for name, whole in out["whole"].items():
            if name == "head.weight":  # tied: the embedding's
                continue
            full, replicated, by_column, native = out["ops"][name]
            assert torch.equal(full, whole), (rank, name)
            assert torch.equal(replicated, whole), (rank, name)
            assert torch.equal(by_column, whole), (rank, name)
            assert native, (rank, name)
            native_state, gathered_state = out["state"][name]
            assert torch.equal(native_state, gathered_state), (rank, name)
        assert ("RaggedDTensor" in out["kinds"]) == (policy != "chunk"), (rank, out["kinds"])


def save_plainly(alignment: Any, directory: str) -> dict[str, torch.Tensor]:
    """DCP straight from the state dicts, as an FSDP2 user writes it; then two more steps."""
    model = wrap("optim_grads_params", shard_alignment=alignment)
    optimizer = fully_shard_optimizer(make_optimizer(model.parameters()))
    train(model, optimizer, range(3))
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=directory)
    train(model, optimizer, range(3, 5))
    return full_weights(model)


def load_plainly(alignment: Any, directory: str) -> dict[str, torch.Tensor]:
    model = wrap("optim_grads_params", shard_alignment=alignment, seed=1)
    optimizer = fully_shard_optimizer(make_optimizer(model.parameters()))
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    train(model, optimizer, range(3, 5))
    return full_weights(model)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((4, "chunk"), (2, None)), ((2, "tensor"), (4, "chunk")), ((2, "chunk"), (2, "chunk"))],
)
def test_checkpoints_reshard_across_policies_and_sizes(
    saved: tuple[int, Any], loaded: tuple[int, Any], tmp_path: Path
) -> None:
    directory = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(save_plainly, saved[0], args=(saved[1], directory))[0]
    for rank, weights in enumerate(run_distributed(load_plainly, loaded[0], args=(loaded[1], directory))):
        assert max_relative_difference(weights, uninterrupted) <= 1e-6, rank


def refused_under_outer_optim() -> str:
    try:
        wrap("optim_grads_params", shard_alignment="chunk", outer=2, outer_dp_sharding_strategy="optim")
    except ValueError as error:
        return str(error)
    return "accepted"


def test_chunk_is_refused_where_torch_rule_cannot_hold() -> None:
    for message in run_distributed(refused_under_outer_optim, 4):
        assert "'chunk'" in message
        assert "use 'row', 'tensor' or 'block'" in message


def test_every_rank_holds_shards_torch_would_give() -> None:
    """The layout alone: a chunk param's shard of a 37-row matrix over 4 ranks is 10, 10, 10, 7 rows."""
    layout = compute_bucket_layout([torch.Size([37, 12])], 4, [CHUNK])
    assert [layout.local_rows(0, r)[1] - layout.local_rows(0, r)[0] for r in range(4)] == [
        len(c) for c in torch.arange(37).chunk(4)
    ]
    layout = compute_bucket_layout([torch.Size([5, 3])], 4, [CHUNK])  # torch.chunk: 2, 2, 1, 0
    assert [layout.local_rows(0, r)[1] - layout.local_rows(0, r)[0] for r in range(4)] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="bucket of its own"):
        compute_bucket_layout([torch.Size([5, 3]), torch.Size([4])], 4, [CHUNK, CHUNK])
