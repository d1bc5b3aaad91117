"""control/rank/release.py on CPU: every survivor, saver or not, stops its device work at the
controller's lock, off its main thread, and its main thread leaves the failed step: by the
error of the collective the abort ended (what NCCL and HCCL do), or by the exception raised
into it (NVRx's way) when it sits in Python code instead; never inside an update or at the gate.
No optimizer update starts after the abort but on a rank already at the gate. A survivor whose
abort fails (or whose main thread never leaves) fails an ordered recovery at once.

The "collective" here is a test double: a wait that returns only when its group's abort is
called, and then raises, as an NCCL collective with a dead peer does (a real backend that
behaves so, tests/writer/test_nccl_like*.py, runs the same property across processes)."""

from __future__ import annotations

import importlib
import threading
import time
from typing import Iterator, List

import pytest

from mindio_ttp import hooks
from mindio_ttp.control.rank.processor import Processor
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.faulttime import abort, device_copy
from mindio_ttp.recovery import rank as R

from .test_processor import (
    DP,
    cfg,
    job,  # noqa: F401 - the fixture
    train_to,
)


class SpinningGroup:
    """An NCCL group whose collectives wait for a dead peer until this group is aborted."""

    def __init__(self, name: str = "dp", fail: bool = False) -> None:
        self.group_name, self.fail = name, fail
        self.aborted = threading.Event()
        self.abort_threads: List[str] = []

    def name(self) -> str:
        return "nccl"

    def abort(self) -> None:
        self.abort_threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("ncclCommAbort: unhandled system error")
        self.aborted.set()

    def all_reduce(self) -> None:
        """Blocks as NCCL's does with a dead peer; the abort makes it raise."""
        self.aborted.wait()
        raise RuntimeError("NCCL communicator was aborted on rank 0")


def _new_fault() -> None:
    """No stop run, no latch, the hot state fresh (tolerant of the code before the stop, so
    that these tests show what it did: the main thread never left)."""
    hooks.STATE.reset()
    device_copy.MARK.reset()  # no device bound (an earlier test may have registered npu:3)
    getattr(device_copy, "STOP", device_copy.GATHERED).reset()
    training = getattr(hooks, "TRAINING", None)
    if training is not None:
        training.__init__()


@pytest.fixture
def fresh() -> Iterator[None]:
    importlib.import_module("torch")  # a survivor's process has: its groups are torch's
    _new_fault()
    yield
    _new_fault()


def _release():
    return importlib.import_module("mindio_ttp.control.rank.release")


def _trainer(body) -> dict:
    """Run `body` as the decorated train() in a thread of its own (the job's main thread)."""
    box: dict = {"done": threading.Event()}

    @hooks.to_persist
    def train() -> None:
        body()

    def run() -> None:
        try:
            train()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            box["error"] = exc
        box["left"] = time.monotonic()
        box["done"].set()

    box["thread"] = threading.Thread(target=run, name="trainer", daemon=True)
    box["thread"].start()
    return box


def test_a_survivor_that_saves_nothing_aborts_at_the_lock_off_its_main_thread(
        job, fresh, monkeypatch) -> None:  # noqa: F811 - job: the fixture
    """D3, D8: the main thread spins in a collective with the dead rank; only the savers used
    to abort (in their save handler), and only in-memory recovery's main thread, after leaving
    train(): on NCCL neither ever came. Now the lock aborts, from the ttp-fault-stop thread, on
    every rank, and the main thread leaves with the collective's error."""
    group = SpinningGroup()
    monkeypatch.setattr(abort, "_all_groups", lambda: [group])
    ctl, proc, codes, fakes = job(rank=0)
    train_to(3)
    box = _trainer(group.all_reduce)
    time.sleep(0.2)  # the trainer is in its collective now
    assert not box["done"].is_set()
    t0 = time.monotonic()
    fakes[1].close()  # rank 1 dies: the controller locks everyone else
    assert box["done"].wait(10.0), "the main thread never left the spinning collective"
    # by the aborted collective's error; on a loaded machine, by the release's backstop
    assert "NCCL communicator was aborted" in str(box["error"]) or \
        isinstance(box["error"], hooks.TTPReleased), repr(box["error"])
    assert group.abort_threads and "trainer" not in group.abort_threads[0]
    assert group.abort_threads[0].startswith("ttp-abort-")
    assert box["left"] - t0 < ctl.cfg.heartbeat_timeout + 1.0  # detection + 1 s


def test_a_main_thread_in_python_code_is_released_by_an_exception_raised_into_it(
        fresh, monkeypatch) -> None:
    """NVRx's way: a main thread that has not left the step after the abort (here, a Python
    loop that reaches no collective) gets TTPReleased raised into it, and leaves."""
    monkeypatch.setattr(abort, "_all_groups", lambda: [SpinningGroup()])
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            time.sleep(0.005)

    box = _trainer(loop)
    time.sleep(0.1)
    outcome = _release().stop("test", grace_s=0.1, retry_s=0.1, timeout_s=5.0)
    stop.set()
    assert box["done"].wait(5.0)
    assert isinstance(box["error"], hooks.TTPReleased), box.get("error")
    assert outcome.left and outcome.raised >= 1 and outcome.ok, outcome.describe()


def test_nothing_is_raised_into_an_update_or_the_gate(fresh, monkeypatch) -> None:
    """Raising inside the update window would leave the rank half-updated (not clean); at the
    gate, an admitted rank is about to catch up: both are left alone until they are out."""
    monkeypatch.setattr(abort, "_all_groups", lambda: [SpinningGroup()])
    raised: List[str] = []
    hooks.TRAINING.enter()
    hooks.STATE.state = (3, True)  # inside the update window

    def raise_into(ident: int, exc: type) -> bool:
        raised.append("updating" if hooks.STATE.updating else "out")
        hooks.TRAINING.leave()
        return True

    def finish_update() -> None:
        time.sleep(0.3)
        hooks.end_updating_os(4)

    threading.Thread(target=finish_update, daemon=True).start()
    outcome = _release().stop("test", grace_s=0.05, retry_s=0.05, timeout_s=3.0,
                              raise_into=raise_into)
    assert raised == ["out"] and outcome.left
    hooks.TRAINING.enter()
    hooks.STATE.waiting = True
    device_copy.STOP.reset()
    outcome = _release().stop("test", grace_s=0.05, retry_s=0.05, timeout_s=0.3,
                              raise_into=raise_into)
    assert raised == ["out"] and not outcome.left  # never raised at the gate


def test_nothing_is_raised_where_nothing_was_aborted(fresh, monkeypatch) -> None:
    """gloo: a collective with a dead peer raises by itself; nothing to release."""
    raised: List[str] = []

    class Gloo:
        group_name = "world"

        def name(self) -> str:
            return "gloo"

    hooks.TRAINING.enter()
    monkeypatch.setattr(abort, "_all_groups", lambda: [Gloo()])
    outcome = _release().stop("test", grace_s=0.05, retry_s=0.05, timeout_s=0.3,
                              raise_into=lambda i, e: raised.append("gloo") or True)
    assert raised == [] and not outcome.report.aborted
    assert outcome.ok  # its main thread leaves when the dead (or killed) peer's sockets close


def test_after_the_abort_only_a_rank_already_at_the_gate_may_update(fresh) -> None:
    """An aborted collective may return early with torn gradients and no error: a rank that
    reaches the gate after the abort must not update; one that waited there before may."""
    hooks.STATE.lock()
    hooks.STATE.fence()  # what the fault-time stop does just before its abort
    t0 = time.monotonic()
    with pytest.raises(hooks.TTPForceStop, match="aborted before its update"):
        hooks.start_updating_os(-1)  # got here after the abort
    assert time.monotonic() - t0 < 1.0  # at once, not after TTP_OT

    hooks.STATE.reset()
    hooks.STATE.lock()
    admitted: dict = {}

    def at_gate() -> None:
        try:
            hooks.start_updating_os(-1)
            admitted["ok"] = True
        except hooks.TTPForceStop as exc:
            admitted["ok"] = exc

    waiter = threading.Thread(target=at_gate, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 5
    while not hooks.STATE.waiting and time.monotonic() < deadline:
        time.sleep(0.005)
    hooks.STATE.fence()  # it was waiting at the gate: its gradients were complete
    # the controller lets it catch up to step 1
    threading.Thread(target=hooks.STATE.advance_to, args=(1, 2.0), daemon=True).start()
    waiter.join(5)
    assert admitted["ok"] is True


def test_a_recovery_whose_abort_fails_is_failed_at_once_not_after_its_bound(
        fresh, tmp_path, monkeypatch) -> None:
    """A recovery must never wait out TTP_RECOVER_TIMEOUT because a survivor could not abort:
    its processor answers the order with a failed RecoverReady as soon as its stop failed."""
    monkeypatch.setattr(abort, "_all_groups", lambda: [SpinningGroup(fail=True)])
    monkeypatch.setattr(R, "RECOVERY", R.RankRecovery())
    monkeypatch.setattr("mindio_ttp.control.rank.processor.RECOVERY", R.RECOVERY)
    sent: List[P.Message] = []
    proc = Processor(cfg(tmp_path), 0, DP, 4, 2)
    proc._send = sent.append  # type: ignore[method-assign]
    R.RECOVERY.reporter = proc._report_ready
    t0 = time.monotonic()
    proc._handle(P.RecoverOrder(1, 1, 3, [1], "ttp-recovery/1-abcd", 120.0))
    deadline = time.monotonic() + 5
    while not any(isinstance(m, P.RecoverReady) for m in sent) and time.monotonic() < deadline:
        proc._on_mail()
        time.sleep(0.01)
    (ready,) = [m for m in sent if isinstance(m, P.RecoverReady)]
    assert not ready.ok and "unhandled system error" in ready.detail
    assert time.monotonic() - t0 < 3.0  # not TTP_RECOVER_TIMEOUT (120 s)
    assert R.RECOVERY.abandoned


def test_a_busy_main_thread_without_device_groups_does_not_fail_the_recovery(
        fresh, monkeypatch) -> None:
    """gloo: nothing to abort, and a main thread still in the step after the grace (a long
    forward, a pipeline stage waiting on another) leaves it by itself; it must not fail an
    ordered recovery (the PP2xDP2 every-kind run did, when its first stage was slow)."""
    class Gloo:
        group_name = "world"

        def name(self) -> str:
            return "gloo"

    monkeypatch.setattr(abort, "_all_groups", lambda: [Gloo()])
    hooks.TRAINING.enter()
    outcome = _release().stop("test", grace_s=0.05, retry_s=0.05, timeout_s=0.2,
                              raise_into=lambda ident, exc: pytest.fail("raised on gloo"))
    assert not outcome.left and outcome.ok, outcome.describe()


def test_a_rank_without_device_groups_is_neither_fenced_nor_aborted(fresh, monkeypatch) -> None:
    """gloo: a dead peer's collective raises by itself; nothing torn, nothing to abort, and a
    rank behind its partners may still catch up at the gate."""
    class Gloo:
        group_name = "world"

        def name(self) -> str:
            return "gloo"

    monkeypatch.setattr(abort, "_all_groups", lambda: [Gloo()])
    outcome = _release().stop("test", timeout_s=5.0)  # the bound only; a loaded CI machine is slow
    assert outcome.ok and not hooks.STATE.fenced
    assert [g.outcome for g in outcome.report.groups] == [abort.SKIPPED]



def test_a_release_that_lands_in_the_decorators_own_handler_still_counts_as_out(
        fresh, monkeypatch) -> None:
    """The exception raised into the main thread lands at its next Python instruction: if the
    aborted collective returned with its own error at that moment, that instruction is in the
    decorator's handler, which it escapes. The patched start-up takes it for what it is: out of
    the step, on to the ordered recovery (not a failed one)."""
    from mindio_ttp.megatron_ttp import rejoin

    monkeypatch.setattr(R, "RECOVERY", R.RankRecovery())
    monkeypatch.setattr(rejoin, "RECOVERY", R.RECOVERY)
    R.RECOVERY.ordered(R.RecoveryOrder(1, 1, 3, (1,), "ns", "", 120.0))
    monkeypatch.setattr(hooks, "RUNTIME", type("Rt", (), {"running": True})())
    hooks.TRAINING.enter()
    assert rejoin._hold_for_verdict(hooks.TTPReleased()) is True
    assert not hooks.TRAINING.in_step and R.RECOVERY.pending
