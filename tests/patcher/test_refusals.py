"""Every bad input: a clear message, a non-zero exit code, and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import SCRIPT, TARGETS, FixtureRepo, fixture_files, git, make_repo

from patcher import fileio
from patcher.cli import main
from testkit.patcher_pin import pin_to, unpin

RECORD = Path(".git") / "ttp-patch.json"


def refused(capsys, repo: FixtureRepo, args, code: int, *needles: str) -> str:
    """Run a command that must refuse: its exit code, message, and an untouched tree."""
    before = repo.snapshot()
    status_before = repo.porcelain()
    assert main(list(args)) == code
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert repo.snapshot() == before
    assert repo.porcelain() == status_before
    return err


def test_not_a_directory(tmp_path: Path, capsys) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["apply", str(f)]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_not_a_git_repo(tmp_path: Path, capsys) -> None:
    (tmp_path / "pretrain_gpt.py").write_text("import torch\n")
    assert main(["apply", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a git repository" in err and "285068c8108e" in err
    assert (tmp_path / "pretrain_gpt.py").read_text() == "import torch\n"


def test_subdirectory_of_the_checkout_is_refused(repo: FixtureRepo, capsys) -> None:
    refused(capsys, repo, ["apply", str(repo.root / "megatron")], 2, "not its root")


def test_wrong_commit_newer_and_older(repo: FixtureRepo, capsys, monkeypatch) -> None:
    """A commit whose target files differ from the pin's; identical files apply (test_forks)."""
    training = repo.root / "megatron/training.py"
    training.write_bytes(training.read_bytes() + b"# a later upstream change\n")
    newer = repo.commit_all("later")
    pin_to(monkeypatch, repo.root, repo.commit)
    err = refused(
        capsys, repo, ["apply", str(repo.root)], 2, newer, "newer than the pinned",
        "megatron/training.py", "--allow-modified",
    )
    assert f"checkout {repo.commit}" in err
    git(repo.root, "checkout", "-q", repo.commit)
    pin_to(monkeypatch, repo.root, newer)
    refused(capsys, repo, ["apply", str(repo.root)], 2, repo.commit, "older than the pinned")
    refused(capsys, repo, ["verify", str(repo.root)], 1)  # reads the files, whatever HEAD is
    refused(capsys, repo, ["revert", str(repo.root)], 0, "nothing to revert")


def test_pinned_commit_unknown_to_the_repo(repo: FixtureRepo, capsys, monkeypatch) -> None:
    unpin(monkeypatch)
    refused(
        capsys,
        repo,
        ["apply", str(repo.root)],
        2,
        "not in this repository",
        "git -C",
        "checkout 285068c8108e0e8e6538f54fe27c3ee86c5217a2",
    )


def test_target_file_missing(repo: FixtureRepo, capsys) -> None:
    (repo.root / "megatron/core/parallel_state.py").unlink()
    refused(
        capsys,
        repo,
        ["apply", str(repo.root)],
        2,
        "megatron/core/parallel_state.py is missing",
        "git checkout --",
    )


def test_target_file_modified_by_the_user(repo: FixtureRepo, capsys) -> None:
    path = repo.root / "megatron/training.py"
    path.write_bytes(path.read_bytes() + b"# local change\n")
    refused(capsys, repo, ["apply", str(repo.root)], 1, "megatron/training.py", "git diff")


def test_file_patched_by_hand_but_differently(repo: FixtureRepo, capsys) -> None:
    path = repo.root / "megatron/training.py"
    text = path.read_text().replace(
        "    optimizer.reduce_model_grads(args, timers)\n",
        "    optimizer.reduce_model_grads(args, timers)\n    torch.distributed.barrier()\n",
    )
    path.write_text(text)
    refused(capsys, repo, ["apply", str(repo.root)], 1, "megatron/training.py")


def test_own_launch_script_is_never_overwritten(repo: FixtureRepo, capsys) -> None:
    (repo.root / SCRIPT).write_text("#!/bin/sh\necho mine\n")
    refused(capsys, repo, ["apply", str(repo.root)], 1, SCRIPT)


def test_read_only_target(repo: FixtureRepo, capsys) -> None:
    path = repo.root / "megatron/optimizer/__init__.py"
    path.chmod(0o444)
    refused(capsys, repo, ["apply", str(repo.root)], 2, "read-only (mode 0444)", "chmod u+w")


def test_write_failure_half_way_leaves_nothing_changed(
    repo: FixtureRepo, capsys, monkeypatch
) -> None:
    calls = []
    real = fileio._replace_file

    def fail_third(tmp: str, target: Path) -> None:
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(tmp, target)

    monkeypatch.setattr(fileio, "_replace_file", fail_third)
    err = refused(
        capsys,
        repo,
        ["apply", str(repo.root)],
        2,
        "No space left on device",
        "already written were restored".replace("already written", "written before"),
    )
    assert len(calls) >= 3
    leftovers = [p for p in repo.root.rglob("*.ttp-tmp")]
    assert leftovers == [] and "2 file(s)" in err


def test_other_device_after_apply_is_refused(repo: FixtureRepo, capsys) -> None:
    assert main(["apply", str(repo.root)]) == 0
    capsys.readouterr()
    refused(
        capsys,
        repo,
        ["apply", str(repo.root), "--device", "cpu"],
        1,
        "already applied with --device npu",
        "revert",
    )


def test_stale_record_is_refused_by_apply_and_cleared_by_revert(repo: FixtureRepo, capsys) -> None:
    assert main(["apply", str(repo.root)]) == 0
    git(repo.root, "checkout", "--", ".")
    (repo.root / SCRIPT).unlink()
    capsys.readouterr()
    refused(capsys, repo, ["apply", str(repo.root)], 2, "stale", "ttp-patch revert")
    assert main(["revert", str(repo.root)]) == 0
    assert not (repo.root / RECORD).exists()
    assert main(["apply", str(repo.root)]) == 0


def test_corrupt_record(repo: FixtureRepo, capsys) -> None:
    (repo.root / RECORD).write_text("{not json")
    for args in (["apply", str(repo.root)], ["verify", str(repo.root)], ["revert", str(repo.root)]):
        refused(capsys, repo, args, 2, "ttp-patch.json is corrupt", "revert --force")
    (repo.root / RECORD).write_text('{"schema": 1, "device": "gpu"}')
    refused(capsys, repo, ["status", str(repo.root)], 2, "is corrupt")
    assert main(["revert", str(repo.root), "--force"]) == 0
    assert not (repo.root / RECORD).exists() and repo.porcelain() == ""


def test_crlf_target(repo: FixtureRepo, capsys) -> None:
    path = repo.root / "megatron/training.py"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    refused(capsys, repo, ["apply", str(repo.root)], 2, "CR/CRLF", "core.autocrlf")


def test_non_utf8_target(repo: FixtureRepo, capsys) -> None:
    path = repo.root / "pretrain_gpt.py"
    path.write_bytes(path.read_bytes().replace(b"toy GPT", b"toy \xe9 GPT"))
    refused(capsys, repo, ["apply", str(repo.root)], 2, "not UTF-8")


def test_crlf_committed_upstream_is_refused_before_writing(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    files = fixture_files()
    files["megatron/training.py"] = files["megatron/training.py"].replace(b"\n", b"\r\n")
    repo = make_repo(tmp_path / "crlf", files)
    pin_to(monkeypatch, repo.root, repo.commit)
    refused(capsys, repo, ["apply", str(repo.root)], 2, "CR/CRLF")


def test_anchor_missing_upstream_names_the_edit(tmp_path: Path, capsys, monkeypatch) -> None:
    files = fixture_files()
    files["megatron/training.py"] = files["megatron/training.py"].replace(
        b"optimizer.reduce_model_grads(args, timers)", b"optimizer.reduce_grads(args, timers)"
    )
    repo = make_repo(tmp_path / "moved", files)
    pin_to(monkeypatch, repo.root, repo.commit)
    refused(
        capsys,
        repo,
        ["apply", str(repo.root)],
        1,
        "training/barrier-after-reduce",
        "function train_step()",
        "optimizer.reduce_model_grads(args, timers)",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_read_only_directory(repo: FixtureRepo, capsys) -> None:  # pragma: no cover - non-root
    (repo.root / "megatron/core").chmod(0o555)
    try:
        refused(capsys, repo, ["apply", str(repo.root)], 2, "not writable")
    finally:
        (repo.root / "megatron/core").chmod(0o755)


def test_every_target_is_covered_by_the_fixture() -> None:
    assert set(TARGETS) <= set(fixture_files())


def test_tree_whose_distributed_optimizer_predates_params_dtype_is_refused(
    repo: FixtureRepo, capsys
) -> None:
    """Megatron-LM before 57bfa7caba: the targets patch and compile, then every rank would
    die with a TypeError when Megatron builds the optimizer. apply says so instead."""
    path = "megatron/optimizer/distrib_optimizer.py"
    old = repo.read(path).replace(b"bf16, params_dtype, grad_scaler", b"bf16, grad_scaler")
    repo.write(path, old)
    for args in (["apply", str(repo.root)], ["apply", str(repo.root), "--allow-modified"]):
        refused(capsys, repo, args, 1, path, "without params_dtype", "TypeError", "57bfa7caba")
    (repo.root / path).unlink()
    refused(capsys, repo, ["apply", str(repo.root)], 2, f"{path} is missing")


def test_the_refusal_knows_the_arguments_replicated_optimizer_takes() -> None:
    """patcher/prerequisites.py cannot import the runtime (it imports Megatron): read both."""
    import ast

    from patcher.prerequisites import CONSTRUCTOR_ARGS, constructor_args

    source = Path(__file__).resolve().parents[2] / "mindio_ttp/megatron_ttp/replicated_optimizer.py"
    args = constructor_args(source.read_bytes(), "ReplicatedOptimizer")
    tree = ast.parse(source.read_bytes())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef)
                and c.name == "ReplicatedOptimizer" for f in c.body
                if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    passed = next(n for n in ast.walk(init) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__")
    assert args is not None and args[: len(CONSTRUCTOR_ARGS)] == CONSTRUCTOR_ARGS
    assert tuple(a.id for a in passed.args) == CONSTRUCTOR_ARGS
