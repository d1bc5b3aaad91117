"""Running the save and rename handlers for the processor: one handler thread at a time,
each with a deadline the processor's loop enforces (a handler cannot be killed; past its limit
it is reported as failed and the exit order ends the process).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Tuple

from . import protocol as P
from . import save_session
from .device import NO_DEVICE
from .hooks import STATE

log = logging.getLogger("mindio_ttp.processor")

# "device": the DeviceBinding captured when the save handler was registered (device.py)
HANDLERS: dict = {"save": None, "rename": None, "device": NO_DEVICE}


class _Job:
    def __init__(self, kind: str, fid: int, limit: float) -> None:
        self.kind, self.fid = kind, fid
        self.t0 = time.monotonic()
        self.deadline = self.t0 + limit
        self.reported = False


class HandlerMixin:
    """Mixed into Processor: needs rank, _mail, _send, _job, _job_thread."""

    def _start_save(self, m: P.SaveOrder) -> None:
        step, updating = STATE.snapshot()
        problem = ""
        if step != m.step or updating:
            problem = (f"rank {self.rank} holds step {step}{' (updating)' if updating else ''},"
                       f" not the ordered step {m.step}")
        elif self.rank not in m.save_ranks:
            problem = f"rank {self.rank} is not in save_ranks {m.save_ranks[:8]}"
        session = None
        if not problem:
            try:
                host, port = save_session.parse_address(m.store)
                session = save_session.SaveSession(
                    m.flow_id, m.step, tuple(m.save_ranks), host, port,
                    save_session.check_tag(m.tag), m.time_limit)
            except ValueError as exc:
                problem = f"bad save order: {exc}"
        if problem:
            log.error("rank %d: refusing save order: %s", self.rank, problem)
            self._send(P.SaveResult(m.flow_id, self.rank, False, problem, 0.0))
            return
        self._session = session
        self._start_job("save", m.flow_id, m.time_limit, HANDLERS["save"],
                        (m.step, list(m.save_ranks), STATE.ckpt_args), session)

    def _start_rename(self, m: P.RenameOrder) -> None:
        """The rename runs in the session of this flow's save order (its staging directory)."""
        session = self._session
        if session is not None and (session.flow_id, session.step) != (m.flow_id, m.step):
            session = None
        self._start_job("rename", m.flow_id, m.time_limit, HANDLERS["rename"],
                        (m.step, STATE.ckpt_args), session)

    def _start_job(self, kind: str, fid: int, limit: float, fn: Optional[Callable[..., Any]],
                   args: Tuple[Any, ...],
                   session: Optional[save_session.SaveSession] = None) -> None:
        job = _Job(kind, fid, limit)
        if fn is None:
            self._result(job, False, f"no {kind} handler registered on rank {self.rank} "
                         f"(call ttp_register_{'save_ckpt' if kind == 'save' else kind}_handler)")
            return
        self._job = job
        log.info("rank %d: running the %s handler for step %s", self.rank, kind, args[0])
        prev = self._job_thread
        binding = HANDLERS.get("device") or NO_DEVICE

        def run() -> None:
            # a flow re-run by a standby controller may order the same save again: never run
            # two handlers of this rank at once
            if prev is not None and prev.is_alive():
                prev.join(max(0.0, job.deadline - time.monotonic()))
                if prev.is_alive():
                    self._mail.put("job_done", job, False, "the previous handler of this rank "
                                   "is still running")
                    return
            save_session.activate(session)
            try:
                binding.bind()  # before any device work: a new thread starts on device 0
                fn(*args)
            except BaseException as exc:  # report anything; the exit order ends the process
                log.exception("rank %d: %s handler failed", self.rank, kind)
                self._mail.put("job_done", job, False, f"{type(exc).__name__}: {exc}"[:2000])
            else:
                self._mail.put("job_done", job, True, "")
        self._job_thread = threading.Thread(target=run, name=f"ttp-{kind}-handler", daemon=True)
        self._job_thread.start()

    def _result(self, job: _Job, ok: bool, err: str) -> None:
        secs = time.monotonic() - job.t0
        cls = P.SaveResult if job.kind == "save" else P.RenameResult
        (log.info if ok else log.error)("rank %d: %s handler %s in %.3f s%s", self.rank, job.kind,
                                        "succeeded" if ok else "FAILED", secs,
                                        f": {err}" if err else "")
        self._send(cls(job.fid, self.rank, ok, err, secs))
