"""The runtime's fault-time stop against a backend that fails as NCCL does (testkit/nccl_like),
for each emulated torch release: rank 1 dies (SIGKILL) or stops (SIGSTOP), rank 0's main thread
spins in an all-reduce with it (a host read behind it blocks), and the runtime's stop, run off
the main thread as the processor runs it at the controller's lock, aborts by whichever name the
release binds (D1: torch 2.1 has only ``_abort``) and gets the main thread out of the step
within a second (D3). The param all-gather's note is the one taken before the abort, however
often the save asks (D2), and the process builds a working new world after it (what in-memory
recovery needs: destroy bounded, the device checked, D6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.hooks import NCCL_LIKE_DIR, pythonpath

WORKER = Path(__file__).resolve().parent / "stop_worker.py"
ABORT_NAME = {"2.1": "_abort", "2.4": "_shutdown", "2.6": "abort"}


def run(tmp_path: Path, release: str, sig: str, after: str = "save") -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath(NCCL_LIKE_DIR), "NCCL_LIKE": "1",
           "NCCL_LIKE_TORCH": release, "OMP_NUM_THREADS": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "2"}
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(WORKER), sig, str(rank), store, after],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for rank in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=150)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert procs[0].returncode == 0 and lines, err[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("release", sorted(ABORT_NAME))
@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_every_survivor_is_out_of_the_step_within_a_second_of_the_stop(tmp_path, release,
                                                                      sig) -> None:
    got = run(tmp_path, release, sig)
    assert got["stop_ok"], got
    assert "NCCL communicator was aborted" in got["main_error"], got
    assert got["left_after_fault_s"] - got["lock_after_fault_s"] < 1.0, got
    assert got["aborted"], got  # world and subgroup, by the release's own name
    assert got["gathered"] == [True, True] or got["gathered"] == [False, False], got


def test_the_note_is_the_one_taken_before_the_abort(tmp_path) -> None:
    """The all-gather of the step finished before the fault: both save attempts say so."""
    got = run(tmp_path, "2.6", "KILL")
    assert got["gathered"] == [True, True] and got["event_done_after_abort"], got


@pytest.mark.parametrize("release", ["2.1", "2.6"])
def test_after_the_abort_the_process_builds_a_working_new_world(tmp_path, release) -> None:
    got = run(tmp_path, release, "KILL", after="reinit")
    assert got["stop_ok"] and got["destroyed"] and got["health"] == "ok", got
    assert got["new_world_sum"] == 3.0, got
