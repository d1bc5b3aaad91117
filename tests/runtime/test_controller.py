"""The controller against scripted processors over real loopback sockets (no torch)."""

from __future__ import annotations

import socket
import time

import pytest

from mindio_ttp.config import Outcome, TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.controller.state import ControllerState
from mindio_ttp.control.wire import protocol as P

from .conftest import DP, ENV
from .fakes import KEY, FakeRank, handshake, read_frames, wait_for


@pytest.fixture
def ranks(ctl):
    made = []

    def make(*specs, **kw):
        for r in specs:
            made.append(FakeRank(ctl.address, r, 4, DP, 2, **kw))
        deadline = time.monotonic() + 5
        while len(ctl.registered) < len(made) and time.monotonic() < deadline:
            time.sleep(0.01)
        return made
    yield make
    for f in made:
        f.close()


def wait_decision(ctl, timeout=10.0):
    assert ctl.decided.wait(timeout), f"no decision; faults: {ctl.faults}"
    return ctl.decision


def test_dead_rank_detected_fast_and_partner_saves(ctl, ranks):
    fakes = ranks(0, 1, 2, 3)
    t0 = time.monotonic()
    fakes[1].close()
    d = wait_decision(ctl)
    assert ctl.fault_at - t0 < 0.5, "connection drop -> fault must take < 0.5 s"
    assert d.outcome is Outcome.SAVED and d.step == 3 and d.ranks == [0, 3]
    assert "rank 1 dead" in ctl.faults[0]
    renames = [f.rank for f in fakes if f.of_type(P.RenameOrder)]
    assert renames == [0]
    for f in (fakes[0], fakes[2], fakes[3]):
        assert f.got_exit.wait(3) and f.exit.exit_code == 83
    states = [b for _, b, _ in ctl.sm.history]
    assert states[:4] == [ControllerState.SERVING, ControllerState.COLLECTING,
                          ControllerState.SAVING, ControllerState.RENAMING]


def test_silent_rank_is_declared_hung(ctl, ranks):
    fakes = ranks(0, 1, 2, 3)
    fakes[2].silent = True
    d = wait_decision(ctl)
    assert "rank 2 hung" in ctl.faults[0]
    assert d.outcome is Outcome.SAVED and d.ranks == [0, 1]


def test_both_holders_of_a_shard_dead_refuses_and_names_it(ctl, ranks):
    fakes = ranks(0, 1, 2, 3)
    fakes[1].close()
    fakes[3].close()
    d = wait_decision(ctl)
    assert d.outcome is Outcome.NO_CONSISTENT_STEP and d.step is None
    assert "shard 1" in d.reason and "rank 1" in d.reason and "rank 3" in d.reason
    assert not any(f.of_type(P.SaveOrder) for f in fakes)
    assert fakes[0].got_exit.wait(3) and fakes[0].exit.exit_code == 84


def test_save_failure_runs_no_rename(ctl, ranks):
    fakes = ranks(0, 1, 2, save_ok=False)
    fakes += ranks(3)
    fakes[2].close()
    d = wait_decision(ctl)
    assert d.outcome is Outcome.SAVE_FAILED and "disk full" in d.reason
    assert "rename not run" in d.reason
    assert not any(f.of_type(P.RenameOrder) for f in fakes)
    assert fakes[3].got_exit.wait(3) and fakes[3].exit.exit_code == 85


def test_rank_behind_is_told_to_catch_up_to_the_newest_step(ctl, ranks):
    fakes = ranks(0, 1, 2, 3)
    fakes[0].updating = True  # inside the window of step 4
    fakes[3].close()
    wait_decision(ctl)
    adv = fakes[1].of_type(P.AdvanceTo)
    assert adv and adv[0].limit == 4


def test_bad_frames_are_rejected_and_the_controller_keeps_serving(ctl, ranks, caplog):
    garbage = [b"GET / HTTP/1.0\r\n\r\n",
               P.encode(P.Goodbye(1), b"k" * 32),  # wrong key
               P.encode(P.Heartbeat(1, 1, 1, False), KEY),  # not registered
               b"TP\x07\x01\x00\x00\x00\x02{}" + b"\0" * 32]  # other version
    for g in garbage:
        with socket.create_connection(ctl.address, timeout=2) as s:
            s.sendall(g)
            assert only_a_challenge_then_closed(s)
    assert ctl.rejected_frames >= len(garbage)
    assert "rejected frame" in caplog.text
    fakes = ranks(0, 1, 2, 3)
    assert ctl.sm.state is ControllerState.SERVING and ctl.faults == []
    fakes[1].close()
    assert wait_decision(ctl).outcome is Outcome.SAVED


def only_a_challenge_then_closed(s: socket.socket) -> bool:
    """Everything the listener sent before closing `s`: its Challenge and nothing else."""
    s.settimeout(2)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    msgs = P.FrameDecoder(KEY).feed(data)
    return [type(m) for m in msgs] == [P.Challenge]


def test_mismatched_registration_is_refused(ctl):
    with socket.create_connection(ctl.address, timeout=2) as s:
        hs = handshake(s, P.Register(1, 8, [0, 1], 1, "127.0.0.1", 0, 0, None, False, False, False))
        msg = read_frames(s, hs.dec)[0]  # the Reject is sealed with this connection's key
    assert isinstance(msg, P.Reject) and "world_size 4" in msg.reason


def test_goodbye_is_not_a_fault_and_stop_waits_for_it(ctl, ranks):
    fakes = ranks(0, 1)
    for f in fakes:
        f.send(P.Goodbye(f.rank))
        f.close()
    # the controller has seen each goodbye and then each connection close (where a fault
    # would be counted): the rank is gone and its connection dropped
    assert wait_for(lambda: all(ctl._ranks[r].status == "gone" and ctl._ranks[r].conn is None
                                for r in (0, 1)))
    assert ctl.faults == []
    t0 = time.monotonic()
    ctl.stop(wait_goodbyes=5)
    assert time.monotonic() - t0 < 2
    assert ctl.sm.state is ControllerState.STOPPED


def test_standby_takes_over_once_half_the_world_registered():
    cfg = TTPConfig.from_env(ENV)
    sb = Controller(cfg, 4, 2, host_rank=1, standby=True)
    sb.listen("127.0.0.1", 0)
    sb.start()
    fakes = []
    try:
        fakes.append(FakeRank(sb.address, 1, 4, DP, 2))
        assert wait_for(lambda: sb.registered == [1])
        registered_at = sb._ranks[1].last_seen
        # a later heartbeat is served: the registration (and its promotion check) is over
        assert wait_for(lambda: sb._ranks[1].last_seen > registered_at)
        assert sb.sm.state is ControllerState.STANDBY and not sb.faults
        fakes += [FakeRank(sb.address, r, 4, DP, 2) for r in (2, 3)]
        d = wait_decision(sb)
        assert "primary controller lost" in sb.faults[0]
        assert d.outcome is Outcome.SAVED and d.step == 3 and d.ranks == [1, 2]
    finally:
        for f in fakes:
            f.close()
        sb.stop()


def test_job_wide_stall_starts_the_flow_when_step_timeout_is_set():
    c = Controller(TTPConfig.from_env(dict(ENV, TTP_STEP_TIMEOUT="0.5")), 4, 2, host_rank=0)
    c.listen("127.0.0.1", 0)
    c.start()
    fakes = [FakeRank(c.address, r, 4, DP, 2) for r in range(4)]
    try:
        assert wait_for(lambda: len(c.registered) == 4)
        since = time.monotonic()
        # the stall check ran after TTP_STEP_TIMEOUT (0.5 s) of no change: it could have fired
        assert wait_for(lambda: c.checked_at > since + 0.6)
        assert c.faults == [], "no step change seen yet: the stall detector is not armed"
        fakes[0].step = 4  # one step of progress, then every rank stalls
        d = wait_decision(c)
        assert "no training progress" in c.faults[0]
        assert d.outcome is Outcome.SAVED and d.step == 3 and d.ranks == [1, 2]
    finally:
        for f in fakes:
            f.close()
        c.stop()


def test_step_timeout_is_off_by_default():
    assert TTPConfig.from_env(ENV).step_timeout == 0.0
    with pytest.raises(ValueError, match="TTP_STEP_TIMEOUT"):
        TTPConfig.from_env(dict(ENV, TTP_STEP_TIMEOUT="-3"))


def test_every_rank_learns_the_same_backups_soon_after_it_registers():
    """Ranks registering one after another each learn a list that then changes (rank 3 alone,
    then 2 and 3, then 1 and 2): with the default 2 s heartbeat, a fault 0.3 s after the last
    registration found rank 1 with only itself and ranks 2 and 3 with rank 2, and the job failed
    over to two standbys, neither with a majority. Every rank must hold the final list well
    within that."""
    from mindio_ttp import hooks
    from mindio_ttp.control.rank.processor import Processor

    env = {k: v for k, v in ENV.items() if not k.startswith("TTP_HEARTBEAT")}
    ctl = Controller(TTPConfig.from_env(env), 4, 2, host_rank=0)
    ctl.listen("127.0.0.1", 0)
    ctl.start()
    assert ctl.cfg.heartbeat_interval == 2.0
    procs = []
    try:
        for rank in (3, 2, 1):
            hooks.STATE.reset()
            proc = Processor(TTPConfig.from_env(env), rank, DP, 4, 2)
            proc.exit_fn = lambda code: None
            proc.start("127.0.0.1", ctl.address[1])
            procs.append(proc)
        registered = time.monotonic()
        assert wait_for(lambda: all([b[0] for b in p._backups] == [1, 2] for p in procs), 5.0)
        assert time.monotonic() - registered < 0.5
    finally:
        ctl.stop()  # first: its Closing tells each processor to end quietly, no fault
        for proc in procs:
            proc._stop.set()
            proc._mail.wake()
            if proc.standby:
                proc.standby.stop()
        hooks.STATE.reset()
