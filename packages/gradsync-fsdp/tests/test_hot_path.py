"""The per-step hot path: fully_shard_optimizer's step runs on the shards' local tensors (same results,
DTensors back afterwards), and reductions into persistent grad buffers are never waited mid-backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import STRATEGIES, full_weights, local_microbatches, wrap
from torch.distributed.tensor import DTensor

from gradsync.buffers import collectives
from gradsync.fsdp import fully_shard_optimizer
from gradsync.groups.testing import run_distributed


def adam_steps(strategy: str, dtype: torch.dtype, local: bool) -> dict[str, object]:
    """Three AdamW steps, the optimizer wrapped by fully_shard_optimizer (``local``) or stepped on the
    DTensors as a plain optimizer; what the step saw and left behind."""
    main_grads = torch.float32 if dtype == torch.bfloat16 else None
    model = wrap(strategy, dtype=dtype, main_grads_dtype=main_grads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if local:
        fully_shard_optimizer(optimizer)
    seen: list[type] = []
    optimizer.register_step_pre_hook(
        lambda opt, *_: seen.extend(type(p) for g in opt.param_groups for p in g["params"])
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(local_microbatches(step, rank, world, 1)[0]).backward()
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return {
        "weights": full_weights(model),
        "seen_dtensor": any(issubclass(t, DTensor) for t in seen),
        "params_dtensor": all(isinstance(p, DTensor) for p in params),
        "state_keys_are_params": set(map(id, optimizer.state)) <= set(map(id, params)),
        "state_dtensor": all(isinstance(v, DTensor) for v in state if v.dim() > 0),
        "state_tensors": len(state),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_local_step_equals_the_step_on_dtensors(strategy: str, dtype: torch.dtype) -> None:
    plain = run_distributed(adam_steps, 2, args=(strategy, dtype, False))
    local = run_distributed(adam_steps, 2, args=(strategy, dtype, True))
    for rank, (on_dtensors, on_locals) in enumerate(zip(plain, local, strict=True)):
        assert on_dtensors["seen_dtensor"]
        assert not on_locals["seen_dtensor"]
        got, want = on_locals["weights"], on_dtensors["weights"]
        assert isinstance(got, dict)
        assert isinstance(want, dict)
        assert all(torch.equal(got[k], want[k]) for k in want), (strategy, rank)
        for key in ("params_dtensor", "state_keys_are_params", "state_dtensor"):
            assert on_locals[key], key
        assert on_locals["state_tensors"] == on_dtensors["state_tensors"]


def state_created_in_a_local_step() -> list[bool]:
    """State the optimizer creates during a local step (here after the state was dropped) comes back
    as DTensors shaped like the params; an exception inside the step leaves the DTensors in place."""
    model = wrap("optim")
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    model.finish_grad_sync()
    optimizer.state.clear()
    optimizer.step()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stepped = [(p, optimizer.state[p]["momentum_buffer"]) for p in params if p in optimizer.state]
    checks = [bool(stepped), all(isinstance(b, DTensor) and b.shape == p.shape for p, b in stepped)]

    def fail(*_: object) -> None:
        raise RuntimeError("pre-hook failure")

    handle = optimizer.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="pre-hook failure"):
        optimizer.step()
    handle.remove()
    after = [p for g in optimizer.param_groups for p in g["params"]]
    checks.append([id(p) for p in after] == [id(p) for p in params])
    checks.append(all(isinstance(optimizer.state[p]["momentum_buffer"], DTensor) for p in optimizer.state))
    return checks


def test_state_created_during_a_local_step_becomes_dtensors() -> None:
    for checks in run_distributed(state_created_in_a_local_step, 2):
        assert all(checks), checks


def waits_before_the_last_launch(strategy: str) -> int:
    """Reductions waited during the backward before its last reduction was launched, with the in-flight
    bound set to one element."""
    model = wrap(strategy, bucket_size=64)  # several buckets per unit
    model.suggested_RS_queue_capacity = 1
    loss = model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0])
    events: list[str] = []  # from here on: the backward's
    original_wait, launch = collectives.Launched.wait, model._reductions.launch

    def wait(self: collectives.Launched) -> None:
        events.append("wait")
        original_wait(self)

    def recording_launch(bucket: object) -> None:
        events.append("launch")
        launch(bucket)  # type: ignore[arg-type]

    collectives.Launched.wait = wait  # type: ignore[method-assign]
    model._reductions.launch = recording_launch  # type: ignore[method-assign]
    try:
        loss.backward()
    finally:
        collectives.Launched.wait = original_wait  # type: ignore[method-assign]
    last_launch = len(events) - events[::-1].index("launch")
    assert events.count("launch") > 2
    return events[:last_launch].count("wait")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_in_flight_bound_applies_to_temporary_grads_only(strategy: str) -> None:
    """no_shard / optim reduce persistent grad buffers: nothing to bound, and a wait would stall the
    backward. ZeRO-2/3's temporary whole-bucket grads stay bounded."""
    for waits in run_distributed(waits_before_the_last_launch, 2, args=(strategy,)):
        if strategy in ("no_shard", "optim"):
            assert waits == 0
        else:
            assert waits > 0
