"""A run that ends cleanly exits 0, every time: after ``destroy_process_group`` no gloo group of gradsync's,
of torch's DTensor caches or of a garbage cycle is left alive into the interpreter's finalization, where a
gloo worker freeing its last collective aborts the process (``terminate called without an active
exception``: see ``gradsync.groups.teardown``). Each wrapper's training teardown runs on 2 ranks, twice,
and each rank reports the gloo worker threads alive once gradsync's exit release has run: there must be
none (before the release existed: 36 under DDP, 10 under ZeRO-3)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "exit_teardown.py"
RUNS = 2

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("wrapper", ["ddp", "megatron_fsdp", "fully_shard"])
def test_every_gloo_group_is_gone_before_the_interpreter_finalizes(wrapper: str) -> None:
    for run in range(RUNS):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
        ranks = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), wrapper],
                env={**env, "RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        for rank, process in enumerate(ranks):
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, f"run {run} rank {rank} exited {process.returncode}:\n{err}"
            assert "gloo workers at exit: 0" in out, f"run {run} rank {rank}: {out}"
