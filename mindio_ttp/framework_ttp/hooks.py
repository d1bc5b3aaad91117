"""The per-step hot path and the `ttp_to_persist` decorator.

`start_updating_os` / `end_updating_os` / `set_ckpt_args` run every training step, so they
touch only this process's `HotState` under one tiny lock: no I/O, no messages. The processor
thread reads the state when it heartbeats and locks it when the controller orders a stop; the
lock makes "am I locked? then mark updating" atomic against "lock, then read updating".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Optional, Tuple, TypeVar

log = logging.getLogger("mindio_ttp")


class TTPError(RuntimeError):
    """Base class of the runtime's own errors."""


class TTPForceStop(TTPError):
    """Raised by ttp_start_updating_os on a healthy rank after a fault: leave the step, the
    runtime is saving a dying checkpoint and will end the process with its exit code."""


class HotState:
    """This rank's optimizer-update state. `locked` (a fault is being handled) makes the next
    start_updating_os wait for the controller's limit: a rank behind its partners may still
    advance to `limit`; at or past it (or once `stopped`) it raises TTPForceStop."""

    __slots__ = ("cond", "step", "updating", "locked", "limit", "stopped", "ckpt_args",
                 "backup_step", "wait_limit")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.reset()

    def reset(self) -> None:
        self.step: Optional[int] = None
        self.updating = False
        self.locked = False
        self.limit: Optional[int] = None
        self.stopped = False
        self.ckpt_args: Tuple[Any, ...] = ()
        self.backup_step = -1
        self.wait_limit = 120.0  # TTP_OT: longest a locked rank waits for a decision

    def snapshot(self) -> Tuple[Optional[int], bool]:
        return self.step, self.updating

    def lock(self) -> Tuple[Optional[int], bool]:
        """Phase 1: no new update may start until the controller decides; returns the state."""
        with self.cond:
            self.locked = True
            return self.step, self.updating

    def advance_to(self, limit: int, grace: float) -> Tuple[Optional[int], bool]:
        """Phase 2: let this rank finish updates up to `limit` (bounded by `grace`), then stop
        it for good and return the final state."""
        deadline = time.monotonic() + max(0.0, grace)
        with self.cond:
            self.locked = True
            self.limit = limit
            self.cond.notify_all()
            while self.updating or (self.step or 0) < limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            self.stopped = True
            self.cond.notify_all()
            return self.step, self.updating

    def stop(self) -> None:
        with self.cond:
            self.locked = self.stopped = True
            self.cond.notify_all()

    def _wait_for_permission(self) -> None:
        """Called with cond held and locked set: block until allowed, or raise."""
        deadline = time.monotonic() + self.wait_limit
        while True:
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


def start_updating_os(backup_step: int) -> None:
    st = STATE
    with st.cond:
        if st.locked:
            st._wait_for_permission()
        st.updating = True
        st.backup_step = backup_step


def end_updating_os(step: int) -> None:
    st = STATE
    with st.cond:
        st.step = step
        st.updating = False
        if st.locked:
            st.cond.notify_all()


def set_ckpt_args(args: Tuple[Any, ...]) -> None:
    STATE.ckpt_args = args


# -- decorator -----------------------------------------------------------------------------------
F = TypeVar("F", bound=Callable[..., Any])

# Set by the package when the processor starts: object with report_exception(exc) and
# wait_for_exit(timeout) -> None (returns only if no exit order came), shutdown(), ot.
RUNTIME: Optional[Any] = None


def to_persist(func: F) -> F:
    """Wrap `train`: a normal return shuts the runtime down; an exception is reported to the
    controller at once, then the process waits for the exit order (the processor thread ends
    the process with the flow's exit code). Without a started runtime it just re-raises."""
    if not callable(func):
        raise ValueError(f"ttp_to_persist decorates a function (your train), got "
                         f"{type(func).__name__}")

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            rt = RUNTIME
            if rt is None or not rt.running:
                raise
            if isinstance(exc, TTPForceStop):
                log.info("training stopped by the controller; waiting for the exit order")
            elif isinstance(exc, (KeyboardInterrupt, SystemExit)) and not rt.fault_seen:
                raise
            else:
                log.error("exception in train: %r; reporting it and waiting up to %g s for the "
                          "controller's verdict", exc, rt.ot)
                rt.report_exception(exc)
            rt.wait_for_exit(rt.ot)
            log.error("no exit order within TTP_OT=%g s: re-raising", rt.ot)
            raise
        rt = RUNTIME
        if rt is not None:
            rt.shutdown()
        return result

    return wrapper  # type: ignore[return-value]
