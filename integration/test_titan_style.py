"""torchtitan-style training (:mod:`titan_style`) with gradsync's ``fully_shard`` against torch FSDP2 on the
same seed, 2 ranks: meta init, divide factor 1 with the loss over global tokens, a chunked cross-entropy,
fp32 losses and grad norms within 1e-6 of torch's at every step, bf16 within the measured bound; a DCP
checkpoint saved by one and resumed by the other, both ways, continuing as the uninterrupted run. Runs on
torches whose own ``fully_shard`` runs on the CPU (not 2.6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from titan_style import GRADSYNC, TORCH, Args, losses_and_norms, make_optimizer, parallelize, relative
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from gradsync.groups.testing import run_distributed, test_device

STEPS, SAVED_AT = 6, 3
# measured (2026-12-07, torch 2.13 CPU, 2 ranks): bf16 losses and grad norms equal torch's at every step, fp32
# losses equal and grad norms within 1.5e-7; the bf16 bound leaves room for another torch's rounding
BF16_BOUND = 1e-3
pytestmark = pytest.mark.skipif(
    test_device().type == "cpu" and not hasattr(torch.cpu.Stream(), "record_event"),
    reason="torch's own fully_shard does not run on this torch's CPU (2.6)",
)


def mesh() -> object:
    return init_device_mesh(test_device().type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def trained(api: str, fused_qkv: bool, param_dtype: torch.dtype | None) -> list[tuple[float, float]]:
    args = Args(fused_qkv=fused_qkv)
    model = parallelize(api, args, mesh(), param_dtype, seed=0)  # type: ignore[arg-type]
    return losses_and_norms(model, make_optimizer(model), range(STEPS))


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["separate-qkv", "fused-qkv"])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_trains_as_torch_fsdp2(fused_qkv: bool, param_dtype: torch.dtype | None) -> None:
    ours = run_distributed(trained, 2, args=(GRADSYNC, fused_qkv, param_dtype))[0]
    theirs = run_distributed(trained, 2, args=(TORCH, fused_qkv, param_dtype))[0]
    bound = 1e-6 if param_dtype is None else BF16_BOUND
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(ours, theirs, strict=True)):
        assert relative(loss, want_loss) <= bound, (step, loss, want_loss)
        assert relative(norm, want_norm) <= bound, (step, norm, want_norm)
    assert theirs[-1][0] < theirs[0][0] - 0.05, "the run no longer learns: the comparison shows little"


def saved(api: str, directory: str) -> list[tuple[float, float]]:
    """Train to SAVED_AT, save model and optimizer as torchtitan does, and go on uninterrupted."""
    model = parallelize(api, Args(), mesh(), None, seed=0)  # type: ignore[arg-type]
    optimizer = make_optimizer(model)
    history = losses_and_norms(model, optimizer, range(SAVED_AT))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)
    return history + losses_and_norms(model, optimizer, range(SAVED_AT, STEPS))


def resumed(api: str, directory: str) -> list[tuple[float, float]]:
    """A fresh model from another seed, loaded from the checkpoint, trained from SAVED_AT."""
    model = parallelize(api, Args(), mesh(), None, seed=1)  # type: ignore[arg-type]
    optimizer = make_optimizer(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return losses_and_norms(model, optimizer, range(SAVED_AT, STEPS))


@pytest.mark.parametrize(
    ("saver", "loader"), [(GRADSYNC, TORCH), (TORCH, GRADSYNC)], ids=["to-torch", "from-torch"]
)
def test_a_dcp_checkpoint_resumes_in_the_other(saver: str, loader: str, tmp_path: Path) -> None:
    directory = str(tmp_path / "step3")
    uninterrupted = run_distributed(saved, 2, args=(saver, directory))[0]
    after = run_distributed(resumed, 2, args=(loader, directory))[0]
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(
        zip(after, uninterrupted[SAVED_AT:], strict=True)
    ):
        assert relative(loss, want_loss) <= 1e-6, (SAVED_AT + step, loss, want_loss)
        assert relative(norm, want_norm) <= 1e-6, (SAVED_AT + step, norm, want_norm)
