# ruff: noqa: INP001 (a script, not a package)
"""Doc check: the READMEs and docs/ pages name only what exists, and every figure says where it came from.

Checked in every README, CONTRIBUTING.md, benchmarks/RESULTS.md and docs/*.md (``DOC_GLOBS``):

- ``gradsync.x.y`` dotted names, and the names of ``from gradsync.x import a, b`` lines in code blocks,
  resolve: the module imports and each attribute exists.
- ``torch.x.y`` dotted names in backticks resolve the same way.
- Any other backticked Python name that looks like a symbol, a field or an argument (it has an underscore
  or inner capitals: ``finish_grad_sync``, ``RaggedDTensor``, ``nccl_ub=True``) is defined somewhere in the
  project's Python (a def, class, attribute, argument or identifier-shaped string of the packages, their
  tests, integration/, benchmarks/, tools/mutations.py or the noxfile) or in torch's public modules, or
  is listed in ``tools/doccheck_names.txt``, the names of other projects (Megatron-Core, DeepSpeed, ...)
  the docs mention.
- ``nox -s NAME`` names a session of noxfile.py, as does every backticked name in the first column of a
  table whose first header is ``session``.
- ``--flags`` after a documented command (``integration/train.py``, ``nox -s train --``,
  ``python -m gradsync.buffers.plan``, the benchmark scripts, ``tools/mutations.py``) are flags its
  ``--help`` lists; a lone backticked ``--flag`` is a flag of one of them or of a launcher.
- Relative links point to files that exist (images too), and ``#anchors`` to headings in them.
- Every picture tools/draw_layouts.py draws (its ``PICTURES``) is in docs/ and shown by a doc, in a
  section that says how to redraw it (``nox -s pictures``).
- A figure (a table cell or a sentence with a measured quantity: ``12.9 ms``, ``1.167x``, ``538 MiB``,
  ``tok/s``, ...) has a provenance line in its section (between two headings)::

      Measured: commit 26c4866, 2026-11-24, 2-core AMD EPYC CPU (no GPU), torch 2.13.0+cpu

  (``Computed:`` for a model's predictions): a commit of this repository, a date, the device and torch.
  Figures quoted from another publication take a ``Source:`` line naming it instead.
- No "issue N", "the issue", "this session", "this change", "scratch script", "our machines" or
  "spec ... §" in the docs, nor in the Python the names are gathered from (``PY_GLOBS``), examples/ or
  constraints.txt, and no "the session", "a session", "each session" (...) in a paragraph that does not
  name nox (a nox session is "the `train` session", "a nox session"); a phrase wrapped over two lines
  counts: the docs and the code state the fact or the rule itself, not how the project came to it.

- The benchmark figures the docs quote (benchmarks/RESULTS.md whole, and each ``<!-- bench:NAME -->``
  block of the README and docs/performance.md) are what benchmarks/bench_report.py renders from
  benchmarks/results.json, measured on a committed tree; a section holding such a block holds no other
  figure.
- A package's version quoted as ``gradsync-X 1.2.3`` (or ``gradsync-X>=1.2.3``) is its version or an
  earlier one, and the front page's "Alpha (A to B)" spans the packages' lowest and highest major.minor.

In the CHANGELOGs: one ``## Unreleased`` section at most, first, and every other section
``## X.Y.Z (YYYY-MM-DD)``.

    python tools/doccheck.py            # every doc; exit status 1 and one line per problem if any
    python tools/doccheck.py README.md  # some docs only
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC_GLOBS = (
    "README.md",
    "CONTRIBUTING.md",
    "integration/README.md",
    "benchmarks/RESULTS.md",
    "packages/*/README.md",
    "docs/*.md",
)
CHANGELOG_GLOB = "packages/*/CHANGELOG.md"
PY_GLOBS = (
    "packages/*/src/**/*.py",
    "packages/*/tests/*.py",
    "packages/*/benchmarks/*.py",
    "integration/**/*.py",
    "benchmarks/*.py",
    "tools/mutations.py",  # not the doc check itself: its test holds the planted wrong names
    "tools/draw_layouts.py",
    "noxfile.py",
)
NAMES_FILE = "tools/doccheck_names.txt"
PICTURES_SCRIPT = "tools/draw_layouts.py"
REDRAW = "nox -s pictures"

# The torch modules whose public names (and their classes' attributes) the docs may name bare.
TORCH_MODULES = (
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.nn.utils",
    "torch.optim",
    "torch.optim.lr_scheduler",
    "torch.autograd",
    "torch.cuda",
    "torch.accelerator",
    "torch.utils.checkpoint",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.placement_types",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.nn.parallel",
)

# CLIs the docs document, by what names them on a line, and how to ask them for --help.
CLIS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        r"integration/train_ft\.py|\btrain_ft\.py|nox -s train -- --fault-tolerance",
        ("integration/train_ft.py",),
    ),
    (r"integration/train\.py|\btrain\.py|nox -s train\b", ("integration/train.py",)),
    (r"gradsync\.buffers\.plan\b(?![.\w])", ("-m", "gradsync.buffers.plan")),
    (r"bench_ab\.py|nox -s bench-ab\b", ("benchmarks/bench_ab.py",)),
    (r"bench_muon\.py|nox -s bench-muon\b", ("benchmarks/bench_muon.py",)),
    (r"(?<![\w/])bench\.py|nox -s bench(?![\w-])", ("benchmarks/bench.py",)),
    (r"plan_check\.py", ("benchmarks/plan_check.py",)),
    (r"plan_scaling\.py", ("benchmarks/plan_scaling.py",)),
    (r"plot_trace\.py", ("benchmarks/plot_trace.py",)),
    (r"bench_ragged_dispatch\.py", ("benchmarks/bench_ragged_dispatch.py",)),
    (r"bench_fault_tolerance\.py", ("benchmarks/bench_fault_tolerance.py",)),
    (r"bench_launch\.py|nox -s bench-launch\b", ("benchmarks/bench_launch.py",)),
    (r"profile_launch\.py", ("benchmarks/profile_launch.py",)),
    (r"bench_ddp\.py|nox -s bench-(?:ddp|overhead)\b", ("packages/gradsync-ddp/benchmarks/bench_ddp.py",)),
    (
        r"bench_collectives\.py|nox -s bench-buffers\b",
        ("packages/gradsync-buffers/benchmarks/bench_collectives.py",),
    ),
    (r"mutations\.py|nox -s mutations\b", ("tools/mutations.py",)),
)
# Flags of the launchers in front of those commands (torchrun, nox, pip, pytest).
LAUNCHER_FLAGS = frozenset(
    {
        "--nproc-per-node",
        "--nnodes",
        "--standalone",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--session",
        "--sessions",
        "--list",
        "--no-deps",
        "--force-reinstall",
        "--timeout",
        "--help",
    }
)

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED_GRADSYNC = re.compile(rf"(?<![\w./-])gradsync(?:\.{IDENT})+")
FROM_IMPORT = re.compile(rf"^\s*from\s+(gradsync(?:\.{IDENT})+)\s+import\s+(.+)$")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
NOX_SESSION = re.compile(r"\bnox\s+(?:-\S+\s+)*?(?:-s|--sessions?)\s+([\w.\-]+)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s#]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
PROVENANCE = re.compile(r"^(?:Measured|Computed): (.+)$")
BENCH_MARK = re.compile(r"^<!-- (/?)bench:[\w-]+ -->$")
"""A line opening or closing a block of figures rendered from benchmarks/results.json."""
SOURCE = re.compile(r"^Source: \S.{9,}$")  # figures quoted from another publication
COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})\b")
DISTANCE = re.compile(r"\bat ([0-9a-f]{7,40}), (20\d\d-\d\d-\d\d), at least (\d+) commits before this tree\b")
"""A claim of how far the tree has moved since a commit (the GPU status): ``python tools/doccheck.py
--refresh-distances`` writes the current distance."""
DATE = re.compile(r"\b(20\d\d)-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b")
TORCH_VERSION = re.compile(r"\btorch \d+\.\d+")
UNIT = r"(?:ms|us|µs|s|min|MiB|GiB|KiB|MB|GB|GB/s|tok/s|GFLOP|%)"
FIGURE_CELL = re.compile(rf"(?<![\w.])\d+(?:\.\d+)?\s?{UNIT}(?![\w/])|(?<![\w.])\d+\.\d+x\b")
FIGURE_PROSE = re.compile(
    r"(?<![\w.])\d+\.\d+x\b|(?<![\w.-])\d+(?:\.\d+)?\s?(?:ms|us|µs)\b|\btok/s\b|\bGB/s\b|\bGFLOP\b"
    r"|MiB (?:per|a) step|MiB/step|ms/step|% of the step"
)
FORBIDDEN = re.compile(
    r"\bissues? \d+\b|\bthis session\b|\bthis change\b|\bspec\b[^.\n]{0,30}§|§\s?\d"
    r"|\bthe issue'?s?\b|\bscratch script\b|\btheir own issues?\b|\bour machines?\b",
    re.IGNORECASE,
)
BARE_SESSION = re.compile(
    r"\b(?:the|a|each|every|another|same|later|earlier|previous|next)\s+session\b", re.IGNORECASE
)
"""A session with nothing to say it is nox's (``the session``, not ``the `train` session``): forbidden
unless its paragraph names nox (``NOX``), or the file is the noxfile."""
NOX = re.compile(r"\bnox\b")
WRAPPED_LINK = re.compile(r"!?\[[^\]]*\]\([^)\s]*$")
"""A link whose target runs past the end of its line: markdown breaks it, and the link check, reading one
line at a time, would not see its target."""
SPEC_CITATION = re.compile(r"\bspec\b[^\n]{0,20}§")
PACKAGE_VERSION = re.compile(
    r"\bgradsync-(groups|buffers|ddp|fsdp|finalize)\s?(?:[<>=~!]=?\s?)?(\d+\.\d+\.\d+)\b"
)
"""A version quoted for one package: ``gradsync-fsdp 0.3.0``, ``gradsync-buffers>=0.6.0``."""
VERSION_RANGE = re.compile(r"\bAlpha \((\d+\.\d+) to (\d+\.\d+)\)")
"""The front page's span of the packages' versions (major.minor)."""
CHANGELOG_HEADING = re.compile(r"^## (?:Unreleased|\d+\.\d+\.\d+ \((20\d\d-\d\d-\d\d)\))$")


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Context:
    """What the docs are checked against, gathered once per root."""

    root: Path
    names: set[str] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    versions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    commits_checked: dict[str, bool] = field(default_factory=dict)
    flags_cache: dict[tuple[str, ...], frozenset[str]] = field(default_factory=dict)
    bench_report: ModuleType | None = None
    bench_results: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, root: Path) -> Context:
        ctx = cls(root)
        ctx.bench_report = load_bench_report(root)
        ctx.bench_results = ctx.bench_report.load(root / "benchmarks" / "results.json")
        ctx.names = project_names(root) | torch_names() | listed_names(root / NAMES_FILE)
        ctx.sessions = nox_sessions(root)
        ctx.versions = package_versions(root)
        return ctx

    def commit_exists(self, commit: str) -> bool:
        if commit not in self.commits_checked:
            result = subprocess.run(
                ["git", "-C", str(self.root), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                capture_output=True,
                check=False,
            )
            self.commits_checked[commit] = result.returncode == 0
        return self.commits_checked[commit]

    def git(self, *args: str) -> str | None:
        """``git ARGS``'s output in the repository, or None when it fails (a commit not in a clone)."""
        result = subprocess.run(
            ["git", "-C", str(self.root), *args], capture_output=True, text=True, check=False
        )
        return result.stdout.strip() if result.returncode == 0 else None

    def cli_flags(self, argv: tuple[str, ...]) -> frozenset[str]:
        """The flags ``python ARGV --help`` prints (empty when it fails to run)."""
        if argv in self.flags_cache:
            return self.flags_cache[argv]
        result = subprocess.run(
            [sys.executable, *argv, "--help"],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        flags = frozenset(FLAG.findall(result.stdout)) if result.returncode == 0 else frozenset()
        self.flags_cache[argv] = flags
        return flags

    def all_cli_flags(self) -> frozenset[str]:
        flags: set[str] = set(LAUNCHER_FLAGS)
        for _, argv in CLIS:
            flags |= self.cli_flags(argv)
        return frozenset(flags)


# --- what exists --------------------------------------------------------------------------------------


def load_bench_report(root: Path) -> ModuleType:
    """benchmarks/bench_report.py, which renders the benchmark figures the docs quote."""
    spec = importlib.util.spec_from_file_location("bench_report", root / "benchmarks" / "bench_report.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def package_versions(root: Path) -> dict[str, tuple[int, ...]]:
    """Each package's version (``gradsync-ddp`` -> ``ddp``), from its ``version.py``, which hatchling
    reads into the wheel's metadata."""
    versions = {}
    for path in sorted(root.glob("packages/gradsync-*/src/gradsync/*/version.py")):
        found = re.search(r'__version__ = "(\d+(?:\.\d+)*)"', path.read_text())
        if found:
            versions[path.parent.name] = tuple(int(part) for part in found.group(1).split("."))
    return versions


def project_names(root: Path) -> set[str]:
    """Every name the project's Python defines or uses: defs, classes, attributes, arguments, keywords,
    imported names and identifier-shaped strings (config fields, error messages' names)."""
    names: set[str] = set()
    for pattern in PY_GLOBS:
        for path in root.glob(pattern):
            try:
                tree = ast.parse(path.read_text(), filename=str(path))
            except SyntaxError:
                continue
            names.update(_names_in(tree))
    return names


def _names_in(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.asname or node.name.split(".")[-1]
            yield from node.name.split(".")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield from re.findall(IDENT, node.value)


def torch_names() -> set[str]:
    names: set[str] = set()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated torch names still count
    for module_name in TORCH_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in dir(module):
            names.add(name)
            value = getattr(module, name, None)
            if isinstance(value, type):
                names.update(dir(value))
    return names


def listed_names(path: Path) -> set[str]:
    if not path.exists():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def nox_sessions(root: Path) -> set[str]:
    """The sessions noxfile.py registers (run in a fresh interpreter: nox keeps a global registry)."""
    code = (
        "import runpy, sys, nox.registry\n"
        f"runpy.run_path({str(root / 'noxfile.py')!r})\n"
        "print('\\n'.join(nox.registry.get()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True, timeout=120
    )
    return set(result.stdout.split())


def resolve(dotted: str) -> bool:
    """``a.b.c``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                try:  # a submodule not imported by its package
                    obj = importlib.import_module(f"{getattr(obj, '__name__', '')}.{attr}")
                except ImportError:
                    return False
            else:
                obj = getattr(obj, attr)
        return True
    return False


# --- reading a Markdown file ----------------------------------------------------------------------------


@dataclass
class Line:
    number: int
    text: str
    in_code: bool


def read_lines(text: str) -> list[Line]:
    lines: list[Line] = []
    in_code = False
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.lstrip().startswith("```"):
            in_code = not in_code
            lines.append(Line(number, raw, True))
            continue
        lines.append(Line(number, raw, in_code))
    return lines


def logical_lines(lines: list[Line]) -> Iterator[tuple[int, str, bool]]:
    """Lines with backslash continuations joined (a shell command over several lines)."""
    buffer: list[str] = []
    start = 0
    for line in lines:
        if not buffer:
            start = line.number
        if line.in_code and line.text.rstrip().endswith("\\"):
            buffer.append(line.text.rstrip()[:-1])
            continue
        buffer.append(line.text)
        yield start, " ".join(buffer), line.in_code
        buffer = []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in read_lines(text):
        match = HEADING.match(line.text)
        if match and not line.in_code:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


# --- the checks -----------------------------------------------------------------------------------------


def check_doc(ctx: Context, rel: str, text: str) -> list[Problem]:
    lines = read_lines(text)
    problems: list[Problem] = []
    problems += check_names(ctx, rel, lines)
    problems += check_sessions(ctx, rel, lines)
    problems += check_flags(ctx, rel, lines)
    problems += check_links(ctx, rel, lines)
    problems += check_provenance(ctx, rel, lines)
    problems += check_versions(ctx, rel, lines)
    problems += check_distances(ctx, rel, lines)
    problems += check_bench_quotes(ctx, rel, text, lines)
    problems += [
        Problem(rel, number, f"says {phrase!r}: state the fact or rule itself")
        for number, phrase in forbidden_phrases(text)
    ]
    return problems


def forbidden_phrases(text: str, nox_file: bool = False) -> Iterator[tuple[int, str]]:
    """(line number, phrase) of each forbidden phrase in ``text``, read a paragraph at a time so that a
    phrase wrapped over two lines is found (``#`` comment markers dropped); a bare session
    (``BARE_SESSION``) only where the paragraph does not name nox and the file is not the noxfile."""
    rows = text.splitlines()
    start = 0
    while start < len(rows):
        if not rows[start].strip():
            start += 1
            continue
        end = start
        while end < len(rows) and rows[end].strip():
            end += 1
        parts = [rows[i].strip().lstrip("#").strip() for i in range(start, end)]
        offsets: list[int] = []
        joined = ""
        for part in parts:
            offsets.append(len(joined))
            joined += part + " "
        found = list(FORBIDDEN.finditer(joined))
        if not nox_file and not NOX.search(joined):
            found += BARE_SESSION.finditer(joined)
        for match in sorted(found, key=lambda m: m.start()):
            row = max(i for i, offset in enumerate(offsets) if offset <= match.start())
            yield start + row + 1, " ".join(match.group(0).split())
        start = end


def check_versions(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    """A quoted package version exists (the package's own or an earlier one), and the front page's span
    of versions is the packages' lowest and highest major.minor."""
    minors = sorted({version[:2] for version in ctx.versions.values()})
    span = tuple(".".join(map(str, v)) for v in (minors[0], minors[-1])) if minors else None
    for line in lines:
        for match in PACKAGE_VERSION.finditer(line.text):
            have = ctx.versions.get(match.group(1))
            quoted = tuple(int(part) for part in match.group(2).split("."))
            if have is not None and quoted > have:
                current = ".".join(map(str, have))
                yield Problem(
                    rel, line.number, f"{match.group(0)!r}: gradsync-{match.group(1)} is at {current}"
                )
        for match in VERSION_RANGE.finditer(line.text):
            if span is not None and (match.group(1), match.group(2)) != span:
                yield Problem(
                    rel, line.number, f"{match.group(0)!r}: the packages span {span[0]} to {span[1]}"
                )


def check_names(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    for line in lines:
        for match in DOTTED_GRADSYNC.finditer(line.text):
            if not resolve(match.group(0)):
                yield Problem(rel, line.number, f"{match.group(0)} does not exist")
        imported = FROM_IMPORT.match(line.text) if line.in_code else None
        if imported:
            names = re.findall(IDENT, imported.group(2).split("#", 1)[0].replace(" as ", " , "))
            for name in names:
                if not resolve(f"{imported.group(1)}.{name}"):
                    yield Problem(rel, line.number, f"{imported.group(1)} has no {name}")
        if line.in_code:
            continue
        for span in CODE_SPAN.findall(line.text):
            for name in span_names(span):
                if name.startswith("torch.") and not resolve(name):
                    yield Problem(rel, line.number, f"`{span}`: {name} does not exist in torch")
                elif not name.startswith(("torch.", "gradsync.")):
                    unknown = [p for p in name.split(".") if symbol_like(p) and p not in ctx.names]
                    if unknown:
                        yield Problem(
                            rel, line.number, f"`{span}`: no {', '.join(unknown)} in gradsync or torch"
                        )


def span_names(span: str) -> Iterator[str]:
    """The Python names a code span stands for: ``name``, ``a.b``, ``f(...)`` (and its keywords),
    ``field=value``."""
    text = span.strip()
    if (
        text.startswith(("-", "$", "python ", "pip ", "nox ", "torchrun ", "/", "~"))
        or " " in text.split("(")[0]
    ):
        return
    if re.search(r"\.(?:py|md|json|txt|toml|png|ini|cfg|sh)$", text):  # a file name
        return
    call = re.match(rf"^({IDENT}(?:\.{IDENT})*)\((.*)\)(?:\.\w+)*$", text)
    if call:
        yield call.group(1)
        yield from re.findall(rf"(?<![\w.])({IDENT})=(?!=)", call.group(2))
        return
    assign = re.match(rf"^({IDENT})=", text)
    if assign:
        yield assign.group(1)
        return
    if re.fullmatch(rf"{IDENT}(?:\.{IDENT})*(?:\(\))?", text):
        yield text.removesuffix("()")


def symbol_like(part: str) -> bool:
    """A name worth checking: snake_case with an underscore, or CamelCase; not a plain word."""
    core = part.strip("_")
    return bool(core) and ("_" in part or re.search(r"[a-z][A-Z]|[A-Z][a-z]+[A-Z]", part) is not None)


def check_sessions(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    header: list[str] | None = None
    for line in lines:
        for name in NOX_SESSION.findall(line.text):
            if name not in ctx.sessions:
                yield Problem(rel, line.number, f"nox session {name!r} does not exist")
        cells = table_cells(line.text) if not line.in_code else None
        if cells is None:
            header = None
            continue
        if header is None:
            header = cells
        elif header[0].lower() == "session" and not set(cells[0]) <= set("-: "):
            for name in CODE_SPAN.findall(cells[0]):
                if name not in ctx.sessions:
                    yield Problem(rel, line.number, f"nox session {name!r} does not exist")


def table_cells(text: str) -> list[str] | None:
    stripped = text.strip()
    if not (stripped.startswith("|") and stripped.endswith("|")):
        return None
    return [cell.strip() for cell in stripped[1:-1].split("|")]


def check_flags(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    for number, text, in_code in logical_lines(lines):
        commands = [text] if in_code else CODE_SPAN.findall(text)
        for command in commands:
            yield from _check_command_flags(ctx, rel, number, command, lone=not in_code)


def _check_command_flags(ctx: Context, rel: str, number: int, command: str, lone: bool) -> Iterator[Problem]:
    command = command.split(" #", 1)[0]
    anchored = False
    for pattern, argv in CLIS:
        match = re.search(pattern, command)
        if not match:
            continue
        anchored = True
        rest = command[match.end() :]
        if "nox -s" in match.group(0):  # the script's flags come after nox's `--`
            rest = rest.split(" -- ", 1)[1] if " -- " in rest else ""
        known = ctx.cli_flags(argv)
        if not known:
            yield Problem(rel, number, f"`{' '.join(argv)} --help` did not run")
            continue
        for flag in FLAG.findall(rest):
            if flag not in known:
                yield Problem(rel, number, f"{flag} is not a flag of {argv[-1]}")
        break
    if lone and not anchored and re.fullmatch(r"--[a-z][a-z0-9-]*(?:[ =]\S+)?", command.strip()):
        flag = FLAG.findall(command)[0]
        if flag not in ctx.all_cli_flags():
            yield Problem(rel, number, f"{flag} is not a flag of any documented command")


def check_links(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    here = (ctx.root / rel).parent
    for line in lines:
        if line.in_code:
            continue
        if WRAPPED_LINK.search(line.text):
            yield Problem(rel, line.number, "a link target wraps onto the next line: keep it on one line")
        for target in LINK.findall(line.text):
            if re.match(r"^[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            path = (here / path_part).resolve() if path_part else ctx.root / rel
            if not path.exists():
                yield Problem(rel, line.number, f"link to {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(_read(path)):
                yield Problem(rel, line.number, f"link to {target}: no such heading")


_OVERRIDES: dict[Path, str] = {}


def _read(path: Path) -> str:
    override = _OVERRIDES.get(path.resolve())
    return override if override is not None else path.read_text()


def sections(lines: list[Line]) -> Iterator[list[Line]]:
    section: list[Line] = []
    for line in lines:
        if HEADING.match(line.text) and not line.in_code and section:
            yield section
            section = []
        section.append(line)
    if section:
        yield section


def check_provenance(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    for section in sections(lines):
        provenance = [line for line in section if PROVENANCE.match(line.text.strip())]
        for line in provenance:
            yield from _check_provenance_line(ctx, rel, line)
        if provenance or any(SOURCE.match(line.text.strip()) for line in section):
            continue
        for line in section:
            if HEADING.match(line.text) and not line.in_code:
                continue
            cells = table_cells(line.text)
            pattern = FIGURE_CELL if cells is not None and not line.in_code else FIGURE_PROSE
            text = " | ".join(cells) if cells is not None else line.text
            text = re.sub(r"`[^`]*`", "", text) if not line.in_code else text
            match = pattern.search(text)
            if match:
                yield Problem(
                    rel,
                    line.number,
                    f"figure {match.group(0)!r} without a 'Measured: commit ..., date, device, torch ...' "
                    "line in its section",
                )
                break


def check_bench_quotes(ctx: Context, rel: str, text: str, lines: list[Line]) -> Iterator[Problem]:
    report, data = ctx.bench_report, ctx.bench_results
    assert report is not None
    if rel == "benchmarks/RESULTS.md":
        if "+" in data["run"]["commit"]:
            yield Problem(rel, 1, "benchmarks/results.json was measured on a tree with uncommitted changes")
        if text != report.results_md(data):
            yield Problem(rel, 1, "differs from what benchmarks/results.json renders: run `nox -s bench`")
    for number, message in report.stale_quotes(rel, text, data):
        yield Problem(rel, number, message)
    quoted, inside = set(), False
    for line in lines:
        mark = BENCH_MARK.match(line.text)
        if mark:
            inside = not mark.group(1)
        if mark or inside:
            quoted.add(line.number)
    for section in sections(lines):
        if not any(line.number in quoted for line in section):
            continue
        for line in section:
            if line.number in quoted or HEADING.match(line.text):
                continue
            cells = table_cells(line.text)
            figure = (FIGURE_CELL if cells is not None else FIGURE_PROSE).search(line.text)
            if figure:
                yield Problem(
                    rel,
                    line.number,
                    f"figure {figure.group(0)!r} beside a bench block: quote it from results.json "
                    "(benchmarks/bench_report.py) or give it a section of its own",
                )


def _check_provenance_line(ctx: Context, rel: str, line: Line) -> Iterator[Problem]:
    text = line.text.strip()
    commit = COMMIT.search(text)
    if not commit:
        yield Problem(rel, line.number, "provenance line without 'commit <hash>'")
    elif not ctx.commit_exists(commit.group(1)):
        yield Problem(rel, line.number, f"provenance names commit {commit.group(1)}, not in this repository")
    if not DATE.search(text):
        yield Problem(rel, line.number, "provenance line without a YYYY-MM-DD date")
    if not TORCH_VERSION.search(text):
        yield Problem(rel, line.number, "provenance line without 'torch <version>'")
    if len([part for part in text.split(",") if part.strip()]) < 4:
        yield Problem(
            rel, line.number, "provenance line needs commit, date, device and torch, comma-separated"
        )


def commit_distance(ctx: Context, commit: str) -> tuple[str, int] | None:
    """``commit``'s date and the commits since it in this tree, or None where git does not know it."""
    date = ctx.git("log", "-1", "--format=%cs", commit)
    count = ctx.git("rev-list", "--count", f"{commit}..HEAD")
    return None if date is None or count is None else (date, int(count))


def check_distances(ctx: Context, rel: str, lines: list[Line]) -> Iterator[Problem]:
    """'at COMMIT, DATE, at least N commits before this tree': the commit's own date, and N no more than
    the commits since it (N only grows truer as the tree moves on)."""
    for number, text, _ in logical_lines(lines):
        for match in DISTANCE.finditer(text):
            commit, date, claimed = match.group(1), match.group(2), int(match.group(3))
            known = commit_distance(ctx, commit)
            if known is None:
                yield Problem(rel, number, f"names commit {commit}, not in this repository")
            elif known[0] != date:
                yield Problem(rel, number, f"dates commit {commit} {date}; it is {known[0]}")
            elif claimed > known[1]:
                yield Problem(rel, number, f"says {claimed} commits since {commit}; there are {known[1]}")


def refresh_distances(ctx: Context, path: Path) -> None:
    """Rewrite each distance claim in ``path`` to the commits since its commit now."""

    def current(match: re.Match[str]) -> str:
        known = commit_distance(ctx, match.group(1))
        if known is None:
            return match.group(0)
        return f"at {match.group(1)}, {known[0]}, at least {known[1]} commits before this tree"

    path.write_text(DISTANCE.sub(current, path.read_text()))


def drawn_pictures(root: Path) -> tuple[int, list[str]]:
    """The line of ``PICTURES`` in tools/draw_layouts.py and the names in it (the PNGs it writes into
    docs/), read without running the script; (0, []) where there is none."""
    path = root / PICTURES_SCRIPT
    if not path.exists():
        return 0, []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "PICTURES" for target in node.targets
        ):
            return node.lineno, [str(name) for name in ast.literal_eval(node.value)]
    return 0, []


def shown_images(root: Path, docs: Iterable[Path]) -> dict[Path, list[tuple[str, int, bool]]]:
    """Each image the docs show: where (doc, line) and whether its section names ``REDRAW``."""
    shown: dict[Path, list[tuple[str, int, bool]]] = {}
    for doc in docs:
        rel = str(doc.resolve().relative_to(root.resolve()))
        for section in sections(read_lines(_read(doc))):
            redraw = any(REDRAW in line.text for line in section)
            for line in section:
                for target in [] if line.in_code else IMAGE.findall(line.text):
                    where = (doc.parent / target).resolve()
                    shown.setdefault(where, []).append((rel, line.number, redraw))
    return shown


def check_pictures(root: Path, docs: Iterable[Path]) -> Iterator[Problem]:
    """Every picture tools/draw_layouts.py draws is in docs/ and shown by a doc whose section says how to
    redraw it."""
    number, names = drawn_pictures(root)
    shown = shown_images(root, docs)
    for name in names:
        path = (root / "docs" / name).resolve()
        if not path.exists():
            yield Problem(PICTURES_SCRIPT, number, f"draws docs/{name}, which is not there: run `{REDRAW}`")
        places = shown.get(path, [])
        if not places:
            yield Problem(PICTURES_SCRIPT, number, f"draws docs/{name}, which no doc shows")
        for rel, line, redraw in places:
            if not redraw:
                yield Problem(
                    rel, line, f"shows docs/{name}: say in its section how to redraw it (`{REDRAW}`)"
                )


def check_changelog(rel: str, text: str) -> Iterator[Problem]:
    unreleased = 0
    first = True
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("## "):
            continue
        if not CHANGELOG_HEADING.match(line):
            yield Problem(rel, number, f"{line!r}: sections are '## Unreleased' or '## X.Y.Z (YYYY-MM-DD)'")
        if line == "## Unreleased":
            unreleased += 1
            if not first or unreleased > 1:
                yield Problem(rel, number, "one '## Unreleased' section, before every version")
        first = False


def check_sources(root: Path) -> Iterator[Problem]:
    """The code, the examples and the pins speak of the project, not of how it was made: no spec citation,
    none of the docs' forbidden words (``FORBIDDEN``, ``BARE_SESSION``)."""
    paths: list[Path] = []
    for pattern in (*PY_GLOBS, "examples/*.py", "constraints.txt"):
        paths += sorted(p for p in root.glob(pattern) if p not in paths)
    for path in paths:
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), start=1):
            if SPEC_CITATION.search(line):
                yield Problem(str(path.relative_to(root)), number, "cites a spec section: state the rule")
        for number, phrase in forbidden_phrases(text, nox_file=path.name == "noxfile.py"):
            yield Problem(
                str(path.relative_to(root)), number, f"says {phrase!r}: state the fact or rule itself"
            )


# --- entry points ---------------------------------------------------------------------------------------


def doc_paths(root: Path) -> list[Path]:
    found: list[Path] = []
    for pattern in DOC_GLOBS:
        found += sorted(p for p in root.glob(pattern) if p not in found)
    return found


def check(
    root: Path = ROOT, paths: Iterable[Path] | None = None, ctx: Context | None = None
) -> list[Problem]:
    """Every problem in the docs under ``root`` (or in ``paths`` only), in file order."""
    ctx = ctx or Context.build(root)
    problems: list[Problem] = []
    selected = list(paths) if paths is not None else doc_paths(root)
    for path in selected:
        rel = str(path.resolve().relative_to(root.resolve()))
        problems += check_doc(ctx, rel, _read(path))
    if paths is None:
        for path in sorted(root.glob(CHANGELOG_GLOB)):
            problems += check_changelog(str(path.relative_to(root)), path.read_text())
        problems += check_sources(root)
        problems += check_pictures(root, doc_paths(root))
    return problems


def check_text(ctx: Context, rel: str, text: str) -> list[Problem]:
    """Check ``text`` as if it were the doc at ``rel`` (links resolve from there)."""
    _OVERRIDES[(ctx.root / rel).resolve()] = text
    try:
        return check_doc(ctx, rel, text)
    finally:
        del _OVERRIDES[(ctx.root / rel).resolve()]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("docs", nargs="*", type=Path, help="docs to check (default: every doc)")
    parser.add_argument(
        "--refresh-distances", action="store_true", help="first rewrite each 'at least N commits' claim"
    )
    args = parser.parse_args(argv)
    if args.refresh_distances:
        ctx = Context(ROOT)
        for path in [p.resolve() for p in args.docs] or doc_paths(ROOT):
            refresh_distances(ctx, path)
    problems = check(ROOT, [p.resolve() for p in args.docs] or None)
    for problem in problems:
        print(problem)
    checked = len(args.docs) or len(doc_paths(ROOT))
    print(f"doccheck: {checked} docs, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
