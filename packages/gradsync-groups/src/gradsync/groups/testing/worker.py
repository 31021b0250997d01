"""The body of one spawned rank: join the process group once, then run tasks until told to stop.

Everything sent back is pickled here, explicitly, so an unpicklable result or exception becomes a readable
error in the parent instead of a silent failure in a queue's feeder thread.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist

from .devices import enter_rank

STACK_DUMP_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    backend: str
    device: str
    init_method: str
    pg_timeout_s: float
    stack_file: str


@dataclass(frozen=True)
class Outcome:
    """A rank's answer to one task: pickled return value, or the failure with its traceback."""

    rank: int
    task_id: int
    ok: bool
    payload: bytes = b""
    traceback: str = ""


def _failure(rank: int, task_id: int, exc: BaseException) -> Outcome:
    text = "".join(traceback.format_exception(exc))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:
        payload = b""
    return Outcome(rank, task_id, ok=False, payload=payload, traceback=text)


def _run_task(spec: WorkerSpec, task: bytes) -> Outcome:
    task_id = -1
    try:
        task_id, fn, args, kwargs = pickle.loads(task)
        result = fn(*args, **kwargs)
        payload = pickle.dumps(result)
    except BaseException as exc:
        return _failure(spec.rank, task_id, exc)
    # Align the ranks between tasks, so one test's stragglers never overlap the next test's collectives.
    dist.barrier()
    # Wrappers hold their process groups in reference cycles (hooks close over the wrapper); until a full
    # collection frees them, each destroyed gloo group keeps its TCP loop thread polling, and a pooled rank
    # that has run many tests ends up with hundreds of them eating the machine's cores.
    gc.collect()
    return Outcome(spec.rank, task_id, ok=True, payload=payload)


def worker_main(spec: WorkerSpec, tasks: Queue[bytes | None], outcomes: Queue[Outcome]) -> None:
    """Entry point of a spawned rank."""
    stack_file = open(spec.stack_file, "w")  # noqa: SIM115 — must stay open for faulthandler
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)
    os.environ["RANK"] = str(spec.rank)
    os.environ["WORLD_SIZE"] = str(spec.world_size)
    os.environ["LOCAL_RANK"] = str(spec.rank)
    # gradsync's own code calling an API torch deprecated fails the test, as the test process's pytest
    # filters make it (torch warns with FutureWarning, attributed to its caller's module);
    # GRADSYNC_TEST_DEPRECATIONS=default keeps them warnings (the compat sessions: an older or newer torch
    # deprecates other names)
    action = os.environ.get("GRADSYNC_TEST_DEPRECATIONS", "error")
    warnings.filterwarnings(action, category=FutureWarning, module=r"gradsync\.")  # type: ignore[arg-type]
    # Ranks share the machine's cores: one intra-op thread pool each would oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    try:
        enter_rank(spec.device, spec.rank)
        dist.init_process_group(
            spec.backend,
            init_method=spec.init_method,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.pg_timeout_s),
        )
    except BaseException as exc:
        outcomes.put(_failure(spec.rank, -1, exc))
        return
    outcomes.put(Outcome(spec.rank, -1, ok=True))
    # What is alive now (torch and its modules) lives as long as the rank: keep it out of the collections
    # after every task, which then cost microseconds instead of ~90 ms.
    gc.collect()
    gc.freeze()
    while (task := tasks.get()) is not None:
        outcomes.put(_run_task(spec, task))
    # A barrier before teardown avoids gloo's "terminate called without an active exception" at exit.
    dist.barrier()
    dist.destroy_process_group()
