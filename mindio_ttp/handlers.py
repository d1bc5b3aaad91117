"""Running the save and rename handlers of one rank: one handler thread at a time, each with a
deadline the processor's loop enforces (a handler cannot be killed; past its limit it is
reported as failed and the exit order ends the process).

Not the control plane: it knows no message and no connection. `Handlers` is owned by the
processor (control/rank/processor.py) and given only what it uses, so it runs (and is tested)
without one: the rank, `send` (a `Result`, called on the processor's thread, which turns it
into the controller's message), `done` (a handler's end, called on the handler's thread: it
must hand over to the processor's thread, which then calls `finished`) and `opener` (how a save
session opens the store its savers meet through: the processor's AuthStore). The processor's
loop asks it for `deadline()` and calls `expire(now)`; orders arrive through `start_save` and
`start_rename`, read by their fields.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Protocol, Tuple

from mindio_ttp.faulttime import save_session
from mindio_ttp.faulttime.device import NO_DEVICE
from mindio_ttp.hooks import STATE, HotState

log = logging.getLogger("mindio_ttp.processor")

# "device": the DeviceBinding captured when the save handler was registered (device.py)
HANDLERS: dict = {"save": None, "rename": None, "device": NO_DEVICE}


class SaveOrder(Protocol):
    """What a save order says (protocol.SaveOrder, validated by the wire layer)."""
    flow_id: int
    step: int
    save_ranks: List[int]
    time_limit: float
    store: str
    tag: str


class RenameOrder(Protocol):
    flow_id: int
    step: int
    time_limit: float


@dataclass(frozen=True)
class Result:
    """A handler's answer: `kind` "save" or "rename"."""
    kind: str
    flow_id: int
    rank: int
    ok: bool
    error: str
    seconds: float


class Job:
    """One handler run: what it answers (kind, flow), and when it must have answered."""

    def __init__(self, kind: str, fid: int, limit: float) -> None:
        self.kind, self.fid = kind, fid
        self.t0 = time.monotonic()
        self.deadline = self.t0 + limit
        self.reported = False


class Handlers:
    def __init__(self, rank: int, send: Callable[[Result], None],
                 done: Callable[[Job, bool, str], None], state: HotState = STATE,
                 registry: Mapping[str, Any] = HANDLERS, channel: Any = None,
                 opener: Any = None) -> None:
        self.rank = rank
        self._channel = channel  # what the order's AuthStore talks through (the processor)
        self._opener = opener  # the store class a save session opens (the AuthStore)
        self._send = send
        self._done = done
        self._state = state  # this rank's step, and the ckpt_args the handlers get
        self._registry = registry  # read at each order: handlers may be registered late
        self._job: Optional[Job] = None
        self._job_thread: Optional[threading.Thread] = None
        self._session: Optional[save_session.SaveSession] = None  # of the last save order

    # -- orders (on the processor's thread) ------------------------------------------------------
    def start_save(self, m: SaveOrder) -> None:
        step, updating = self._state.snapshot()
        problem = ""
        if step != m.step or updating:
            problem = (f"rank {self.rank} holds step {step}{' (updating)' if updating else ''},"
                       f" not the ordered step {m.step}")
        elif self.rank not in m.save_ranks:
            problem = f"rank {self.rank} is not in save_ranks {m.save_ranks[:8]}"
        if problem:
            log.error("rank %d: refusing save order: %s", self.rank, problem)
            self._send(Result("save", m.flow_id, self.rank, False, problem, 0.0))
            return
        # the order's fields were validated by the protocol layer (store namespace, tag)
        session = save_session.SaveSession(m.flow_id, m.step, tuple(m.save_ranks), m.store,
                                           m.tag, m.time_limit, channel=self._channel,
                                           opener=self._opener)
        self._session = session
        self._start_job("save", m.flow_id, m.time_limit, self._registry["save"],
                        (m.step, list(m.save_ranks), self._state.ckpt_args), session)

    def start_rename(self, m: RenameOrder) -> None:
        """The rename runs in the session of this flow's save order (its staging directory)."""
        session = self._session
        if session is not None and (session.flow_id, session.step) != (m.flow_id, m.step):
            session = None
        self._start_job("rename", m.flow_id, m.time_limit, self._registry["rename"],
                        (m.step, self._state.ckpt_args), session)

    # -- the processor's loop --------------------------------------------------------------------
    def deadline(self) -> Optional[float]:
        """When the running handler must have answered; None when none is outstanding."""
        job = self._job
        return job.deadline if job is not None and not job.reported else None

    def expire(self, now: float) -> None:
        """Report a handler past its deadline as failed (it keeps running: it cannot be
        killed; the exit order ends the process)."""
        job = self._job
        if job is not None and not job.reported and now > job.deadline:
            job.reported = True
            self._result(job, False, f"{job.kind} handler exceeded its time limit "
                                     f"({job.deadline - job.t0:g} s)")

    def finished(self, job: Job, ok: bool, err: str) -> None:
        """A handler ended (handed over by `done`): its result, unless it already expired."""
        if not job.reported:
            job.reported = True
            self._result(job, ok, err)

    # -- internals -------------------------------------------------------------------------------
    def _start_job(self, kind: str, fid: int, limit: float, fn: Optional[Callable[..., Any]],
                   args: Tuple[Any, ...],
                   session: Optional[save_session.SaveSession] = None) -> None:
        job = Job(kind, fid, limit)
        if fn is None:
            self._result(job, False, f"no {kind} handler registered on rank {self.rank} "
                         f"(call ttp_register_{'save_ckpt' if kind == 'save' else kind}_handler)")
            return
        self._job = job
        log.info("rank %d: running the %s handler for step %s", self.rank, kind, args[0])
        prev = self._job_thread
        binding = self._registry.get("device") or NO_DEVICE
        done = self._done

        def run() -> None:
            # a flow re-run by a standby controller may order the same save again: never run
            # two handlers of this rank at once
            if prev is not None and prev.is_alive():
                prev.join(max(0.0, job.deadline - time.monotonic()))
                if prev.is_alive():
                    done(job, False, "the previous handler of this rank is still running")
                    return
            save_session.activate(session)
            try:
                binding.bind()  # before any device work: a new thread starts on device 0
                fn(*args)
            except BaseException as exc:  # report anything; the exit order ends the process
                log.exception("rank %d: %s handler failed", self.rank, kind)
                done(job, False, f"{type(exc).__name__}: {exc}"[:2000])
            else:
                done(job, True, "")
        self._job_thread = threading.Thread(target=run, name=f"ttp-{kind}-handler", daemon=True)
        self._job_thread.start()

    def _result(self, job: Job, ok: bool, err: str) -> None:
        secs = time.monotonic() - job.t0
        (log.info if ok else log.error)("rank %d: %s handler %s in %.3f s%s", self.rank, job.kind,
                                        "succeeded" if ok else "FAILED", secs,
                                        f": {err}" if err else "")
        self._send(Result(job.kind, job.fid, self.rank, ok, err, secs))


def checkpoint_location(step: Optional[int]) -> Optional[str]:
    """Where the saved checkpoint of ``step`` is, from the rename handler's optional
    ``checkpoint_location(step)``: every rank can answer (not only the one that renamed), so
    whichever rank writes flow-finished.json last, ttprun can name the directory. Never raises:
    this runs on the way out."""
    locate = getattr(HANDLERS["rename"], "checkpoint_location", None)
    if step is None or locate is None:
        return None
    try:
        where = locate(step)
    except Exception as exc:  # noqa: BLE001 - a broken locator must not stop the exit
        log.warning("checkpoint_location(%s) failed: %s", step, exc)
        return None
    return None if where is None else str(where)


def latest_iteration() -> Optional[int]:
    """The iteration `latest` names after the save, from the rename handler's optional
    ``latest_iteration()``; None when it has none or fails (never raises: the way out)."""
    ask = getattr(HANDLERS["rename"], "latest_iteration", None)
    if ask is None:
        return None
    try:
        named = ask()
    except Exception as exc:  # noqa: BLE001 - as checkpoint_location
        log.warning("latest_iteration() failed: %s", exc)
        return None
    return named if isinstance(named, int) and not isinstance(named, bool) and named >= 0 \
        else None
