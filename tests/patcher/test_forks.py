"""Forks and nearby commits (issue 10): the pin is four files' bytes, not one commit id.

Fixture repos stand in for Megatron: the fixture's first commit is the pin
(testkit/patcher_pin.py), whose target blobs play 285068c's; later commits, branches and
work-tree edits are made on top.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from conftest import SCRIPT, TARGETS, FixtureRepo, fixture_files, git, golden

from patcher import fileio, originals
from patcher.cli import main
from patcher.pin import PINNED_BLOBS, PINNED_COMMIT, blob_id

RECORD = Path(".git") / "ttp-patch.json"


def ttp(capsys, *args: str):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _record(repo: FixtureRepo) -> dict:
    return json.loads((repo.root / RECORD).read_text())


# --- 1. any HEAD whose target files are byte-identical to the pin's ---------------------


def test_empty_commit_on_top_applies_and_names_the_commit(repo: FixtureRepo, capsys) -> None:
    git(repo.root, "commit", "-q", "--allow-empty", "-m", "empty on top")
    head = git(repo.root, "rev-parse", "HEAD").strip()
    code, _, err = ttp(capsys, "apply", str(repo.root), "--device", "cpu")
    assert code == 0, err
    assert f"found HEAD {head} (newer than the pinned commit)" in err
    assert "5 target files are byte-identical" in err
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


# --- 2. --allow-modified: other bytes, when every anchor is found exactly once ----------------

TRAINING = "megatron/training.py"
USER_EDIT = (b'    """Evaluation."""\n', b'    """Evaluation, our fork\'s."""\n')


def _user_edit(data: bytes) -> bytes:
    assert data.count(USER_EDIT[0]) == 1
    return data.replace(*USER_EDIT)


def test_modified_file_without_the_flag_is_refused_with_the_hint(
    repo: FixtureRepo, capsys
) -> None:
    repo.write(TRAINING, _user_edit(repo.read(TRAINING)))
    before = repo.snapshot()
    code, _, err = ttp(capsys, "apply", str(repo.root))
    assert code == 1 and TRAINING in err and "--allow-modified" in err
    assert repo.snapshot() == before


def test_allow_modified_work_tree_edit_applies_and_revert_gives_the_users_bytes(
    repo: FixtureRepo, capsys
) -> None:
    mine = _user_edit(repo.read(TRAINING))
    repo.write(TRAINING, mine)
    code, _, err = ttp(capsys, "apply", str(repo.root), "--allow-modified", "--device", "cpu")
    assert code == 0, err
    assert f"--allow-modified: patching {TRAINING}" in err
    assert repo.read(TRAINING) == _user_edit(golden("cpu", TRAINING))
    stored = originals.stored_path(repo.root / ".git", TRAINING)
    assert stored.read_bytes() == mine  # not in git: the copy is what revert can give back
    assert _record(repo)["files"][TRAINING]["before"] == hashlib.sha256(mine).hexdigest()
    assert ttp(capsys, "verify", str(repo.root))[0] == 0
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 0, err
    assert repo.read(TRAINING) == mine
    assert not stored.exists() and not (repo.root / RECORD).exists()
    assert repo.porcelain() == f" M {TRAINING}\n"


def test_allow_modified_fork_commit_applies_and_reverts_to_head(repo: FixtureRepo, capsys) -> None:
    repo.write(TRAINING, _user_edit(repo.read(TRAINING)))
    head = repo.commit_all("fork: our docstring")
    code, _, err = ttp(capsys, "apply", str(repo.root), "--allow-modified")
    assert code == 0, err
    assert f"found HEAD {head}" in err and f"differing: {TRAINING}" in err
    assert not originals.stored_path(repo.root / ".git", TRAINING).exists()  # HEAD has them
    assert repo.read(TRAINING) == _user_edit(golden("npu", TRAINING))
    assert ttp(capsys, "revert", str(repo.root))[0] == 0
    assert repo.porcelain() == ""


@pytest.mark.parametrize(
    "old, new, needles",
    [
        (
            b"    optimizer.reduce_model_grads(args, timers)\n",
            b"    optimizer.reduce_grads(args, timers)\n",
            ["training/barrier-after-reduce", "function train_step()", "not found"],
        ),
        (
            b"    total_loss_dict = {}\n\n    # Iterations.\n",
            b"    total_loss_dict = {}\n    total_loss_dict = {}\n\n    # Iterations.\n",
            ["training/start-ttp", "function train()", "found 2 times"],
        ),
    ],
    ids=["anchor-gone", "anchor-twice"],
)
def test_allow_modified_refuses_an_anchor_that_does_not_match_once(
    repo: FixtureRepo, capsys, old: bytes, new: bytes, needles
) -> None:
    data = repo.read(TRAINING)
    assert data.count(old) == 1
    repo.write(TRAINING, data.replace(old, new))
    before = repo.snapshot()
    code, _, err = ttp(capsys, "apply", str(repo.root), "--allow-modified")
    assert code == 1
    for needle in [TRAINING, *needles]:
        assert needle in err, err
    assert repo.snapshot() == before


def test_commit_after_apply_then_revert_restores_the_recorded_original(
    repo: FixtureRepo, capsys
) -> None:
    mine = _user_edit(repo.read(TRAINING))
    repo.write(TRAINING, mine)
    assert ttp(capsys, "apply", str(repo.root), "--allow-modified")[0] == 0
    repo.commit_all("commit the patched tree")  # HEAD now holds our output
    assert ttp(capsys, "revert", str(repo.root))[0] == 0
    assert repo.read(TRAINING) == mine
    assert repo.read("pretrain_gpt.py") == fixture_files()["pretrain_gpt.py"]  # from the commit


def test_planted_original_copy_is_never_restored(repo: FixtureRepo, capsys) -> None:
    repo.write(TRAINING, _user_edit(repo.read(TRAINING)))
    assert ttp(capsys, "apply", str(repo.root), "--allow-modified")[0] == 0
    originals.stored_path(repo.root / ".git", TRAINING).write_bytes(b"import os\n")
    before = repo.snapshot()
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 2 and f"the bytes {TRAINING} had before apply" in err and "--force" in err
    assert repo.snapshot() == before
    assert ttp(capsys, "revert", str(repo.root), "--force")[0] == 0
    assert repo.read(TRAINING) == fixture_files()[TRAINING]  # HEAD's, as the hint said


# --- 3. revert after the user changed other lines: take out only our edits -------------------


def test_revert_keeps_user_changes_away_from_our_hunks(repo: FixtureRepo, capsys) -> None:
    assert ttp(capsys, "apply", str(repo.root), "--port", "9100")[0] == 0
    changed = _user_edit(repo.read(TRAINING)).replace(
        b"import time\n", b"import time\nimport json  # added after apply\n"
    )
    repo.write(TRAINING, changed)
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 0, err
    assert f"kept your later changes in {TRAINING}" in err
    want = _user_edit(fixture_files()[TRAINING]).replace(
        b"import time\n", b"import time\nimport json  # added after apply\n"
    )
    assert repo.read(TRAINING) == want
    for path in TARGETS:
        if path != TRAINING:
            assert repo.read(path) == fixture_files()[path]
    assert repo.porcelain() == f" M {TRAINING}\n"


def test_revert_after_allow_modified_and_later_edit_gives_both_user_changes(
    repo: FixtureRepo, capsys
) -> None:
    mine = _user_edit(repo.read(TRAINING))
    repo.write(TRAINING, mine)
    assert ttp(capsys, "apply", str(repo.root), "--allow-modified")[0] == 0
    later = b"# note added after apply\n"
    repo.write(TRAINING, repo.read(TRAINING) + later)
    assert ttp(capsys, "revert", str(repo.root))[0] == 0
    assert repo.read(TRAINING) == mine + later


@pytest.mark.parametrize(
    "old, new, edit",
    [
        (  # the anchor line of 2.7 itself
            b"    total_loss_dict = {}\n    # begin",
            b"    total_loss_dict = dict()\n    # begin",
            "training/start-ttp (2.7)",
        ),
        (  # a line right after our inserted 2.8
            b"        args.consumed_train_samples +=",
            b"        print(iteration)\n        args.consumed_train_samples +=",
            "training/set-ckpt-args (2.8)",
        ),
    ],
    ids=["anchor-changed", "insert-next-to-ours"],
)
def test_revert_refuses_a_user_change_touching_our_hunk(
    repo: FixtureRepo, capsys, old: bytes, new: bytes, edit: str
) -> None:
    assert ttp(capsys, "apply", str(repo.root))[0] == 0
    data = repo.read(TRAINING)
    assert data.count(old) == 1, data.decode()
    repo.write(TRAINING, data.replace(old, new))
    before = repo.snapshot()
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 1
    assert f"{TRAINING}: your change at line" in err and edit in err, err
    assert repo.snapshot() == before


def test_merged_revert_is_all_or_nothing(repo: FixtureRepo, capsys, monkeypatch) -> None:
    """The merged file goes through write_all with the rest: a failing write restores all."""
    assert ttp(capsys, "apply", str(repo.root))[0] == 0
    repo.write(TRAINING, _user_edit(repo.read(TRAINING)))
    before = repo.snapshot()
    calls = []
    real = fileio._replace_file

    def fail_third(tmp: str, target: Path) -> None:
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(tmp, target)

    monkeypatch.setattr(fileio, "_replace_file", fail_third)
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 2 and "No space left on device" in err
    assert repo.snapshot() == before
    assert not (repo.root / ".git" / "ttp-patch.journal").exists()
