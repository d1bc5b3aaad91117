"""Every survivor out of the failed step: the fault-time stop, run off the main thread.

On gloo a collective whose peer died raises as soon as the peer's socket closes, so the main
thread leaves the failed step by itself. On NCCL and HCCL it does not: the collective's kernel
spins until someone aborts its communicator, and the main thread waits behind it (in a barrier,
``.item()``, a synchronize) until the process group's timeout, which is at least 600 s here.
Nothing in the main thread can end that wait. So, like NVRx's monitor thread and torchft's
timer threads, another thread does, on every survivor, not only the savers (NCCL wants every
rank of a node to abort: nccl #863). The processor starts `stop` in a thread of its own at the
controller's lock, at a recover order, and when its controller is lost; the first one counts:

1. **Fence** the hot path (`HotState.fence`), before the abort: an aborted collective can
   return early without raising, with torn results, so no optimizer update may start after it
   but on a rank that was already waiting at the gate (the guide's barrier, which it passed,
   synchronised its device).
2. **Snapshot and abort** (`device_copy.STOP`): note what the device finished, latched for
   every later question (D2), then abort every communicator, bounded, each aborting thread
   bound to this rank's device (faulttime/abort.py). Skipped, fence included, where no group
   has device communicators (gloo: nothing to abort, nothing torn).
3. **Release** the main thread. The abort ends the collective it waits in, which raises on
   NCCL and HCCL, so it usually leaves by itself, into the decorator's wait for the verdict.
   Where something was aborted and the thread has not left the step `GRACE_S` later (an
   aborted collective that returned without an error, then code that reaches no other
   collective), `TTPReleased` is raised into it (``PyThreadState_SetAsyncExc``, as NVRx's
   monitor thread does), again every `RETRY_S`, never while it runs an update or waits at the
   gate, until it has left or `TIMEOUT_S` has passed. It lands when the thread next runs
   Python code; if that is the decorator's own handler (the thread returned from C with an
   error at that very moment), it escapes it, and the patched start-up (rejoin.py) takes it
   for what it is: the thread left the step. Where nothing was aborted (gloo), nothing is
   raised: a collective with a dead peer raises by itself.

The processor hears the result (`Outcome`): an abort that did not work, or a main thread that
would not leave, fails an ordered in-memory recovery at once, so the controller falls back to
the dying checkpoint instead of waiting out TTP_RECOVER_TIMEOUT.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mindio_ttp import config
from mindio_ttp.faulttime import abort, device_copy
from mindio_ttp.hooks import STATE, TRAINING, HotState, TrainingThread, TTPReleased

log = logging.getLogger("mindio_ttp.processor")

GRACE_S = 0.5  # after the abort, before raising into a main thread that has not left
RETRY_S = 0.5  # between raises (one that landed while the thread was in C waits there)
TIMEOUT_S = config.ABORT_TIMEOUT_S  # giving up: the recovery is failed, the save goes on


@dataclass(frozen=True)
class Outcome:
    report: abort.AbortReport
    left: bool  # the training thread is out of the failed step (or was never in one)
    raised: int  # how many times TTPReleased was raised into it
    seconds: float  # from the abort's start to the thread out of the step (or to giving up)

    @property
    def aborted(self) -> bool:
        """Something was aborted (a device communicator, the device): the main thread's
        collective ends only because of it. Not on gloo, where it fails by itself once the
        dead peer's sockets close (a stopped peer's: when its launcher kills it)."""
        return bool(self.report.aborted) or bool(self.report.device)

    @property
    def ok(self) -> bool:
        return self.report.ok and (self.left or not self.aborted)

    def describe(self) -> str:
        where = (f"main thread out of the step {self.seconds:.3f} s after the abort began"
                 if self.left else f"main thread still in the step after {self.seconds:.1f} s")
        return (f"{self.report.describe()}; {where}"
                + (f" (released {self.raised}x)" if self.raised else ""))


def raise_in(ident: int, exc: type) -> bool:
    """Raise `exc` in the thread `ident` when it next runs Python code (CPython's
    PyThreadState_SetAsyncExc; True when that thread exists)."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                      ctypes.py_object(exc))
    if done > 1:  # never: one thread per id; undo as CPython's docs ask
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return False
    return done == 1


def _wants_device_abort(binding: Any) -> bool:
    """Some group has a device communicator (NCCL, HCCL), or the device itself is stopped."""
    try:
        groups = abort._all_groups()
        return binding.kind == "npu" or any(
            name in abort.DEVICE_BACKENDS for pg in groups for name, _ in abort._backends(pg))
    except Exception:  # noqa: BLE001 - cannot tell: fence and abort, the safe side
        return True


def stop(why: str, *, training: TrainingThread = TRAINING, state: HotState = STATE,
         timeout_s: float = TIMEOUT_S, grace_s: float = GRACE_S, retry_s: float = RETRY_S,
         raise_into: Callable[[int, type], bool] = raise_in) -> Outcome:
    """Fence, snapshot and abort, release the main thread (module doc). Bounded by the abort's
    timeout plus `timeout_s`; never raises."""
    binding = device_copy.MARK.binding
    fence = state.fence if _wants_device_abort(binding) else (lambda: None)
    log.warning("fault-time stop (%s): aborting this rank's communicators off the main thread",
                why)
    report = device_copy.STOP.run(config.ABORT_TIMEOUT_S, binding, before_abort=fence)
    began = device_copy.STOP.started_at or time.monotonic()
    raised = 0
    aborted = bool(report.aborted) or bool(report.device)
    if aborted and training.in_step:
        training.left.wait(grace_s)
    deadline = time.monotonic() + timeout_s
    while aborted and training.in_step and time.monotonic() < deadline:
        ident = training.ident
        with state.cond:  # never inside the update window nor at the gate (module doc)
            safe = not state.updating and not state.waiting and training.in_step
            if safe and ident is not None and raise_into(ident, TTPReleased):
                raised += 1
        training.left.wait(retry_s)
    left = not training.in_step
    outcome = Outcome(report, left, raised, time.monotonic() - began)
    (log.warning if outcome.ok else log.error)("fault-time stop (%s): %s%s", why,
                                               outcome.describe(),
                                               f" (at {training.left_at:.3f})"
                                               if left and training.left_at else "")
    return outcome


class Stopper:
    """One fault's stop for the processor: started once, in its own thread; `done(outcome)`
    is called from that thread when it ends."""

    def __init__(self, done: Callable[[Outcome], None]) -> None:
        self._done = done
        self._thread: Optional[threading.Thread] = None
        self.outcome: Optional[Outcome] = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, why: str) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(why,), name="ttp-fault-stop",
                                        daemon=True)
        self._thread.start()

    def _run(self, why: str) -> None:
        try:
            outcome = stop(why)
        except BaseException as exc:  # noqa: BLE001 - reported: never a silent dead thread
            log.exception("fault-time stop failed")
            outcome = Outcome(abort.AbortReport((abort.GroupAbort(
                "*", "?", abort.FAILED, f"{type(exc).__name__}: {exc}"[:300]),), "", False, 0.0),
                not TRAINING.in_step, 0, 0.0)
        self.outcome = outcome
        self._done(outcome)

    def reset(self) -> None:
        """After a committed recovery: the next fault stops anew."""
        self._thread, self.outcome = None, None
