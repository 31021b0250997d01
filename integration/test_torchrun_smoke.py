"""The integration suite runs real torchrun launches; each is bounded so a hang fails, never freezes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def torchrun(script: str, nproc: int, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / script),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_two_rank_smoke_under_torchrun() -> None:
    result = torchrun("smoke_allreduce.py", nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke ok: world 2" in result.stdout
