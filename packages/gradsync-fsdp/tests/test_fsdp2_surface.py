"""torch 2.15's FSDP2 surface on gradsync's ``fully_shard``: ``dp_mesh_dims``, the prefetch lists,
``set_unshard_in_backward``, manual backward finalization, ``set_post_optim_event``; each trains like one
process on the global batch (fp32, <= 1e-6) and is seen doing what it says (the gathers it starts, the
gathers it skips, when grads are handed over, the event waited). Then the API table: every ``fully_shard``
argument and every public ``FSDPModule`` method of the installed torch exists in gradsync's, with torch's
parameters, and docs/fsdp2-migration.md has a row for each.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_testkit import (
    DIM,
    MICRO_ROWS,
    VOCAB,
    Block,
    clear_torch_mesh_state,
    global_batch,
    local_microbatches,
    max_relative_difference,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

from gradsync.fsdp import uneven_dtensor_to_full_tensor
from gradsync.fsdp.bucket import BucketStatus
from gradsync.fsdp.fsdp2 import FSDPModule, fully_shard, megatron_fsdp_of
from gradsync.groups.testing import run_distributed, test_device

STEPS, MICRO = 3, 2


@dataclass(frozen=True)
class MeshDims:
    """torch's ``DataParallelMeshDims`` (2.13 on) by its fields, for a torch without it."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None


class EmbedLM(nn.Module):
    """An embedding (a unit whose backward needs no weights), two blocks, and the root's norm and head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.to(test_device())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@functools.lru_cache(maxsize=2)
def one_process(world: int) -> dict[str, torch.Tensor]:
    model = EmbedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for batch in global_batch(step, world, MICRO).split(world * MICRO_ROWS):
            (model(batch) / MICRO).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def sharded(mesh: DeviceMesh | None = None, **kwargs: Any) -> EmbedLM:
    model = EmbedLM()
    for unit in (model.embedding, *model.blocks):
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def train(model: EmbedLM, manual: bool = False, event: Any = None) -> dict[str, torch.Tensor]:
    """torchtitan's loop over microbatches; ``manual``: the root finalizes the backward itself (the first
    step asynchronously), after which the grads are there; ``event``: handed over after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    group = megatron_fsdp_of(model).dist_index.get_dp_group()
    rank, world = group.rank(), group.size()
    for step in range(STEPS):
        batches = local_microbatches(step, rank, world, MICRO)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            (model(batch) / MICRO).backward()
        if manual:
            assert all(p.grad is None for p in model.parameters()), "a backward ended the cycle by itself"
            handle = model.finalize_backward(async_op=step == 0)
            if handle is not None:
                handle.wait()
            assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        if event is not None:
            model.set_post_optim_event(event)
    return {name: uneven_dtensor_to_full_tensor(p).cpu() for name, p in model.named_parameters()}


def spmd_mesh(case: str) -> dict[str, torch.Tensor]:
    """``dp_mesh_dims`` over a whole SPMD mesh: HSDP (replicate x shard), two shard dims flattened, and
    params handed over as DTensors replicated on a mesh with a size-1 tensor-parallel dim."""
    clear_torch_mesh_state()  # torch 2.6 takes a new mesh equal to an earlier test's submesh for one
    kind, world = test_device().type, dist.get_world_size()
    dims_type: Any = getattr(torch.distributed.fsdp, "DataParallelMeshDims", MeshDims)
    if case == "hsdp":
        mesh = init_device_mesh(kind, (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dims = dims_type(shard="dp_shard", replicate="dp_replicate")
    elif case == "flattened":
        mesh = init_device_mesh(kind, (2, world // 2), mesh_dim_names=("dp_a", "dp_b"))
        dims = dims_type(shard=("dp_a", "dp_b"))
    else:
        mesh = init_device_mesh(kind, (world, 1), mesh_dim_names=("dp_shard", "tp"))
        dims = dims_type(shard="dp_shard")
    model = EmbedLM()
    if case == "dtensors":
        for owner in model.modules():
            for leaf, param in list(owner._parameters.items()):
                if param is not None:
                    replicated = distribute_tensor(param.detach(), mesh, [Replicate(), Replicate()])
                    owner._parameters[leaf] = nn.Parameter(replicated)
    for unit in (model.embedding, *model.blocks):
        fully_shard(unit, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    fsdp = megatron_fsdp_of(model)
    assert fsdp.dist_index.get_dp_group().size() == world
    if case == "hsdp":
        assert fsdp.dist_index.get_fsdp_group().size() == world // 2
    return train(model)


@pytest.mark.parametrize(("case", "world"), [("hsdp", 4), ("flattened", 4), ("dtensors", 2)])
def test_dp_mesh_dims_trains_like_one_process(case: str, world: int) -> None:
    reference = one_process(world)
    for weights in run_distributed(spmd_mesh, world, args=(case,)):
        assert max_relative_difference(weights, reference) <= 1e-6


def spmd_refusal(case: str) -> str:
    clear_torch_mesh_state()
    kind = test_device().type
    mesh = init_device_mesh(kind, (1, 2), mesh_dim_names=("dp_shard", "tp"))
    model = EmbedLM()
    try:
        if case == "unknown dim":
            fully_shard(model, mesh=mesh, dp_mesh_dims=MeshDims(shard="fsdp"))
        elif case == "tp of size 2":
            fully_shard(model, mesh=mesh, dp_mesh_dims=MeshDims(shard="dp_shard"))
        else:
            fully_shard(model, mesh=mesh, dp_mesh_dims=MeshDims(replicate="tp"))
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "nothing raised"


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("unknown dim", "must name dims of the mesh ('dp_shard', 'tp') (unknown: ['fsdp'])"),
        ("tp of size 2", "mesh dims ['tp'] are not data-parallel and have size > 1"),
        ("replicate only", "replicate dims only is data parallelism without sharding"),
    ],
)
def test_dp_mesh_dims_refusals_name_the_dims(case: str, fragment: str) -> None:
    for message in run_distributed(spmd_refusal, 2, args=(case,)):
        assert fragment in message, message


def gathers_seen(explicit: bool) -> list[str]:
    """The order of the first step's gathers (those that start) and releases, with budgeted prefetch off:
    ``explicit`` lists prefetch both blocks from the embedding in forward, and the first block from the
    last one in backward."""
    model = sharded()
    fsdp = megatron_fsdp_of(model)
    fsdp.suggested_AG_prefetch_size = 0
    names = {
        id(unit): name
        for name, unit in (
            ("embedding", model.embedding),
            *((f"block{i}", b) for i, b in enumerate(model.blocks)),
        )
    }
    events: list[str] = []
    for unit_id, unit in enumerate(fsdp.units):
        for bucket in fsdp.buckets:
            if bucket.spec.unit_id == unit_id:
                _spy(bucket, names[id(unit)], events)
    if explicit:
        model.embedding.set_modules_to_forward_prefetch([model.blocks[0], model.blocks[1]])
        model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    train(model)
    return events


def _spy(bucket: Any, name: str, events: list[str]) -> None:
    launch, release = bucket.launch_gather, bucket.release

    def launch_gather() -> None:
        if bucket.status is BucketStatus.EMPTY:
            events.append(f"gather {name}")
        launch()

    def released() -> None:
        if bucket.status is not BucketStatus.EMPTY:
            events.append(f"release {name}")
        release()

    bucket.launch_gather, bucket.release = launch_gather, released


def test_prefetch_lists_gather_the_listed_units_first() -> None:
    budgeted_off = run_distributed(gathers_seen, 2, args=(False,))[0]
    explicit = run_distributed(gathers_seen, 2, args=(True,))[0]
    forward = ["gather embedding", "release embedding", "gather block0", "release block0", "gather block1"]
    assert budgeted_off[:5] == forward
    # the embedding's gather starts both blocks' before it is released
    assert explicit[:4] == ["gather embedding", "gather block0", "gather block1", "release embedding"]
    # backward: block1 is kept from its forward; block0's gather starts before block1 is released
    backward = explicit[explicit.index("gather block1") + 2 :]
    assert backward.index("gather block0") < backward.index("release block1"), explicit


def prefetched_training() -> dict[str, torch.Tensor]:
    model = sharded()
    megatron_fsdp_of(model).suggested_AG_prefetch_size = 0
    model.embedding.set_modules_to_forward_prefetch([model.blocks[0], model.blocks[1]])
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0], model.embedding])
    return train(model)


def unsharded_in_backward() -> tuple[list[str], dict[str, torch.Tensor]]:
    model = sharded()
    fsdp = megatron_fsdp_of(model)
    events: list[str] = []
    for bucket in fsdp.buckets:
        if bucket.spec.unit_id == 0:
            _spy(bucket, "embedding", events)
    model.embedding.set_unshard_in_backward(False)
    weights = train(model)
    return events, weights


def manual_finalization() -> dict[str, torch.Tensor]:
    model = sharded()
    model.set_manual_backward_finalization(True)
    model.set_is_last_backward(True)  # superseded
    return train(model, manual=True)


class Event:
    """A stand-in for ``torch.Event`` that counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def with_post_optim_event() -> tuple[int, dict[str, torch.Tensor]]:
    event = Event()
    weights = train(sharded(), event=event)
    return event.waits, weights


def test_prefetch_lists_train_like_one_process() -> None:
    for weights in run_distributed(prefetched_training, 2):
        assert max_relative_difference(weights, one_process(2)) <= 1e-6


def test_a_unit_not_unsharded_in_backward_is_gathered_in_forward_only() -> None:
    for events, weights in run_distributed(unsharded_in_backward, 2):
        assert events.count("gather embedding") == STEPS * MICRO, events
        assert max_relative_difference(weights, one_process(2)) <= 1e-6


def test_manual_finalization_hands_grads_over_at_finalize_backward() -> None:
    for weights in run_distributed(manual_finalization, 2):
        assert max_relative_difference(weights, one_process(2)) <= 1e-6


def test_the_post_optim_event_is_waited_at_the_next_forward() -> None:
    for waits, weights in run_distributed(with_post_optim_event, 2):
        assert waits == STEPS - 1  # each step's event waited at the next step's first forward
        assert max_relative_difference(weights, one_process(2)) <= 1e-6


def method_refusals() -> list[str]:
    model = sharded()
    messages = []
    for call in (
        lambda: model.blocks[0].set_manual_backward_finalization(True),
        lambda: model.set_unshard_in_backward(False),
        lambda: model.blocks[0].set_modules_to_forward_prefetch([model]),
        lambda: model.set_post_optim_event(object()),
        lambda: model.set_keep_unsharded_storage(True),
    ):
        try:
            call()
            messages.append("nothing raised")
        except (ValueError, TypeError, NotImplementedError) as err:
            messages.append(str(err))
    return messages


def test_methods_refuse_what_does_not_apply_by_name() -> None:
    for messages in run_distributed(method_refusals, 2):
        assert "call it on the root FSDP module" in messages[0]
        assert "set_unshard_in_backward on the root" in messages[1]
        assert "is the root, whose own params are gathered" in messages[2]
        assert "event must be a torch.Event, not object" in messages[3]
        assert "fsdp_double_buffer=True" in messages[4]


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(cls).items()
        if callable(fn) and not name.startswith("_")
    }


def test_every_torch_fsdp2_argument_and_method_is_there_with_torchs_parameters() -> None:
    ours = inspect.signature(fully_shard).parameters
    for name, parameter in inspect.signature(torch_fully_shard).parameters.items():
        assert name in ours, name
        assert ours[name].kind == parameter.kind, name
    mine = {name: inspect.signature(getattr(FSDPModule, name)) for name in _public_methods(TorchFSDPModule)}
    for name, theirs in _public_methods(TorchFSDPModule).items():
        wanted = [(p.name, p.kind) for p in theirs.parameters.values()]
        got = [(p.name, p.kind) for p in mine[name].parameters.values()]
        if got != [
            ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            ("args", inspect.Parameter.VAR_POSITIONAL),
            ("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]:
            assert got == wanted, name  # a refused method takes anything and raises


def test_the_migration_table_has_a_row_per_argument_and_method() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "fsdp2-migration.md").read_text()
    rows = {
        cell for line in doc.splitlines() if line.startswith("| ") for cell in re.findall(r"`([a-z_]+)", line)
    }
    names = [*inspect.signature(torch_fully_shard).parameters, *_public_methods(TorchFSDPModule)]
    assert [name for name in names if name not in rows] == []
