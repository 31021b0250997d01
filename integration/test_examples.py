"""The runnable examples under examples/: each runs under torchrun on 2 CPU ranks and matches one process
on the whole batch, and the README's quick start is cut from it (every paragraph of its code block is a run
of the example's lines, the body of ``main`` read one level out), so the two cannot drift."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_DDP = ROOT / "examples" / "megatron_ddp.py"


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


def test_the_megatron_ddp_example_trains_as_one_process() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*command, str(MEGATRON_DDP)], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    printed = [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)$", result.stdout, re.MULTILINE)]
    want = one_process_losses(load(MEGATRON_DDP), 2)
    assert len(printed) == len(want)
    assert len(set(printed)) > 1  # it does train: the losses move
    for got, expected in zip(printed, want, strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected), (printed, want)


def code_block_after(heading: str, text: str) -> str:
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_the_readmes_quick_start_a_is_cut_from_the_example() -> None:
    block = code_block_after("## Quick start A", (ROOT / "README.md").read_text())
    lines = MEGATRON_DDP.read_text().splitlines()
    one_level_out = [line.removeprefix("    ") for line in lines]
    paragraphs = [p.splitlines() for p in block.strip("\n").split("\n\n")]
    assert len(paragraphs) >= 3  # the imports, and the loop
    for paragraph in paragraphs:
        found = any(
            source[i : i + len(paragraph)] == paragraph
            for source in (lines, one_level_out)
            for i in range(len(source))
        )
        assert found, f"README's quick start A holds lines the example does not, in this order:\n{paragraph}"
