"""ttprun's replacement desk (launch/replace.py) with real processes and a context shaped like
torch's SubprocessContext: a request kills what is left of the lost worker and starts its
replacement with the worker's command line and environment plus the request's, swapped into
the context so torch monitors it; the status file says what happened, and the relay reads it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

from mindio_ttp.launch import replace as R

CHILD = """
import json, os, sys
out = sys.argv[1]
with open(out, "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k in
               ("RANK", "LOCAL_RANK", "MASTER_PORT", "TTP_RECOVERY_JOIN", "FROM_LAUNCHER")}, f)
"""


@dataclass
class Worker:
    global_rank: int
    local_rank: int
    id: int = 0


class Context:
    """The parts of torch's SubprocessContext the desk uses."""

    def __init__(self, tmp: Path, old: subprocess.Popen) -> None:
        self.entrypoint = sys.executable
        self.args = {0: ("-c", CHILD, str(tmp / "replacement.json"))}
        self.envs = {0: {"RANK": "5", "LOCAL_RANK": "0", "MASTER_PORT": "1111"}}
        self.stdouts: Dict[int, str] = {0: ""}
        self.stderrs: Dict[int, str] = {0: ""}
        self.subprocess_handlers = {0: R.AdoptedHandler(old, 0)}
        self._failures = {0: "the lost worker's failure"}
        self._running_local_ranks: set = set()


@pytest.fixture
def lost_worker():
    """A worker that hangs (as a SIGSTOPped or raising rank would): in its own session."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_request_replaces_the_lost_worker_and_says_so(tmp_path, lost_worker, monkeypatch):
    monkeypatch.setenv("FROM_LAUNCHER", "yes")
    ctx, workers = Context(tmp_path, lost_worker), [Worker(5, 0, lost_worker.pid)]
    desk = R.ReplacementDesk(tmp_path)
    assert desk.serve(ctx, workers) == []  # no request: nothing happens
    env = {"MASTER_PORT": "2222", "TTP_RECOVERY_JOIN": "{}"}
    R.write_request(str(tmp_path), R.ReplacementRequest(3, 5, env))
    assert desk.serve(ctx, workers) == [0]
    assert lost_worker.poll() == -signal.SIGKILL  # what was left of it is gone first
    new = ctx.subprocess_handlers[0].proc
    assert new.pid != lost_worker.pid and workers[0].id == new.pid
    assert ctx._failures == {} and ctx._running_local_ranks == {0}
    status = R.read_status(str(tmp_path), 3, 5)
    assert status is not None and (status.state, status.pid) == (R.STARTED, new.pid)
    wait_for(tmp_path / "replacement.json")
    new.wait(30)
    seen = json.loads((tmp_path / "replacement.json").read_text())
    assert seen == {"RANK": "5", "LOCAL_RANK": "0", "MASTER_PORT": "2222",
                    "TTP_RECOVERY_JOIN": "{}", "FROM_LAUNCHER": "yes"}
    assert desk.serve(ctx, workers) == []  # served once only
    status = R.read_status(str(tmp_path), 3, 5)
    assert status.state == R.EXITED and status.detail == "exit code 0"


def test_a_rank_that_is_not_this_launchers_fails_the_request(tmp_path, lost_worker):
    ctx, workers = Context(tmp_path, lost_worker), [Worker(5, 0, lost_worker.pid)]
    R.write_request(str(tmp_path), R.ReplacementRequest(1, 7, {}))
    assert R.ReplacementDesk(tmp_path).serve(ctx, workers) == []
    status = R.read_status(str(tmp_path), 1, 7)
    assert status.state == R.FAILED and "not a worker of this launcher" in status.detail
    assert lost_worker.poll() is None


def test_a_malformed_request_is_ignored(tmp_path, lost_worker, caplog):
    ctx, workers = Context(tmp_path, lost_worker), [Worker(5, 0, lost_worker.pid)]
    (tmp_path / R.REPLACE_DIR).mkdir()
    (tmp_path / R.REPLACE_DIR / "r1-rank5.json").write_text('{"rank": "five"')
    (tmp_path / R.REPLACE_DIR / "r2-rank5.json").write_text(json.dumps(
        {"recovery_id": 2, "rank": 6, "env": {}}))  # names another request than its file
    desk = R.ReplacementDesk(tmp_path)
    assert desk.serve(ctx, workers) == [] and desk.serve(ctx, workers) == []
    assert lost_worker.poll() is None
    assert sum("replacement request" in r.message for r in caplog.records) == 2


def test_starters_are_tried_in_order(tmp_path, lost_worker):
    calls: List[str] = []

    def no_spare(*args):
        calls.append("spare")
        return None

    def broken(*args):
        calls.append("broken")
        raise OSError("exec format error")

    def cold(*args):
        calls.append("cold")
        return R.cold_start(*args)

    ctx, workers = Context(tmp_path, lost_worker), [Worker(5, 0, lost_worker.pid)]
    R.write_request(str(tmp_path), R.ReplacementRequest(1, 5, {}))
    assert R.ReplacementDesk(tmp_path, [no_spare, broken, cold]).serve(ctx, workers) == [0]
    assert calls == ["spare", "broken", "cold"]
    ctx.subprocess_handlers[0].proc.wait(30)

    R.write_request(str(tmp_path), R.ReplacementRequest(2, 5, {}))
    assert R.ReplacementDesk(tmp_path, [no_spare]).serve(ctx, workers) == []
    assert R.read_status(str(tmp_path), 2, 5).state == R.FAILED


def test_cold_start_appends_to_the_workers_log(tmp_path):
    log = tmp_path / "rank5.log"
    log.write_text("before the fault\n")
    proc = R.cold_start(0, dict(os.environ), [sys.executable, "-c", "print('replacement')"],
                        str(log), None)
    assert proc.wait(30) == 0
    assert log.read_text() == "before the fault\nreplacement\n"


def test_a_restarted_worker_group_gets_a_fresh_desk(tmp_path, lost_worker):
    """Under --max-restarts a new attempt numbers its recoveries from 1 again: a request
    named like the previous attempt's must be served, not taken as done."""
    ctx, workers = Context(tmp_path, lost_worker), [Worker(5, 0, lost_worker.pid)]
    desk = R.ReplacementDesk(tmp_path)
    R.write_request(str(tmp_path), R.ReplacementRequest(1, 7, {}))
    desk.serve(ctx, workers)
    assert R.read_status(str(tmp_path), 1, 7).state == R.FAILED
    desk = desk.fresh()
    assert not (tmp_path / R.REPLACE_DIR).exists()
    R.write_request(str(tmp_path), R.ReplacementRequest(1, 5, {}))
    assert desk.serve(ctx, workers) == [0]
    ctx.subprocess_handlers[0].proc.wait(30)


def test_a_fresh_desk_still_hands_a_lost_nodes_ranks_to_the_takeover(tmp_path, lost_worker):
    """ttprun makes a fresh desk at every start of its workers, the first included: the
    takeover's hand-off (`foreign`) must survive it, or a lost node's ranks are failed at once
    instead of going to a spare node."""
    ctx, workers = Context(tmp_path, lost_worker), [Worker(5, 0, lost_worker.pid)]
    held: List[R.ReplacementRequest] = []
    desk = R.ReplacementDesk(tmp_path, foreign=lambda request: held.append(request) or True)
    desk = desk.fresh()
    R.write_request(str(tmp_path), R.ReplacementRequest(1, 7, {}))
    assert desk.serve(ctx, workers) == []
    assert [r.rank for r in held] == [7]
    assert R.read_status(str(tmp_path), 1, 7) is None  # the takeover answers, not the desk
    assert lost_worker.poll() is None
