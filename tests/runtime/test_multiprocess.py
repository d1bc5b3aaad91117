"""Real jobs: 4 processes, gloo, the TTP hooks, one injected fault each (see ttp_worker.py).

Layout: one DP group [0, 1, 2, 3], replica 2, so shard 0 lives on ranks 0 and 2, shard 1 on
ranks 1 and 3. A fault at step 5 that strikes once every other rank has done its update of step
5 (`fault`: they can, its collectives are behind them) leaves every survivor clean at step 5, so
the dying checkpoint must be step 5. A survivor the fault's news reaches before that update
(the lock, or its own lost controller) is held at its gate with step 4, and 4 is then what it
holds: see test_survivors_held_at_the_gate_save_the_step_they_hold.
"""

from __future__ import annotations

import json

import pytest

from .jobs import run_job

pytestmark = pytest.mark.slow
SAVED, REFUSED, SAVE_FAILED = 83, 84, 85


def fault(kind, rank, phase, step=5):
    # a fault noticed at once (a death, an exception) strikes once the others did their update
    # of `step`; a hang is seen a heartbeat timeout later, a SIGTERM's race is its test's point
    return {"kind": kind, "rank": rank, "step": step, "phase": phase,
            "after_others": kind in ("kill", "kill_host", "exception")}


def expected_param(step: int) -> float:
    return 4.0 * step * (step + 1) / 2  # all-reduced grad of step t is 4t


def check_saved(res, step, savers):
    assert res.flow is not None, res.all_logs()
    assert res.flow["outcome"] == "saved" and res.flow["step"] == step, res.flow
    assert res.flow["ranks"] == savers
    assert res.latest == step
    assert res.saved_ranks(step) == savers
    for r in savers:
        data = json.loads((res.out / f"iter_{step}" / f"rank_{r}.json").read_text())
        assert data["param"] == [expected_param(step)] * 4, (r, data)
    assert not list(res.out.glob("*_tmp"))


def test_dead_rank_partner_saves(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("kill", 1, "inside")]})
    assert res.codes == {0: SAVED, 1: -9, 2: SAVED, 3: SAVED}, res.all_logs()
    check_saved(res, 5, [0, 3])


def test_rank0_killed_its_controller_process_outlives_it_and_saves(tmp_path):
    """The controller runs in a process of its own (control/controller/host.py): rank 0's death is
    a dead
    rank like any other, with no failover."""
    res = run_job(tmp_path, {"faults": [fault("kill", 0, "inside")]})
    assert res.codes == {0: -9, 1: SAVED, 2: SAVED, 3: SAVED}, res.all_logs()
    check_saved(res, 5, [1, 2])
    assert "controller@rank0: FAULT rank 0 dead" in res.logs[0]
    assert "standby -> serving" not in res.all_logs()


def test_rank0_and_its_controller_killed_standby_takes_over(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("kill_host", 0, "inside")]})
    assert res.codes == {0: -9, 1: SAVED, 2: SAVED, 3: SAVED}, res.all_logs()
    check_saved(res, 5, [1, 2])
    assert "standby -> serving" in res.logs[1]


def test_survivors_held_at_the_gate_save_the_step_they_hold(tmp_path):
    """Node 0 (rank 0 and its controller) and rank 1 lost right after their update of step 5,
    while ranks 2 and 3, past step 5's barrier, have not begun theirs: each survivor's processor
    locks it at the lost controller, so both wait at the gate holding step 4, and the standby's
    flow saves 4, the newest step every shard's surviving holder has. Nobody alive ever held
    5 (its holders died with it); that is not a lost step to be recovered. (Under load this
    ordering happens by itself: test_rank0_and_first_backup_killed_... once saved 4.)"""
    held = {"step": 5, "phase": "before", "kind": "until_locked"}
    res = run_job(tmp_path, {"faults": [dict(fault("kill_host", 0, "after"), after_others=False),
                                        dict(fault("kill", 1, "after"), after_others=False),
                                        dict(held, rank=2), dict(held, rank=3)]})
    assert [res.codes[r] for r in (2, 3)] == [SAVED] * 2, res.all_logs()
    assert "worker 2: locked=True before its update" in res.logs[2], res.all_logs()
    assert "worker 3: locked=True before its update" in res.logs[3], res.all_logs()
    if res.codes[1] == -9:  # rank 1 did its update of 5 and died, as planned
        check_saved(res, 4, [2, 3])
    else:  # node 0's loss reached rank 1 first (rank 0 does not wait for it: it cannot wait
        # for 2 and 3, held before their update): held at its gate with 4 as well, it saves 4
        # for its shard (CI's clean-clone run met it once in 1457 tests)
        assert res.codes[1] == SAVED and "worker 1: injecting" not in res.logs[1], res.all_logs()
        check_saved(res, 4, [1, 2])


def test_rank0_hung_its_controller_declares_it_hung(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("stop", 0, "after")]}, stopped=[0])
    assert [res.codes[r] for r in (1, 2, 3)] == [SAVED] * 3, res.all_logs()
    check_saved(res, 5, [1, 2])
    assert "controller@rank0: FAULT rank 0 hung" in res.logs[0]


def test_rank0_and_its_controller_hung_standby_takes_over(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("stop_host", 0, "after")]}, stopped=[0])
    assert [res.codes[r] for r in (1, 2, 3)] == [SAVED] * 3, res.all_logs()
    check_saved(res, 5, [1, 2])
    assert "controller silent" in res.logs[2]


def test_controller_host_dying_during_the_save_standby_reruns_the_flow(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("kill", 1, "after")], "save_kill_host": 0})
    assert [res.codes[r] for r in (0, 1, 2, 3)] == [-9, -9, SAVED, SAVED], res.all_logs()
    check_saved(res, 5, [2, 3])
    assert "standby controller@rank2: standby -> serving" in res.logs[2]


def test_hung_rank_detected_by_heartbeat(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("stop", 2, "before")]}, stopped=[2])
    assert [res.codes[r] for r in (0, 1, 3)] == [SAVED] * 3, res.all_logs()
    check_saved(res, 5, [0, 1])
    assert "rank 2 hung" in res.logs[0]


def test_exception_inside_window_is_reported_and_excluded(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("exception", 2, "inside")]})
    assert res.codes == {r: SAVED for r in range(4)}, res.all_logs()
    check_saved(res, 5, [0, 1])
    assert "rank 2 reported exception: RuntimeError: injected failure" in res.logs[0]


def test_sigterm_preemption_saves_without_a_dead_rank(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("term", 3, "before")]})
    assert res.codes == {r: SAVED for r in range(4)}, res.all_logs()
    step = res.flow["step"]
    # Rank 3 locks itself right after the SIGTERM, before step 5's update, unless its training
    # thread enters the window first (the lock then holds it after step 5); every step needs its
    # all-reduce, so no rank passes step 6; the others may or may not enter their next window
    # before the lock reaches them (on a loaded machine it can reach them first: CI saw 4).
    assert step in (4, 5, 6), res.flow
    check_saved(res, step, [0, 1])
    assert "reported preempted" in res.logs[0]


def test_both_holders_of_a_shard_dead_refuses(tmp_path):
    res = run_job(tmp_path, {"faults": [fault("kill", 1, "after"), fault("kill", 3, "after")]})
    assert res.codes[0] == REFUSED and res.codes[2] == REFUSED, res.all_logs()
    assert res.flow["outcome"] == "no_consistent_step"
    assert "shard 1 has no clean replica" in res.flow["reason"]
    assert res.latest is None and not list(res.out.glob("iter_*"))


def test_save_failure_leaves_nothing_marked_latest(tmp_path):
    # rank 0's save fails; the save is ordered again with shard 0 on rank 2, which fails too
    res = run_job(tmp_path, {"faults": [fault("kill", 1, "inside")], "save_fail_rank": [0, 2]})
    assert [res.codes[r] for r in (0, 2, 3)] == [SAVE_FAILED] * 3, res.all_logs()
    assert "ordering it again, from rank(s) [2, 3]" in res.all_logs()
    assert res.flow["outcome"] == "save_failed" and "disk full" in res.flow["reason"]
    assert res.latest is None and not (res.out / "iter_5").exists()
    assert "running the rename handler" not in res.all_logs()


def test_clean_run_with_bad_frames_exits_zero_without_a_flow(tmp_path):
    res = run_job(tmp_path, {"steps": 8, "faults": [fault("garbage", 2, "after", step=3)]})
    assert res.codes == {r: 0 for r in range(4)}, res.all_logs()
    assert res.flow is None and res.latest is None
    assert "FAULT" not in res.all_logs()
    assert res.logs[0].count("rejected frame") == 2


def test_rank0_and_first_backup_killed_second_backup_takes_over(tmp_path):
    # rank 0 kills its controller, rank 1 (the first backup) and itself back to back: a rank 1
    # still alive once the others notice the controller's loss would itself take over, and a
    # controller still alive once rank 1 is gone would start (and claim) a flow of its own
    res = run_job(tmp_path, {"faults": [dict(fault("kill_host", 0, "after"), with_ranks=[1])]})
    assert [res.codes[r] for r in (2, 3)] == [SAVED] * 2, res.all_logs()
    check_saved(res, 5, [2, 3])
    assert "now served by the standby controller on rank 2" in res.logs[3]
    assert "standby controller@rank2: standby -> serving" in res.logs[2]
