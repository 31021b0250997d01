# ruff: noqa: INP001 (a script, not a package)
"""Mutation check: every behaviour listed in ``tools/mutations.json`` is guarded by a test that fails when
the behaviour is broken.

Each entry names a source file, an exact piece of its text, a replacement that breaks the behaviour, and
the pytest node ids that guard it. The script copies ``packages/`` and ``integration/`` (whose tests may
guard too) to a temporary directory once per job (``--jobs`` mutations run at once, 2 by default: most of
a run is process start-up), points
``PYTHONPATH`` at each copy's sources (so the installed packages, editable or not, are shadowed), checks
that the copy is what gets imported, runs every guard once unmutated (it must pass; ``--passed`` names
JUnit reports of this tree's test sessions, whose passing guards need no second run), and then for each
mutation: replaces the text in the copy (it must occur exactly once, so a stale entry fails loudly),
runs the guards, and puts the original back. The working tree is never written. A mutation is killed
when pytest reports failed tests (exit status 1); one whose guards pass survived, and any other status
(collection error, unknown node id, timeout) is an error. Exit status 0 only if every mutation was
killed.

    python tools/mutations.py                 # every listed mutation
    python tools/mutations.py -k watchdog     # those whose name contains "watchdog"
    python tools/mutations.py --list
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LISTED = ROOT / "tools" / "mutations.json"
PACKAGES = ("groups", "buffers", "ddp", "fsdp", "finalize")
IGNORED = shutil.ignore_patterns("__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info", "build", "dist")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    replacement: str
    guards: tuple[str, ...]


def load(path: Path) -> list[Mutation]:
    mutations = []
    for entry in json.loads(path.read_text()):
        guards = entry["guards"]
        if not guards or not all(isinstance(g, str) and "::" in g for g in guards):
            raise SystemExit(f"{path}: {entry['name']!r} needs pytest node ids as guards, got {guards!r}")
        if len({g.split("/tests/")[0] for g in guards}) != 1:
            raise SystemExit(
                f"{path}: {entry['name']!r}: guards from one package's tests, please (module names repeat)"
            )
        if entry["original"] == entry["replacement"]:
            raise SystemExit(f"{path}: {entry['name']!r} replaces its text with itself")
        mutations.append(
            Mutation(entry["name"], entry["file"], entry["original"], entry["replacement"], tuple(guards))
        )
    return mutations


def src_path(root: Path) -> str:
    return os.pathsep.join(str(root / "packages" / f"gradsync-{p}" / "src") for p in PACKAGES)


# Third-party modules every guard run imports (about 6 s of CPU here, over half of a typical mutation's run).
# Runs fork from a server that imported them once (multiprocessing's ``forkserver``: the server holds no
# threads and has run no compute, so forking it is safe), and so do the ranks a run starts through the
# harness (see ``share_warm_server``); gradsync itself is never imported there, so each run and each rank
# imports the mutated copy afresh.
WARM_IMPORTS = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "numpy",
    "hypothesis",
    "pytest",
)


def warm_context() -> multiprocessing.context.ForkServerContext:
    """The warm server, started now with its output to /dev/null: the ranks it forks write their warnings
    there rather than into this script's report (a rank's failure reaches its run's log as the harness's
    exception, traceback included)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in WARM_IMPORTS if importlib.util.find_spec(m.split(".")[0])])
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        for fd in (*kept, null):
            os.close(fd)
    return ctx


def share_warm_server() -> None:
    """Let the processes this run starts through the forkserver (the harness's ranks) fork from the warm
    server too, instead of a fresh one that imports torch again. A forkserver's child already holds the
    server's address and its alive fd, but not its pid, so multiprocessing would start a new server; where
    this Python's internals differ, nothing is changed and the run starts its own."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    known = ("_forkserver_address", "_forkserver_alive_fd")
    if server is not None and all(getattr(server, name, None) is not None for name in known):
        server.ensure_running = lambda: None


def run_pytest_in(copy: Path, env: dict[str, str], nodes: tuple[str, ...], log: str) -> None:
    """The body of one guard run, in a process forked from the warm server: the copy's environment and
    sources first on the path (the ranks get the same path from multiprocessing), output to ``log``, in its
    own process group (so a timeout kills it and what it started itself)."""
    os.setpgrp()
    share_warm_server()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(copy)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
    stray = [m for m in sys.modules if m == "gradsync" or m.startswith("gradsync.")]
    if stray:
        raise SystemExit(f"the warm server imported {stray}: the run would not test the copy")
    # the server imported pytest's plugins (hypothesis) before pytest could mark them for rewriting
    quiet = ("-W", "ignore::pytest.PytestAssertRewriteWarning")
    code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *quiet, *nodes]))
    harness = sys.modules.get("gradsync.groups.testing")
    if harness is not None:  # this process ends through os._exit, skipping atexit: close the rank pools
        harness.shutdown_pools()  # (each removes its directory of rendezvous and stack files)
    sys.exit(code)


def run_guards(
    ctx: multiprocessing.context.ForkServerContext,
    copy: Path,
    env: dict[str, str],
    nodes: tuple[str, ...],
    timeout: float,
) -> tuple[int, str]:
    """Run ``nodes`` in ``copy``; the exit status (124 on timeout) and the tail of the output."""
    log = copy / "pytest.log"
    proc = ctx.Process(target=run_pytest_in, args=(copy, env, nodes, str(log)))
    proc.start()
    proc.join(timeout)
    timed_out = proc.exitcode is None
    assert proc.pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the run's ranks and rank server, whatever became of it
    proc.join()
    if timed_out:
        return 124, f"timed out after {timeout:g} s"
    text = log.read_text(errors="replace") if log.exists() else ""
    return int(proc.exitcode or 0), "\n".join(text.strip().splitlines()[-15:])


def check_imports_from(copy: Path, env: dict[str, str]) -> None:
    probe = "import " + ", ".join(f"gradsync.{p}" for p in PACKAGES) + "; import sys; "
    probe += "print('\\n'.join(sys.modules[f'gradsync.{p}'].__file__ for p in " + repr(PACKAGES) + "))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    stray = [line for line in out.stdout.split() if not Path(line).resolve().is_relative_to(copy.resolve())]
    if stray:
        raise SystemExit(f"the copy does not shadow the installed packages; imported {stray}")


def apply(copy: Path, mutation: Mutation) -> str:
    """Mutate the copy's file; returns its original text."""
    path = copy / mutation.file
    text = path.read_text()
    found = text.count(mutation.original)
    if found != 1:
        raise ValueError(f"{mutation.file}: the original text occurs {found} times (must be once)")
    path.write_text(text.replace(mutation.original, mutation.replacement))
    return text


Copies = queue.SimpleQueue[tuple[Path, dict[str, str]]]


@contextlib.contextmanager
def borrowed(copies: Copies) -> Iterator[tuple[Path, dict[str, str]]]:
    """A free copy of the packages and its environment, handed back after the block."""
    copy = copies.get()
    try:
        yield copy
    finally:
        copies.put(copy)


def passed_in(reports: Iterable[Path]) -> set[str]:
    """The node ids (from the repository root) that passed in pytest JUnit reports written with
    ``junit_family=xunit1`` (which names each test's file) by a package's test runs, named
    ``tests-<package>.xml`` and ``tests-<package>.serial.xml``; a skipped test did not pass. A parametrized
    test's own id (a guard may name it whole) is among them when every case of it passed."""
    cases: dict[str, bool] = {}
    whole: dict[str, bool] = {}
    for report in reports:
        package = ROOT / "packages" / f"gradsync-{report.stem.removeprefix('tests-').split('.')[0]}"
        for case in ET.parse(report).iter("testcase"):
            node = f"{(package / case.attrib['file']).relative_to(ROOT)}::{case.attrib['name']}"
            passed = not any(child.tag in {"failure", "error", "skipped"} for child in case)
            cases[node] = passed
            function = node.split("[", 1)[0]
            whole[function] = whole.get(function, True) and passed
    return {node for found in (cases, whole) for node, passed in found.items() if passed}


def baseline_runs(mutations: list[Mutation], jobs: int, passed: set[str]) -> list[tuple[str, ...]]:
    """Every guard not in ``passed`` once, in pytest runs that ``jobs`` copies can take at once: a run holds
    one package's tests only (module names repeat across packages), split by test module into about
    ``jobs`` runs each."""
    modules: dict[str, dict[str, list[str]]] = {}
    for guard in dict.fromkeys(g for m in mutations for g in m.guards if g not in passed):
        module = guard.split("::")[0]
        modules.setdefault(module.split("/tests/")[0], {}).setdefault(module, []).append(guard)
    runs: list[tuple[str, ...]] = []
    for by_module in modules.values():
        chunks: list[list[str]] = [[] for _ in range(min(jobs, len(by_module)))]
        for guards in sorted(by_module.values(), key=len, reverse=True):  # the largest module first
            min(chunks, key=len).extend(guards)
        runs.extend(tuple(chunk) for chunk in chunks)
    return sorted(runs, key=len, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file", type=Path, default=LISTED, help="the listed mutations (JSON)")
    parser.add_argument("-k", dest="select", default="", help="only mutations whose name contains this")
    parser.add_argument(
        "--list", action="store_true", help="list the mutations and their guards, run nothing"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip running the guards unmutated first")
    parser.add_argument(
        "--passed",
        type=Path,
        nargs="*",
        default=[],
        help="JUnit reports (tests-<package>.xml, xunit1) of this tree: its passing guards skip the baseline",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("-v", "--verbose", action="store_true", help="show how each guard failed")
    parser.add_argument(
        "--jobs", type=int, default=2, help="mutations run at once, each in its own copy (default 2)"
    )
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress shows in CI logs

    mutations = [m for m in load(args.file) if args.select in m.name]
    if args.list:
        for m in mutations:
            print(f"{m.name}\n    {m.file}\n    guards: {', '.join(m.guards)}")
        return 0
    if not mutations:
        raise SystemExit(f"no mutation in {args.file} matches {args.select!r}")

    started = time.monotonic()
    ctx = warm_context()
    with tempfile.TemporaryDirectory(prefix="gradsync-mutations-") as tmp:
        copies: Copies = queue.SimpleQueue()
        for index in range(max(1, args.jobs)):
            copy = Path(tmp) / str(index)
            for tree in ("packages", "integration"):  # guards live in both
                shutil.copytree(ROOT / tree, copy / tree, ignore=IGNORED)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (src_path(copy), env.get("PYTHONPATH", "")) if p)
            check_imports_from(copy, env)
            copies.put((copy, env))

        if not args.no_baseline:
            passed = passed_in(args.passed)
            runs = baseline_runs(mutations, max(1, args.jobs), passed)

            def run_unmutated(guards: tuple[str, ...]) -> tuple[tuple[str, ...], int, str]:
                with borrowed(copies) as (copy, env):
                    return (guards, *run_guards(ctx, copy, env, guards, args.timeout))

            with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
                for guards, rc, tail in pool.map(run_unmutated, runs):
                    if rc != 0:
                        print(f"the guards fail without any mutation (pytest exit {rc}): {guards}\n{tail}")
                        return 1
            count = sum(len(g) for g in runs)
            reused = {g for m in mutations for g in m.guards} & passed
            print(
                f"baseline: {count} guards pass unmutated, {len(reused)} more passed in the reports "
                f"given ({time.monotonic() - started:.0f} s)"
            )

        def run(m: Mutation) -> tuple[Mutation, int, str, float]:
            """Mutate a free copy, run the guards, put the copy back as it was."""
            t0 = time.monotonic()
            with borrowed(copies) as (copy, env):
                try:
                    original = apply(copy, m)
                except ValueError as error:
                    return m, -1, str(error), 0.0
                try:
                    rc, tail = run_guards(ctx, copy, env, m.guards, args.timeout)
                finally:
                    (copy / m.file).write_text(original)
            return m, rc, tail, time.monotonic() - t0

        failures = []
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for m, rc, tail, took in pool.map(run, mutations):
                if rc == -1:
                    failures.append(m.name)
                    print(f"ERROR     {m.name}: {tail}")
                elif rc == 1:
                    print(f"killed    {m.name} ({took:.0f} s)" + (f"\n{tail}\n" if args.verbose else ""))
                else:
                    failures.append(m.name)
                    verdict = "SURVIVED" if rc == 0 else f"ERROR (pytest exit {rc})"
                    print(
                        f"{verdict:9} {m.name} ({took:.0f} s): {m.file}, guards {', '.join(m.guards)}\n{tail}"
                    )

    total = time.monotonic() - started
    print(f"{len(mutations) - len(failures)} of {len(mutations)} mutations killed in {total:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
