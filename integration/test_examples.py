"""The runnable examples under examples/: each runs under torchrun on 2 CPU ranks and matches one process
on the whole batch, and the README's quick start is cut from it (every paragraph of its code block is a run
of the example's lines, the body of ``main`` read one level out), so the two cannot drift."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_DDP = ROOT / "examples" / "megatron_ddp.py"
FSDP2_LLAMA = ROOT / "examples" / "fsdp2_llama.py"


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_process_losses(example: ModuleType, world: int) -> list[float]:
    """The example's model, optimizer and data in one process, every rank's rows in one batch."""
    model = example.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=example.LR)
    losses = []
    for step in range(example.STEPS):
        rows = [example.batch(step, rank) for rank in range(world)]
        inputs, targets = (torch.cat(parts) for parts in zip(*rows, strict=True))
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def launched(example: Path, **env: str) -> str:
    """What rank 0 printed, under torchrun on 2 CPU ranks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*command, str(example)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def printed_losses(stdout: str, prefix: str = "step") -> list[float]:
    return [float(m.group(1)) for m in re.finditer(rf"^{prefix} \d+ loss (\S+)$", stdout, re.MULTILINE)]


def test_the_megatron_ddp_example_trains_as_one_process() -> None:
    printed = printed_losses(launched(MEGATRON_DDP))
    want = one_process_losses(load(MEGATRON_DDP), 2)
    assert len(printed) == len(want)
    assert len(set(printed)) > 1  # it does train: the losses move
    for got, expected in zip(printed, want, strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected), (printed, want)


def one_process_llama_losses(example: ModuleType, world: int, steps: int) -> list[float]:
    """The Llama example's model and AdamW in one process, every rank's rows in one batch: the mean loss
    over all tokens is the mean of the ranks' means (each rank holds as many tokens)."""
    model = example.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=example.LR)
    losses = []
    for step in range(steps):
        tokens = torch.cat([example.batch(step, rank) for rank in range(world)])
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_the_fsdp2_llama_example_trains_and_resumes_as_one_process(tmp_path: Path) -> None:
    """Every step's loss, and those of the two steps after the DCP save and load into a fresh sharded
    model (the second shows the optimizer state came back), equal one process training on, uninterrupted."""
    pytest.importorskip("transformers")
    stdout = launched(FSDP2_LLAMA, CHECKPOINT_DIR=str(tmp_path / "checkpoint"))
    example = load(FSDP2_LLAMA)
    printed = printed_losses(stdout) + printed_losses(stdout, "resumed step")
    want = one_process_llama_losses(example, 2, example.STEPS + 2)
    assert len(printed) == len(want) == example.STEPS + 2, stdout
    assert len(set(printed)) > 1  # it does train: the losses move
    for got, expected in zip(printed, want, strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected), (printed, want)


def code_block_after(heading: str, text: str) -> str:
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


@pytest.mark.parametrize(
    ("heading", "example"), [("## Quick start A", MEGATRON_DDP), ("## Quick start B", FSDP2_LLAMA)]
)
def test_the_readmes_quick_start_is_cut_from_its_example(heading: str, example: Path) -> None:
    block = code_block_after(heading, (ROOT / "README.md").read_text())
    lines = example.read_text().splitlines()
    one_level_out = [line.removeprefix("    ") for line in lines]
    paragraphs = [p.splitlines() for p in block.strip("\n").split("\n\n")]
    assert len(paragraphs) >= 3  # the imports, and the loop
    for paragraph in paragraphs:
        found = any(
            source[i : i + len(paragraph)] == paragraph
            for source in (lines, one_level_out)
            for i in range(len(source))
        )
        assert found, (
            f"README's {heading[3:]} holds lines {example.name} does not, in this order:\n{paragraph}"
        )
