"""The dying-checkpoint flow (control/controller/flow.py) on its own: no controller, no sockets.

The flow gets what a controller would give it (a real Roster, state machine and condition) and
a scripted Outbox that answers each order the way the ranks would, from the caller's thread,
as the controller's I/O thread does. The store namespaces it closes are recorded."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from mindio_ttp.config import Outcome, TTPConfig
from mindio_ttp.control.controller.flow import Flow
from mindio_ttp.control.controller.roster import RankInfo, Roster
from mindio_ttp.control.controller.state import ControllerState as S
from mindio_ttp.control.controller.state import StateMachine
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.faulttime import claim as C

from .conftest import DP, ENV


class ScriptedRanks:
    """An Outbox whose ranks answer at once: `steps` says what each answering rank holds;
    `die_on_lock` ranks die (as the I/O thread reports it) instead of answering the lock."""

    def __init__(self, roster: Roster, cond: threading.Condition, steps: Dict[int, int],
                 die_on_lock: Set[int] = frozenset()) -> None:
        self.roster, self.cond, self.steps, self.die_on_lock = roster, cond, steps, die_on_lock
        self.flow: Optional[Flow] = None
        self.sent: List[Tuple[str, object, P.Message]] = []
        self.closed: List[str] = []  # store namespaces the flow closed

    def _answering(self, ranks: List[int]) -> List[int]:
        return [r for r in ranks if r in self.steps and self.roster[r].status == "alive"]

    def broadcast(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        self.sent.append(("all", exclude, msg))
        assert self.flow is not None
        with self.cond:
            if isinstance(msg, P.Lock):
                for r in sorted(self.die_on_lock):
                    info = self.roster[r]
                    if self.roster.set_status(info, "dead", "dead (killed during the lock)"):
                        self.flow.left(r)
                    self.cond.notify_all()
            if isinstance(msg, (P.Lock, P.AdvanceTo)):
                phase = 1 if isinstance(msg, P.Lock) else 2
                for r in self._answering(self.roster.alive()):
                    self.flow.report(msg.flow_id, phase, r, self.steps[r], False)

    def send_many(self, ranks: List[int], msg: P.Message) -> None:
        self.sent.append(("many", list(ranks), msg))
        assert self.flow is not None
        cls = P.SaveResult if isinstance(msg, P.SaveOrder) else P.RenameResult
        with self.cond:
            for r in self._answering(ranks):
                self.flow.result(msg.flow_id, r, cls(msg.flow_id, r, True, "", 0.0))

    def send(self, rank: int, msg: P.Message) -> None:
        self.sent.append(("one", rank, msg))

    def flush(self, timeout: float) -> bool:
        return True

    def kinds(self) -> List[Tuple[str, object, str]]:
        return [(how, to, type(m).__name__) for how, to, m in self.sent]


def make_flow(alive: List[int], steps: Dict[int, int], die_on_lock: Set[int] = frozenset(),
              claims=lambda: None, state: S = S.SERVING,
              **env: str) -> Tuple[Flow, ScriptedRanks]:
    cfg = TTPConfig.from_env({**ENV, **env})
    cond = threading.Condition(threading.RLock())
    roster = Roster()
    for r in alive:
        roster.register(RankInfo(r, tuple(DP), "127.0.0.1", 0, None, time.monotonic()))
    sm = StateMachine("test flow")
    sm.transition_to(state, "test")
    out = ScriptedRanks(roster, cond, steps, die_on_lock)
    flow = Flow(cfg, 4, 2, 0, "test flow", sm, cond, roster, out, out.closed.append, claims)
    out.flow = flow
    return flow, out


def test_flow_saves_on_one_rank_per_shard_and_exits_its_host_last() -> None:
    flow, out = make_flow([0, 2, 3], {0: 3, 2: 3, 3: 3})
    with out.cond:
        flow.fault("rank 1 dead")
    assert flow.decided.wait(10), flow.faults
    d = flow.decision
    assert d.outcome is Outcome.SAVED and d.step == 3 and d.ranks == [0, 3], d
    assert out.kinds() == [("all", None, "Lock"), ("all", None, "AdvanceTo"),
                           ("many", [0, 3], "SaveOrder"), ("many", [0], "RenameOrder"),
                           ("all", 0, "ExitOrder"), ("one", 0, "ExitOrder")]
    assert out.sent[1][2].limit == 3
    save = out.sent[2][2]
    assert save.step == 3 and save.store == f"ttp-save/{save.tag}"
    assert out.closed == [save.store], "the save's store namespace outlived the order"
    assert [b for _, b, _ in flow.sm.history] == [S.SERVING, S.COLLECTING, S.SAVING,
                                                  S.RENAMING, S.EXITING]


def test_a_rank_dying_while_awaited_ends_the_wait_at_once() -> None:
    # without `left` the lock phase would wait out TTP_COLLECT_TIMEOUT=30 s for rank 3
    flow, out = make_flow([0, 1, 2, 3], {0: 5, 1: 5, 2: 5}, die_on_lock={3},
                          TTP_COLLECT_TIMEOUT="30")
    with out.cond:
        flow.fault("rank 3 reported exception")
    assert flow.decided.wait(10), "the flow waited for a dead rank"
    assert flow.timeline["locked"] - flow.fault_at < 2.0
    assert flow.decision.outcome is Outcome.SAVED and flow.decision.ranks == [0, 1]


def test_a_fault_outside_serving_is_recorded_but_starts_nothing() -> None:
    # a standby not yet promoted
    flow, out = make_flow([0, 1, 2, 3], {0: 1, 1: 1, 2: 1, 3: 1}, state=S.STANDBY)
    with out.cond:
        flow.fault("rank 2 dead")
    assert flow.faults == ["rank 2 dead"] and out.sent == []
    assert not flow.decided.wait(0.3)


def test_half_of_the_job_without_a_claim_directory_saves_nothing() -> None:
    flow, out = make_flow([0, 1], {0: 4, 1: 4})
    with out.cond:
        flow.fault("primary controller lost", promoted=True)
    assert flow.decided.wait(10)
    d = flow.decision
    assert d.outcome is Outcome.NOT_CLAIMED and d.step is None, d
    assert "only 2 of 4 ranks answered" in d.reason
    assert not [k for k in out.kinds() if k[2] in ("SaveOrder", "RenameOrder")]


def test_a_fault_claimed_by_another_flow_is_not_saved(tmp_path: Path) -> None:
    space = C.ClaimSpace(tmp_path, "c" * 32)
    other, why = C.acquire(space, "the other half's controller")
    assert other is not None, why
    flow, out = make_flow([0, 1, 2, 3], {0: 2, 1: 2, 2: 2, 3: 2}, claims=lambda: space)
    with out.cond:
        flow.fault("rank 1 reported exception")
    assert flow.decided.wait(10)
    assert flow.decision.outcome is Outcome.NOT_CLAIMED, flow.decision
    assert not [k for k in out.kinds() if k[2] == "SaveOrder"]


def test_a_promoted_standby_waits_while_the_job_keeps_failing_over_to_it() -> None:
    """A failover storm (here one rank every 0.4 s, for 1.6 s) outlasts the fixed floor of 2
    heartbeat intervals + 0.5 s: the flow freezes its membership once registrations stop (two
    ranks never come), so no rank still on its way counts as dead."""
    cfg = TTPConfig.from_env(ENV)
    cond = threading.Condition(threading.RLock())
    roster = Roster()
    group = tuple(range(8))
    for r in (0, 1):
        roster.register(RankInfo(r, group, "127.0.0.1", 0, None, time.monotonic()))
    sm = StateMachine("test flow")
    sm.transition_to(S.SERVING, "test")
    out = ScriptedRanks(roster, cond, {r: 4 for r in range(8)})
    flow = Flow(cfg, 8, 4, 0, "test flow", sm, cond, roster, out, out.closed.append,
                lambda: None)
    out.flow = flow

    def storm() -> None:
        for r in range(2, 6):  # ranks 6 and 7 never come
            time.sleep(0.4)
            with cond:
                roster.register(RankInfo(r, group, "127.0.0.1", 0, None, time.monotonic()))
                flow.joined(r)
                cond.notify_all()

    joiner = threading.Thread(target=storm)
    with cond:
        flow.fault("primary controller lost", promoted=True)
    joiner.start()
    assert flow.decided.wait(15)
    joiner.join()
    assert flow.timeline["locked"] - flow.fault_at > 1.6 + 0.9  # the last one, then quiet
    assert sorted(flow._reports[1]) == list(range(6))
