"""Every check gradsync runs, as nox sessions. `nox` with no arguments runs the quick set a contributor
runs before a change (lint, layers, types, every package's tests and the integration suite, on the pinned
torch only); `nox -t ci` runs the whole suite, as CI does: that set plus the build and doc check, the
compat torches (three CUDA builds of about 4.6 GB each on a fresh machine) and the mutation check.

Each session builds its own venv with torch pinned through constraints.txt, so what passes here passes on
a fresh machine that has only Python and pip.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# Every install is pinned by constraints.txt and skips byte-compiling: compiling all of torch's sources took
# about two thirds of each session's install (nearly a minute). Instead the first process that imports a
# module writes its bytecode, which needs PYTHONDONTWRITEBYTECODE unset (some images set it: every process
# would then compile torch again at import, about 10 s each).
NO_COMPILE = "--no-compile"
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
CONSTRAINTS = (NO_COMPILE, "-c", str(ROOT / "constraints.txt"))
TEST_TOOLS = ("pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "numpy")
# Optional extras some tests exercise: the fault-tolerance tests run on torchft. They kill and restart
# replica groups for about four minutes in all, so only the `faults` session (CI's) installs torchft; the
# test sessions and the compat sessions (torchft needs torch 2.7 or later) go without, and they skip there.
TEST_EXTRAS = {"ddp": ("torchft",), "fsdp": ("torchft",)}
FAULT_TESTS = {  # tests directory -> the files that need torchft
    ROOT / "packages" / "gradsync-ddp" / "tests": ("test_fault_tolerance.py",),
    ROOT / "packages" / "gradsync-fsdp" / "tests": ("test_fault_tolerance.py",),
    ROOT / "integration": ("test_train_ft.py", "test_ft_examples.py"),
}
# Tests only CI runs (the `tests-ci` session), kept out of the quick set's 15 minutes: the main job's optional
# report parts (each trains the job two or three times), gradsync-fsdp's hang-watchdog tests (they time real
# waits, so they run alone) and its stress test of every mesh and strategy in one world.
CI_ONLY_TESTS = {
    ROOT / "integration": ("test_torchrun_reports.py",),
    ROOT / "packages" / "gradsync-fsdp" / "tests": ("test_watchdog.py", "test_meshes_in_a_row.py"),
}
SLOWEST = "--durations=10"  # every test session names its slowest tests, so a slow CI run shows where it went
# The ranks of a multi-rank test sit idle in rendezvous and start-up much of the time, so two test files run
# at once (one pytest worker each; a file stays on one worker, which keeps its rank pools and cached
# references). The watchdog and fault tests time real waits against thresholds: they run alone, after.
PARALLEL = ("-n", "2", "--dist", "loadfile")
SERIAL = ("test_watchdog*.py", "test_fault_tolerance*.py", "test_train_ft.py", "test_torchrun.py")
# Each package's test session reports its results here (JUnit, one file per package), for this run's
# mutations session: guards that passed there need no second unmutated run (about 3 minutes of the suite).
REPORTS = Path(tempfile.mkdtemp(prefix="gradsync-nox-reports-"))
atexit.register(shutil.rmtree, REPORTS, ignore_errors=True)

# Layer of each package and the gradsync packages it declares (its pip dependencies). Kept in step with
# the pyprojects and the import-linter contract in .importlinter; the `build` session checks pip agrees.
LAYERS = {"groups": 1, "buffers": 2, "ddp": 3, "fsdp": 3, "finalize": 4}
DECLARES = {
    "groups": (),
    "buffers": ("groups",),
    "ddp": ("groups", "buffers"),
    "fsdp": ("groups", "buffers"),
    "finalize": ("groups",),
}
PACKAGES = tuple(LAYERS)

# torch releases the compat sessions run on besides the pinned one: the floor the packages declare, what
# current GPU images ship, and the newest release. Each takes a CUDA build from the registry (about 4.6 GB,
# run on the CPU); the venvs are reused between runs, so only a fresh machine downloads them.
COMPAT_TORCH = {"2.6": "2.6.0", "2.11": "2.11.0", "2.15": "2.15.0"}
FLOOR_TORCH = "2.6"

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
# `nox`: the quick set, on the pinned torch, nothing downloaded beyond the test tools. `nox -t ci` (what
# .ci/run runs): every session tagged "ci", in the order defined here (mutations last: it reuses the test
# sessions' results).
CI = "ci"
nox.options.sessions = [
    "lint",
    "layers",
    "typecheck",
    *(f"tests-{p}" for p in PACKAGES),
    "integration",
]


def pkg_dir(name: str) -> str:
    return str(ROOT / "packages" / f"gradsync-{name}")


def closure(name: str) -> set[str]:
    """The gradsync packages pip must pull in for ``name``, itself excluded."""
    deps: set[str] = set()
    for dep in DECLARES[name]:
        deps |= {dep} | closure(dep)
    return deps


def install_local(session: nox.Session, *names: str, extra: tuple[str, ...] = ()) -> None:
    """Install gradsync packages from their local paths with exactly the dependencies they declare."""
    needed = set(names)
    for name in names:
        needed |= closure(name)
    session.install(*CONSTRAINTS, *(pkg_dir(n) for n in sorted(needed)), *extra)


def run_tests(
    session: nox.Session, tests: Path, report: str | None, env: dict[str, str] | None = None
) -> None:
    """pytest over ``tests``: the files outside ``SERIAL`` two at a time, then those alone. ``report``: the
    JUnit reports' name (``<report>.xml`` and ``<report>.serial.xml``, for the mutation check). Arguments
    after ``--`` go to both runs; a run they leave with nothing to collect passes (exit status 5)."""
    ci_only = {str(tests / name) for name in CI_ONLY_TESTS.get(tests, ())}
    serial = sorted({str(path) for pattern in SERIAL for path in tests.glob(pattern)} - ci_only)
    ignored = [f"--ignore={path}" for path in sorted({*serial, *ci_only})]
    runs = (("", PARALLEL, [str(tests), *ignored]), (".serial", (), serial))
    for label, selection, targets in runs:
        if not targets:
            continue
        junit = (
            ()
            if report is None
            else ("-o", "junit_family=xunit1", f"--junitxml={REPORTS / report}{label}.xml")
        )
        session.run(
            "pytest", SLOWEST, *selection, *junit, *targets, *session.posargs, success_codes=[0, 5], env=env
        )


def make_tests_session(name: str) -> None:
    @nox.session(name=f"tests-{name}", tags=[CI])
    def tests(session: nox.Session) -> None:
        install_local(session, name, extra=TEST_TOOLS)
        run_tests(session, Path(pkg_dir(name)) / "tests", f"tests-{name}")

    tests.__doc__ = f"pytest on gradsync-{name} in a venv holding only it and its dependencies."


for _name in PACKAGES:
    make_tests_session(_name)


@nox.session(tags=[CI])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=[CI])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's sources, the integration model and script, and the benchmarks
    (config in mypy.ini)."""
    session.install(*CONSTRAINTS, "mypy", "torch", *TEST_TOOLS, "nox", "matplotlib")
    session.run("mypy", *(arg for p in PACKAGES for arg in ("-p", f"gradsync.{p}")))
    session.run("mypy", "noxfile.py")
    scripts = [
        "integration/toygpt",
        "integration/train.py",
        "integration/parity.py",
        "integration/exit_teardown.py",
        "integration/titan_style.py",
        "benchmarks",
        "tools",
        "examples",
    ]
    # benchmarks/ scripts import each other (bench_ab reuses bench_worker), as they run with it on the path
    # and examples/ too (the fault-tolerance examples share torchft_loop.py)
    search = os.pathsep.join(str(ROOT / d) for d in ("integration", "benchmarks", "examples"))
    session.run("mypy", *scripts, env={"MYPYPATH": search})


def src_path(root: Path) -> str:
    return ":".join(str(root / "packages" / f"gradsync-{p}" / "src") for p in PACKAGES)


@nox.session(tags=[CI])
def layers(session: nox.Session) -> None:
    """The import-linter layers contract, and proof that it catches upward and sibling imports."""
    session.install(*CONSTRAINTS, "import-linter")
    session.run("lint-imports", env={"PYTHONPATH": src_path(ROOT)})
    violations = {
        "groups": "import gradsync.buffers\n",  # upward import
        "buffers": "from gradsync.ddp import version\n",  # upward import
        "ddp": "import gradsync.fsdp\n",  # sibling import
    }
    for package, line in violations.items():
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp)
            shutil.copytree(ROOT / "packages", copy / "packages")
            shutil.copy(ROOT / ".importlinter", copy / ".importlinter")
            probe = copy / "packages" / f"gradsync-{package}" / "src" / "gradsync" / package
            (probe / "_layer_probe.py").write_text(line)
            result = subprocess.run(
                [str(Path(session.bin) / "lint-imports"), "--no-cache"],
                cwd=copy,
                env={"PYTHONPATH": src_path(copy), "PATH": session.bin},
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode == 0 or "BROKEN" not in result.stdout:
                session.error(
                    f"the layers contract did not catch `{line.strip()}` in gradsync.{package}:\n"
                    f"{result.stdout}{result.stderr}"
                )
            session.log(f"contract rejects `{line.strip()}` in gradsync.{package}, as it should")


@nox.session(tags=[CI])
def build(session: nox.Session) -> None:
    """Every wheel builds; then the doc check (tools/doccheck.py, and its test that plants wrong names):
    every name, session, flag and link in the READMEs and docs/ exists, and every figure carries its
    provenance; and the statistics bench_ab reports its ratios with. (The READMEs' install lines run in
    ``compat-2.6``, on the declared torch floor.)"""
    session.install(*CONSTRAINTS, "build", "torch")
    dist_dir = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(dist_dir, ignore_errors=True)
    for name in PACKAGES:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist_dir), pkg_dir(name))
    install_local(session, *PACKAGES, extra=("pytest", "nox"))
    doc_test = str(ROOT / "tools" / "test_doccheck.py")
    bench_stats_test = str(ROOT / "benchmarks" / "test_bench_ab.py")
    session.run("pytest", "-p", "no:cacheprovider", doc_test, bench_stats_test, *session.posargs)


def check_readme_installs(session: nox.Session, env: dict[str, str] | None = None) -> None:
    """Run every README's ``pip install packages/...`` line verbatim over the torch already in the venv:
    each must install exactly the layer it ends with and the layers that layer declares below it, nothing
    above, so a README that drifts fails here."""
    for package in PACKAGES:  # a reused venv may still hold them
        session.run("python", "-m", "pip", "uninstall", "-y", "-q", f"gradsync-{package}")
    commands = readme_install_commands()
    if {target for target, _ in commands} != set(PACKAGES):
        session.error(f"the READMEs show install commands for {sorted({t for t, _ in commands})} only")
    for target, command in commands:
        if installed_gradsync(session):
            session.error(f"venv not clean before `{' '.join(command)}`")
        session.run("python", "-m", *command, env=env)
        session.run("python", "-c", f"import gradsync.{target} as m; print(m.__name__, m.__version__)")
        pulled = installed_gradsync(session) - {target}
        if pulled != closure(target):
            session.error(
                f"`{' '.join(command)}` installed {sorted(pulled)} besides gradsync-{target}; "
                f"it declares {sorted(closure(target))}"
            )
        above = {p for p in pulled if LAYERS[p] >= LAYERS[target]}
        if above:
            session.error(f"gradsync-{target} pulled in layers at or above its own: {sorted(above)}")
        session.log(
            f"`{' '.join(command)}` installs gradsync-{target} with {sorted(pulled) or 'nothing else'}"
        )
        session.run("python", "-m", "pip", "uninstall", "-y", *(f"gradsync-{p}" for p in pulled | {target}))


def readme_install_commands() -> list[tuple[str, list[str]]]:
    """``(package, argv)`` for every distinct ``pip install packages/...`` line in the READMEs; the package
    is the last path the line names (comments after ``#`` dropped)."""
    found = []
    for readme in [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]:
        for line in readme.read_text().splitlines():
            words = line.split("#", 1)[0].split()
            if words[:2] != ["pip", "install"] or not words[-1].startswith("packages/gradsync-"):
                continue
            entry = (words[-1].removeprefix("packages/gradsync-"), words)
            if entry not in found:
                found.append(entry)
    return found


def installed_gradsync(session: nox.Session) -> set[str]:
    out = session.run("python", "-m", "pip", "list", "--format=json", silent=True)
    assert isinstance(out, str)
    names = {entry["name"].lower() for entry in json.loads(out)}
    return {n.removeprefix("gradsync-") for n in names if n.startswith("gradsync-")}


# The subset each compat session runs: every wrapper (DDP, distributed optimizer, MegatronFSDP's four
# strategies, HSDP / HFSDP, the fully_shard and fsdp2 APIs), every checkpoint path (DCP resharding, the
# optimizer's state on ranks owning nothing, full state dicts), finalize_model_grads, and the packed wires
# (fp8 views and casts) and torch's own comm hooks.
COMPAT_TESTS = {
    "groups": ("test_megatron_api.py", "test_teardown.py"),
    "buffers": ("test_buffer.py", "test_collective_paths.py", "test_low_precision_reduce.py"),
    "ddp": (
        "test_wrapper.py",
        "test_distributed_optimizer.py",
        "test_dcp.py",
        "test_rank_agreement.py",
        "test_comm_hooks.py",
    ),
    "fsdp": (
        "test_parity.py",
        "test_hsdp.py",
        "test_fully_shard.py",
        "test_dcp.py",
        "test_dcp_empty_ranks.py",
        "test_fsdp2_api.py",
        "test_fsdp2_surface.py",
        "test_fsdp2_meta_and_load.py",
        "test_ragged.py",
        "test_torch_native.py",
        "test_uneven_dtensor.py",
        "test_rank_agreement.py",
        "test_local_step.py",
        "test_grad_comm_wire.py",
        "test_param_gather_wire.py",
        "test_comm_hooks.py",
        "test_schedules.py",  # the zero-skip reads torch's version counter
    ),
    "finalize": ("test_finalize.py",),
}


def make_compat_session(label: str, version: str) -> None:
    @nox.session(name=f"compat-{label}", reuse_venv=True, tags=[CI])
    def compat(session: nox.Session) -> None:
        # the machine's pip configuration may cap torch below the newest release: installs here ignore it
        env = {"PIP_CONFIG_FILE": os.devnull}
        pins = Path(session.create_tmp()) / "constraints.txt"
        # this torch's own triton pin replaces ours (the CUDA builds depend on one exact triton each)
        lines = [
            f"torch=={version}" if line.startswith("torch==") else line
            for line in (ROOT / "constraints.txt").read_text().splitlines()
            if not line.startswith("triton==")
        ]
        pins.write_text("\n".join(lines))
        session.install(NO_COMPILE, "-c", str(pins), "torch", *TEST_TOOLS, env=env)
        if label == FLOOR_TORCH:  # (it leaves no gradsync package installed)
            check_readme_installs(session, env)
        # a reused venv keeps the last run's packages: put this tree's in place, over the torch above
        local = (str(ROOT / "packages" / f"gradsync-{p}") for p in PACKAGES)
        session.install(NO_COMPILE, "--no-deps", "--force-reinstall", *local, env=env)
        session.run(
            "python",
            "-c",
            f"import torch; assert torch.__version__.startswith('{version}'), torch.__version__",
        )
        # another torch deprecates other names: gradsync's use of them warns there instead of failing
        keep = ("-W", "default::FutureWarning:gradsync")
        for name, files in COMPAT_TESTS.items():
            tests = [str(ROOT / "packages" / f"gradsync-{name}" / "tests" / f) for f in files]
            session.run(
                "pytest", SLOWEST, *PARALLEL, *keep, "-p", "no:cacheprovider", *tests, *session.posargs,
                env={"GRADSYNC_TEST_DEPRECATIONS": "default"},
            )  # fmt: skip

    compat.__doc__ = (
        f"Every package's compat subset (COMPAT_TESTS) on torch {version} from the registry, in a reused venv"
        + (", and every README install line on it (the declared floor)." if label == FLOOR_TORCH else ".")
    )


for _label, _version in COMPAT_TORCH.items():
    make_compat_session(_label, _version)


@nox.session(tags=[CI])
def integration(session: nox.Session) -> None:
    """The integration suite: every strategy on the CI layouts vs a single-process run, plus torchrun
    launches (report, bit-exact resume, a killed rank), the main job under torchft with a replica group
    killed (in the `faults` session), and the examples (quick start B's needs transformers)."""
    install_local(session, *PACKAGES, extra=(*TEST_TOOLS, "transformers", "triton"))
    megatron = {"PYTHONPATH": megatron_core(session), "GRADSYNC_REQUIRE_MEGATRON_CORE": "1"}
    run_tests(session, ROOT / "integration", None, env=megatron)


@nox.session(name="tests-ci", tags=[CI])
def tests_ci(session: nox.Session) -> None:
    """The tests only CI runs (CI_ONLY_TESTS), one at a time; a package's results go to this run's mutation
    check as the test sessions' do."""
    install_local(session, *PACKAGES, extra=(*TEST_TOOLS, "matplotlib"))
    run_listed(session, CI_ONLY_TESTS, "ci")


def run_listed(
    session: nox.Session,
    listed: dict[Path, tuple[str, ...]],
    label: str,
    success_codes: tuple[int, ...] = (0,),
) -> None:
    """pytest over each directory's ``listed`` files, one directory at a time; a package's results go to
    this run's reports as ``tests-<package>.<label>.xml`` (the mutation check reads them)."""
    for tests, files in listed.items():
        package = tests.parent.name.removeprefix("gradsync-")
        junit = ("-o", "junit_family=xunit1", f"--junitxml={REPORTS / f'tests-{package}.{label}.xml'}")
        session.run(
            "pytest", SLOWEST, *(junit if tests.name == "tests" else ()), *(str(tests / f) for f in files),
            *session.posargs, success_codes=list(success_codes),
        )  # fmt: skip


def megatron_core(session: nox.Session) -> str:
    """A directory holding Megatron-Core's pure-Python code, unzipped from the wheel constraints.txt pins:
    the wheel declares Python >= 3.12, so pip will not install it on 3.11, and the compiled helper it
    carries is not needed. Kept in the session's tmp directory between runs."""
    pin = next(
        line
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("megatron-core==")
    )
    target = Path(session.create_tmp()) / pin
    if not (target / "megatron" / "core").is_dir():
        wheels = target / "wheel"
        session.run(
            "python", "-m", "pip", "download", pin, "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "-d", str(wheels),
        )  # fmt: skip
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return str(target)


@nox.session(tags=[CI])
def faults(session: nox.Session) -> None:
    """The fault-tolerance tests on torchft (FAULT_TESTS): replica groups SIGKILLed mid-step, healed from a
    peer, checked against a one-process replay; the main job with a group killed. One at a time: they time
    real restarts."""
    extras = {extra for p in PACKAGES for extra in TEST_EXTRAS.get(p, ())}
    install_local(session, *PACKAGES, extra=(*TEST_TOOLS, *sorted(extras)))
    run_listed(session, FAULT_TESTS, "faults", success_codes=(0, 5))  # 5: nothing collected after -k


@nox.session(tags=[CI])
def mutations(session: nox.Session) -> None:
    """The mutation check: each behaviour listed in tools/mutations.json is broken on purpose in a copy of
    the packages, and the tests guarding it must fail (tools/mutations.py; arguments go to it: -k NAME,
    --list, -v). Guards that passed in this run's test sessions are not run unmutated again."""
    extras = {extra for p in PACKAGES for extra in TEST_EXTRAS.get(p, ())}
    install_local(session, *PACKAGES, extra=(*TEST_TOOLS, *sorted(extras)))
    reports = sorted(str(r) for r in REPORTS.glob("tests-*.xml"))
    passed = ("--passed", *reports) if reports else ()
    session.run("python", str(ROOT / "tools" / "mutations.py"), *passed, *session.posargs)


@nox.session(name="integration-full")
def integration_full(session: nox.Session) -> None:
    """The integration suite over every layout (not in the default set: about twice as long)."""
    install_local(session, *PACKAGES, extra=(*TEST_TOOLS, "transformers"))
    session.run("pytest", str(ROOT / "integration"), *session.posargs, env={"GRADSYNC_INTEGRATION_FULL": "1"})


@nox.session(name="bench-buffers")
def bench_buffers(session: nox.Session) -> None:
    """Benchmark (not a test): each collective path of gradsync-buffers on this machine, as a table."""
    install_local(session, "buffers")
    session.run("python", pkg_dir("buffers") + "/benchmarks/bench_collectives.py", *session.posargs)


@nox.session(name="bench-ddp")
def bench_ddp(session: nox.Session) -> None:
    """Benchmark (not a test): gradsync DDP vs torch DDP vs the compute floor on a ~23M-param GPT."""
    install_local(session, "ddp")
    session.run("python", pkg_dir("ddp") + "/benchmarks/bench_ddp.py", *session.posargs)


@nox.session(name="bench-overhead")
def bench_overhead(session: nox.Session) -> None:
    """Benchmark (not a test): per-step wrapper overhead in microseconds, gradsync DDP vs torch DDP, on a
    model of 10,000 tiny params at DP 2 (bench_ddp.py --model tiny-params)."""
    install_local(session, "ddp")
    script = pkg_dir("ddp") + "/benchmarks/bench_ddp.py"
    session.run("python", script, "--model", "tiny-params", "--steps", "40", "--interleave", *session.posargs)


@nox.session(name="bench-ab")
def bench_ab(session: nox.Session) -> None:
    """Benchmark (not a test): every gradsync strategy, torch DDP, torch FSDP2 and DeepSpeed ZeRO-1/2/3, their
    steps interleaved in the same processes, as ratios to the compute floor and to torch DDP (arguments go
    to benchmarks/bench_ab.py: --systems, --repeats, --bucket-mb, --steps)."""
    install_local(session, "ddp", "fsdp", "finalize", extra=("deepspeed",))
    session.run("python", str(ROOT / "benchmarks" / "bench_ab.py"), *session.posargs)


@nox.session(name="bench-launch")
def bench_launch(session: nox.Session) -> None:
    """Benchmark (not a test): the launch-bound model (next to no compute, many small params and units), every
    system's steps interleaved: host time per step, unit and param beside torch DDP, FSDP2 and the floor, on
    gloo at worlds 1 and 2 (no GPU). ``-- --device cuda`` adds the GPT models of docs/performance.md (fp32,
    the bf16 recipe) at world 1 on NCCL, sized for five minutes on one GPU (benchmarks/bench_launch.py;
    DeepSpeed if named)."""
    install_local(session, "ddp", "fsdp", "finalize")
    session.run("python", str(ROOT / "benchmarks" / "bench_launch.py"), *session.posargs)


@nox.session(name="bench-memory")
def bench_memory(session: nox.Session) -> None:
    """Benchmark (not a test): bytes per param each strategy holds after a step and its peak in one, fp32
    and the bf16 recipe, beside the ZeRO formulas and torch FSDP2, at worlds 1 and 2 (gloo, or
    ``-- --device cuda``; benchmarks/bench_memory.py)."""
    install_local(session, "ddp", "fsdp", "finalize")
    session.run("python", str(ROOT / "benchmarks" / "bench_memory.py"), *session.posargs)


@nox.session(name="bench-muon")
def bench_muon(session: nox.Session) -> None:
    """Benchmark (not a test): Muon against AdamW under ddp+distopt, ZeRO-1 and ZeRO-3, interleaved at two
    batch sizes, with wire bytes (benchmarks/bench_muon.py)."""
    install_local(session, "ddp", "fsdp", "finalize")
    session.run("python", str(ROOT / "benchmarks" / "bench_muon.py"), *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark (not a test): gradsync's DDP and FSDP strategies vs torch DDP, torch FSDP2 and DeepSpeed
    ZeRO-1/2/3: step times interleaved in the same processes (repeated), peak RSS and wire bytes from each
    system alone, as ratios to the compute floor; writes benchmarks/RESULTS.md and results.png."""
    install_local(session, "ddp", "fsdp", "finalize", extra=("deepspeed", "matplotlib"))
    session.run("python", str(ROOT / "benchmarks" / "bench.py"), *session.posargs)


@nox.session
def train(session: nox.Session) -> None:
    """The main job: train the toy GPT on 4 ranks (gloo on CPU, NCCL with 4 GPUs) for a few minutes and
    write a report. Extra arguments go to integration/train.py (``nox -s train -- --help``).

    ``nox -s train -- --fault-tolerance [...]``: the job under torchft instead, 3 replica groups with one
    killed and restarted, against the same job with no fault (integration/train_ft.py; runs/train-ft)."""
    if "--fault-tolerance" in session.posargs:
        install_local(session, "ddp", extra=("matplotlib", *TEST_EXTRAS["ddp"]))
        rest = [arg for arg in session.posargs if arg != "--fault-tolerance"]
        out = f"--out-dir={ROOT / 'runs' / 'train-ft'}"
        session.run("python", str(ROOT / "integration" / "train_ft.py"), out, *rest)
        return
    install_local(session, *PACKAGES, extra=("matplotlib",))
    out_dir = ROOT / "runs" / "train"
    args = " ".join(session.posargs)
    whole_matrices = "muon" in args and "--tp" not in args  # Muon's README report ran at DP 4 (--tp 2 works)
    layout = [] if whole_matrices else ["--tp=2", "--sequence-parallel"]
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node=4",
        str(ROOT / "integration" / "train.py"),
        *layout,
        f"--out-dir={out_dir}",
        *session.posargs,
    )


@nox.session
def pictures(session: nox.Session) -> None:
    """The layout pictures in docs/ (not a test): the flat buffers of gradsync DDP with the distributed
    optimizer and of MegatronFSDP ZeRO-3, the HSDP mesh and the torchft layout, drawn from the packages' own
    layout code by tools/draw_layouts.py (arguments go to it: --out-dir). An unchanged tree redraws the same
    bytes."""
    install_local(session, "fsdp", extra=("matplotlib",))
    session.run("python", str(ROOT / "tools" / "draw_layouts.py"), *session.posargs)
