"""Forks and nearby commits (issue 10): the pin is four files' bytes, not one commit id.

Fixture repos stand in for Megatron: TTP_PATCH_COMMIT names the fixture's first commit, whose
target blobs play 285068c's; later commits, branches and work-tree edits are made on top.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import SCRIPT, TARGETS, FixtureRepo, fixture_files, git, golden

from patcher import originals
from patcher.cli import main
from patcher.pin import PINNED_BLOBS, PINNED_COMMIT, blob_id

RECORD = Path(".git") / "ttp-patch.json"


def ttp(capsys, *args: str):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _record(repo: FixtureRepo) -> dict:
    return json.loads((repo.root / RECORD).read_text())


# --- 1. any HEAD whose four target files are byte-identical to the pin's ---------------------


def test_empty_commit_on_top_applies_and_names_the_commit(repo: FixtureRepo, capsys) -> None:
    git(repo.root, "commit", "-q", "--allow-empty", "-m", "empty on top")
    head = git(repo.root, "rev-parse", "HEAD").strip()
    code, _, err = ttp(capsys, "apply", str(repo.root), "--device", "cpu")
    assert code == 0, err
    assert f"found HEAD {head} (newer than the pinned commit)" in err
    assert "4 target files are byte-identical" in err
    for path in TARGETS + [SCRIPT]:
        assert repo.read(path) == golden("cpu", path), path
    assert _record(repo)["commit"] == head
    assert ttp(capsys, "verify", str(repo.root))[0] == 0
    assert ttp(capsys, "revert", str(repo.root))[0] == 0
    assert repo.porcelain() == ""


def test_fork_commit_with_identical_targets_applies(repo: FixtureRepo, capsys) -> None:
    """A fork: its own history (no pinned commit in it), other files changed, targets equal."""
    files = fixture_files()
    files["README.md"] = b"our fork of the fixture\n"
    fork = repo.root.parent / "fork"
    subprocess.run(["git", "init", "-q", str(fork)], check=True)
    git(fork, "config", "user.email", "fork@ttp-patch.invalid")
    git(fork, "config", "user.name", "fork")
    for rel, data in files.items():
        (fork / rel).parent.mkdir(parents=True, exist_ok=True)
        (fork / rel).write_bytes(data)
    git(fork, "add", "-A")
    git(fork, "commit", "-q", "-m", "fork")
    # The pin's blob ids come from the fixture repo's commit; make it known to the fork too.
    git(fork, "fetch", "-q", str(repo.root), repo.commit)
    code, _, err = ttp(capsys, "apply", str(fork))
    assert code == 0, err
    assert "not on the pinned commit's line" in err and "byte-identical" in err
    assert (fork / "megatron/training.py").read_bytes() == golden("npu", "megatron/training.py")
    assert ttp(capsys, "revert", str(fork))[0] == 0
    assert git(fork, "status", "--porcelain") == ""


def test_pinned_head_says_nothing_about_the_commit(repo: FixtureRepo, capsys) -> None:
    code, _, err = ttp(capsys, "apply", str(repo.root))
    assert code == 0 and "found HEAD" not in err


def test_commit_with_a_differing_target_is_refused_naming_it(repo: FixtureRepo, capsys) -> None:
    opt = repo.root / "megatron/optimizer/__init__.py"
    opt.write_bytes(opt.read_bytes() + b"# fork-local\n")
    head = repo.commit_all("fork change")
    before = repo.snapshot()
    code, _, err = ttp(capsys, "apply", str(repo.root))
    assert code == 2
    assert head in err and "megatron/optimizer/__init__.py" in err and "--allow-modified" in err
    assert "megatron/training.py" not in err.split("hint:")[0]
    assert repo.snapshot() == before


def test_pinned_blob_table_is_285068c(megatron_dir: Path) -> None:
    """The table the tool ships equals the real checkout's `git ls-tree` and its bytes."""
    out = git(megatron_dir, "ls-tree", PINNED_COMMIT, "--", *TARGETS)
    listed = {line.split("\t")[1]: line.split()[2] for line in out.splitlines()}
    assert listed == PINNED_BLOBS
    for path, blob in PINNED_BLOBS.items():
        data = subprocess.run(
            ["git", "-C", str(megatron_dir), "cat-file", "blob", f"{PINNED_COMMIT}:{path}"],
            check=True,
            capture_output=True,
        ).stdout
        assert blob_id(data) == blob


@pytest.mark.parametrize("data", [b"", b"x\n", b"\x00\xff" * 100])
def test_blob_id_is_gits(tmp_path: Path, data: bytes) -> None:
    f = tmp_path / "f"
    f.write_bytes(data)
    out = subprocess.run(["git", "hash-object", str(f)], check=True, capture_output=True)
    assert blob_id(data) == out.stdout.decode().strip()


def test_stored_original_names_are_flat_in_git_dir(tmp_path: Path) -> None:
    names = [p.name for p in originals.all_paths(tmp_path)]
    assert len(set(names)) == len(TARGETS) and all("/" not in n for n in names)
