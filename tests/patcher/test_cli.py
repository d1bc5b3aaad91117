"""The commands end to end on fixture git repositories: apply, re-apply, dry run, revert,
status/verify states and exit codes, diff. Most run `main()` in-process (fast); a few run the
installed `ttp-patch` script to check what a user or CI sees (stdout carries only payload)."""

from __future__ import annotations

import json
import stat
import subprocess

import pytest
import unidiff
from conftest import SCRIPT, TARGETS, FixtureRepo, git, golden, run_cli

from patcher.cli import main
from patcher.diffs import summarize

pytestmark = pytest.mark.smoke  # `pytest -m smoke`: README's quick check


def ttp(capsys: pytest.CaptureFixture, *args: str):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_apply_writes_goldens_script_and_record_then_git_status_shows_only_edits(
    repo: FixtureRepo, capsys
) -> None:
    code, out, err = ttp(capsys, "apply", str(repo.root))
    assert code == 0 and out == "" and "applied (--device npu --port 8000)" in err
    for path in TARGETS:
        assert repo.read(path) == golden("npu", path)
    assert repo.read(SCRIPT) == golden("npu", SCRIPT)
    assert stat.S_IMODE((repo.root / SCRIPT).stat().st_mode) == 0o755
    record = json.loads((repo.root / ".git" / "ttp-patch.json").read_text())
    assert record["device"] == "npu" and set(record["files"]) == set(TARGETS)
    assert sorted(repo.porcelain().splitlines()) == sorted(
        [f" M {p}" for p in TARGETS] + [f"?? {SCRIPT}"]
    )


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_apply_other_devices(repo: FixtureRepo, capsys, device: str) -> None:
    assert ttp(capsys, "apply", str(repo.root), "--device", device)[0] == 0
    for path in TARGETS + [SCRIPT]:
        assert repo.read(path) == golden(device, path)
    code, out, _ = ttp(capsys, "verify", str(repo.root), "--json")
    assert code == 0 and json.loads(out)["device"] == device


def test_reapply_is_a_noop_with_exit_0(repo: FixtureRepo, capsys) -> None:
    ttp(capsys, "apply", str(repo.root))
    before = repo.snapshot()
    code, out, err = ttp(capsys, "apply", str(repo.root))
    assert code == 0 and "nothing to do" in err
    assert repo.snapshot() == before


def test_dry_run_prints_the_diff_and_changes_nothing(repo: FixtureRepo, capsys) -> None:
    before = repo.snapshot()
    code, out, err = ttp(capsys, "apply", str(repo.root), "--dry-run", "--device", "cpu")
    assert code == 0 and "nothing written" in err
    assert repo.snapshot() == before and repo.porcelain() == ""
    files = {s.path: s for s in summarize(out)}
    assert set(files) == set(TARGETS + [SCRIPT]) and files[SCRIPT].new
    assert files["megatron/training.py"].added == 30 and files["megatron/training.py"].removed == 1
    code, diff_out, _ = ttp(capsys, "diff", str(repo.root), "--device", "cpu")
    assert diff_out == out
    patch = repo.root.parent / "cpu.patch"
    patch.write_text(out)
    git(repo.root, "apply", "--check", str(patch))
    git(repo.root, "apply", str(patch))
    for path in TARGETS + [SCRIPT]:
        assert repo.read(path) == golden("cpu", path)


def test_revert_restores_head_bytes_and_git_status(repo: FixtureRepo, capsys) -> None:
    (repo.root / "untracked-note.txt").write_text("mine\n")
    status_before = repo.porcelain()
    snapshot = repo.snapshot()
    ttp(capsys, "apply", str(repo.root), "--device", "cpu", "--port", "9123")
    assert b"    port = 9123\n" in repo.read("megatron/training.py")
    assert ttp(capsys, "verify", str(repo.root))[0] == 0
    code, made, _ = ttp(capsys, "diff", str(repo.root))  # once applied: the recorded options
    assert "+    port = 9123\n" in made and "+import mindio_ttp.cpu_adaptor\n" in made
    code, out, err = ttp(capsys, "revert", str(repo.root))
    assert code == 0 and "reverted" in err
    assert repo.porcelain() == status_before
    assert repo.snapshot() == snapshot
    assert not (repo.root / ".git" / "ttp-patch.json").exists()


def test_revert_on_a_clean_tree_says_nothing_to_do(repo: FixtureRepo, capsys) -> None:
    code, out, err = ttp(capsys, "revert", str(repo.root))
    assert code == 0 and "nothing to revert" in err and out == ""


def test_file_modes_are_kept(repo: FixtureRepo, capsys) -> None:
    target = repo.root / "megatron/training.py"
    target.chmod(0o640)
    ttp(capsys, "apply", str(repo.root))
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    ttp(capsys, "revert", str(repo.root))
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def _status(capsys, repo: FixtureRepo, *extra: str, code: int = 0):
    got, out, _ = ttp(capsys, "status", str(repo.root), "--json", *extra)
    assert got == code
    return json.loads(out)


def test_status_states_and_verify_exit_codes(repo: FixtureRepo, capsys) -> None:
    doc = _status(capsys, repo)
    assert doc["overall"] == "clean" and len(doc["edits"]) == 25  # 24 edits + the script
    assert {e["state"] for e in doc["edits"]} == {"missing"}
    assert ttp(capsys, "verify", str(repo.root))[0] == 1

    ttp(capsys, "apply", str(repo.root))
    assert _status(capsys, repo)["overall"] == "applied"
    code, out, _ = ttp(capsys, "verify", str(repo.root))
    assert code == 0 and "overall: applied" in out

    git(repo.root, "checkout", "--", "megatron/optimizer/__init__.py")  # partial
    doc = _status(capsys, repo)
    assert doc["overall"] == "partial"
    assert [e["id"] for e in doc["edits"] if e["state"] == "missing"] == [
        "optimizer/import-replicated",
        "optimizer/replicated-opt-ty",
        "optimizer/check-args",
    ]
    assert ttp(capsys, "verify", str(repo.root))[0] == 1

    text = repo.read("megatron/training.py").replace(
        b"ttp.ttp_start_updating_os(-1)", b"ttp.ttp_start_updating_os(-2)"
    )
    repo.write("megatron/training.py", text)  # drifted
    doc = _status(capsys, repo, code=1)
    assert doc["overall"] == "drifted"
    drifted = [e for e in doc["edits"] if e["state"] == "drifted"]
    assert [e["id"] for e in drifted] == ["training/start-updating-os"]
    assert ttp(capsys, "verify", str(repo.root))[0] == 1


def test_status_lists_the_edits_in_the_order_of_their_numbers(repo: FixtureRepo,
                                                              capsys) -> None:
    edits = _status(capsys, repo)["edits"]
    numbers = [tuple(int(p) for p in e["number"].split(".")) for e in edits]
    assert numbers == sorted(numbers) and (5,) in numbers  # the script (5) before 6.x


def test_a_hand_edit_inside_an_edit_is_modified_for_status_verify_and_revert(
        repo: FixtureRepo, capsys) -> None:
    """The controller port inside edit 2.7, changed by hand after apply: the edit is still
    there (the AST check alone reads it applied), but revert refuses it, so status and verify
    must not call the tree applied either."""
    ttp(capsys, "apply", str(repo.root))
    text = repo.read("megatron/training.py")
    assert text.count(b"port = 8000") == 1
    repo.write("megatron/training.py", text.replace(b"port = 8000", b"port = 8100"))
    doc = _status(capsys, repo, code=1)
    assert doc["overall"] == "modified"
    modified = [e for e in doc["edits"] if e["state"] != "applied"]
    assert [(e["id"], e["state"]) for e in modified] == [("training/start-ttp", "modified")]
    assert "revert refuses it" in modified[0]["detail"]
    code, out, _ = ttp(capsys, "status", str(repo.root))
    assert code == 1 and "overall: modified" in out
    code, out, _ = ttp(capsys, "verify", str(repo.root))
    assert code == 1 and "training/start-ttp" in out and "modified" in out
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 1 and "training/start-ttp" in err  # the same edit, the same verdict
    # a change outside every edit is the user's own: applied, and revert keeps it
    repo.write("megatron/training.py", text.replace(b'"""Training utilities."""',
                                                    b'"""Training utilities (mine)."""'))
    doc = _status(capsys, repo)
    assert doc["overall"] == "applied" and any("outside" in n for n in doc["notes"])
    assert ttp(capsys, "verify", str(repo.root))[0] == 0


def test_status_recognises_edits_made_by_hand(repo: FixtureRepo, capsys) -> None:
    for path in TARGETS:
        text = golden("cuda", path).decode()
        text = text.replace("    # all rank need to barrier\n", "").replace(
            "port = 8000", "port=8000"
        )
        repo.write(path, text.encode())
    doc = _status(capsys, repo)  # no record, no adaptor import: device unknown -> edit 1 missing
    assert [e["id"] for e in doc["edits"] if e["state"] != "applied"] == [
        "pretrain/adaptor-import",
        "launch/pretrain-gpt-ttp-sh",
    ]
    repo.write(SCRIPT, golden("cuda", SCRIPT))
    assert ttp(capsys, "verify", str(repo.root), "--device", "cuda")[0] == 0
    assert ttp(capsys, "verify", str(repo.root), "--device", "npu")[0] == 1


def test_revert_refuses_drift_and_force_restores(repo: FixtureRepo, capsys) -> None:
    ttp(capsys, "apply", str(repo.root))
    text = repo.read("megatron/training.py").replace(  # touches our edit 2.3: drift
        b"torch.distributed.barrier()\n", b"torch.distributed.barrier()  # my own note\n"
    )
    repo.write("megatron/training.py", text)
    before = repo.snapshot()
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 1 and "megatron/training.py" in err and "--force" in err
    assert "training/barrier-after-reduce" in err
    assert repo.snapshot() == before
    code, _, err = ttp(capsys, "revert", str(repo.root), "--force")
    assert code == 0 and "discarded" in err
    assert repo.porcelain() == ""


def test_filled_in_script_reads_applied_but_revert_protects_it(repo: FixtureRepo, capsys) -> None:
    ttp(capsys, "apply", str(repo.root))
    text = repo.read(SCRIPT).replace(b"xxx.xxx.xxx.xxx", b"10.0.0.1")
    repo.write(SCRIPT, text)
    assert ttp(capsys, "verify", str(repo.root))[0] == 0
    code, _, err = ttp(capsys, "revert", str(repo.root))
    assert code == 1 and SCRIPT in err
    assert ttp(capsys, "revert", str(repo.root), "--force")[0] == 0
    assert repo.porcelain() == ""


def test_revert_without_record_proves_files_are_ours(repo: FixtureRepo, capsys) -> None:
    ttp(capsys, "apply", str(repo.root), "--device", "cpu", "--port", "9000")
    (repo.root / ".git" / "ttp-patch.json").unlink()
    assert ttp(capsys, "revert", str(repo.root))[0] == 0
    assert repo.porcelain() == ""


def test_console_script_exit_codes_and_stdout_payload_only(repo: FixtureRepo, capsys) -> None:
    res = run_cli("apply", str(repo.root), "--dry-run")
    assert res.returncode == 0 and res.stdout.startswith("diff --git a/pretrain_gpt.py")
    assert "ttp-patch:" not in res.stdout and "nothing written" in res.stderr
    unidiff.PatchSet(res.stdout)  # the payload is a well-formed diff
    ttp(capsys, "apply", str(repo.root))
    res = subprocess.run(
        ["python", "-m", "patcher", "verify", str(repo.root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and json.loads(res.stdout)["overall"] == "applied"
    res = run_cli("verify", str(repo.root.parent))
    assert res.returncode == 2 and "not a git repository" in res.stderr and res.stdout == ""


def test_bad_option_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["apply", ".", "--device", "tpu"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
