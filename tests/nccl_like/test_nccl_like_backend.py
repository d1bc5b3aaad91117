"""The NCCL-like backend (testkit/nccl_like) blocks where NCCL blocks and releases on abort,
for each emulated torch release: two real processes on loopback, every collective checked
against gloo's values first, then rank 1 dies (SIGKILL) or stops (SIGSTOP) and rank 0's main
thread blocks in a collective with it until another thread aborts the group (by whichever
name that release has: a test written against a double with every name fails here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from testkit.hooks import NCCL_LIKE_DIR, pythonpath

WORKER = Path(__file__).resolve().parent / "nccl_like_worker.py"
RELEASES = ["2.1", "2.4", "2.6"]
ABORT_NAME = {"2.1": "_abort", "2.4": "_shutdown", "2.6": "abort"}


def run_ranks(scenario: str, port: int, release: str, env: Optional[Dict[str, str]] = None,
              timeout_s: float = 90, world: int = 2) -> List[Tuple[int, dict, str]]:
    """Every rank of `scenario`; each survivor's exit code, RESULT and stderr. The last rank
    (dead, or stopped) is SIGKILLed once the others are done."""
    full = {**os.environ, "PYTHONPATH": pythonpath(NCCL_LIKE_DIR), "NCCL_LIKE": "1",
            "NCCL_LIKE_TORCH": release, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if name not in (env or {}):
            full.pop(name, None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(rank), str(world),
                               str(port)], env=full, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outs = []
    try:
        for proc in procs[:-1]:
            outs.append(proc.communicate(timeout=timeout_s))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
    found = []
    for proc, (out, err) in zip(procs, outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        found.append((proc.returncode, json.loads(lines[-1][len("RESULT "):]) if lines else {},
                      err))
    return found


def run_pair(scenario: str, port: int, release: str, env: Optional[Dict[str, str]] = None,
             timeout_s: float = 90) -> Tuple[int, dict, str]:
    """Rank 0's exit code, RESULT and stderr of `scenario` on two ranks (rank 1 the peer)."""
    return run_ranks(scenario, port, release, env, timeout_s)[0]


def assert_backend(result: dict, release: str, err: str) -> None:
    assert result["warm_up"] and all(result["warm_up"].values()), (result["warm_up"], err)
    assert result["backend"] == "nccl_like" and result["name"] == "nccl"
    assert result["version"].startswith(release + ".")
    names = result["names"]
    assert [names["abort"], names["_shutdown"], names["_abort"]] == {
        "2.1": [False, False, True], "2.4": [False, True, False],
        "2.6": [True, False, False]}[release], names
    assert names["shutdown"] is names["_group_start"] is names["_group_end"] is (release == "2.6")
    assert result["abort_process_group"] is (release == "2.6")
    assert result["nccl"] == {"2.1": [2, 18, 1], "2.4": [2, 20, 5], "2.6": [2, 26, 2]}[release]
    assert result["abort_name"] == ABORT_NAME[release]


@pytest.mark.parametrize("release", RELEASES)
def test_a_dead_peer_spins_until_aborted(release, free_port) -> None:
    """SIGKILL: gloo sees the reset, the op spins; wait() returns as NCCL's does, an event
    recorded after it stays pending, ``.item()`` blocks; the abort ends the op with an error,
    the stream moves on (the read returns), and the group refuses new work."""
    rc, result, err = run_pair("kill_item", free_port, release)
    assert rc == 0 and result, err
    assert_backend(result, release, err)
    assert result["spinning"] and result["wait_returned"] is True
    assert result["blocked"], "the main thread's .item() returned before the abort"
    assert result["before_abort"] == {"event_done": False, "completed": False,
                                      "exception": False}
    main = result["main"]
    assert main["raised"] is None and main["released_after_abort_s"] < 5, main
    after = result["after_abort"]
    assert after["event_done"] is True
    assert "NCCL communicator was aborted" in after["exception"]
    assert after["wait"].startswith("DistBackendError")
    assert after["next_collective"].startswith("DistBackendError")


@pytest.mark.parametrize("release", RELEASES)
def test_a_stopped_peer_blocks_wait_until_aborted(release, free_port) -> None:
    rc, result, err = run_pair("stop_wait", free_port, release)
    assert rc == 0 and result, err
    assert_backend(result, release, err)
    assert result["blocked"], "wait() returned with the peer stopped"
    assert result["main"]["raised"] == "DistBackendError", result["main"]
    assert "aborted" in result["main"]["message"]


def test_every_survivor_spins_not_only_the_one_gloo_told(free_port) -> None:
    """Three ranks, the last one dead: whichever survivor's gloo saw the reset, both groups
    spin (through the store) and both survivors' wait() returns, as NCCL's does. They then exit
    the ordinary way with an aborted op still pending in gloo, and exit 0 (a completion thread
    left inside gloo's wait() would be ended by std::terminate at the interpreter's exit)."""
    survivors = run_ranks("kill_all_spin", free_port, "2.6", world=3)
    for rc, result, err in survivors:
        assert rc == 0 and result, err
        assert result["warm_up"] and all(result["warm_up"].values()), err
        assert result["spinning"] and result["wait_returned_before_abort"], (result, err)
        assert result["main"]["raised"] is None


def test_barrier_blocks_the_host_even_on_a_spinning_op(free_port) -> None:
    rc, result, err = run_pair("kill_barrier", free_port, "2.6")
    assert rc == 0 and result, err
    assert result["spinning"] and result["blocked"]
    assert result["main"]["raised"] == "DistBackendError", result["main"]


@pytest.mark.parametrize("release, waits", [("2.4", False), ("2.6", True)])
def test_destroy_waits_for_unfinished_work_from_2_6_unless_aborted(release, waits,
                                                                   free_port) -> None:
    rc, result, err = run_pair("kill_destroy", free_port, release)
    assert rc == 0 and result, err
    assert result["blocked"] is waits, result
    assert result["main"]["raised"] is None and result["initialized_after"] is False


@pytest.mark.parametrize("one_queue", [False, True])
def test_a_private_stream_read_waits_behind_a_spinning_collective_only_on_one_queue(
        one_queue, free_port) -> None:
    rc, result, err = run_pair("one_queue_read", free_port, "2.6",
                               env={"NCCL_LIKE_ONE_QUEUE": "1" if one_queue else "0"})
    assert rc == 0 and result, err
    assert result["blocked"] and result["main"]["raised"] is None
    read = result["private_read"]
    assert read["before_abort"] is (not one_queue), read


# (release, env, what the watchdog does after the group's 2 s timeout)
WATCHDOG = [
    ("2.1", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, "tear down"),  # 2.1 reads the old name
    ("2.1", {"NCCL_ASYNC_ERROR_HANDLING": "2"}, "abort"),
    ("2.4", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "1"}, "abort"),
    ("2.6", {}, "tear down"),  # default 3
    ("2.6", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "nothing"),
]


@pytest.mark.parametrize("release, env, does", WATCHDOG)
def test_the_watchdog_reads_its_releases_env_names(release, env, does, free_port) -> None:
    rc, result, err = run_pair("watchdog", free_port, release,
                               env={**env, "WORKER_GROUP_TIMEOUT_S": "2"})
    if does == "tear down":
        assert rc == -signal.SIGABRT, (rc, err)
        assert "Watchdog caught collective operation timeout" in err
        assert "taking the entire process down" in err
        return
    assert rc == 0 and result, err
    if does == "nothing":
        assert result["blocked"] and "keeps spinning" in err
        assert result["main"]["raised"] == "DistBackendError"  # the observer's abort
        assert result["future_result"] == "WorkResult.TIMEOUT"
        return
    assert not result["blocked"], "the watchdog did not end the op"
    assert result["main"]["raised"] == "DistBackendError"
    assert "Watchdog caught collective operation timeout" in result["main"]["message"]
    assert result["has_get_future_result"] is (release == "2.6")
    assert "Watchdog caught" in result["exception"]  # what torch < 2.6 can read (D9)


def test_release_table_and_env_precedence() -> None:
    from testkit.nccl_like import versions

    r21, r24, r26 = (versions.RELEASES[k] for k in RELEASES)
    assert (r21.abort_names, r24.abort_names, r26.abort_names) == (
        ("_abort",), ("_shutdown",), ("abort",))
    both = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert r21.error_handling(both)[0] == 1  # 2.1 never reads the TORCH_ name
    assert r24.error_handling(both)[0] == r26.error_handling(both)[0] == 2  # it wins from 2.2
    assert r21.error_handling({})[0] == 1 and r26.error_handling({})[0] == 3
    assert versions.from_env({}) is r26
    with pytest.raises(ValueError, match="NCCL_LIKE_TORCH='2.3'"):
        versions.from_env({"NCCL_LIKE_TORCH": "2.3"})
    with pytest.raises(ValueError, match="integer 0-3"):
        r26.error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "yes"})
