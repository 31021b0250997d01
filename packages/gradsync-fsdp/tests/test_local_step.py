"""An optimizer built by hand on the fsdp2 API's params (torchtitan's loop: torch's AdamW and an LR scheduler
made before the first step) steps on the shards' local tensors from its second step: the same weights
as torch's own ``fully_shard`` stepping DTensors (fp32, 1e-6 relative), the scheduler still sees every
step, and an optimizer torch does not know to be element-wise is left on the DTensors."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import TinyTransformer, global_batch, local_microbatches, max_relative_difference
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from gradsync.fsdp import uneven_dtensor_to_full_tensor
from gradsync.fsdp.local_step import LENDING_ATTR
from gradsync.groups.testing import run_distributed, test_device

STEPS = 3
GRADSYNC, TORCH = "gradsync.fsdp.fsdp2", "torch.distributed.fsdp"
TORCH_FSDP2_RUNS = test_device().type != "cpu" or hasattr(torch.cpu.Stream(), "record_event")


class MomentumSGD(torch.optim.SGD):
    """A subclass: it may change the update, so nothing may assume it is element-wise."""


def hand_built_loop(api_name: str, optimizer_class: type[torch.optim.Optimizer]) -> dict[str, object]:
    api = importlib.import_module(api_name)
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = TinyTransformer().to(test_device())
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    adopted = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" among them
        for step in range(STEPS):
            (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)
            model(batch).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            adopted.append(bool(getattr(optimizer, LENDING_ATTR, False)))
    weights = {n: uneven_dtensor_to_full_tensor(p).detach().cpu() for n, p in model.named_parameters()}
    return {"weights": weights, "adopted": adopted, "lr": scheduler.get_last_lr()[0]}


def adamw_against_torch() -> None:
    ours = hand_built_loop(GRADSYNC, torch.optim.AdamW)
    assert ours["adopted"] == [True] * STEPS  # adopted at the first step's start, lending from the second
    assert ours["lr"] == pytest.approx(0.01 * 0.5**STEPS)
    if TORCH_FSDP2_RUNS:
        theirs = hand_built_loop(TORCH, torch.optim.AdamW)
        assert max_relative_difference(ours["weights"], theirs["weights"]) <= 1e-6  # type: ignore[arg-type]


def subclass_left_on_dtensors() -> None:
    assert hand_built_loop(GRADSYNC, MomentumSGD)["adopted"] == [False] * STEPS


def test_hand_built_adamw_steps_on_locals_and_matches_torch() -> None:
    run_distributed(adamw_against_torch, 2)


def test_an_optimizer_subclass_is_not_adopted() -> None:
    run_distributed(subclass_left_on_dtensors, 2)


def model_first_met_in_a_lent_step() -> dict[str, torch.Tensor]:
    """A hand-built AdamW steps model ``first`` alone once (adopted: it lends the locals from its next
    step); then ``second``'s params join it as a param group. The optimizer first meets ``second`` inside a
    lent step, holding its local tensors, and must still attach it: ``second`` keeps its weights gathered
    between steps (``reshard_after_forward=False``), so only its after-step hook refreshes them."""
    api = importlib.import_module(GRADSYNC)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(test_device().type, (world,), mesh_dim_names=("dp_shard",))
    first, second = TinyTransformer(seed=0), TinyTransformer(seed=1)
    api.fully_shard(first, mesh=mesh)
    for block in second.blocks:
        api.fully_shard(block, mesh=mesh, reshard_after_forward=False)
    api.fully_shard(second, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(first.parameters(), lr=0.01)
    for step in range(STEPS):
        (batch,) = local_microbatches(step, rank, world, 1)
        if step == 1:
            assert getattr(optimizer, LENDING_ATTR)
            optimizer.add_param_group({"params": list(second.parameters())})
        loss = first(batch) + second(batch) if step >= 1 else first(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: uneven_dtensor_to_full_tensor(p).detach().cpu() for n, p in second.named_parameters()}


def test_a_model_first_met_inside_a_lent_step_is_attached() -> None:
    """``second`` against one process training it alone on the global batches of the steps it joined."""
    got = run_distributed(model_first_met_in_a_lent_step, 2)
    reference = TinyTransformer(seed=1)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(1, STEPS):
        reference(global_batch(step, 2, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = {n: p.detach().cpu() for n, p in reference.named_parameters()}
    for weights in got:
        assert max_relative_difference(weights, want) <= 1e-6


def adam_steps(reload_state: bool) -> dict[str, torch.Tensor]:
    """Three steps of Megatron-FSDP's ``fully_shard`` with Adam; ``reload_state``: the optimizer's own
    state dict loaded back after the first (new param-group dicts, the same param lists)."""
    from fsdp_testkit import Block, full_weights

    from gradsync.fsdp import fully_shard

    module = TinyTransformer()
    model, optimizer = fully_shard(
        module, torch.optim.Adam(module.parameters(), lr=0.01), fsdp_unit_modules=[Block]
    )
    for step in range(STEPS):
        (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if reload_state and step == 0:
            optimizer.load_state_dict(optimizer.state_dict())
    return full_weights(model)


def test_a_reloaded_optimizer_state_keeps_stepping_on_locals() -> None:
    """The lending plan follows the optimizer's param groups: a load_state_dict replaces them."""
    plain = run_distributed(adam_steps, 2, args=(False,))
    reloaded = run_distributed(adam_steps, 2, args=(True,))
    for want, got in zip(plain, reloaded, strict=True):
        assert max_relative_difference(got, want) == 0.0


SCALAR_STATE_OPTIMIZERS = ("Adam", "NAdam", "ASGD")  # step; NAdam's mu_product; ASGD's eta and mu


def steps_with_empty_shards(optimizer_name: str) -> dict[str, Any]:
    """Three steps of Megatron-FSDP's ``fully_shard`` (ZeRO-1: ragged shards, so at 4 ranks many params
    have no elements on a rank) with two param groups, the second small enough to sit on one rank."""
    from fsdp_testkit import Block, full_weights

    from gradsync.fsdp import fully_shard

    module = TinyTransformer()
    alone = [module.blocks[1].norm.weight, module.blocks[1].norm.bias]
    rest = [p for p in module.parameters() if all(p is not q for q in alone)]
    optimizer_class = getattr(torch.optim, optimizer_name)
    optimizer = optimizer_class([{"params": rest}, {"params": alone, "lr": 0.02}], lr=0.01)
    model, optimizer = fully_shard(
        module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy="optim", outer_dp_sharding_strategy=0
    )
    smallest: list[int] = []  # the fewest elements of a tensor the step was handed, in a group with some

    def record_smallest(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        groups = [g["params"] for g in opt.param_groups if any(p.numel() for p in g["params"])]
        smallest.append(min(p.numel() for params in groups for p in params))

    optimizer.register_step_pre_hook(record_smallest)
    names = {id(p): name for name, p in model.named_parameters()}
    scalars = []  # after every step: the first plans the followers' copies, later ones reuse them
    for step in range(STEPS):  # the 4-rank global batch, split among the ranks
        model(global_batch(step, 4, 1).chunk(dist.get_world_size())[dist.get_rank()]).backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"]}
        scalars.append(
            {
                name: {key: float(value) for key, value in entries.items() if not isinstance(value, DTensor)}
                for name, entries in state.items()
            }
        )
    return {
        "weights": full_weights(model),
        "smallest": smallest,
        "group_elements": [sum(p._local_tensor.numel() for p in g["params"]) for g in optimizer.param_groups],
        "keys": {name: sorted(entries) for name, entries in state.items()},
        "scalars": scalars,
    }


def empty_shard_runs() -> dict[str, dict[str, Any]]:
    return {name: steps_with_empty_shards(name) for name in SCALAR_STATE_OPTIMIZERS}


def test_params_with_empty_shards_follow_their_group_and_keep_the_same_state() -> None:
    """A param with no elements on a rank is not handed to the step where a param of its group with
    elements is (the step's smallest tensor is not empty), yet its state equals every other rank's
    (step counts, NAdam's mu_product, ASGD's eta and mu) and the weights match one process's; a group
    with no elements on a rank is stepped there as it is."""
    (single,) = run_distributed(empty_shard_runs, 1)
    ranks = run_distributed(empty_shard_runs, 4)
    for name in SCALAR_STATE_OPTIMIZERS:
        runs = [run[name] for run in ranks]
        assert any(0 in run["group_elements"] for run in runs)  # some rank holds none of the small group
        for run in runs:
            assert min(run["smallest"]) > 0
            assert run["keys"] == single[name]["keys"]
            assert run["scalars"] == single[name]["scalars"]
            assert max_relative_difference(run["weights"], single[name]["weights"]) <= 1e-5


def adam_steps_with_state_reset(replace: bool) -> dict[str, Any]:
    """Four steps of ``fully_shard`` with Adam, its first moments reset to zero after the second: in place
    (``exp_avg.zero_()``), or ``replace``d by new zero DTensors, which a step must then read. Also how
    many params each step lent one by one (the others swap the whole state mapping in)."""
    from fsdp_testkit import Block, full_weights

    from gradsync.fsdp import fully_shard, local_step

    module = TinyTransformer()
    model, optimizer = fully_shard(
        module, torch.optim.Adam(module.parameters(), lr=0.01), fsdp_unit_modules=[Block]
    )
    lent_one_by_one: list[int] = []
    lend = local_step._Lent.lend

    def counted(self: Any, opt: torch.optim.Optimizer) -> None:
        lent_one_by_one[-1] += 1
        lend(self, opt)

    local_step._Lent.lend = counted  # type: ignore[method-assign]
    try:
        for step in range(4):
            (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)
            model(batch).backward()
            lent_one_by_one.append(0)
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                for state in optimizer.state.values():
                    if replace:
                        state["exp_avg"] = state["exp_avg"].detach().clone().zero_()
                    else:
                        state["exp_avg"].zero_()
    finally:
        local_step._Lent.lend = lend  # type: ignore[method-assign]
    return {"weights": full_weights(model), "lent": lent_one_by_one}


def state_reset_runs() -> dict[bool, dict[str, Any]]:
    return {replace: adam_steps_with_state_reset(replace) for replace in (False, True)}


def test_steps_swap_the_state_in_whole_unless_it_was_replaced() -> None:
    """After the first step (which creates the state), a step swaps the whole state mapping in instead of
    lending param by param; a state tensor replaced between steps is seen (the weights equal those of
    the same reset made in place, which needs no lending), and the step after it lends one by one."""
    for run in run_distributed(state_reset_runs, 2):
        in_place, replaced = run[False], run[True]
        assert max_relative_difference(replaced["weights"], in_place["weights"]) == 0.0
        lent = in_place["lent"][0]
        assert lent > 0
        assert in_place["lent"] == [lent, 0, 0, 0]
        assert replaced["lent"] == [lent, 0, lent, 0]


def sgd_state_created_late() -> tuple[list[list[str]], int]:
    """``fully_shard`` with SGD whose momentum is switched on after two steps: the third step creates the
    momentum buffers in a step that swapped the state in whole. After each step: every param's state keys,
    as callers see them, with DTensor values marked; and the number of params."""
    from fsdp_testkit import Block

    from gradsync.fsdp import fully_shard

    module = TinyTransformer()
    model, optimizer = fully_shard(
        module, torch.optim.SGD(module.parameters(), lr=0.01), fsdp_unit_modules=[Block]
    )
    seen = []
    for step in range(4):
        (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)
        model(batch).backward()
        if step == 2:
            optimizer.param_groups[0]["momentum"] = 0.9
        optimizer.step()
        optimizer.zero_grad()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        seen.append(
            sorted(
                f"{key}:{isinstance(value, DTensor)}"
                for p in params
                for key, value in optimizer.state.get(p, {}).items()
            )
        )
    return seen, len(params)


def test_state_a_swapped_step_creates_reaches_the_callers() -> None:
    """Momentum buffers created in a step that swapped the state mapping in whole are given back as
    DTensors under the params, as a step lending param by param gives them."""
    for seen, params in run_distributed(sgd_state_created_late, 2):
        assert seen[0] == seen[1] == []
        assert seen[2] == seen[3] == ["momentum_buffer:True"] * params
