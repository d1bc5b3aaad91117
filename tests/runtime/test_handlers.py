"""A rank's save and rename handlers (mindio_ttp/handlers.py) on their own: no processor.

`Handlers` gets a fresh HotState, its own handler registry, a list for what it sends and a
queue for the handlers' ends, which the test hands back to `finished` as the processor's
thread does."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Dict, List, Tuple

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.faulttime import save_session
from mindio_ttp.faulttime.device import NO_DEVICE
from mindio_ttp.handlers import Handlers, Job, Result
from mindio_ttp.hooks import HotState


def make(step: int, **handlers: Any) -> Tuple[Handlers, List[Result], queue.Queue, HotState]:
    state = HotState()
    state.state = (step, False)
    state.ckpt_args = ("model", "optimizer")
    registry: Dict[str, Any] = {"save": None, "rename": None, "device": NO_DEVICE, **handlers}
    sent: List[Result] = []
    ends: queue.Queue[Tuple[Job, bool, str]] = queue.Queue()
    h = Handlers(1, sent.append, lambda job, ok, err: ends.put((job, ok, err)), state, registry)
    return h, sent, ends, state


def order(step: int, ranks=(0, 1), limit: float = 5.0, fid: int = 1) -> P.SaveOrder:
    tag = save_session.new_tag()
    return P.SaveOrder(fid, step, list(ranks), limit, save_session.namespace_of(tag), tag)


def hand_back(h: Handlers, ends: queue.Queue) -> None:
    job, ok, err = ends.get(timeout=5)
    h.finished(job, ok, err)


def test_save_then_rename_run_in_the_order_session_and_report_success() -> None:
    seen: List[Tuple[str, Any, Any]] = []

    def save(step: int, ranks: List[int], args: tuple) -> None:
        seen.append(("save", (step, ranks, args), save_session.current()))

    def rename(step: int, args: tuple) -> None:
        seen.append(("rename", (step, args), save_session.current()))

    h, sent, ends, _ = make(7, save=save, rename=rename)
    h.start_save(order(7))
    assert h.deadline() is not None
    hand_back(h, ends)
    h.start_rename(P.RenameOrder(1, 7, 5.0))
    hand_back(h, ends)
    assert [(m.kind, m.ok, m.rank) for m in sent] == [("save", True, 1), ("rename", True, 1)]
    (k1, a1, s1), (k2, a2, s2) = seen
    assert a1 == (7, [0, 1], ("model", "optimizer")) and a2 == (7, ("model", "optimizer"))
    assert s1 is not None and (s1.flow_id, s1.step) == (1, 7)
    assert s1.namespace == save_session.namespace_of(s1.tag)
    assert s2 is s1, "the rename must run in its save order's session"
    assert h.deadline() is None


def test_an_order_for_a_step_this_rank_does_not_hold_is_refused_without_running() -> None:
    ran = threading.Event()
    h, sent, ends, state = make(6, save=lambda *a: ran.set())
    h.start_save(order(7))
    state.state = (7, True)  # mid-update: refused too
    h.start_save(order(7))
    state.state = (6, False)
    h.start_save(order(6, ranks=(0, 2)))  # not a saver
    assert [m.ok for m in sent] == [False, False, False]
    assert "holds step 6, not the ordered step 7" in sent[0].error
    assert "holds step 7 (updating)" in sent[1].error
    assert "not in save_ranks" in sent[2].error
    assert not ran.wait(0.2) and h.deadline() is None


def test_a_handler_past_its_limit_is_reported_once_and_blocks_the_next_one() -> None:
    release = threading.Event()
    h, sent, ends, _ = make(3, save=lambda *a: release.wait(10))
    h.start_save(order(3, limit=0.2))
    deadline = h.deadline()
    assert deadline is not None
    h.expire(deadline - 0.1)
    assert sent == [], "not expired yet"
    h.expire(deadline + 0.01)
    assert len(sent) == 1 and not sent[0].ok and "exceeded its time limit" in sent[0].error
    # a second order (a standby re-running the flow) must not start while the first still runs
    h.start_save(order(3, limit=0.3, fid=2))
    job, ok, err = ends.get(timeout=5)
    assert job.fid == 2 and not ok and "previous handler of this rank is still running" in err
    h.finished(job, ok, err)
    release.set()
    hand_back(h, ends)  # the first one ends late: already reported, nothing more is sent
    assert [m.flow_id for m in sent] == [1, 2]


def test_no_registered_handler_is_a_failed_result_naming_the_call() -> None:
    h, sent, _, _ = make(2)
    t0 = time.monotonic()
    h.start_rename(P.RenameOrder(4, 2, 5.0))
    assert time.monotonic() - t0 < 1.0
    assert len(sent) == 1 and sent[0].kind == "rename" and not sent[0].ok
    assert "call ttp_register_rename_handler" in sent[0].error
