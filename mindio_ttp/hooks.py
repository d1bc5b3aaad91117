"""The per-step hot path and the `ttp_to_persist` decorator.

`start_updating_os` / `end_updating_os` / `set_ckpt_args` run every training step, so they
touch only this process's `HotState`: no I/O, no messages, one plain lock (a Condition). On a
rank with an accelerator `end_updating_os` also records one device event on the training
stream (device_copy.MARK: the dying save reads device memory on a private stream after it);
without one that is a single attribute test.

A lock-free variant (a Dekker handshake on one attribute under the GIL) existed until the hook
benchmark on a realistic step said it does not matter: `bench/bench_hooks.py --compare locks`
(commit 21dea35, 2026-12-03, 2 cores): 163 ns per step lock-free against 755 ns with the lock in
a tight loop, and on a 245 ms step (an 11.8M-parameter MLP) +0.01% under a 6.11% noise floor.
The lock is also correct without the GIL (free-threaded CPython) with no second code path.

Once a fault locks the rank: the two-phase lock (`lock`, then `advance_to`), the wait for the
controller's limit (at most TTP_OT), TTPForceStop at or past the limit or once stopped, and the
update grace `advance_to` gives a rank inside its window.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Optional, Tuple, TypeVar

from mindio_ttp.faulttime import device_copy

log = logging.getLogger("mindio_ttp")


class TTPError(RuntimeError):
    """Base class of the runtime's own errors."""


class TTPForceStop(TTPError):
    """Raised by ttp_start_updating_os on a healthy rank after a fault: leave the step, the
    runtime is saving a dying checkpoint and will end the process with its exit code."""


class TTPReleased(TTPForceStop):
    """Raised into the training thread (control/rank/release.py) when it has not left the failed
    step once its communicators were aborted: leave it, as after TTPForceStop."""


class TTPRecovering(TTPError):
    """Raised out of the decorated `train` on a survivor when the controller ordered an
    in-memory recovery: the patched Megatron start-up catches it and rejoins the new world
    (mindio_ttp/megatron_ttp/rejoin.py)."""


class HotState:
    """This rank's optimizer-update state. `locked` (a fault is being handled) makes the next
    start_updating_os wait for the controller's limit: a rank behind its partners may still
    advance to `limit`; at or past it (or once `stopped`) it raises TTPForceStop."""

    __slots__ = ("cond", "state", "locked", "limit", "stopped", "ckpt_args", "backup_step",
                 "wait_limit", "offer", "fenced", "admitted", "waiting")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.reset()

    def reset(self) -> None:
        self.state: Tuple[Optional[int], bool] = (None, False)  # (last step updated, updating)
        self.locked = False
        self.limit: Optional[int] = None
        self.stopped = False
        self.ckpt_args: Tuple[Any, ...] = ()
        self.backup_step = -1
        self.wait_limit = 120.0  # TTP_OT: longest a locked rank waits for a decision
        # (step, fn): the update of `step` is ready (its collectives are done) and `fn` runs it
        # locally; see offer_update. Withdrawn when the normal path starts an update.
        self.offer: Optional[Tuple[int, Callable[[], None]]] = None
        # the fault-time stop's fence (`fence`): set just before this rank's communicators are
        # aborted; `admitted`: the rank was already waiting at the gate then; `waiting`: it is
        self.fenced = self.admitted = self.waiting = False

    @property
    def step(self) -> Optional[int]:
        return self.state[0]

    @property
    def updating(self) -> bool:
        return self.state[1]

    def snapshot(self) -> Tuple[Optional[int], bool]:
        return self.state  # one atomic load: a consistent pair

    def lock(self) -> Tuple[Optional[int], bool]:
        """Phase 1: no new update may start until the controller decides; returns the state."""
        with self.cond:
            self.locked = True
            return self.state

    def advance_to(self, limit: int, grace: float) -> Tuple[Optional[int], bool]:
        """Phase 2: let this rank finish updates up to `limit` (bounded by `grace`), then stop
        it for good and return the final state."""
        deadline = time.monotonic() + max(0.0, grace)
        with self.cond:
            self.locked = True
            self.limit = limit
            self.cond.notify_all()
            while True:
                step, updating = self.state
                if not updating and (step or 0) >= limit:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            self.stopped = True
            self.cond.notify_all()
            return self.state

    def fence(self) -> None:
        """Called just before the fault-time abort (release.py): from now on no update may
        start, but for a rank already waiting at the gate. An aborted collective may return
        early without raising, with torn results (half-reduced gradients); a rank that passed
        the guide's barrier before the abort had its gradients complete on the device (the
        barrier synchronises it), one that gets there after may not."""
        with self.cond:
            self.locked = self.fenced = True
            self.admitted = self.waiting
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.locked = self.stopped = True
            self.cond.notify_all()

    def resume(self, step: int, ckpt_args: Tuple[Any, ...]) -> None:
        """After a committed in-memory recovery: this rank holds `step`, trains again."""
        with self.cond:
            self.state = (step, False)
            self.locked = self.stopped = False
            self.fenced = self.admitted = False
            self.limit = None
            self.offer = None
            self.ckpt_args = ckpt_args
            self.cond.notify_all()

    def _wait_for_permission(self) -> None:
        """Called with cond held and locked set: block until allowed, or raise."""
        deadline = time.monotonic() + self.wait_limit
        self.waiting = True
        try:
            self._wait_at_gate(deadline)
        finally:
            self.waiting = False

    def _wait_at_gate(self, deadline: float) -> None:
        while True:
            if self.fenced and not self.admitted:
                raise TTPForceStop("TTP FORCE STOP: this rank's communicators were aborted "
                                   "before its update's collectives were known complete")
            if self.stopped or (self.limit is not None and (self.step or 0) >= self.limit):
                raise TTPForceStop("TTP FORCE STOP: a fault was detected; this rank must not "
                                   "start another optimizer update (the dying checkpoint is "
                                   "being saved)")
            if self.limit is not None:
                return  # behind its partners: may advance to the limit
            left = deadline - time.monotonic()
            if left <= 0:
                raise TTPForceStop("TTP FORCE STOP: no decision from the controller within "
                                   f"{self.wait_limit:g} s")
            self.cond.wait(left)


STATE = HotState()


class TrainingThread:
    """Where the thread running the decorated `train` is, for the fault-time release
    (control/rank/release.py): inside `train` and not yet out of the failed step, or not."""

    def __init__(self) -> None:
        self.ident: Optional[int] = None
        self.in_train = False
        self.left = threading.Event()
        self.left_at: Optional[float] = None  # time.time() it last left train()

    def enter(self) -> None:
        self.ident, self.in_train, self.left_at = threading.get_ident(), True, None
        self.left.clear()

    def leave(self) -> None:
        self.in_train, self.left_at = False, time.time()
        self.left.set()

    @property
    def in_step(self) -> bool:
        """Inside train() and not yet out of it (the release may raise into it)."""
        return self.in_train and not self.left.is_set()


TRAINING = TrainingThread()


def start_updating_os(backup_step: int) -> None:
    """Enter the update window; after a fault, only with the controller's permission."""
    st = STATE
    st.offer = None  # the normal path runs this update itself
    with st.cond:
        if st.locked:
            st._wait_for_permission()
        st.backup_step = backup_step
        st.state = (st.state[0], True)


def end_updating_os(step: int) -> None:
    # the device event first: a save of `step`, ordered once the step is published below,
    # always finds the event of this update (device_copy.py; nothing on a rank without device)
    device_copy.MARK.record(step)
    st = STATE
    with st.cond:
        st.state = (step, False)
        if st.locked:
            st.cond.notify_all()
    drill = DRILL
    if drill is not None:  # `ttprun --drill` armed this rank (mindio_ttp/drill.py)
        drill.at(step)


def set_ckpt_args(args: Tuple[Any, ...]) -> None:
    STATE.ckpt_args = args


def offer_update(step: int, fn: Callable[[], None]) -> None:
    """Say that the update of `step` is ready to run locally (every collective it needs has
    finished) and that `fn()` runs it, should this rank leave the step before it gets there.

    Why: a rank dying inside the guide's barrier (after the gradient all-reduce, before
    ``ttp_start_updating_os``) can let some survivors through the barrier, to update `step`,
    while the barrier raises on others, which stay one step behind; a shard whose only live
    holder stayed behind then has no clean replica at any step. A rank that left with the
    update ready runs `fn` while it waits for the verdict, when the controller allows this
    step (the catch-up a rank locked at the gate gets), so every shard can serve `step`.
    On a device the offer's collectives may still run when the host gets here (NCCL returns
    at enqueue): an event after them (`device_copy.OFFERED`, latched at the fault's abort)
    says whether they had finished before the abort; only then may the update run.
    """
    device_copy.OFFERED.record(step)
    STATE.offer = (step, fn)


def _catch_up_if_allowed() -> None:
    """In the decorator's wait (main thread, after an exception): run the offered update if
    the controller's limit allows exactly that step; report it done like end_updating_os."""
    st = STATE
    with st.cond:
        offer = st.offer
        if offer is None or st.stopped or st.limit is None or st.updating:
            return
        step, fn = offer
        if (st.step or 0) + 1 != step or step > st.limit:
            return
        st.offer = None
        if st.fenced and not device_copy.OFFERED.done_at(step):
            log.warning("not catching up step %d: its gradients' collectives had not finished "
                        "on the device when they were aborted", step)
            return
        st.state = (st.step, True)  # inside the update window, as start_updating_os would say
    log.warning("catching up: running the ready update of step %d the controller allows", step)
    try:
        fn()
    except BaseException:
        log.exception("the update of step %d failed while catching up: this rank stays "
                      "marked as updating (not clean)", step)
        return
    device_copy.MARK.record(step)  # as end_updating_os: the event before the step
    with st.cond:
        st.state = (step, False)
        st.cond.notify_all()


# -- decorator -----------------------------------------------------------------------------------
# How often the wait for the verdict looks for a catch-up the controller allowed; well inside
# TTP_UPDATE_GRACE (default 5 s), the time the controller gives a rank to catch up.
CATCH_UP_POLL_S = 0.02
# How often a report is retried when exceptions keep being raised into it (one per dead worker)
SHIELD_RETRIES = 64
F = TypeVar("F", bound=Callable[..., Any])

# Set by mindio_ttp.drill on the rank a `ttprun --drill` strikes: at(step) after each update.
DRILL: Optional[Any] = None

# Set by the package when the processor starts: object with report_exception(exc) and
# wait_for_exit(timeout) -> bool (True: the exit order was carried out), shutdown(), ot.
RUNTIME: Optional[Any] = None
# Set by a caller that runs `train` inside work of its own that a fault must not lose
# (Megatron's pretrain: the final evaluation and the final save come after train() returns):
# train()'s normal return then leaves the runtime up, and that caller shuts it down
# (megatron_ttp/rejoin.py, megatron_ttp/completion.py).
HELD = False


def _shielded(fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn` to the end although exceptions are raised into this thread meanwhile (torch's
    DataLoader SIGCHLD handler, once per killed worker: see _wait_for_verdict). A report cut
    short is sent again; a duplicate report is harmless, a missing one is not."""
    for _ in range(SHIELD_RETRIES):
        try:
            fn(*args)
            return
        except BaseException as exc:  # noqa: B902 - anything raised into this thread
            log.warning("ignoring %r raised while handling the fault", exc)


def _wait_for_verdict(rt: Any) -> None:
    """Wait up to TTP_OT for the exit order, whatever is raised into this thread meanwhile.

    A preemption signal that reaches every process of the job (Slurm, or ttprun signalling each
    rank's process group) also kills the DataLoader's worker processes, and torch's SIGCHLD
    handler raises RuntimeError in the main thread for each: in the middle of this wait, too.
    Leaving the wait would end the process before the survivors' save; the processor's thread
    ends the process with the flow's exit code when the verdict comes.
    """
    deadline = time.monotonic() + rt.ot
    while True:
        try:
            left = deadline - time.monotonic()
            if left <= 0 or rt.wait_for_exit(min(left, CATCH_UP_POLL_S)):
                return
            if getattr(rt, "recovery_ordered", False):
                break
            _catch_up_if_allowed()
        except BaseException as exc:  # noqa: B902 - anything, see above
            log.warning("ignoring %r while waiting for the controller's verdict", exc)
            if time.monotonic() >= deadline:
                return
    log.warning("in-memory recovery ordered: leaving train() to rejoin")
    raise TTPRecovering("in-memory recovery ordered by the controller")


# What a collective that lost its peer raises (gloo: a plain RuntimeError naming its transport;
# NCCL/HCCL: torch's Dist*Error). Such a rank is a casualty of another rank's fault.
_COLLECTIVE_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                       "NCCL", "HCCL", "ProcessGroup")


def fault_kind(exc: BaseException, fault_seen: bool) -> str:
    """"collective" when `exc` only says a collective failed (a peer died or left: the fault
    is elsewhere) or came after this rank was already locked for a fault; else "exception":
    this rank's own fault, which an in-memory recovery replaces the rank for."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = str(exc)
    if fault_seen or names & {"DistError", "DistBackendError", "DistNetworkError",
                               "DistStoreError"} or any(m in text for m in _COLLECTIVE_MARKERS):
        return "collective"
    return "exception"


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:limit]


def to_persist(func: F) -> F:
    """Wrap `train`: a normal return shuts the runtime down; an exception is reported to the
    controller at once, then the process waits for the exit order (the processor thread ends
    the process with the flow's exit code). Without a started runtime it just re-raises."""
    if not callable(func):
        raise ValueError(f"ttp_to_persist decorates a function (your train), got "
                         f"{type(func).__name__}")

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        TRAINING.enter()
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            TRAINING.leave()  # first: the release (release.py) stops raising into this thread
            rt = RUNTIME
            if rt is None or not rt.running:
                raise
            if isinstance(exc, TTPForceStop):
                log.info("training stopped by the controller; waiting for the exit order")
            elif isinstance(exc, (KeyboardInterrupt, SystemExit)) and not rt.fault_seen:
                raise
            elif STATE.step is None and not rt.fault_seen:
                # No update finished in this process: it holds nothing a dying checkpoint could
                # use (a start-up error, say a refused configuration), so waiting up to TTP_OT
                # for a verdict would only delay the error. Dying now is seen as a dead rank.
                log.error("exception in train before this process finished any optimizer "
                          "update (nothing to persist): %r", exc)
                rt.report_exception(exc)
                raise
            elif fault_kind(exc, rt.fault_seen) == "collective":
                # a casualty of another rank's fault, not a fault of this rank's: said as such,
                # in one line (gloo's message runs to several)
                _shielded(log.warning, "a collective failed because another rank is gone or "
                          "left (%s: %s); waiting up to %g s for the controller's verdict",
                          type(exc).__name__, _first_line(exc), rt.ot)
                _shielded(rt.report_exception, exc)
            else:
                _shielded(log.error, "exception in train: %r; reporting it and waiting up to %g "
                          "s for the controller's verdict", exc, rt.ot)
                _shielded(rt.report_exception, exc)
            _wait_for_verdict(rt)  # raises TTPRecovering when a recovery was ordered
            log.error("no exit order within TTP_OT=%g s: re-raising", rt.ot)
            try:
                exc._ttp_waited = True  # type: ignore[attr-defined] # callers: do not wait again
            except AttributeError:
                pass
            raise
        TRAINING.leave()
        rt = RUNTIME
        if rt is not None and not HELD:
            rt.shutdown()
        elif HELD:  # the caller's own work after train() (Megatron's final evaluation and
            TRAINING.enter()  # save) is protected too: the release may take it out of it
        return result

    return wrapper  # type: ignore[return-value]
