"""torch DDP's comm hooks on MegatronFSDP, gloo ranks with different data: torch's own ``allreduce_hook``
trains every strategy as one process on the global batch (even, ragged and coalesced buckets); torch's
``powerSGD_hook`` starts as a plain all-reduce, then sends a fraction of the bytes and trains as well;
gradsync's ``low_precision_hook`` lands the same bits as the ``grad_comm_dtype`` config field; refusals
name the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    TinyTransformer,
    Trainer,
    cached_reference,
    full_weights,
    global_batch,
    max_relative_difference,
    wrap,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from gradsync.buffers import LowPrecisionHookState, low_precision_hook
from gradsync.buffers.testing import issued_collectives
from gradsync.groups.testing import run_distributed

STEPS = 6


def hook_of(kind: str) -> tuple[Any, Any]:
    """``(state, hook)`` for ``kind``; ``(None, None)`` for no hook."""
    if kind == "allreduce":
        return None, default_hooks.allreduce_hook
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1.5
        )
        return state, powerSGD_hook.powerSGD_hook
    if kind.endswith("-wrapper"):  # torch's wrappers cast the bucket into a copy they swap in
        wrapper = getattr(default_hooks, f"{kind.removesuffix('-wrapper')}_compress_wrapper")
        return None, wrapper(default_hooks.allreduce_hook)
    if kind.startswith("wire-"):
        dtype = torch.bfloat16 if kind == "wire-bf16" else torch.float8_e4m3fn
        return LowPrecisionHookState(None, dtype, error_feedback=kind == "wire-fp8-ef"), low_precision_hook
    return None, None


def held_out_loss(weights: dict[str, torch.Tensor]) -> float:
    """The loss of a plain model holding ``weights`` on a batch no step trained on."""
    model = TinyTransformer()
    model.load_state_dict(weights, strict=False)  # the tied head is the embedding
    with torch.no_grad():
        return float(model(global_batch(STEPS + 1, 2, 1)))


def train(strategy: str, kind: str, layout: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The full weights after training and the grad-reduction bytes this rank sent each step."""
    trainer = Trainer.build(strategy, **layout)
    state, hook = hook_of(kind)
    if hook is not None:
        trainer.model.register_comm_hook(state, hook)
    sent = []
    for step in range(STEPS):
        with issued_collectives() as seen:
            trainer.step(step, 1)
        sent.append(sum(c.nbytes for c in seen if c.kind not in ("all_gather", "broadcast")))  # gathers
    weights = full_weights(trainer.model)
    flat = torch.cat([w.reshape(-1) for w in weights.values()])
    replicas = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, flat)
    assert all(torch.equal(r, flat) for r in replicas), "the replicas' weights differ"
    return weights, sent


LAYOUTS = [
    *((strategy, 2, {}) for strategy in STRATEGIES),
    ("optim_grads_params", 4, {"shard_alignment": "tensor"}),  # ragged shards: one per whole matrix
    ("optim_grads", 2, {"overlap_grad_reduce": False, "units": False}),  # buckets that coalesce
]


@pytest.mark.parametrize(("strategy", "world", "layout"), LAYOUTS, ids=str)
def test_torchs_allreduce_hook_trains_as_one_process(
    strategy: str, world: int, layout: dict[str, Any]
) -> None:
    for weights, _ in run_distributed(train, world, args=(strategy, "allreduce", layout)):
        assert max_relative_difference(weights, cached_reference(world, 1, STEPS)) <= 1e-6


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_torchs_allreduce_hook_under_the_bf16_recipe_lands_the_plain_reductions_bits(strategy: str) -> None:
    """bf16 weights, fp32 main grads: the hook averages the fp32 grads that the backend's own reduction
    would have summed after scaling by 1/dp, the same values at a power-of-two group size."""
    recipe = {"dtype": torch.bfloat16, "main_grads_dtype": torch.float32}
    plain = run_distributed(train, 2, args=(strategy, "none", recipe))
    hooked = run_distributed(train, 2, args=(strategy, "allreduce", recipe))
    for (want, _), (got, _) in zip(plain, hooked, strict=True):
        assert all(torch.equal(w, w.bfloat16().float()) for w in want.values())  # bf16 weights, read as fp32
        assert max_relative_difference(want, cached_reference(2, 1, STEPS)) > 1e-4
        assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_torchs_powersgd_hook_compresses_after_its_start_iteration(strategy: str) -> None:
    plain = run_distributed(train, 2, args=(strategy, "allreduce", {}))
    compressed = run_distributed(train, 2, args=(strategy, "powersgd", {}))
    for (exact, exact_sent), (weights, sent) in zip(plain, compressed, strict=True):
        assert sent[:2] == exact_sent[:2]  # before start_powerSGD_iter: plain all-reduce
        assert max(sent[2:]) < 0.5 * exact_sent[2]  # then rank-2 factors instead of whole matrices
        exact_loss, loss = held_out_loss(exact), held_out_loss(weights)
        assert abs(loss - exact_loss) <= 0.02 * exact_loss  # it trains as well
        assert max_relative_difference(weights, exact) > 1e-4  # and it is not the plain all-reduce


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [("no_shard", "wire-bf16"), ("no_shard", "wire-fp8-ef"), ("optim_grads_params", "wire-bf16")],
)
def test_the_low_precision_hook_lands_the_config_wires_bits(strategy: str, kind: str) -> None:
    """Against no_shard's all-reduce through the config's wire, each bucket alone (a hook is handed one
    bucket at a time; coalesced buckets would cut fp8's blocks elsewhere). ZeRO-3 keeps its shard of the
    hook's all-reduced bucket, so only its unblocked bf16 wire lands the same bits."""
    wire: dict[str, Any] = {"wire": torch.bfloat16 if kind == "wire-bf16" else torch.float8_e4m3fn}
    wire["grad_comm_error_feedback"] = kind == "wire-fp8-ef"
    apart = {"bucket_size": 1}  # no two buckets coalesce
    by_config = run_distributed(train, 2, args=("no_shard", "none", {**wire, **apart}))
    by_hook = run_distributed(train, 2, args=(strategy, kind, apart))
    for (want, _), (got, _) in zip(by_config, by_hook, strict=True):
        assert (
            max_relative_difference(want, cached_reference(2, 1, STEPS)) > 1e-6
        )  # the wire is really low-precision
        assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("kind", ["bf16-wrapper", "fp16-wrapper"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_torchs_compress_wrappers_land_the_mean_in_the_bucket(strategy: str, kind: str) -> None:
    """The wrapper's future holds its cast copy; the mean must land in the bucket (``train`` checks the
    replicas agree: each rank's own grads would set them apart)."""
    for weights, _ in run_distributed(train, 2, args=(strategy, kind, {})):
        assert 1e-6 < max_relative_difference(weights, cached_reference(2, 1, STEPS)) <= 1e-2


def refusals() -> list[str]:
    messages = []
    for strategy, config in [
        ("optim_grads", {"wire": torch.bfloat16}),
        ("optim", {"outer": 2}),
    ]:
        model = wrap(strategy, **config)
        with pytest.raises((NotImplementedError, ValueError)) as caught:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        messages.append(str(caught.value))
    model = wrap("optim_grads")
    with pytest.raises(TypeError, match="the hook must be callable, got NoneType"):
        model.register_comm_hook(None, None)  # type: ignore[arg-type]
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="can only be called once"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return messages


def test_hooks_are_refused_where_they_cannot_work() -> None:
    for wire, hsdp in run_distributed(refusals, 4):
        assert "grad_comm_dtype already sets how buckets are reduced" in wire
        assert "HSDP reduces in two stages" in hsdp
