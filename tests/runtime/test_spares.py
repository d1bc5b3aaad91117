"""Warm spares (mindio_ttp.launch.spares): processes that import the entry's imports ahead, then
become a rank's worker in place; and that never outlive the launcher that started them.

Real processes throughout: the pool spawns real spares of this interpreter, and the lifetime
tests run real `ttprun` launchers and kill them with SIGKILL and SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List

import psutil
import pytest

from mindio_ttp.config import warm_spares
from mindio_ttp.launch.spares import (
    MAX_EARLY_DEATHS,
    SPARE_MODULE,
    Entry,
    SparePool,
    leading_imports,
    pool_from_spec,
)

DEADLINE_S = 60.0

# The entry's leading import: it records every import (pid, RANK at that moment), so a test sees
# that the spare imported it ahead, before it had a rank, and never again.
SLOW_MODULE = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    delay = float(os.environ.get("SPARE_TEST_IMPORT_DELAY", "0"))
    with open(os.environ["SPARE_TEST_IMPORT_LOG"], "a") as f:
        f.write(f"{os.getpid()} {os.environ.get('RANK', '-')} {time.time()}\\n")
    time.sleep(delay)
    if os.environ.get("SPARE_TEST_IMPORT_DIES"):
        os._exit(5)
    """
)
ENTRY = textwrap.dedent(
    """
    \"\"\"A worker: reports what it sees, then exits with the code it was given.\"\"\"
    import json
    import os
    import sys

    import spare_test_mod

    def main():
        report = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv": sys.argv,
                  "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "main_module": sys.modules["__main__"].__dict__.get("MARK")}
        print("REPORT " + json.dumps(report), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        if sys.argv[1] == "raise":
            raise RuntimeError("boom in the worker")
        sys.exit(int(sys.argv[1]))

    MARK = "entry-main"
    if __name__ == "__main__":
        main()
    """
)
WAITER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import spare_test_mod
    stop = Path(sys.argv[1])
    record = {k: os.environ.get(k) for k in ("RANK", "TTP_RECOVERY_JOIN")}
    record["pid"] = os.getpid()
    (stop.parent / f"worker-{os.getpid()}.json").write_text(json.dumps(record))
    while not stop.exists():
        time.sleep(0.05)
    """
)


def _until(check: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "spare_test_mod.py").write_text(SLOW_MODULE)
    (tmp_path / "entry.py").write_text(ENTRY)
    (tmp_path / "waiter.py").write_text(WAITER)
    monkeypatch.setenv("SPARE_TEST_IMPORT_LOG", str(tmp_path / "imports.log"))
    return tmp_path


def _imports(scripts: Path) -> List[List[str]]:
    log = scripts / "imports.log"
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def pool_of(scripts: Path) -> Iterator[Callable[..., SparePool]]:
    made: List[SparePool] = []

    def make(size: int = 1, target: str = "entry.py") -> SparePool:
        pool = pool_from_spec(size, sys.executable, ["-u", str(scripts / target), "0"])
        made.append(pool)
        pool.replenish()
        return pool

    yield make
    for pool in made:
        pool.close()


def _ready(pool: SparePool) -> None:
    def check() -> bool:
        pool.poll()
        return bool(pool.spares) and all(s.ready for s in pool.spares)

    _until(check, "every spare ready")


# -- what a spare runs ahead ------------------------------------------------------------------
def test_leading_imports_stop_at_the_first_statement_that_could_set_something_up() -> None:
    source = textwrap.dedent(
        """
        \"\"\"doc\"\"\"
        from __future__ import annotations
        import os, torch.distributed
        from megatron import get_args, print_rank_0
        from . import sibling
        try:
            import apex
        except ImportError:
            apex = None
        def f():
            import inside_a_function
        class C:
            pass
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        import after_a_side_effect
        """
    )
    assert leading_imports(source) == [
        ("os", ()), ("torch.distributed", ()), ("megatron", ("get_args", "print_rank_0")),
        ("apex", ()),
    ]


def test_entry_parses_torch_worker_commands() -> None:
    py = sys.executable
    entry, rest = Entry.parse(py, ["-u", "pretrain_gpt.py", "--num-layers", "2"])
    assert entry == Entry(py, ("-u",), False, "pretrain_gpt.py") and rest == ["--num-layers", "2"]
    entry, rest = Entry.parse(py, ["-u", "-X", "faulthandler", "-m", "pkg.job", "--steps=3"])
    assert entry == Entry(py, ("-u", "-X", "faulthandler"), True, "pkg.job")
    assert rest == ["--steps=3"]
    # --no-python (no interpreter flags: the entrypoint is the program) and -c: no spare
    assert Entry.parse("/usr/bin/my_trainer", ["--lr", "1"]) == (None, [])
    assert Entry.parse(py, ["-u", "-c", "print(1)"]) == (None, [])
    assert pool_from_spec(2, "/usr/bin/my_trainer", ["--lr", "1"]).size == 0


def test_warm_spares_setting_is_checked() -> None:
    assert warm_spares({}) == 0
    assert warm_spares({"TTP_WARM_SPARES": " 2 "}) == 2
    with pytest.raises(ValueError, match="TTP_WARM_SPARES='two' is not a whole number"):
        warm_spares({"TTP_WARM_SPARES": "two"})
    with pytest.raises(ValueError, match="is negative"):
        warm_spares({"TTP_WARM_SPARES": "-1"})


# -- becoming a rank ---------------------------------------------------------------------------
def test_a_spare_imports_ahead_then_runs_the_entry_as_the_rank(
        scripts: Path, pool_of: Callable[..., SparePool]) -> None:
    pool = pool_of(1)
    _ready(pool)
    (spare,) = pool.spares
    imported = _imports(scripts)
    assert imported == [[str(spare.proc.pid), "-", imported[0][2]]]  # ahead, without a rank
    out, err = scripts / "rank3.out", scripts / "rank3.err"
    out.write_text("the lost worker's lines\n")
    env = dict(os.environ, RANK="3", LOCAL_RANK="1")
    proc = pool.start(1, env, [sys.executable, "-u", str(scripts / "entry.py"), "7", "--flag"],
                      stdout=str(out), stderr=str(err))
    assert proc is spare.proc
    assert proc.wait(DEADLINE_S) == 7
    lines = out.read_text().splitlines()
    assert lines[0] == "the lost worker's lines"  # appended to the local rank's log
    report = next(line for line in lines if line.startswith("REPORT "))
    assert '"rank": "3"' in report and '"name": "__main__"' in report
    assert f'"argv": ["{scripts / "entry.py"}", "7", "--flag"]' in report
    assert f'"path0": "{scripts}"' in report  # where `python script.py` puts it
    assert '"main_module": "entry-main"' in report  # __main__ is the entry while it runs
    assert "to stderr" in err.read_text()
    assert len(_imports(scripts)) == 1  # the worker did not import it again
    assert pool.spares == []  # taken; the launcher's next replenish starts another


def test_an_exception_in_the_entry_ends_the_worker_as_a_cold_one_would(
        scripts: Path, pool_of: Callable[..., SparePool]) -> None:
    pool = pool_of(1)
    err = scripts / "err"
    proc = pool.start(0, dict(os.environ, RANK="0"),
                      [sys.executable, "-u", str(scripts / "entry.py"), "raise"],
                      stderr=str(err))  # taken while still importing: it runs once ready
    assert proc is not None and proc.wait(DEADLINE_S) == 1
    text = err.read_text()
    assert "RuntimeError: boom in the worker" in text and "Traceback" in text


def test_a_module_entry_runs_with_dash_m(scripts: Path) -> None:
    package = scripts / "spare_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(ENTRY)
    pool = SparePool(1, Entry.parse(sys.executable, ["-u", "-m", "spare_pkg.job"])[0],
                     cwd=str(scripts))
    try:
        pool.replenish()
        out = scripts / "out"
        proc = pool.start(0, dict(os.environ, RANK="1"),
                          [sys.executable, "-u", "-m", "spare_pkg.job", "4"], stdout=str(out))
        assert proc is not None and proc.wait(DEADLINE_S) == 4
        assert f'"argv": ["{package / "job.py"}", "4"]' in out.read_text()
        assert '"name": "__main__"' in out.read_text()
    finally:
        pool.close()


def test_a_pool_refuses_a_rank_that_runs_another_entry(
        scripts: Path, pool_of: Callable[..., SparePool]) -> None:
    pool = pool_of(1)
    assert pool.start(0, dict(os.environ),
                      [sys.executable, "-u", str(scripts / "waiter.py"), "x"]) is None
    assert len(pool.spares) == 1


def test_spares_that_die_before_they_are_ready_are_not_restarted_forever(
        scripts: Path, pool_of: Callable[..., SparePool],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARE_TEST_IMPORT_DIES", "1")
    pool = pool_of(2)
    _until(lambda: (pool.replenish(), pool.size == 0 and not pool.spares)[1],
           "the pool giving up")
    assert MAX_EARLY_DEATHS <= len(_imports(scripts)) <= MAX_EARLY_DEATHS + 1
    assert pool.start(0, dict(os.environ),
                      [sys.executable, "-u", str(scripts / "entry.py"), "0"]) is None


def test_closing_the_pool_ends_idle_spares(scripts: Path,
                                           pool_of: Callable[..., SparePool]) -> None:
    pool = pool_of(2)
    pids = [s.proc.pid for s in pool.spares]
    pool.close()
    assert not any(_alive(pid) for pid in pids)
    pool.replenish()
    assert pool.spares == []  # closed for good


# -- never outliving the launcher ----------------------------------------------------------------
def _spare_pids(processes: Iterable[psutil.Process]) -> List[int]:
    found = []
    for child in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if SPARE_MODULE in " ".join(child.cmdline()):
                found.append(child.pid)
    return found


class Launcher:
    """A running ttprun and every process it was seen to start (for the clean-up)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.seen: Dict[int, psutil.Process] = {}

    def spares(self) -> List[int]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        return [pid for pid in _spare_pids(self.seen.values()) if _alive(pid)]

    def wait_for_spares(self, n: int) -> List[int]:
        _until(lambda: len(self.spares()) == n, f"{n} warm spares")
        return self.spares()


@contextlib.contextmanager
def _ttprun(scripts: Path, free_port: int, spares: int = 2) -> Iterator[Launcher]:
    """ttprun with 2 waiting workers and warm spares; every process it started is killed on
    the way out (its workers have no death signal: a SIGKILLed launcher leaves them)."""
    cmd = [sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port}",
           "--node-rank=0", "--monitor-interval=0.05", f"--warm-spares={spares}",
           str(scripts / "waiter.py"), str(scripts / "stop")]
    env = dict(os.environ, TTP_RUN_DIR=str(scripts / "runs"))
    proc = subprocess.Popen(cmd, env=env, cwd=str(scripts), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    launcher = Launcher(proc)
    try:
        yield launcher
    finally:
        launcher.spares()
        proc.kill()
        proc.wait(30)
        for p in launcher.seen.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(list(launcher.seen.values()), timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "exit"])
def test_spares_end_with_ttprun(scripts: Path, free_port: int, how: str) -> None:
    """Every way a launcher ends: SIGKILL (nothing of it runs: the death signal does it),
    SIGTERM (the preemption path: workers get it forwarded, the agent closes the pool), and
    the workers' normal exit."""
    with _ttprun(scripts, free_port) as launcher:
        spares = launcher.wait_for_spares(2)
        _until(lambda: len(_imports(scripts)) >= 4, "workers and spares importing")
        launcher.spares()  # remember the workers too
        if how == "exit":
            (scripts / "stop").touch()
            assert launcher.proc.wait(DEADLINE_S) == 0
        else:
            launcher.proc.send_signal(getattr(signal, how))
            launcher.proc.wait(DEADLINE_S)
        _until(lambda: not any(_alive(pid) for pid in spares), f"spares gone after {how}",
               timeout=10)


@pytest.mark.timeout(120)
def test_a_spare_still_importing_dies_with_a_killed_launcher(
        scripts: Path, free_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARE_TEST_IMPORT_DELAY", "60")  # every import of the module blocks
    with _ttprun(scripts, free_port, spares=1) as launcher:
        (spare,) = launcher.wait_for_spares(1)
        _until(lambda: spare in {int(i[0]) for i in _imports(scripts)}, "the spare importing")
        launcher.spares()
        launcher.proc.kill()
        _until(lambda: not _alive(spare), "the importing spare gone", timeout=10)


@pytest.mark.timeout(120)
def test_ttprun_serves_a_replacement_request_from_a_warm_spare(scripts: Path,
                                                               free_port: int) -> None:
    """The recovery's relay asks ttprun for a replacement of rank 1 (launch/replace.py's request
    file, written here by the test): the launcher stops the old worker and hands the rank to
    its warm spare, which runs it with the request's environment; the relay hears the pid."""
    import json

    with _ttprun(scripts, free_port, spares=1) as launcher:
        (spare,) = launcher.wait_for_spares(1)
        _until(lambda: any(int(i[0]) == spare and i[1] == "-" for i in _imports(scripts)),
               "the spare's imports")

        def workers() -> List[dict]:
            return [json.loads(p.read_text()) for p in scripts.glob("worker-*.json")]

        _until(lambda: len(workers()) == 2, "both workers")
        old = next(w["pid"] for w in workers() if w["RANK"] == "1")
        run_dir = next((scripts / "runs").glob("ttprun-*"))
        (run_dir / "replace").mkdir(mode=0o700, exist_ok=True)
        request = {"recovery_id": 1, "rank": 1, "env": {"TTP_RECOVERY_JOIN": "order"}}
        (run_dir / "replace" / "r1-rank1.json").write_text(json.dumps(request))
        status = run_dir / "replace" / "r1-rank1.status.json"
        _until(status.is_file, "the relay's answer")
        answer = json.loads(status.read_text())
        assert (answer["state"], answer["pid"]) == ("started", spare), answer
        _until(lambda: any(w["pid"] == spare for w in workers()), "the spare as rank 1")
        new = next(w for w in workers() if w["pid"] == spare)
        assert new == {"RANK": "1", "TTP_RECOVERY_JOIN": "order", "pid": spare}
        assert not _alive(old)
        assert len([i for i in _imports(scripts) if int(i[0]) == spare]) == 1  # imported once
        # the launcher started the next spare (the used one keeps its command line)
        _until(lambda: bool(set(launcher.spares()) - {spare}), "the next warm spare")
        (scripts / "stop").touch()
        assert launcher.proc.wait(DEADLINE_S) == 0
