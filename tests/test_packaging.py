"""What ships and what runs where (issue 16, items 3 and 4): the wheel holds the product and no
test rig; the benches run from a checkout without importing tests/; CI, tox and the README run
the same test command."""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted((ROOT / "bench").glob("*.py"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel `pip install .` would install, built from a copy of the tracked sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("ttp_patch-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_the_product(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in ("patcher/cli.py", "patcher/prerequisites.py", "mindio_ttp/config.py",
                   "mindio_ttp/framework_ttp/__init__.py", "mindio_ttp/launch/agent.py",
                   "mindio_ttp/launch/preflight.py", "mindio_ttp/megatron_ttp/save.py",
                   "mindio_ttp/cpu_adaptor/__init__.py", "mindio_ttp/demo/faults.py",
                   "mindio_ttp/demo/rehearsal/runner.py"):
        assert module in names, module
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_points = wheel.read(meta).decode()
    for script in ("ttp-patch = patcher.cli:main", "ttprun = mindio_ttp.launch.agent:main",
                   "ttp-demo = mindio_ttp.demo:main"):
        assert script in entry_points


def test_the_wheel_holds_no_test_rig(wheel: zipfile.ZipFile) -> None:
    """testkit/ (import hooks, the root-only network-namespace helper, the workers'
    sitecustomize hooks) and tests/ stay in the checkout."""
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"patcher", "mindio_ttp"}
    rig = [n for n in names if re.search(r"(^|/)(testkit|tests?|testing|megatron_testing)/", n)
           or n.endswith(("sitecustomize.py", "netns.py", "conftest.py"))]
    assert rig == []
    for name in names:  # nothing shipped imports the rig
        if name.endswith(".py"):
            tree = ast.parse(wheel.read(name))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert node.module.split(".")[0] not in ("testkit", "tests"), name
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        assert alias.name.split(".")[0] not in ("testkit", "tests"), name


def test_no_bench_imports_the_test_tree() -> None:
    for path in BENCHES:
        for node in ast.walk(ast.parse(path.read_bytes())):
            modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                       else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for module in modules:
                assert module.split(".")[0] != "tests", f"{path.name} imports {module}"


@pytest.mark.parametrize("bench", BENCHES, ids=[p.name for p in BENCHES])
def test_every_bench_starts_from_anywhere(bench: Path, tmp_path: Path) -> None:
    """`python bench/X.py --help` from another directory: its imports (testkit included)
    resolve from the checkout alone."""
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(bench), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def _pytest_line(text: str) -> str:
    found = re.search(r"python -m pytest[^\n#{]*", text)
    assert found, text[:200]
    return found.group(0).strip()


def test_ci_tox_and_readme_run_the_same_test_command() -> None:
    """-rfEs: a skipped test says why, so a CI run that skipped the real tree shows it, and the
    summary names every failed and erroring test (one of 1,086 failed once, unnamed)."""
    readme = _pytest_line((ROOT / "README.md").read_text())
    ci = _pytest_line((ROOT / ".ci/run").read_text().split("# README.md: the test command", 1)[1])
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    assert readme == ci == _pytest_line(tox["testenv"]["commands"]) == "python -m pytest -q -rfEs"


def test_ci_fails_without_the_real_tree() -> None:
    """Before: it warned and went on, and every real-tree test skipped on a green run."""
    text = (ROOT / ".ci/run").read_text()
    start = text.index('if [ ! -f "$tarball" ]; then')
    assert "exit 1" in text[start:text.index("fi", start)]


def test_the_demo_extra_has_what_the_demo_imports_and_no_dev_tools() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    demo = {re.split(r"[<>=\[ ]", line.strip())[0] for line in extras["demo"].splitlines()
            if line.strip() and not line.strip().startswith("#")}
    assert {"psutil", "pybind11", "regex", "six"} <= demo
    assert not demo & {"ruff", "hypothesis", "pytest"}


def test_the_quick_start_installs_what_its_next_two_commands_need() -> None:
    """Issue 26: the quick start installed ".[demo]", which leaves out pytest, so the test
    command right after it failed on a fresh machine. The extra it installs must hold what
    `ttp-demo` imports and pytest; and the quick start comes before everything else."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    found = re.search(r'pip install "\.\[([a-z,]+)\]"', block)
    assert found, block
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    names = set()
    for extra in found.group(1).split(","):
        names |= {re.split(r"[<>=\[ ]", line.strip())[0] for line in extras[extra].splitlines()
                  if line.strip() and not line.strip().startswith("#")}
    assert {"pytest", "psutil", "pybind11", "regex", "six"} <= names, names
    lines = block.splitlines()
    assert lines.index(next(ln for ln in lines if ln.startswith("pip install \".["))) < \
        lines.index(next(ln for ln in lines if ln.startswith("ttp-demo"))) < \
        lines.index(next(ln for ln in lines if ln.startswith("python -m pytest")))
    sections = re.findall(r"^## (.+)$", readme, re.M)
    order = [sections.index(s) for s in ("Install on a cluster", "What it costs",
                                         "What survives what")]
    assert order == sorted(order), sections
