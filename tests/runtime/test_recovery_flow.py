"""The controller's side of the in-memory recovery (control/controller/flow.py and its coordinator)
on its own: no controller, no sockets, scripted ranks. Covers the controller's transitions of
docs/recovery.md: COLLECTING -> RECOVERING -> SERVING (committed), and RECOVERING -> SAVING
(abandoned: a rank not ready in time, a failed refill, a replacement that exits, another
fault), and the decision that keeps the dying checkpoint."""

from __future__ import annotations

import threading
import time
from typing import List, Optional, Set

import pytest

from mindio_ttp.config import Outcome, TTPConfig
from mindio_ttp.control.controller.flow import Flow
from mindio_ttp.control.controller.roster import RankInfo, Roster
from mindio_ttp.control.controller.state import ControllerState as S
from mindio_ttp.control.controller.state import StateMachine
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.recovery import rank as R

from .conftest import DP, ENV
from .test_flow import ScriptedRanks

IN_MEMORY = {"TTP_RECOVERY": "in-memory", "TTP_REPLACEMENTS": "cold", "TTP_RECOVER_TIMEOUT": "5"}


class RecoveringRanks(ScriptedRanks):
    """Also answers the recovery: the relay reports the replacement `replace_state`; every rank
    (survivors and replacements) sends RecoverReady, `ok` unless it is in `fail`, except the
    ranks in `silent`; `fault_during` reports a fault once the order went out."""

    def __init__(self, *args, replace_state: str = "started", fail: Set[int] = frozenset(),
                 silent: Set[int] = frozenset(), fault_during=None,
                 die_on_relock: Set[int] = frozenset(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replace_state, self.fail, self.silent = replace_state, fail, silent
        self.fault_during = fault_during  # (desc, fault kwargs), or fn(self) run holding cond
        self.die_on_relock = die_on_relock  # die as the lock after the recovery goes out
        self.order: Optional[P.RecoverOrder] = None

    def broadcast(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        if isinstance(msg, P.Lock) and self.order is not None:
            with self.cond:  # the I/O thread sees their deaths only now
                for r in sorted(self.die_on_relock):
                    if self.roster.set_status(self.roster[r], "dead", "dead (killed)"):
                        self.flow.left(r)
        super().broadcast(msg, exclude)

    def send_many(self, ranks: List[int], msg: P.Message) -> None:
        if not isinstance(msg, (P.RecoverOrder, P.RecoverCommit)):
            return super().send_many(ranks, msg)
        self.sent.append(("many", list(ranks), msg))
        if isinstance(msg, P.RecoverOrder):
            self.order = msg

    def send(self, rank: int, msg: P.Message) -> None:
        super().send(rank, msg)
        if not isinstance(msg, P.ReplaceOrder):
            return
        assert self.flow is not None and self.order is not None
        rec = self.flow.recovery
        with self.cond:
            if self.replace_state == "started":  # the replacement registers, as rank msg.rank
                self.roster.register(RankInfo(msg.rank, tuple(DP), "127.0.0.1", 0, None,
                                              time.monotonic()))
            rec.replace_status(P.ReplaceStatus(msg.recovery_id, msg.rank, self.replace_state,
                                               4242, "by the test"), rank)  # from the relay
            if callable(self.fault_during):
                self.fault_during(self)
            elif self.fault_during is not None:
                self.flow.fault(*self.fault_during[:1], **self.fault_during[1])
            for r in range(4):
                if r not in self.silent:
                    rec.ready(P.RecoverReady(msg.recovery_id, r, r not in self.fail,
                                             "bad refill" if r in self.fail else "", "", 0.1), r)


def make_flow(lost: Set[int], step: int = 4, claims=lambda: None, **kwargs) -> Flow:
    env = {**ENV, **IN_MEMORY, **{k: v for k, v in kwargs.items() if k.startswith("TTP_")}}
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("TTP_")}
    cond = threading.Condition(threading.RLock())
    roster = Roster()
    for r in DP:
        roster.register(RankInfo(r, tuple(DP), "127.0.0.1", 0, None, time.monotonic()))
        if r in lost:
            roster.set_status(roster[r], "dead", "dead (killed)")
    sm = StateMachine("test flow")
    sm.transition_to(S.SERVING, "test")
    out = RecoveringRanks(roster, cond, {r: step for r in DP if r not in lost}, **kwargs)
    flow = Flow(TTPConfig.from_env(env), 4, 2, 0, "test flow", sm, cond, roster, out,
                out.closed.append, claims=claims, address=lambda: ("127.0.0.1", 8000))
    out.flow = flow
    return flow, out


@pytest.fixture(autouse=True)
def capable(monkeypatch):
    monkeypatch.setattr(R.RECOVERY, "capability", lambda: (True, ""))


def fault_and_wait(flow, out, desc: str = "rank 1 dead") -> None:
    with out.cond:
        flow.fault(desc)


def wait_state(flow, state: S, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not flow.sm.is_in(state) or flow._thread is not None and state is S.SERVING:
        assert time.monotonic() < deadline, (flow.sm.state, flow.sm.history)
        time.sleep(0.01)


def test_committed_recovery_sends_no_exit_and_serves_the_next_fault():
    flow, out = make_flow({1})
    fault_and_wait(flow, out)
    wait_state(flow, S.SERVING)
    assert not flow.decided.is_set()
    kinds = out.kinds()
    assert kinds[:2] == [("all", None, "Lock"), ("all", None, "AdvanceTo")]
    assert kinds[2] == ("many", [0, 2, 3], "RecoverOrder")
    assert kinds[3] == ("one", 0, "ReplaceOrder")  # the lowest survivor on rank 1's host
    assert kinds[4] == ("many", [0, 1, 2, 3], "RecoverCommit")
    order, replace = out.sent[2][2], out.sent[3][2]
    assert (order.step, order.lost, order.recovery_id) == (4, [1], 1)
    assert replace.rank == 1 and replace.controller == "127.0.0.1:8000"
    assert replace.dp_ranks == DP  # the replacement registers its DP group before it joins
    assert replace.rendezvous == order.rendezvous
    assert order.rendezvous.startswith("ttp-recovery/1-") and P.NAMESPACE(order.rendezvous)
    assert out.closed == []  # the new world's rendezvous stays open
    assert [b for _, b, _ in flow.sm.history] == [S.SERVING, S.COLLECTING, S.RECOVERING,
                                                  S.SERVING]
    # rearmed: the next fault runs a flow of its own
    out.steps = {r: 5 for r in DP if r != 2}
    with out.cond:
        out.roster.set_status(out.roster[2], "dead", "dead")
    fault_and_wait(flow, out, "rank 2 dead")
    wait_state(flow, S.SERVING)
    assert [k for k in out.kinds() if k[2] == "RecoverOrder"][-1][1] == [0, 1, 3]
    assert out.closed == [order.rendezvous]  # the next recovery's namespace replaced it
    # the controller counts the recoveries it committed itself: in its own process no rank
    # trains, so RECOVERY.epoch there stays 0, and a second recovery 1 would be refused by
    # every rank that committed the first
    assert R.RECOVERY.epoch == 0
    second = [m for _, _, m in out.sent if isinstance(m, P.RecoverOrder)][-1]
    assert second.recovery_id == 2 and second.rendezvous.startswith("ttp-recovery/2-")


def abandoned(flow, out) -> None:
    assert flow.decided.wait(15), flow.sm.history
    d = flow.decision
    assert d.outcome is Outcome.SAVED and d.step == 4 and 1 not in d.ranks, d
    states = [b for _, b, _ in flow.sm.history]
    assert states[:4] == [S.SERVING, S.COLLECTING, S.RECOVERING, S.SAVING], states
    assert "RecoverCommit" not in [k[2] for k in out.kinds()]


@pytest.mark.parametrize("case, kwargs, reason", [
    ("a rank not ready in time", dict(silent={1}, TTP_RECOVER_TIMEOUT="0.5"), "not ready"),
    ("a failed refill", dict(fail={3}), "bad refill"),
    ("a replacement that exits", dict(replace_state="exited"), "exited"),
    ("another fault", dict(fault_during=("rank 2 dead", {}), silent={0, 1, 2, 3}), "another"),
])
def test_abandoned_recovery_falls_back_to_the_dying_checkpoint(case, kwargs, reason, caplog):
    flow, out = make_flow({1}, **kwargs)
    fault_and_wait(flow, out)
    abandoned(flow, out)
    assert any("falling back to the dying checkpoint of iteration 4" in r.message and reason in
               r.message for r in caplog.records), case


def _dies(out) -> None:
    if out.roster.set_status(out.roster[1], "dead", "dead (connection closed)"):
        out.flow.left(1)
    out.flow.fault("rank 1 dead (connection closed)")


def _hangs(out) -> None:
    if out.roster.set_status(out.roster[1], "hung", "hung (no heartbeat for 0.9 s)"):
        out.flow.left(1)
    out.flow.fault("rank 1 hung (no heartbeat for 0.9 s)")


def _raises(out) -> None:  # its process lives on: it answers every lock and order
    out.flow.fault("rank 1 reported exception: InjectedFault", rank=1, kind="exception")


def _hangs_unseen(out) -> None:  # not yet declared hung: it just stops answering
    del out.steps[1]
    out.flow.fault("rank 0 reported exception: RuntimeError: gloo/transport: timed out",
                   rank=0, kind="collective")
    out.fail = {0}


def _dies_unseen(out) -> None:  # a casualty's READY abandons it before the death is seen
    out.fail = {0}
    out.die_on_relock = {1}


@pytest.mark.parametrize("case, during, silent", [
    ("kill", _dies, {1}), ("hang", _hangs, {1}), ("exception", _raises, {1}),
    ("a hang not yet seen", _hangs_unseen, {1}),
    ("a death seen after the abandonment", _dies_unseen, {1}),
])
def test_a_survivor_that_faults_during_the_recovery_is_never_a_saver(case, during, silent):
    """Issue 23: rank 2 lost; during its recovery, survivor rank 1 (DP position 1, the holder
    savers_for picks for shard 1) dies, hangs or raises. The states collected before the
    recovery still say rank 1 is clean at 4: the fallback must save from ranks 0 and 3 (rank
    1's partner), in one order and within seconds, not after a dead saver's save limit."""
    flow, out = make_flow({2}, fault_during=during, silent=silent, TTP_OT="120",
                          TTP_SAVE_TIME_LIMIT="60")
    t0 = time.monotonic()
    fault_and_wait(flow, out, "rank 2 dead")
    assert flow.decided.wait(15), (case, flow.sm.history)
    d = flow.decision
    assert d.outcome is Outcome.SAVED and d.step == 4 and d.ranks == [0, 3], (case, d)
    saves = [to for how, to, m in out.sent if isinstance(m, P.SaveOrder)]
    assert saves == [[0, 3]], (case, saves)
    assert time.monotonic() - t0 < 10, case


def test_a_refusal_every_rank_shares_keeps_every_survivor_a_holder():
    """Copies that differ after the refill: every rank refuses alike (READY not ok), none of
    them faulted: the survivors' state still serves, savers as savers_for picks them."""
    flow, out = make_flow({2}, fail={0, 1, 2, 3})
    fault_and_wait(flow, out, "rank 2 dead")
    assert flow.decided.wait(15), flow.sm.history
    assert flow.decision.outcome is Outcome.SAVED and flow.decision.ranks == [0, 1]


def test_a_casualtys_collective_report_does_not_abandon_the_recovery():
    flow, out = make_flow({1}, fault_during=("rank 2 reported collective: gloo",
                                             {"rank": 2, "kind": "collective"}))
    fault_and_wait(flow, out)
    wait_state(flow, S.SERVING)
    assert not flow.decided.is_set()


def test_an_exception_makes_its_rank_lost_and_replaced():
    flow, out = make_flow(set())
    with out.cond:
        flow.fault("rank 2 reported exception: boom", rank=2, kind="exception")
    wait_state(flow, S.SERVING)
    assert [k for k in out.kinds() if k[2] in ("RecoverOrder", "ReplaceOrder")] == [
        ("many", [0, 1, 3], "RecoverOrder"), ("one", 0, "ReplaceOrder")]
    assert [m.rank for _, _, m in out.sent if isinstance(m, P.ReplaceOrder)] == [2]


def test_dying_checkpoint_mode_never_recovers():
    flow, out = make_flow({1}, TTP_RECOVERY="dying-checkpoint")
    fault_and_wait(flow, out)
    assert flow.decided.wait(10)
    assert flow.decision.outcome is Outcome.SAVED
    assert S.RECOVERING not in [b for _, b, _ in flow.sm.history]


def test_no_launcher_that_replaces_means_no_recovery():
    flow, out = make_flow({1}, TTP_REPLACEMENTS="")
    fault_and_wait(flow, out)
    assert flow.decided.wait(10)
    assert S.RECOVERING not in [b for _, b, _ in flow.sm.history]


def _claims_in(tmp_path) -> tuple:
    from mindio_ttp.faulttime import claim as C

    folder = tmp_path / ".ttp-claims"
    folder.mkdir()
    space = C.ClaimSpace(folder, C.new_fault_id())
    return folder, space


def test_exactly_half_surviving_recovers_only_with_the_faults_claim_and_a_later_fault_claims_anew(
        tmp_path, monkeypatch):
    """Half the ranks lost (a node of two): the other half of a split job may be running, so
    the recovery first wins the fault's claim. After it committed, the same launch goes on: a
    later fault (here falling back to the dying checkpoint) claims under an id of its own."""
    import json

    folder, space = _claims_in(tmp_path)
    flow, out = make_flow({2, 3}, claims=lambda: space)
    fault_and_wait(flow, out, "ranks 2, 3 dead")
    wait_state(flow, S.SERVING)
    (first,) = [json.loads(p.read_text()) for p in folder.glob("fault-*.json")]
    assert (first["state"], first["outcome"], first["purpose"]) == ("done", "recovered",
                                                                    "in-memory recovery")
    monkeypatch.setattr(R.RECOVERY, "epoch", 1)  # what the commit did in the controller's rank
    out.replace_state = "exited"  # the next recovery fails: the dying checkpoint, claimed
    out.steps = {r: 5 for r in DP if r != 1}
    with out.cond:
        out.roster.set_status(out.roster[1], "dead", "dead")
    fault_and_wait(flow, out, "rank 1 dead")
    assert flow.decided.wait(15), flow.sm.history
    assert flow.decision.outcome is Outcome.SAVED, flow.decision
    claims = sorted(json.loads(p.read_text())["state"] for p in folder.glob("fault-*.json"))
    assert claims == ["done", "done"]  # two faults, two claims


def test_exactly_half_surviving_does_not_recover_when_the_other_half_holds_the_claim(tmp_path):
    from mindio_ttp.faulttime import claim as C

    _, space = _claims_in(tmp_path)
    other, why = C.acquire(space, "the other half's controller")  # alive: its lock is held
    assert other is not None, why
    flow, out = make_flow({2, 3}, claims=lambda: space)
    fault_and_wait(flow, out, "ranks 2, 3 dead")
    assert flow.decided.wait(15), flow.sm.history
    assert flow.decision.outcome is Outcome.NOT_CLAIMED, flow.decision
    assert S.RECOVERING not in [b for _, b, _ in flow.sm.history]
