"""Fixture repositories for the patcher tests: our own small files, committed in a tmp git repo.

The pinned Megatron commit cannot exist in such a repo, so the tests point the tool at the
fixture's commit as the pin (testkit/patcher_pin.py: in this process and in every ttp-patch
the tests start).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest

from testkit.patcher_pin import pin_to

CASES = Path(__file__).parent / "cases"
TREE = CASES / "tree"
GOLDEN = CASES / "golden"
TARGETS = [
    "pretrain_gpt.py",
    "megatron/training.py",
    "megatron/optimizer/__init__.py",
    "megatron/core/parallel_state.py",
    "megatron/initialize.py",
]
SCRIPT = "pretrain_gpt_ttp.sh"


def fixture_files() -> Dict[str, bytes]:
    """Relative path in the repo -> bytes, from cases/tree (the .txt suffix dropped)."""
    out = {}
    for p in sorted(TREE.rglob("*.txt")):
        rel = p.relative_to(TREE).as_posix()
        if rel.endswith((".py.txt", ".sh.txt")):
            rel = rel[: -len(".txt")]
        out[rel] = p.read_bytes()
    return out


def golden(device: str, rel: str) -> bytes:
    return (GOLDEN / device / (rel + ".txt")).read_bytes()


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True
    ).stdout


def porcelain(root: Path) -> str:
    return git(root, "status", "--porcelain", "--untracked-files=all")


@dataclass
class FixtureRepo:
    root: Path
    commit: str

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def write(self, rel: str, data: bytes) -> None:
        (self.root / rel).write_bytes(data)

    def porcelain(self) -> str:
        return porcelain(self.root)

    def snapshot(self) -> Dict[str, bytes]:
        """Every work-tree file plus the ttp-patch record, to check that nothing changed."""
        files = {
            p.relative_to(self.root).as_posix(): p.read_bytes()
            for p in self.root.rglob("*")
            if p.is_file() and ".git" not in p.relative_to(self.root).parts
        }
        record = self.root / ".git" / "ttp-patch.json"
        if record.exists():
            files[".git/ttp-patch.json"] = record.read_bytes()
        return files

    def commit_all(self, message: str) -> str:
        git(self.root, "add", "-A")
        git(self.root, "commit", "-q", "-m", message)
        return git(self.root, "rev-parse", "HEAD").strip()


def make_repo(root: Path, files: Dict[str, bytes]) -> FixtureRepo:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if rel.endswith(".sh"):
            target.chmod(0o755)
    git(root, "init", "-q")
    git(root, "config", "user.email", "tests@ttp-patch.invalid")
    git(root, "config", "user.name", "ttp-patch tests")
    git(root, "config", "core.autocrlf", "false")
    repo = FixtureRepo(root, "")
    repo.commit = repo.commit_all("fixture")
    return repo


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FixtureRepo:
    r = make_repo(tmp_path / "megatron", fixture_files())
    pin_to(monkeypatch, r.root, r.commit)
    return r


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it (exit code, stdout, stderr)."""
    return subprocess.run(["ttp-patch", *args], capture_output=True, text=True, timeout=60)
