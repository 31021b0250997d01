"""Shared pieces of the multi-rank buffer tests (imported by spawned ranks, so kept at module level).

Every rank contributes different grads (:func:`local_grads`), so a test passes only if the collective really
ran; expected results are computed here in closed form from every rank's inputs, never by the code under
test. :func:`with_and_without_probe` runs a sync twice, the second time under the race probe, whose async
collectives complete only when waited: a missing or misplaced wait then reads un-reduced data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import Parameter

from gradsync.buffers import (
    DistributedDataParallelConfig,
    GradBuffers,
    ParamAndGradBuffer,
    build_grad_buffers,
    collectives,
    shard_buffer,
)
from gradsync.groups import ProcessGroupCollection, destroy_process_groups, initialize_model_parallel
from gradsync.groups.testing import CollectiveProbe, delayed_collectives, test_device

# Module attributes gradsync.buffers.collectives looks up at call time, besides torch.distributed's own.
COLLECTIVE_ALIASES = ((collectives, "dist_reduce_scatter_func"), (collectives, "dist_all_gather_func"))


def device() -> torch.device:
    """Where tests build tensors: the harness's device (the CPU unless GRADSYNC_TEST_DEVICE=cuda)."""
    return test_device()


def toy_model(
    num_layers: int = 4, dim: int = 24, bias: bool = True, dtype: torch.dtype = torch.float32
) -> nn.Sequential:
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(dim, dim, bias=bias) for _ in range(num_layers)))
    return layers.to(device=device(), dtype=dtype)


@contextmanager
def model_parallel(**kwargs: Any) -> Iterator[ProcessGroupCollection]:
    groups = initialize_model_parallel(**kwargs)
    yield groups
    # Not in a ``finally``: the teardown is collective, and after a failure on one rank the others may be
    # waiting in a collective of their own, so that rank would hang there instead of reporting its error.
    # The harness kills a pool that saw a failure anyway.
    destroy_process_groups(groups)


def buffers_for(
    model: nn.Module, config: DistributedDataParallelConfig, groups: ProcessGroupCollection, **kwargs: Any
) -> GradBuffers:
    return build_grad_buffers(list(model.named_parameters()), config, groups, **kwargs)


def rank_values(numel: int, rank: int) -> torch.Tensor:
    """``(i % 7 + 1) * (rank + 1)`` in float64: distinct per rank and per position, and small integers, so
    that every partial sum over up to 8 ranks (at most 7 * 36 = 252) is exact even in bf16."""
    return (torch.arange(numel, dtype=torch.float64, device=device()) % 7 + 1) * (rank + 1)


def local_grads(buffer: ParamAndGradBuffer, rank: int) -> torch.Tensor:
    """What rank ``rank`` accumulates into ``buffer`` before the sync (float64; zero in the padding)."""
    values = rank_values(buffer.numel, rank)
    grads = torch.zeros_like(values)
    for start, end, _ in buffer.param_index_map.values():
        grads[start:end] = values[start:end]
    return grads


def fill_local_grads(buffers: GradBuffers, rank: int) -> None:
    """Write this rank's grads straight into every grad buffer (no readiness tracking)."""
    for buffer in buffers.all_buffers:
        buffer.grad_data.copy_(local_grads(buffer, rank))


def expected_grads(
    buffer: ParamAndGradBuffer,
    rank: int,
    summed_over: Sequence[int],
    factor: float,
    *,
    average: bool,
    shard: tuple[int, int] | None,
) -> torch.Tensor:
    """The grad buffer after the sync, from every rank's :func:`local_grads` in closed form.

    ``summed_over`` are the global ranks whose grads are reduced (the mean with ``average``), after each
    rank scaled its own by ``factor``. With ``shard=(index, count)`` (reduce-scatter) only that shard of each
    bucket is reduced; the others keep this rank's scaled local values.
    """
    reduced = (
        sum(
            (local_grads(buffer, r) for r in summed_over),
            torch.zeros(buffer.numel, dtype=torch.float64, device=device()),
        )
        * factor
    )
    if average:
        reduced /= len(summed_over)
    if shard is None:
        return reduced.to(buffer.grad_dtype)
    result = local_grads(buffer, rank) * factor
    index, count = shard
    for start, end in buffer.bucket_indices:
        shard_buffer(result[start:end], count)[index].copy_(shard_buffer(reduced[start:end], count)[index])
    return result.to(buffer.grad_dtype)


def emulate_backward(
    buffers: GradBuffers,
    model: nn.Module,
    value: float | Callable[[Parameter], torch.Tensor] = 1.0,
    skip: frozenset[str] = frozenset(),
) -> None:
    """What DDP's hooks do: add each param's grad to main_grad and, with overlap_grad_reduce, report it
    ready, last layer first.

    ``value`` is a number added to every element, or a function giving the param's grad.
    """
    params = list(model.named_parameters())
    for name, param in reversed(params):
        if name in skip:
            continue
        param.main_grad.add_(value if isinstance(value, float | int) else value(param))  # type: ignore[attr-defined]
        for group in buffers.all_bucket_groups:
            if param in group.params and group.ddp_config.overlap_grad_reduce:
                group.register_grad_ready(param)


def rank_grad_of(buffers: GradBuffers, rank: int) -> Callable[[Parameter], torch.Tensor]:
    """For :func:`emulate_backward`: each param's slice of :func:`local_grads`."""

    def grad(param: Parameter) -> torch.Tensor:
        (buffer,) = [b for b in buffers.all_buffers if param in b.param_index_map]
        start, end, _ = buffer.param_index_map[param]
        return local_grads(buffer, rank)[start:end].view(param.shape)

    return grad


def finish_first_iteration(buffers: GradBuffers, model: nn.Module) -> None:
    """Run the counting first iteration, so later ones dispatch from readiness."""
    emulate_backward(buffers, model)
    buffers.finish_grad_sync()
    buffers.reset()


@contextmanager
def probe_collectives(seed: int) -> Iterator[CollectiveProbe]:
    """The race probe over torch.distributed and gradsync.buffers' aliases; fails unless it deferred
    something, so a test cannot silently bypass it."""
    with delayed_collectives(seed, extra_targets=COLLECTIVE_ALIASES) as probe:
        yield probe
    assert probe.deferred > 0, "no asynchronous collective went through the race probe"
    assert probe.completed == probe.deferred


def with_and_without_probe(run: Callable[[], list[torch.Tensor]], seed: int = 0) -> list[torch.Tensor]:
    """``run()`` plainly and under the race probe; the results must be bit-identical. Returns them."""
    plain = [t.clone() for t in run()]
    with probe_collectives(seed):
        probed = [t.clone() for t in run()]
    assert len(plain) == len(probed)
    for i, (a, b) in enumerate(zip(plain, probed, strict=True)):
        assert torch.equal(a, b), f"result {i} differs under the race probe"
    return plain
