"""All-or-nothing under Ctrl-C, SIGTERM, SIGKILL and races; symlinks; hostile records (issue 9).

The signal and kill tests run the installed `ttp-patch` as a subprocess and stop it inside its
write phase, which the tests stretch (testkit/patcher_pin.py); the moment is found by polling for
the journal, the only sign on disk that the write phase started. After each stop the next
command must leave the tree exactly clean or exactly applied, with no temp file anywhere.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import pytest
from conftest import SCRIPT, TARGETS, FixtureRepo, git, golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patcher import fileio
from patcher.cli import main
from patcher.errors import ManifestError
from patcher.manifest import Manifest, parse
from testkit.patcher_pin import child_env, pin_to, stretch_writes

RECORD = Path(".git") / "ttp-patch.json"
JOURNAL = Path(".git") / "ttp-patch.journal"


def temps(repo: FixtureRepo) -> list:
    return sorted(str(p) for p in repo.root.rglob("*.ttp-tmp"))


def state(repo: FixtureRepo, device: str = "npu") -> str:
    """'clean' or 'applied' when the tree is exactly that, else a description of the mess."""
    record = repo.root / RECORD
    if repo.porcelain() == "" and not record.exists():
        return "clean"
    files = {p: repo.read(p) for p in TARGETS if (repo.root / p).is_file()}
    if (
        record.exists()
        and files == {p: golden(device, p) for p in TARGETS}
        and (repo.root / SCRIPT).is_file()
        and repo.read(SCRIPT) == golden(device, SCRIPT)
        and json.loads(record.read_text())["device"] == device
    ):
        return "applied"
    return f"neither: {repo.porcelain()!r}, record {record.exists()}"


def spawn(repo: FixtureRepo, *args: str, pause: float) -> subprocess.Popen:
    env = child_env(pause)
    return subprocess.Popen(
        ["ttp-patch", *args, str(repo.root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_write_phase(repo: FixtureRepo, proc: subprocess.Popen, timeout: float = 30) -> bool:
    """True once the journal exists (the write phase began), False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (repo.root / JOURNAL).exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    raise AssertionError("ttp-patch never reached its write phase")


def finish(proc: subprocess.Popen) -> tuple:
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # pragma: no cover
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def recover_and_check(repo: FixtureRepo, capsys) -> str:
    """The next command (status) must repair whatever the stop left."""
    assert main(["status", str(repo.root)]) == 0
    capsys.readouterr()
    now = state(repo)
    assert now in ("clean", "applied"), now
    assert temps(repo) == []
    assert not (repo.root / JOURNAL).exists()
    return now


# 5 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("other_thread", [False, True], ids=["one-thread", "other-thread"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_after_the_second_replace_rolls_back(
    repo: FixtureRepo, capsys, monkeypatch, request, signum: int, other_thread: bool
) -> None:
    """With another thread alive the kernel may hand the signal to it (a per-thread mask does
    not defer it then): the CI run that had torch's threads in the process failed that way."""
    if other_thread:
        stop = threading.Event()
        request.addfinalizer(stop.set)
        threading.Thread(target=stop.wait, daemon=True).start()
    real = fileio._replace_file
    calls = []

    def signal_after_second(tmp: str, target: Path) -> None:
        real(tmp, target)
        calls.append(target)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)  # blocked in the write phase: must not escape as-is

    monkeypatch.setattr(fileio, "_replace_file", signal_after_second)
    before = repo.snapshot()
    assert main(["apply", str(repo.root)]) == 128 + signum
    err = capsys.readouterr().err
    assert f"interrupted by {signal.Signals(signum).name}: nothing changed" in err
    assert "Traceback" not in err and "2 file(s)" in err
    assert repo.snapshot() == before and repo.porcelain() == ""
    assert temps(repo) == [] and not (repo.root / JOURNAL).exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_at_random_moments_of_the_write_phase_loop(
    repo: FixtureRepo, capsys, signum: int
) -> None:
    """Ctrl-C, or the SIGTERM of a scheduler or `kill`, at a random instant of apply or revert."""
    rng = random.Random(9 + signum)
    interrupted = 128 + signum
    outcomes = set()
    for _ in range(6):
        applied = state(repo) == "applied"
        proc = spawn(repo, "revert" if applied else "apply", pause=0.03)
        if wait_for_write_phase(repo, proc):
            time.sleep(rng.uniform(0, 0.2))  # the random moment under test, not synchronisation
            proc.send_signal(signum)
        code, _, err = finish(proc)
        assert "Traceback" not in err, err
        # -signum: the signal came after the write phase, once the default action was back
        # (the shell sees 128+N as well); the command had finished, so the tree is done
        assert code in (0, interrupted, -signum), err
        now = recover_and_check(repo, capsys)
        if code == interrupted and "the command completed" in err:  # after the commit point
            assert now == ("clean" if applied else "applied"), err
        elif code == interrupted:  # interrupted: rolled back to where it started
            assert now == ("applied" if applied else "clean"), err
            assert f"interrupted by {signal.Signals(signum).name}" in err, err
        if code == -signum:
            assert now == ("clean" if applied else "applied"), err
        outcomes.add(code)
    assert interrupted in outcomes


# 6 -----------------------------------------------------------------------------------------


def fork_main(*args: str, pause: float) -> int:
    """`main(args)` in a forked child (the modules already imported, so a run starts in ms)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            stretch_writes(pause)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = main(list(args))
        finally:
            os._exit(code)
    return pid


def test_sigkill_at_random_moments_of_the_write_phase(repo: FixtureRepo, capsys) -> None:
    rng = random.Random(6)
    seen: Dict[str, int] = {}
    for run in range(20):
        applied = state(repo) == "applied"
        pid = fork_main("revert" if applied else "apply", str(repo.root), pause=0.02)
        try:
            deadline = time.monotonic() + 30
            while not (repo.root / JOURNAL).exists() and time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    pid = 0  # ended before its write phase was seen
                    break
                time.sleep(0.002)
            if pid and run % 4 != 3:  # every fourth run completes: reverts get killed too
                time.sleep(rng.uniform(0, 0.15))  # the random moment under test
                os.kill(pid, signal.SIGKILL)
        finally:
            if pid:
                os.waitpid(pid, 0)
        now = recover_and_check(repo, capsys)
        seen[f"{'revert' if applied else 'apply'}->{now}"] = 1 + seen.get(now, 0)
    assert {k.split("->")[0] for k in seen} == {"apply", "revert"}, seen


def test_stray_temp_files_are_removed_by_the_next_command(repo: FixtureRepo, capsys) -> None:
    stray = repo.root / "megatron" / ".training.py.x1y2.ttp-tmp"
    stray.write_bytes(b"half")
    mine = repo.root / "megatron" / ".notes.ttp-tmp"  # not named after one of our files
    mine.write_bytes(b"mine")
    assert main(["revert", str(repo.root)]) == 0
    assert not stray.exists() and mine.exists()
    assert "leftover temp file" in capsys.readouterr().err


def test_a_journal_whose_file_changed_since_is_refused_not_overwritten(
    repo: FixtureRepo, capsys
) -> None:
    pid = fork_main("apply", str(repo.root), pause=0.3)
    try:
        deadline = time.monotonic() + 30
        written: list = []
        while not written and time.monotonic() < deadline:
            written = [p for p in TARGETS if repo.read(p) == golden("npu", p)]
        os.kill(pid, signal.SIGKILL)  # after its first replace, long before its last
    finally:
        os.waitpid(pid, 0)
    assert (repo.root / JOURNAL).exists() and len(written) == 1
    repo.write(written[0], b"# the user's own edit\n")
    assert main(["status", str(repo.root)]) == 2
    err = capsys.readouterr().err
    assert "changed after an interrupted ttp-patch" in err
    assert repo.read(written[0]) == b"# the user's own edit\n"



def test_a_journal_naming_a_path_that_is_not_ours_is_refused_untouched(
    repo: FixtureRepo, capsys
) -> None:
    """A damaged or planted journal must not make recovery write .git/hooks, or write through a
    link that an earlier entry of the same journal put back."""
    hook = repo.root / ".git" / "hooks" / "pre-commit"
    entries = [
        {"base": "tree", "rel": "out", "kind": "symlink", "data": "L3RtcA==", "mode": 420,
         "new": None},  # a link to /tmp ...
        {"base": "tree", "rel": "out/planted", "kind": "file", "data": "eA==", "mode": 420,
         "new": None},  # ... then a file through it
        {"base": "git", "rel": "hooks/pre-commit", "kind": "file",
         "data": "IyEvYmluL3NoCmVjaG8gcHduZWQK", "mode": 0o755, "new": None},
    ]
    for entry in entries:
        (repo.root / JOURNAL).write_text(json.dumps({"schema": 1, "entries": [entry]}))
        refused(repo, capsys, ["status", str(repo.root)], 2, "is not one ttp-patch writes")
    assert not os.path.lexists(hook) and not os.path.lexists(repo.root / "out")


_journal_entry = st.fixed_dictionaries({
    "base": st.sampled_from(["git", "tree"]) | st.text(max_size=5),
    "rel": st.sampled_from([TARGETS[0], SCRIPT, "x/../y", "/etc/passwd", "a\0b", ""])
    | st.text(max_size=10),
    "kind": st.sampled_from(["absent", "file", "symlink"]) | st.integers() | st.none(),
    "data": st.sampled_from(["", "eA==", "!!"]) | st.integers() | st.none(),
    "mode": st.sampled_from([0o644, 10**30, -1, 1e400, "420", True]) | st.integers(),
    "new": st.none() | st.text(max_size=5) | st.integers(),
})


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.one_of(
    st.binary(max_size=200),
    st.lists(_journal_entry, max_size=3).map(
        lambda es: json.dumps({"schema": 1, "entries": es}).encode()),
))
def test_journal_loader_fuzz_raises_only_patch_errors(tmp_path, data: bytes) -> None:
    """Whatever the journal holds, recovery is a PatchError (a clear message) or a rollback of
    our own paths, never a traceback."""
    from patcher.errors import PatchError
    from patcher.journal import Journal

    root = tmp_path / "fuzz"
    (root / ".git").mkdir(parents=True, exist_ok=True)
    ours = [root / TARGETS[0], root / SCRIPT]
    j = Journal(root / ".git", {"git": root / ".git", "tree": root}, ours)
    j.path.write_bytes(data)
    try:
        j.recover()
    except PatchError:
        pass
    finally:
        if os.path.lexists(j.path):
            j.path.unlink()
    left = {p.relative_to(root).as_posix() for p in root.rglob("*")} - {".git"}
    assert left <= {TARGETS[0], SCRIPT}, left


# 7 -----------------------------------------------------------------------------------------


def test_second_apply_while_one_runs_fails_fast_and_the_record_matches(
    repo: FixtureRepo, capsys
) -> None:
    first = spawn(repo, "apply", "--device", "cpu", pause=0.8)
    assert wait_for_write_phase(repo, first)
    second = spawn(repo, "apply", "--device", "cuda", pause=0)
    code2, _, err2 = finish(second)
    code1, _, err1 = finish(first)
    assert code2 == 2 and "another ttp-patch" in err2 and "pid" in err2, err2
    assert code1 == 0, err1
    assert state(repo, "cpu") == "applied"
    assert main(["verify", str(repo.root)]) == 0


def test_apply_refuses_while_the_lock_is_held(repo: FixtureRepo, capsys) -> None:
    fd = os.open(repo.root / ".git" / "ttp-patch.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before = repo.snapshot()
        start = time.monotonic()
        assert main(["apply", str(repo.root)]) == 2
        assert time.monotonic() - start < 10
        assert "another ttp-patch" in capsys.readouterr().err
        assert repo.snapshot() == before
    finally:
        os.close(fd)
    assert main(["apply", str(repo.root)]) == 0


def test_a_file_changed_during_the_write_phase_is_refused(
    repo: FixtureRepo, capsys, monkeypatch
) -> None:
    real = fileio._replace_file
    edited = repo.root / TARGETS[-1]

    def edit_behind_our_back(tmp: str, target: Path) -> None:
        real(tmp, target)
        if not edited.read_bytes().startswith(b"# outsider"):
            edited.write_bytes(b"# outsider\n" + edited.read_bytes())

    monkeypatch.setattr(fileio, "_replace_file", edit_behind_our_back)
    assert main(["apply", str(repo.root)]) == 1
    err = capsys.readouterr().err
    assert "changed while ttp-patch was running" in err
    for path in TARGETS[:-1]:
        assert git(repo.root, "diff", "--", path) == ""
    assert edited.read_bytes().startswith(b"# outsider")  # the outsider's bytes are kept
    assert temps(repo) == [] and not (repo.root / RECORD).exists()


# 8 -----------------------------------------------------------------------------------------


def snap(repo: FixtureRepo) -> tuple:
    """Like repo.snapshot(), but a record that is a link is read as its target, never followed."""
    record = repo.root / RECORD
    link = os.readlink(record) if record.is_symlink() else None
    if link is None:
        return repo.snapshot(), None
    record.rename(record.with_suffix(".link"))  # hide it from snapshot(), which follows it
    try:
        return repo.snapshot(), link
    finally:
        record.with_suffix(".link").rename(record)


def refused(repo: FixtureRepo, capsys, args, code: int, *needles: str, outside=None) -> None:
    before = snap(repo)
    outside_before = _files(outside) if outside else None
    assert main(list(args)) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    assert snap(repo) == before
    if outside:
        assert _files(outside) == outside_before


def _files(root: Path) -> Dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_symlinked_directory_to_outside_is_refused(repo: FixtureRepo, capsys, tmp_path) -> None:
    outside = tmp_path / "elsewhere"
    os.rename(repo.root / "megatron", outside)
    os.symlink(outside, repo.root / "megatron")
    refused(repo, capsys, ["apply", str(repo.root)], 2, "megatron is a symlink", outside=outside)
    refused(repo, capsys, ["revert", "--force", str(repo.root)], 2, "symlink", outside=outside)


def test_target_that_is_a_symlink_is_refused_and_the_link_kept(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    real = tmp_path / "training.py"
    real.write_bytes(repo.read("megatron/training.py"))
    link = repo.root / "megatron/training.py"
    link.unlink()
    os.symlink(real, link)
    refused(repo, capsys, ["apply", str(repo.root)], 2, "megatron/training.py is a symlink")
    assert link.is_symlink() and os.readlink(link) == str(real)


def test_target_with_git_mode_other_than_100644_is_refused(
    repo: FixtureRepo, capsys, monkeypatch
) -> None:
    (repo.root / "pretrain_gpt.py").chmod(0o755)
    pin_to(monkeypatch, repo.root, repo.commit_all("executable"))
    refused(repo, capsys, ["apply", str(repo.root)], 2, "git mode 100755")



@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_target_that_is_not_a_regular_file_is_refused_unopened(
    repo: FixtureRepo, capsys, kind: str
) -> None:
    """A FIFO opened for reading would hang the patcher; a directory used to be a traceback.
    Run as a subprocess with a deadline, so a patcher that opened the FIFO fails the test."""
    target = repo.root / "megatron/training.py"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    for args in (["apply"], ["revert", "--force"]):
        before = repo.snapshot()
        done = subprocess.run(["ttp-patch", *args, str(repo.root)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "megatron/training.py exists but is not a regular file" in done.stderr
        assert "Traceback" not in done.stderr
        assert repo.snapshot() == before
    assert stat.S_ISFIFO(os.lstat(target).st_mode) if kind == "fifo" else target.is_dir()


def test_launch_script_that_is_a_symlink_to_outside_is_refused(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    """pretrain_gpt_ttp.sh linked to a file outside the tree: apply must not write through it."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "victim.sh").write_bytes(b"#!/bin/sh\necho mine\n")
    os.symlink(outside / "victim.sh", repo.root / SCRIPT)
    refused(repo, capsys, ["apply", str(repo.root)], 2, f"{SCRIPT} is a symlink", outside=outside)
    assert os.readlink(repo.root / SCRIPT) == str(outside / "victim.sh")


def test_symlinked_subdirectory_inside_the_path_is_refused(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    """megatron/core linked elsewhere: parallel_state.py would be written outside the tree."""
    outside = tmp_path / "core"
    os.rename(repo.root / "megatron/core", outside)
    os.symlink(outside, repo.root / "megatron/core")
    refused(repo, capsys, ["apply", str(repo.root)], 2, "megatron/core is a symlink",
            outside=outside)


# 9 -----------------------------------------------------------------------------------------


def _applied_with_record(repo: FixtureRepo, capsys, record: Optional[bytes], link=None) -> None:
    assert main(["apply", str(repo.root)]) == 0
    capsys.readouterr()
    path = repo.root / RECORD
    path.unlink()
    if link:
        os.symlink(link, path)
    else:
        path.write_bytes(record)


@pytest.mark.parametrize(
    "record,link,needle",
    [
        (b"[" * 200_000 + b"]" * 200_000, None, "corrupt"),
        (None, "/dev/zero", "is a symlink"),
        (b"x" * (2 << 20), None, "over 1048576 bytes"),
    ],
    ids=["deep-nesting", "dev-zero", "huge"],
)
def test_hostile_record_is_a_clear_error_and_revert_force_clears_it(
    repo: FixtureRepo, capsys, record, link, needle
) -> None:
    _applied_with_record(repo, capsys, record, link)
    for cmd in (["status"], ["verify"], ["diff"], ["apply"], ["revert"]):
        refused(repo, capsys, [*cmd, str(repo.root)], 2, needle)
    assert main(["revert", "--force", str(repo.root)]) == 0
    capsys.readouterr()
    assert state(repo) == "clean" and not os.path.lexists(repo.root / RECORD)



_VALID = {
    "commit": "a" * 40,
    "device": "npu",
    "port": 8000,
    "files": {TARGETS[0]: {"before": "b" * 64, "after": "c" * 64}},
    "launch_script": "d" * 64,
    "tool_version": "0",
    "libcst_version": "1",
    "schema": 1,
}

@pytest.mark.parametrize(
    "kind,record",
    [
        ("file", b""),
        ("file", b"\xff\xfe not utf-8"),
        ("file", b"[1, 2]"),
        ("file", json.dumps({**_VALID, "files": {"../../etc/passwd": {}}}).encode()),
        ("file", json.dumps({**_VALID, "files": [1]}).encode()),
        ("file", json.dumps({**_VALID, "device": "rm -rf /"}).encode()),
        ("file", json.dumps({**_VALID, "schema": 99}).encode()),
        ("fifo", None),
        ("directory", None),
    ],
    ids=["empty", "not-utf8", "list", "traversal", "files-list", "device", "schema", "fifo",
         "directory"],
)
def test_revert_force_clears_whatever_the_record_holds(
    repo: FixtureRepo, capsys, kind: str, record: Optional[bytes]
) -> None:
    """Every command refuses the record with the way out; `revert --force` takes it."""
    assert main(["apply", str(repo.root)]) == 0
    path = repo.root / RECORD
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(record)
    capsys.readouterr()
    assert main(["status", str(repo.root)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ttp-patch revert --force" in err, err
    assert main(["revert", "--force", str(repo.root)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert state(repo) == "clean" and not os.path.lexists(path)



def test_a_record_that_is_a_directory_with_files_is_kept_and_named(
    repo: FixtureRepo, capsys
) -> None:
    """Not ours to delete: every command, `revert --force` too, says what to look at."""
    assert main(["apply", str(repo.root)]) == 0
    path = repo.root / RECORD
    path.unlink()
    path.mkdir()
    (path / "notes").write_text("someone's\n")
    capsys.readouterr()
    for cmd in (["status"], ["revert", "--force"]):
        assert main([*cmd, str(repo.root)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"rm -r {path}" in err, err
    assert (path / "notes").read_text() == "someone's\n"
    assert all(repo.read(p) == golden("npu", p) for p in TARGETS)  # nothing half-reverted


@pytest.mark.parametrize("port", [-1, True, 1e30, 80, 70000, "8000", None])
def test_record_port_must_be_an_int_in_the_runtime_range(repo: FixtureRepo, capsys, port) -> None:
    assert main(["apply", str(repo.root)]) == 0
    path = repo.root / RECORD
    doc = json.loads(path.read_text())
    doc["port"] = port
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    refused(repo, capsys, ["status", str(repo.root)], 2, "port")
    assert main(["revert", "--force", str(repo.root)]) == 0
    assert state(repo) == "clean"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=200),
        _json.map(lambda v: json.dumps(v).encode()),
        st.tuples(st.sampled_from(sorted(_VALID)), _json).map(
            lambda kv: json.dumps({**_VALID, kv[0]: kv[1]}).encode()
        ),
    )
)
def test_record_loader_fuzz_raises_only_manifest_error(data: bytes) -> None:
    try:
        man = parse(data, Path("ttp-patch.json"))
    except ManifestError as exc:
        assert "corrupt" in exc.message
        return
    assert isinstance(man, Manifest)
    assert type(man.port) is int and 1024 <= man.port <= 65535
    assert man.device in ("npu", "cuda", "cpu") and set(man.files) <= set(TARGETS)


def test_fuzz_sees_the_valid_record_as_valid() -> None:
    assert parse(json.dumps(_VALID).encode(), Path("r")).port == 8000


# 10 ----------------------------------------------------------------------------------------


def test_directory_named_like_the_script_is_refused(repo: FixtureRepo, capsys) -> None:
    (repo.root / SCRIPT).mkdir()
    (repo.root / SCRIPT / "keep").write_text("mine\n")
    refused(repo, capsys, ["apply", str(repo.root)], 2, f"{SCRIPT} exists but is not a regular")
    refused(repo, capsys, ["revert", str(repo.root)], 2, "not a regular")
