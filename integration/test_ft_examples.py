"""The fault-tolerance examples as a torchft user runs them: ``examples/fault_tolerance_launch.py`` starts
a lighthouse and three replica groups of each example, kills one group mid-run and restarts it, and the
job must end with every group at the same step with bit-identical weights, the restarted group having
healed and rejoined. docs/fault-tolerance.md's snippets are cut from the examples."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("example", "ranks"), [("fault_tolerance_ddp.py", 1), ("fault_tolerance_fsdp.py", 2)]
)
def test_a_group_killed_and_restarted_heals_and_every_group_ends_alike(
    tmp_path: Path, example: str, ranks: int
) -> None:
    pytest.importorskip("torchft", reason="torchft is an optional extra (torch >= 2.7)")
    command = [sys.executable, str(EXAMPLES / "fault_tolerance_launch.py"), str(EXAMPLES / example)]
    options = ["--ranks", str(ranks), "--steps", "15", "--kill-after", "4", "--out", str(tmp_path)]
    result = subprocess.run(
        [*command, *options], capture_output=True, text=True, timeout=280, check=False, env=dict(os.environ)
    )
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("group*.log")))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "group 1 healed and rejoined at step" in result.stdout
    assert "weights bit-identical across groups: True" in result.stdout


def code_blocks_after(heading: str, text: str, count: int) -> list[str]:
    section = text[text.index(heading) :]
    blocks, start = [], 0
    for _ in range(count):
        start = section.index("```python\n", start) + len("```python\n")
        end = section.index("```", start)
        blocks.append(section[start:end])
        start = end + 3
    return blocks


@pytest.mark.parametrize(("heading", "count"), [("## Use", 2), ("## The FSDP2-style API under torchft", 1)])
def test_the_docs_snippets_are_cut_from_the_examples(heading: str, count: int) -> None:
    sources = [
        variant
        for name in ("fault_tolerance_ddp.py", "fault_tolerance_fsdp.py", "torchft_loop.py")
        for lines in [(EXAMPLES / name).read_text().splitlines()]
        for variant in (lines, [line.removeprefix("    ") for line in lines])
    ]
    text = (ROOT / "docs" / "fault-tolerance.md").read_text()
    for block in code_blocks_after(heading, text, count):
        for paragraph in (p.splitlines() for p in block.strip("\n").split("\n\n")):
            found = any(
                source[i : i + len(paragraph)] == paragraph for source in sources for i in range(len(source))
            )
            assert found, f"docs/fault-tolerance.md's {heading[3:]} holds lines no example does:\n{paragraph}"
