"""DiLoCo on gloo ranks, each replica training on its own data: the weights equal the replicas simulated in
one process (inner Adam steps, the averaged pseudo-gradient, Nesterov outer steps written out by hand);
replicas agree right after a sync and drift apart between syncs; a low-precision wire stays near the
fp32 one; and replicas that are themselves DistributedDataParallel groups (plain or with the distributed
optimizer) synchronise over the outer group as one process per replica would. Streaming DiLoCo (the model
synced in fragments on a staggered schedule, each sync landing some inner steps late and mixed into the
local weights) equals its own hand-written replay, and each sync sends only its fragment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, flat_params, global_batch, local_microbatches, make_optimizer

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DiLoCo, DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig, ProcessGroupCollection
from gradsync.groups.testing import run_distributed

SYNC_EVERY, STEPS, OUTER_LR, OUTER_MOMENTUM = 3, 7, 0.7, 0.9  # two syncs, then one local step


def simulated(replicas: int, batch_of: Any) -> list[torch.Tensor]:
    """Every replica's weights after STEPS, in one process: ``batch_of(step, replica)`` is its data."""
    models = [TinyGPT() for _ in range(replicas)]
    inner = [make_optimizer("adam", m.parameters()) for m in models]
    synced = [p.detach().clone() for p in models[0].parameters()]
    momentum: list[torch.Tensor] | None = None
    for step in range(STEPS):
        for replica, (model, optimizer) in enumerate(zip(models, inner, strict=True)):
            optimizer.zero_grad()
            model(batch_of(step, replica)).backward()
            optimizer.step()
        if (step + 1) % SYNC_EVERY:
            continue
        moves = [sum(s - p.detach() for p in params) / replicas for s, *params in
                 zip(synced, *(m.parameters() for m in models), strict=True)]  # fmt: skip
        # torch's SGD with Nesterov momentum: buf = m * buf + g (buf = g at first); step g + m * buf
        momentum = (
            moves
            if momentum is None
            else [OUTER_MOMENTUM * b + g for b, g in zip(momentum, moves, strict=True)]
        )
        synced = [s - OUTER_LR * (g + OUTER_MOMENTUM * b) for s, g, b in
                  zip(synced, moves, momentum, strict=True)]  # fmt: skip
        with torch.no_grad():
            for model in models:
                for param, value in zip(model.parameters(), synced, strict=True):
                    param.copy_(value)
    return [flat_params(m) for m in models]


@dataclass(frozen=True)
class Streaming:
    """A Streaming DiLoCo run: ``fragments`` an int, or params' indices (in ``parameters()`` order)."""

    fragments: int | tuple[tuple[int, ...], ...]
    delay: int
    alpha: float


STREAM_EVERY, STREAM_STEPS = 4, 11
STREAMING = [
    Streaming(3, delay=0, alpha=0.0),
    Streaming(((0, 2, 4, 6, 8, 10, 12, 14), (1, 3, 5, 7, 9, 11, 13, 15)), delay=2, alpha=0.5),  # strided
    Streaming(4, delay=1, alpha=0.0),
]


def replayed_streaming(replicas: int, run: Streaming, pieces: list[list[int]]) -> list[torch.Tensor]:
    """Every replica's weights after STREAM_STEPS, in one process, written from the schedule: fragment f
    of F starts its sync after inner step t when t % H == f * H // F; its mean move lands ``delay`` inner
    steps later (a landing before a start in the same step), stepping only that fragment's synced weights
    by torch's Nesterov SGD and its momentum; each replica then keeps ``alpha`` of its own weights."""
    models = [TinyGPT() for _ in range(replicas)]
    inner = [make_optimizer("adam", m.parameters()) for m in models]
    synced = [p.detach().clone() for p in models[0].parameters()]
    momentum: dict[int, torch.Tensor] = {}
    pending: list[tuple[int, list[int], dict[int, torch.Tensor]]] = []  # (lands after, params, mean moves)

    def land(piece: list[int], moves: dict[int, torch.Tensor]) -> None:
        for i in piece:
            momentum[i] = moves[i] if i not in momentum else OUTER_MOMENTUM * momentum[i] + moves[i]
            synced[i] = synced[i] - OUTER_LR * (moves[i] + OUTER_MOMENTUM * momentum[i])
            with torch.no_grad():
                for model in models:
                    param = list(model.parameters())[i]
                    param.copy_(run.alpha * param + (1 - run.alpha) * synced[i])

    for step in range(1, STREAM_STEPS + 1):
        for replica, (model, optimizer) in enumerate(zip(models, inner, strict=True)):
            optimizer.zero_grad()
            model(local_microbatches(step - 1, replica, replicas, 1)[0]).backward()
            optimizer.step()
        if pending and pending[0][0] <= step:
            land(*pending.pop()[1:])
        for f, piece in enumerate(pieces):
            if step % STREAM_EVERY == f * STREAM_EVERY // len(pieces):
                weights = [list(m.parameters()) for m in models]
                moves = {i: sum(synced[i] - w[i].detach() for w in weights) / replicas for i in piece}
                pending.append((step + run.delay, piece, moves))
                if run.delay == 0:
                    land(*pending.pop()[1:])
    return [flat_params(m) for m in models]


def train_streaming() -> list[tuple[torch.Tensor, list[list[int]], int, list[int]]]:
    """Each rank one replica on its own batches, every STREAMING run in turn: its weights at the end, the
    fragments (params' indices), the most bytes one sync sent, and at which steps a sync was in flight."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for run in STREAMING:
        model = TinyGPT()
        params = list(model.parameters())
        fragments = (
            run.fragments
            if isinstance(run.fragments, int)
            else [[params[i] for i in piece] for piece in run.fragments]
        )
        diloco = DiLoCo(
            params, make_optimizer("adam", params), STREAM_EVERY, outer_lr=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM, fragments=fragments, fragment_sync_delay=run.delay,
            fragment_update_alpha=run.alpha,
        )  # fmt: skip
        index = {id(p): i for i, p in enumerate(params)}
        pieces = [[index[id(p)] for p in fragment.params] for fragment in diloco.fragments]
        in_flight = []
        for step in range(STREAM_STEPS):
            diloco.zero_grad()
            model(local_microbatches(step, rank, world, 1)[0]).backward()
            diloco.step()
            if diloco.in_flight is not None:
                in_flight.append(step + 1)
        results.append((flat_params(model), pieces, diloco.peak_sync_bytes, in_flight))
    return results


def test_streaming_diloco_equals_its_replay_and_sends_a_fragment_per_sync() -> None:
    sizes = [p.numel() for p in TinyGPT().parameters()]
    ranks = run_distributed(train_streaming, 2)
    for r, run in enumerate(STREAMING):
        _, pieces, _, in_flight = ranks[0][r]
        count = len(pieces)
        if isinstance(run.fragments, int):  # runs of params, in order, each about 1/F of the whole
            assert [i for piece in pieces for i in piece] == list(range(len(sizes))), pieces
            assert count == run.fragments
            assert max(sum(sizes[i] for i in piece) for piece in pieces) <= sum(sizes) / count + max(sizes)
        else:
            assert pieces == [list(piece) for piece in run.fragments]
        want = replayed_streaming(2, run, pieces)
        offsets = [f * STREAM_EVERY // count for f in range(count)]
        starts = [t for t in range(1, STREAM_STEPS + 1) if t % STREAM_EVERY in offsets]
        assert in_flight == sorted(
            {s for t in starts for s in range(t, min(t + run.delay, STREAM_STEPS + 1))}
        )
        for rank, results in enumerate(ranks):
            got, _, peak, _ = results[r]
            assert relative(got, want[rank]) <= 1e-6, (run, rank)
            assert peak == 4 * max(sum(sizes[i] for i in piece) for piece in pieces), (run, peak)
        assert not torch.equal(ranks[0][r][0], ranks[1][r][0])  # a fragment is always between syncs


def train_plain(wire_dtype: torch.dtype | None, seed_by_rank: bool = False) -> tuple[list[torch.Tensor], int]:
    """This rank's weights after every step (each rank one replica, its own batches; built from its own
    seed with ``seed_by_rank``), and the bytes its syncs sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyGPT(rank if seed_by_rank else 0)
    diloco = DiLoCo(
        model.parameters(), make_optimizer("adam", model.parameters()), SYNC_EVERY, outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM, wire_dtype=wire_dtype,
    )  # fmt: skip
    history = []
    for step in range(STEPS):
        diloco.zero_grad()
        model(local_microbatches(step, rank, world, 1)[0]).backward()
        diloco.step()
        history.append(flat_params(model))
    return history, diloco.communicated_bytes


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("world", [2, 4])
def test_diloco_equals_its_replicas_simulated_in_one_process(world: int) -> None:
    want = simulated(world, lambda step, replica: local_microbatches(step, replica, world, 1)[0])
    runs = [history for history, _ in run_distributed(train_plain, world, args=(None,))]
    for rank, history in enumerate(runs):
        assert relative(history[-1], want[rank]) <= 1e-6, rank
    for step, states in enumerate(zip(*runs, strict=True)):
        agree = all(torch.equal(states[0], s) for s in states)
        assert agree == ((step + 1) % SYNC_EVERY == 0), f"step {step}: replicas agree={agree}"


def test_replicas_built_apart_start_from_the_first_ranks_weights() -> None:
    """Seeded differently, the replicas would stay apart by their first difference after every sync;
    construction broadcasts rank 0's weights (seed 0, the simulation's), as torch DDP does."""
    want = simulated(2, lambda step, replica: local_microbatches(step, replica, 2, 1)[0])
    for rank, (history, _) in enumerate(run_distributed(train_plain, 2, args=(None, True))):
        assert relative(history[-1], want[rank]) <= 1e-6, rank


def test_a_low_precision_wire_stays_near_the_fp32_one() -> None:
    exact = run_distributed(train_plain, 2, args=(None,))
    cheap = run_distributed(train_plain, 2, args=(torch.bfloat16,))
    syncs = STEPS // SYNC_EVERY
    for (fp32, fp32_bytes), (bf16, bf16_bytes) in zip(exact, cheap, strict=True):
        assert 0 < relative(bf16[-2], fp32[-2]) <= 1e-3  # right after the second sync
        assert fp32_bytes == syncs * 4 * sum(p.numel() for p in TinyGPT().parameters())
        assert bf16_bytes == fp32_bytes // 2  # the all-to-all's packed pieces, one per rank


def train_replicated_groups(distopt: bool) -> torch.Tensor:
    """World 4: two DistributedDataParallel replicas of 2 ranks ({0, 1} and {2, 3}), joined by DiLoCo
    over {0, 2} and {1, 3}."""
    rank = dist.get_rank()
    inner_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outer_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, inner_rank = divmod(rank, 2)
    inner = inner_groups[replica]
    model = TinyGPT()
    config = DistributedDataParallelConfig(use_distributed_optimizer=distopt)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), config, model, pg_collection=ProcessGroupCollection(dp=inner, dp_cp=inner)
    )
    optimizer: Any = make_optimizer("adam", ddp.parameters())
    if distopt:
        optimizer = DistributedOptimizer(optimizer, ddp)
    diloco = DiLoCo(ddp.parameters(), optimizer, SYNC_EVERY, group=outer_groups[inner_rank],
                    outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)  # fmt: skip
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        diloco.zero_grad()
        ddp(local_microbatches(2 * step + replica, inner_rank, 2, 1)[0]).backward()
        ddp.finish_grad_sync()
        diloco.step()
    return flat_params(model)


@pytest.mark.parametrize("distopt", [False, True], ids=["ddp", "distopt"])
def test_diloco_over_the_outer_group_of_data_parallel_replicas(distopt: bool) -> None:
    want = simulated(2, lambda step, replica: global_batch(2 * step + replica, 2, 1))
    for rank, got in enumerate(run_distributed(train_replicated_groups, 4, args=(distopt,))):
        assert relative(got, want[rank // 2]) <= 1e-6, rank


def test_bad_arguments_are_refused_by_name() -> None:
    model = TinyGPT()
    optimizer = make_optimizer("adam", model.parameters())
    with pytest.raises(ValueError, match="sync_every must be at least 1 step, got 0"):
        DiLoCo(model.parameters(), optimizer, 0)
    with pytest.raises(ValueError, match=r"wire_dtype=torch\.float32 is not a wire dtype"):
        DiLoCo(model.parameters(), optimizer, 2, wire_dtype=torch.float32)
    with pytest.raises(ValueError, match="wire_block_size must be a positive number of elements, got 0"):
        DiLoCo(model.parameters(), optimizer, 2, wire_dtype=torch.float8_e4m3fn, wire_block_size=0)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="3 fragments need sync_every of at least 3 steps"):
        DiLoCo(params, optimizer, 2, fragments=3)
    with pytest.raises(
        ValueError, match=r"fragment_sync_delay must be between 0 and sync_every // fragments = 2"
    ):
        DiLoCo(params, optimizer, 4, fragments=2, fragment_sync_delay=3)
    with pytest.raises(ValueError, match=r"fragment_update_alpha must be in \[0, 1\), got 1.0"):
        DiLoCo(params, optimizer, 4, fragment_update_alpha=1.0)
    with pytest.raises(
        ValueError, match=r"hold every trainable param of params exactly once \(15 listed for 16"
    ):
        DiLoCo(params, optimizer, 4, fragments=[params[:8], params[9:]])
    with pytest.raises(ValueError, match="fragments must be between 1 and the 16 params, got 17"):
        DiLoCo(params, optimizer, 20, fragments=17)


def main_params_after_a_sync(fragments: int) -> list[bool]:
    """Each rank a replica of its own (a DDP group of one) with bf16 weights and fp32 main params: whether
    the distributed optimizer's main params equal the model's weights after each step (``fragments``: a
    Streaming DiLoCo's, each fragment's sync refreshing them)."""
    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    model = TinyGPT().to(torch.bfloat16)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), config, model, pg_collection=ProcessGroupCollection(dp=own, dp_cp=own)
    )
    optimizer = DistributedOptimizer(make_optimizer("adam", ddp.parameters()), ddp)
    diloco = DiLoCo(ddp.parameters(), optimizer, SYNC_EVERY, fragments=fragments)
    followed = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        diloco.zero_grad()
        ddp(local_microbatches(step, rank, 2, 1)[0]).backward()
        ddp.finish_grad_sync()
        diloco.step()
        followed.append(all(
            torch.equal(shard.main, shard.buffer.param_data[shard.lo : shard.hi].float())  # type: ignore[index]
            for shard in optimizer.shards
        ))  # fmt: skip
    return followed


@pytest.mark.parametrize("fragments", [1, 2], ids=["diloco", "streaming"])
def test_the_distributed_optimizers_main_params_take_the_synced_weights(fragments: int) -> None:
    """bf16 weights: the fp32 main params are a copy, which a sync must refresh (the next inner step
    starts from them); with 2 fragments (offsets 0 and 1 of 3 steps) after each fragment's sync."""
    offsets = {f * SYNC_EVERY // fragments for f in range(fragments)}
    for followed in run_distributed(main_params_after_a_sync, 2, args=(fragments,)):
        synced_steps = [step for step in range(STEPS) if (step + 1) % SYNC_EVERY in offsets]
        assert all(followed[step] for step in synced_steps), followed
        assert not all(followed), followed  # between syncs they hold more than bf16 can show
