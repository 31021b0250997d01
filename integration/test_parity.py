"""Every strategy on every layout equals the single-process reference: the loss at every step and the
final params (TP shards concatenated, pipeline stages and experts merged, the tied copy equal to wte)."""

from __future__ import annotations

import os

import pytest
import torch
from parity import FULL_LAYOUTS, LAYOUTS, options, reference, reference_key
from toygpt.full_state import TIED_COPY_KEY
from toygpt.strategies import STRATEGIES
from train import Options, RunResult, run

from gradsync.groups.testing import run_distributed

FULL = os.environ.get("GRADSYNC_INTEGRATION_FULL") == "1"
CASES = {**LAYOUTS, **(FULL_LAYOUTS if FULL else {})}
LOSS_TOLERANCE = 1e-5  # relative, per step: fp32 sums in another order, nothing more
PARAM_TOLERANCE = 1e-5  # max |difference| / max(max |reference|, INIT_STD), per param
INIT_STD = 0.02  # a floor for params that stay near zero (k's bias: its grad is zero up to rounding)


def train_and_collect(opts: Options) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    result: RunResult = run(opts)
    return result.losses, result.full_params


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("layout", list(CASES))
def test_matches_single_process(layout: str, strategy: str) -> None:
    world, overrides = CASES[layout]
    opts = options(strategy, overrides)
    losses, params = run_distributed(train_and_collect, world, args=(opts,))[0]
    expected_losses, expected_params = reference(reference_key(opts))
    assert params is not None
    for step, (got, want) in enumerate(zip(losses, expected_losses, strict=True), start=1):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), f"step {step}: loss {got} != reference {want}"
    tied_copy = params.pop(TIED_COPY_KEY, None)
    if tied_copy is not None:
        assert torch.equal(tied_copy, params["wte.weight"]), "the last stage's tied copy drifted from wte"
    assert params.keys() == expected_params.keys()
    for name, want in expected_params.items():
        difference = float((params[name] - want).abs().max() / max(float(want.abs().max()), INIT_STD))
        assert difference <= PARAM_TOLERANCE, f"{name}: relative difference {difference:.2e}"
