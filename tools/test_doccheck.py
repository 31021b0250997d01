# ruff: noqa: INP001 (a script's test, not a package)
"""The doc check passes on the docs as they are, and fails on each kind of wrong name or missing
provenance planted into a copy of a real doc's text (run by ``nox -s build``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def load_doccheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doccheck", HERE / "doccheck.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["doccheck"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


doccheck = load_doccheck()
ROOT: Path = doccheck.ROOT


@pytest.fixture(scope="module")
def ctx() -> Any:
    return doccheck.Context.build(ROOT)


def messages(ctx: Any, rel: str, text: str) -> list[str]:
    return [str(problem) for problem in doccheck.check_text(ctx, rel, text)]


def test_the_docs_pass(ctx: Any) -> None:
    problems = doccheck.check(ROOT, ctx=ctx)
    assert not problems, "\n".join(str(p) for p in problems)


# (doc, exact text in it, the wrong version planted, what the check must then name)
PLANTS = [
    (
        "README.md",
        "`gradsync.finalize.finalize_model_grads`",
        "`gradsync.finalize.finalize_model_gradz`",
        "gradsync.finalize.finalize_model_gradz does not exist",
    ),
    (
        "packages/gradsync-fsdp/README.md",
        "`init_model_with_meta_device`",
        "`init_model_with_meta_devices`",
        "init_model_with_meta_devices",
    ),
    (
        "packages/gradsync-ddp/README.md",
        "`zero_grad_buffer()` before",
        "`zero_grad_buffers()` before",
        "zero_grad_buffers",
    ),
    (
        "packages/gradsync-ddp/README.md",
        "from gradsync.ddp import DistributedOptimizer\n",
        "from gradsync.ddp import DistributedOptimiser\n",
        "gradsync.ddp has no DistributedOptimiser",
    ),
    ("docs/allocators.md", "`nccl_ub=True` (CUDA", "`nccl_ubb=True` (CUDA", "nccl_ubb"),
    ("CONTRIBUTING.md", "nox -s tests-groups --", "nox -s tests-group --", "nox session 'tests-group'"),
    ("CONTRIBUTING.md", "| `layers` |", "| `layer` |", "nox session 'layer'"),
    ("integration/README.md", "train -- --pp 2", "train -- --pipeline 2", "--pipeline is not a flag of"),
    (
        "README.md",
        "--costs nccl-h100-ib",
        "--cost nccl-h100-ib",
        "--cost is not a flag of gradsync.buffers.plan",
    ),
    ("README.md", "(docs/planner.md)", "(docs/planer.md)", "no such file"),
    (
        "docs/fault-tolerance.md",
        "](fault-tolerance-layout.png)",
        "](fault-tolerance-layouts.png)",
        "link to fault-tolerance-layouts.png: no such file",
    ),
    ("CONTRIBUTING.md", "(README.md#what-is-verified-and-where)", "(README.md#status)", "no such heading"),
    (
        "docs/performance.md",
        "Measured: commit 3cac611,",
        "Figures: commit 3cac611,",
        "without a 'Measured: commit",
    ),
    (
        "docs/performance.md",
        "Measured: commit 3cac611,",
        "Measured: commit 1234567,",
        "commit 1234567, not in this repository",
    ),
    ("docs/planner.md", "The α-β form fits", "This session, the α-β form fits", "says 'This session'"),
    (
        "docs/performance.md",
        "The command then sets each gradsync-fsdp system against its yardstick",
        "The command then sets each gradsync-fsdp system against the issue's yardstick",
        'says "the issue\'s"',
    ),
    (
        "docs/performance.md",
        "timed alone with `timeit`",
        "timed alone with a scratch script",
        "says 'scratch script'",
    ),
    ("docs/planner.md", "The α-β form fits", "On our machines the α-β form fits", "says 'our machines'"),
    ("docs/planner.md", "The α-β form fits", "Each session found the α-β form fits", "says 'Each session'"),
    ("docs/planner.md", "The α-β form fits", "In a session, the α-β form fits", "says 'a session'"),
    (
        "integration/README.md",
        "through the main job's `torchrun` command)\n",
        "through the same torchrun command the\nsession runs)\n",
        "README.md:67: says 'the session'",
    ),
    (
        "docs/hsdp.md",
        "`nox -s train -- --strategy fsdp-optim_grads_params --hsdp 2 [--hsdp-outer optim]`",
        "`train.py --strategy fsdp-optim_grads_params --hsdp 2`",
        "says 'The session'",
    ),
    ("README.md", "Alpha (0.2 to 0.9)", "Alpha (0.2 to 0.5)", "the packages span 0.2 to 0.9"),
    ("README.md", "02fc30c, 2026-11-26, at least", "02fc30c, 2026-11-25, at least", "it is 2026-11-26"),
    ("README.md", "02fc30c, 2026-11-26, at least", "0000000, 2026-11-26, at least", "names commit 0000000"),
    (
        "docs/checkpoints.md",
        "gradsync-fsdp 0.3.0 and earlier",
        "gradsync-fsdp 9.3.0 and earlier",
        "'gradsync-fsdp 9.3.0': gradsync-fsdp is at",
    ),
    (
        "docs/performance.md",
        "([how the benchmarks measure](#how-the-benchmarks-measure-figures-2-core-intel-xeon)).",
        "([how the benchmarks measure](#how-the-benchmarks-measure-\nfigures-2-core-intel-xeon)).",
        "a link target wraps onto the next line",
    ),
    (
        "README.md",
        "<!-- /bench:front-page -->",
        "| a row of my own | 1.000x |\n<!-- /bench:front-page -->",
        "bench block 'front-page' differs from benchmarks/results.json",
    ),
    ("README.md", "<!-- bench:front-page -->", "<!-- front-page -->", "no bench block 'front-page'"),
    (
        "README.md",
        "No GPU figures yet.",
        "No GPU figures yet; torch DDP took 1.072x the floor.",
        "figure '1.072x' beside a bench block",
    ),
    (
        "README.md",
        "## Performance\n",
        "## Performance\n<!-- bench:side-by-side -->\n<!-- /bench:side-by-side -->\n",
        "bench block 'side-by-side' belongs in docs/performance.md",
    ),
    (
        "benchmarks/RESULTS.md",
        "| floor |",
        "| the floor |",
        "differs from what benchmarks/results.json renders",
    ),
]


@pytest.mark.parametrize(("doc", "right", "wrong", "expected"), PLANTS, ids=[p[2] for p in PLANTS])
def test_a_planted_mistake_fails(ctx: Any, doc: str, right: str, wrong: str, expected: str) -> None:
    text = (ROOT / doc).read_text()
    assert right in text, f"{doc} no longer holds {right!r}: plant elsewhere"
    assert not any(expected in m for m in messages(ctx, doc, text))
    found = messages(ctx, doc, text.replace(right, wrong, 1))
    assert any(expected in m for m in found), found


def test_figures_from_a_tree_with_uncommitted_changes_fail(ctx: Any) -> None:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    committed = ctx.bench_results
    run = {**committed["run"], "commit": committed["run"]["commit"] + "+dirty"}
    ctx.bench_results = {**committed, "run": run}
    try:
        found = messages(ctx, "benchmarks/RESULTS.md", ctx.bench_report.results_md(ctx.bench_results))
    finally:
        ctx.bench_results = committed
    assert any("measured on a tree with uncommitted changes" in m for m in found), found
    assert not messages(ctx, "benchmarks/RESULTS.md", text)


def test_every_drawn_picture_is_shown_with_how_to_redraw_it(tmp_path: Path) -> None:
    """A picture tools/draw_layouts.py draws must be in docs/ and shown by a doc, in a section that names
    ``nox -s pictures``."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "tools" / "draw_layouts.py").write_text('"""Draws."""\n\nPICTURES = ("mesh.png",)\n')
    doc = tmp_path / "docs" / "mesh.md"
    doc.write_text("# Mesh\n\nNo picture yet.\n")

    def found() -> list[str]:
        return [str(problem) for problem in doccheck.check_pictures(tmp_path, [doc])]

    assert found() == [
        "tools/draw_layouts.py:3: draws docs/mesh.png, which is not there: run `nox -s pictures`",
        "tools/draw_layouts.py:3: draws docs/mesh.png, which no doc shows",
    ]
    (tmp_path / "docs" / "mesh.png").write_bytes(b"")
    doc.write_text("# Mesh\n\n![the mesh](mesh.png)\n\n## Next\n\nDrawn by `nox -s pictures`.\n")
    assert found() == [
        "docs/mesh.md:3: shows docs/mesh.png: say in its section how to redraw it (`nox -s pictures`)"
    ]
    doc.write_text("# Mesh\n\n![the mesh](mesh.png)\n\nDrawn by `nox -s pictures`.\n")
    assert not found()


def test_changelog_sections() -> None:
    good = "# Changelog\n\n## Unreleased\n- a\n\n## 0.2.0 (2026-11-23)\n- b\n"
    assert not list(doccheck.check_changelog("CHANGELOG.md", good))
    bad = "# Changelog\n\n## 0.3.0 (unreleased)\n\n## Unreleased\n\n## 0.2.0\n"
    found = [str(p) for p in doccheck.check_changelog("CHANGELOG.md", bad)]
    assert len(found) == 3, found  # the undated 0.3.0, the late Unreleased, the undated 0.2.0


@pytest.mark.parametrize(
    ("path", "text", "expected"),
    [
        ("benchmarks/bench.py", '"""The benchmark (issue 30)."""\n', "says 'issue 30'"),
        ("packages/gradsync-ddp/src/gradsync/ddp/x.py", "# the issue's targets\n", 'says "the issue\'s"'),
        ("constraints.txt", "# what this session pins\n", "says 'this session'"),
        ("examples/fsdp2_llama.py", "# what the session measured\n", "says 'the session'"),
        ("integration/train.py", '"""Timed on our machines."""\n', "says 'our machines'"),
        ("benchmarks/bench.py", "# as run by a\n# session\n", "says 'a session'"),
    ],
)
def test_sources_speak_of_the_project(tmp_path: Path, path: str, text: str, expected: str) -> None:
    """The forbidden words are looked for in the code, the examples and the pins too, not only in the
    docs, a phrase wrapped over two comment lines included."""
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
    found = [str(problem) for problem in doccheck.check_sources(tmp_path)]
    assert any(f"{path}:1: {expected}" in message for message in found), found
    fixed = text.replace("issue", "benchmark").replace("session", "file").replace("our machine", "a machine")
    (tmp_path / path).write_text(fixed)
    assert not list(doccheck.check_sources(tmp_path))


def test_a_nox_session_may_be_named_so() -> None:
    """A bare "the session" in a paragraph that names nox, or anywhere in the noxfile, is a nox session."""
    doc = "`nox -s train` runs the job.\nThe session's default is 2 ranks.\n\nEach session ran it.\n"
    assert list(doccheck.forbidden_phrases(doc)) == [(4, "Each session")]
    assert not list(doccheck.forbidden_phrases("# each session installs\n", nox_file=True))
    assert list(doccheck.forbidden_phrases("# this session\n", nox_file=True)) == [(1, "this session")]
