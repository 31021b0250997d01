"""A pool of ranks, each its own process, that share one process group and run functions on request.

Starting a rank (importing torch and gradsync, then the rendezvous) costs seconds on a small machine, so a
pool per (world size, backend, device) is kept for the life of the test process and reused across tests,
and ranks fork from a server process that imported those once (multiprocessing's ``forkserver``: the
server holds no threads, devices or process group, so forking it is safe) rather than each importing them
again (about 5 s of CPU per rank here). A pool that saw a failure or a hang is killed, never reused: one
failed or mismatched gloo collective desyncs the ranks, and every later op would time out.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any, Literal

from .worker import STACK_DUMP_SIGNAL, Outcome, WorkerSpec, worker_main

Rendezvous = Literal["file", "tcp"]


def _rank_context() -> ForkServerContext:
    """Ranks fork from a server that first imports the worker and every gradsync module this process has
    imported (the packages the calling tests use, whatever layer they are, without naming them here).
    Read when the server starts, at the first pool of the process."""
    ctx = mp.get_context("forkserver")
    imported = sorted(name for name in sys.modules if name.startswith("gradsync."))
    ctx.set_forkserver_preload(["gradsync.groups.testing.worker", *imported])
    return ctx


class RankFailure(RuntimeError):
    """A rank raised (or died). ``rank`` is the first rank that reported; ``exception`` is the original
    exception when it could be pickled back."""

    def __init__(
        self, rank: int, world_size: int, traceback_text: str, exception: BaseException | None
    ) -> None:
        super().__init__(f"rank {rank} of {world_size} failed:\n{traceback_text}")
        self.rank = rank
        self.world_size = world_size
        self.traceback_text = traceback_text
        self.exception = exception


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time; the message holds every rank's Python stack."""

    def __init__(self, pending: list[int], world_size: int, timeout: float, stacks: str) -> None:
        super().__init__(
            f"ranks {pending} of {world_size} did not finish within {timeout:.1f}s "
            f"(a hang or a collective some ranks never joined). Stacks at the timeout:\n{stacks}"
        )
        self.pending = pending


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankPool:
    """``world_size`` spawned ranks joined in one default process group, building tensors on ``device``
    (``"cpu"`` or ``"cuda"``; with CUDA each rank takes GPU ``rank % device_count``)."""

    def __init__(
        self,
        world_size: int,
        backend: str,
        *,
        device: str = "cpu",
        rendezvous: Rendezvous = "file",
        pg_timeout_s: float = 120.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self._dir = Path(tempfile.mkdtemp(prefix="gradsync-ranks-"))
        if rendezvous == "file":
            init_method = f"file://{self._dir / 'rendezvous'}"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = _rank_context()
        self._outcomes: mp.Queue[Outcome] = ctx.Queue()
        self._tasks: list[mp.Queue[bytes | None]] = [ctx.Queue() for _ in range(world_size)]
        self._next_task = 0
        self._procs = []
        for rank in range(world_size):
            spec = WorkerSpec(
                rank=rank,
                world_size=world_size,
                backend=backend,
                device=device,
                init_method=init_method,
                pg_timeout_s=pg_timeout_s,
                stack_file=str(self._dir / f"stack-{rank}.txt"),
            )
            proc = ctx.Process(
                target=worker_main,
                args=(spec, self._tasks[rank], self._outcomes),
                name=f"gradsync-rank-{rank}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        self._collect(-1, start_timeout_s)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        self._next_task += 1
        task = pickle.dumps((self._next_task, fn, args, kwargs))
        for tasks in self._tasks:
            tasks.put(task)
        outcomes = self._collect(self._next_task, timeout)
        return [pickle.loads(outcomes[r].payload) for r in range(self.world_size)]

    def _collect(self, task_id: int, timeout: float) -> dict[int, Outcome]:
        done: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = [r for r in range(self.world_size) if r not in done]
                stacks = self._dump_stacks()
                self.close(kill=True)
                raise RankTimeout(pending, self.world_size, timeout, stacks)
            try:
                outcome = self._outcomes.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                self._check_exits(done)
                continue
            if outcome.task_id != task_id:
                continue  # a late answer to a task that already failed elsewhere
            if not outcome.ok:
                self.close(kill=True)
                exc = pickle.loads(outcome.payload) if outcome.payload else None
                raise RankFailure(outcome.rank, self.world_size, outcome.traceback, exc)
            done[outcome.rank] = outcome
        return done

    def _check_exits(self, done: dict[int, Outcome]) -> None:
        for rank, proc in enumerate(self._procs):
            if rank not in done and proc.exitcode is not None:
                self.close(kill=True)
                raise RankFailure(
                    rank,
                    self.world_size,
                    f"the process exited with code {proc.exitcode} before answering",
                    None,
                )

    def _dump_stacks(self) -> str:
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, STACK_DUMP_SIGNAL)
        time.sleep(0.5)
        parts = []
        for rank in range(self.world_size):
            path = self._dir / f"stack-{rank}.txt"
            text = path.read_text() if path.exists() else ""
            parts.append(f"--- rank {rank} ---\n{text.strip() or '(no stack: process not running)'}")
        return "\n".join(parts)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: politely (barrier, destroy) or, after a failure, by killing them."""
        if not kill:
            for tasks in self._tasks:
                tasks.put(None)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)
