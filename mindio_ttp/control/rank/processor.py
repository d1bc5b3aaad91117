"""The per-rank processor: a background thread that heartbeats, obeys orders, fails over.

It runs beside training so the main thread may be stuck in a collective with a dead peer and
the rank can still answer, save (handlers run in a processor-owned thread, time-limited) and
exit. It also hosts this rank's standby controller. When the controller dies or falls silent
the processor stops its own training (lock), then registers with the announced backups in
order; if none answers within TTP_OT it ends the process with ExitCode.NO_VERDICT.

The handlers are a composed `Handlers` object (handlers.py), not a mixin: the processor gives it
`_send` and a way to hand a handler's end back to this thread (the mailbox), and its loop asks
it for the running handler's deadline.

It is also the channel of this rank's `AuthStore` (authstore.py): `store_call` hands a request
to this thread and waits for the controller's answer, which this thread delivers; losing the
connection fails every call in flight at once.

Nothing a controller or a backup list holds may stop this thread: a failover target that cannot
be reached (whatever the error) is skipped for the next one, and an unexpected error in the loop
ends the process with ExitCode.NO_VERDICT and the error, never a silent dead thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import selectors
import socket
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindio_ttp.config import Outcome, TTPConfig
from mindio_ttp.control.agent import client as agent_client
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.rank import authstore, failover
from mindio_ttp.control.rank.calls import PendingCalls
from mindio_ttp.control.rank.preemption import SigtermWatch
from mindio_ttp.control.rank.release import Outcome as StopOutcome
from mindio_ttp.control.rank.release import Stopper
from mindio_ttp.control.rank.state import LIVE, RankMachine, RankState
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.liveness import LookingClock
from mindio_ttp.control.wire.session import RankHandshake
from mindio_ttp.control.wire.transport import Conn, ConnClosed, Mailbox, connect, recv_messages
from mindio_ttp.handlers import Handlers, Job, Result, checkpoint_location, latest_iteration
from mindio_ttp.hooks import STATE, TTPError, fault_kind
from mindio_ttp.recovery.rank import RECOVERY, RecoveryOrder

log = logging.getLogger("mindio_ttp.processor")

NOT_OUR_CONTROLLER = (
    "something other than this job's TTP controller listens there (another program, or another "
    "job's controller with another TTP_AUTH_KEY or mindio_ttp version): free the port, or give "
    "every rank another free port in TTP_CONTROLLER_PORT")


RETRY_PAUSE_S = 0.1  # between two tries of a registration the listener closed (+-50 %)


class HandshakeFailed(Exception):
    """The listener did not complete the handshake; the text says why and what to do.
    `again`: why trying again may work ("closed": the listener closed the connection without
    an answer, maybe to make room for newer ones, see admission.py; "timeout": it did not
    answer in time), "" when it will not (a refusal, a peer that is not this job's
    controller)."""

    def __init__(self, text: str, again: str = "") -> None:
        super().__init__(text)
        self.again = again


S = RankState
TRAINING_ONLY = frozenset({S.TRAINING})
FAULT_ONLY = frozenset({S.TRAINING, S.FAULT})  # where a recover order finds a rank
RECOVERING_ONLY = frozenset({S.RECOVERING})
IN_FAULT = frozenset({S.FAULT, S.RECOVERING})
RUNNING = frozenset(set(S) - {S.INIT, S.STOPPED})
NOT_EXITING = frozenset(set(S) - {S.EXITING})


class Processor:
    def __init__(self, cfg: TTPConfig, rank: int, dp_ranks: List[int], world_size: int,
                 replica: int) -> None:
        self.cfg, self.rank, self.dp_ranks = cfg, rank, list(dp_ranks)
        self.world_size, self.replica = world_size, replica
        self.ot = cfg.ot
        # training / fault / recovering / unprotected / exiting / stopped (state.py)
        self.machine = RankMachine(rank)
        self.exit_fn: Callable[[int], Any] = os._exit  # tests running in-process replace it
        self.exited = threading.Event()
        self.standby: Optional[Controller] = None
        self.controller_rank: Optional[int] = None
        self.fault_id: Optional[str] = None  # the launch's, from the primary's RegisterAck
        self._calls = PendingCalls()
        self._fault_time: Optional[float] = None
        self._conn: Optional[Conn] = None
        self._backups: List[List[Any]] = []
        self._mail = Mailbox()
        self._sel = selectors.DefaultSelector()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._seq = 0
        # the controller's silence is measured on the time this thread ran (liveness.py): a GC
        # pause or a GIL-holding call in training must not look like a lost controller
        self._clock = LookingClock()
        self.handlers = Handlers(rank, self._send_result, self._handler_done, channel=self,
                                 opener=authstore.AuthStore)
        self._preempted = False
        self._sigterm = SigtermWatch()
        # the fault-time stop (release.py): abort off the main thread, on every survivor
        self.stopper = Stopper(lambda outcome: self._mail.put(self._on_stopped, outcome))
        # through this node's agent (control/agent/): what it accepts from it; None: direct
        self._agent: Optional[agent_client.AgentLink] = None
        self._controller_at: Optional[Tuple[str, int]] = None  # where ttp_start_processor said
        self._advanced: Dict[int, Optional[Tuple[Optional[int], bool]]] = {}  # flow -> report
        self._incarnation = ""  # of the controller that welcomed us last (through the agent)
        # what we ask of this node's launcher (launch/desk.py): set by the API face at start
        self.launcher: Any = None

    @property
    def running(self) -> bool:
        """Registered and not shut down (a rank that obeyed its exit order still runs until its
        process ends)."""
        return self.machine.state in RUNNING

    @property
    def fault_seen(self) -> bool:
        return self.machine.fault_seen

    # -- start / stop ----------------------------------------------------------------------------
    def start(self, ip: str, port: int, deadline_s: Optional[float] = None) -> None:
        """Connect and register (blocks). Connecting is retried until TTP_CONNECT_TIMEOUT, and
        so is a handshake the listener closed without an answer (before its challenge, or
        after our Register: it made room for newer connections, control/wire/admission.py).
        `deadline_s` (a replacement: its recovery order's deadline) is how long instead, and
        then a handshake the listener did not answer in time is retried too: a replacement
        that gives up ends its recovery. A refusal is final. Through this node's agent first
        (control/agent/), unless TTP_NODE_AGENT=0 or this is a replacement (which reaches the
        acting controller itself)."""
        self._controller_at = (ip, port)
        if self.cfg.node_agent and deadline_s is None and self._start_via_agent(ip, port):
            return
        persistent = deadline_s is not None
        deadline = time.monotonic() + (self.cfg.connect_timeout if deadline_s is None
                                        else deadline_s)
        tries = 0
        while True:
            sock = self._connect(ip, port, deadline, persistent)
            if self.standby is None:
                self.standby = Controller(self.cfg, self.world_size, self.replica, self.rank,
                                          standby=True)
                self.standby.listen(sock.getsockname()[0], 0, self.cfg.listen_ports, self.rank)
                self.standby.start()
            try:
                conn = self._handshake(sock, failover=False, timeout=max(0.1, min(
                    self.cfg.handshake_timeout, deadline - time.monotonic())))
                break
            except HandshakeFailed as exc:
                retry = exc.again == "closed" or (persistent and exc.again != "")
                if retry and time.monotonic() + RETRY_PAUSE_S < deadline:
                    tries += 1
                    (log.warning if tries in (1, 10, 100) else log.debug)(
                        "rank %d: TTP controller at %s:%d: %s; trying again (try %d)",
                        self.rank, ip, port, exc, tries + 1)
                    time.sleep(RETRY_PAUSE_S * (0.5 + random.random()))
                    continue
                self.standby.stop()
                raise TTPError(f"rank {self.rank}: TTP controller at {ip}:{port}: {exc}"
                               f"{f' (after {tries + 1} tries)' if tries else ''}") from None
        self._begin(conn, ip, port)

    def _start_via_agent(self, ip: str, port: int) -> bool:
        """Register through this node's agent (found or started: agent/client.py); False when
        there is none or it does not take us within TTP_CONNECT_TIMEOUT (the caller then
        connects to the controller itself)."""
        link = agent_client.AgentLink(self.cfg.auth_key, self.rank)
        path, started = agent_client.find_or_start(link.hop_key, ip, port, self.world_size)
        if path is None:
            return False
        bad = agent_client.probe(self.cfg.auth_key, ip, port, self.cfg.handshake_timeout) \
            if started else ""
        if bad:
            started.kill()  # type: ignore[union-attr]
            raise TTPError(f"rank {self.rank}: TTP controller at {ip}:{port}: no valid TTP "
                           f"handshake ({bad}): {NOT_OUR_CONTROLLER}")
        local_ip = agent_client.local_ip_towards(ip, port)
        self.standby = Controller(self.cfg, self.world_size, self.replica, self.rank,
                                  standby=True)
        self.standby.listen(local_ip, 0, self.cfg.listen_ports, self.rank)
        self.standby.start()
        local = os.environ.get("LOCAL_WORLD_SIZE", "0")
        try:
            sock, hs, early = agent_client.connect(
                path, link.hop_key, self._register_msg(local_ip, False),
                T.Upstream(ip, port, int(local) if local.isdigit() else 0),
                self.cfg.handshake_timeout)
            link.inbox.nonces.add(hs.nonce or "")
            welcome = self._await_welcome(sock, hs, early, link)
        except (OSError, TimeoutError, ConnClosed, P.ProtocolError, HandshakeFailed) as exc:
            log.warning("rank %d: node agent at %s did not register this rank (%s); connecting "
                        "to the controller itself", self.rank, path, exc)
            self.standby.stop()
            self.standby = None
            return False
        self._agent = link
        self._welcomed(welcome)
        conn = Conn(sock, hs.tx, hs.dec, "node agent", clock=self._clock.now)
        conn.data = early
        self._begin(conn, ip, port)
        return True

    def _await_welcome(self, sock: socket.socket, hs: Any, early: List[P.Message],
                       link: agent_client.AgentLink) -> T.Welcome:
        """Block (TTP_CONNECT_TIMEOUT) until the controller's Welcome comes through the agent;
        frames behind it stay in `early`. HandshakeFailed when the controller refuses us."""
        deadline = time.monotonic() + self.cfg.connect_timeout
        while True:
            while early:
                m = early.pop(0)
                if isinstance(m, P.Reject):
                    raise HandshakeFailed(f"the controller refused the registration: {m.reason}")
                kind, inner = link.classify(m)
                if kind == link.ORDER and isinstance(inner, T.Welcome):
                    return inner
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no Welcome from the controller through the node agent "
                                   f"within TTP_CONNECT_TIMEOUT={self.cfg.connect_timeout:g} s")
            early.extend(recv_messages(sock, hs.dec, left))

    def _welcomed(self, w: T.Welcome) -> None:
        """A controller took this rank through its agent (the RegisterAck of a direct rank)."""
        if w.incarnation != self._incarnation:  # flow ids are a controller's own
            if self._incarnation and w.role == "standby":
                log.warning("rank %d: now served by the standby controller on rank %s",
                            self.rank, w.controller_rank)
            self._incarnation = w.incarnation
            self._advanced.clear()
        self.controller_rank = w.controller_rank
        if self.fault_id is None and w.fault_id:
            self.fault_id = w.fault_id
        if w.backups:
            self._backups = w.backups

    def _begin(self, conn: Conn, ip: str, port: int) -> None:
        assert self.standby is not None
        STATE.wait_limit = self.cfg.ot
        self.standby.fault_id = self.fault_id  # if promoted, it claims under the primary's id
        if self.controller_rank is not None:  # where the controller's rank runs, should the
            self.standby.flow.known_hosts[self.controller_rank] = ip  # standby take over
        RECOVERY.reporter = self._report_ready
        self._set_conn(conn)
        self._sel.register(self._mail.reader, selectors.EVENT_READ, "wake")
        self.machine.transition_to(RankState.TRAINING, "registered")
        self._thread = threading.Thread(target=self._loop, name=f"ttp-processor-{self.rank}",
                                        daemon=True)
        self._thread.start()
        authstore.attach(self)  # the default channel of an AuthStore made in this process
        log.info("rank %d: processor registered with the controller at %s:%d", self.rank, ip,
                 port)

    def _connect(self, ip: str, port: int, deadline: float, persistent: bool) -> socket.socket:
        """A TCP connection to the controller, tried until `deadline` (the controller's rank
        may not be listening yet)."""
        last: Exception = TimeoutError("no attempt")
        while time.monotonic() < deadline:
            try:
                return connect(ip, port, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            except OSError as exc:
                last = exc
                time.sleep(0.1)
        if persistent:
            raise TTPError(f"rank {self.rank}: cannot reach the TTP controller at {ip}:{port} "
                           f"before the recovery's deadline ({last})")
        raise TTPError(f"rank {self.rank}: cannot reach the TTP controller at {ip}:{port} "
                       f"within TTP_CONNECT_TIMEOUT={self.cfg.connect_timeout:g} s ({last}); "
                       "is rank 0 calling ttp_start_controller with the same ip/port?")

    def shutdown(self, timeout: float = 2.0) -> None:
        """Normal end of training: say goodbye so our disconnect is not taken for a fault."""
        authstore.detach(self)
        if not self.machine.move_from(RUNNING, RankState.STOPPED, "end of training"):
            return
        done = threading.Event()
        self._mail.put(self._say_goodbye, done)
        done.wait(timeout)
        self._stop.set()
        self._mail.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.standby is not None:
            self.standby.stop()
        self._sigterm.restore()

    # -- called from the training thread -------------------------------------------------------
    def report_exception(self, exc: BaseException, kind: str = "") -> None:
        """Reported as "exception" (this rank's own fault) or "collective" (a collective failed
        because of another rank's fault: hooks.fault_kind), unless the caller says which."""
        kind = kind or fault_kind(exc, self.fault_seen)
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        self._mail.put(self._report_fault, kind, f"{type(exc).__name__}: {exc}{where}"[:2000])

    def report_preempted(self) -> None:
        if not self._preempted:
            self._preempted = True
            self._mail.put(self._report_fault, "preempted", "SIGTERM received (preemption)")

    def wait_for_exit(self, timeout: float) -> bool:
        """True once the exit order was carried out (tests replace the process exit)."""
        return self.exited.wait(timeout)

    def install_sigterm(self) -> None:
        """SIGTERM = preemption (preemption.py): reported to this thread even while the main
        thread sits in a long C call."""
        self._sigterm.install(self.report_preempted)
        if self._sigterm.reader is not None:
            self._sel.register(self._sigterm.reader, selectors.EVENT_READ, "signal")

    # -- connection ------------------------------------------------------------------------------
    def _register_msg(self, host: str, failover: bool) -> P.Register:
        step, updating = STATE.snapshot()
        port = self.standby.address[1] if self.standby and self.standby.address else 0
        return P.Register(self.rank, self.world_size, self.dp_ranks, self.replica, host, port,
                          os.getpid(), step, updating, STATE.locked, failover)

    def _handshake(self, sock: socket.socket, failover: bool, timeout: float) -> Conn:
        """The challenge within `timeout`, then our Register and its ack within
        TTP_HANDSHAKE_TIMEOUT (session.py); closes the socket and raises HandshakeFailed with
        what to do otherwise. Two limits: a listener sends its challenge as it accepts, so a
        hung one is left after `timeout`, while one busy with a whole job's registrations (a
        start-up or failover storm) has shown it is alive and gets the full, scaled time."""
        hs = RankHandshake(self.cfg.auth_key)
        answered = False
        try:
            msgs = recv_messages(sock, hs.dec, timeout)
            sock.sendall(hs.answer(msgs[0], self._register_msg(sock.getsockname()[0], failover)))
            answered = True
            msgs = recv_messages(sock, hs.dec, self.cfg.handshake_timeout)
        except (OSError, TimeoutError, ConnClosed, P.ProtocolError) as exc:
            sock.close()
            again = ("timeout" if isinstance(exc, TimeoutError) else
                     "closed" if isinstance(exc, (ConnClosed, ConnectionError)) else "")
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(f"no {'answer to our Register' if answered else 'challenge'} "
                                   f"within {self.cfg.handshake_timeout if answered else timeout:g}"
                                   " s (TTP_HANDSHAKE_TIMEOUT)")
            if answered:
                raise HandshakeFailed(f"registration failed: {exc}", again) from None
            raise HandshakeFailed(f"no valid TTP handshake ({exc}): {NOT_OUR_CONTROLLER}",
                                  again) from None
        first = msgs[0]
        if not isinstance(first, P.RegisterAck):
            sock.close()
            raise HandshakeFailed(f"the controller refused the registration: "
                                  f"{getattr(first, 'reason', type(first).__name__)}")
        self.controller_rank = first.controller_rank
        if self.fault_id is None and first.fault_id:
            self.fault_id = first.fault_id  # the first ack is the primary's
        elif first.fault_id and first.fault_id != self.fault_id:
            log.error("rank %d: controller on rank %d names fault id %s, not the launch's %s "
                      "(keeping ours)", self.rank, first.controller_rank, first.fault_id,
                      self.fault_id)
        if first.backups:  # a standby announces none: keep the primary's list for the next loss
            self._backups = first.backups
        conn = Conn(sock, hs.tx, hs.dec, "controller", clock=self._clock.now)
        conn.data = msgs[1:]
        return conn

    def _set_conn(self, conn: Conn) -> None:
        self._conn = conn
        if self._agent is None:
            self._advanced.clear()  # a (new) controller's flows: their ids are its own
        self._sel.register(conn.sock, selectors.EVENT_READ, "conn")
        early, conn.data = conn.data or [], None
        for m in early:
            self._handle(m)

    def _drop_conn(self) -> None:
        if self._conn is not None:
            try:
                self._sel.unregister(self._conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            self._conn.close()
            self._conn = None
        self._calls.fail_all(ConnectionError("the connection to the TTP controller was lost "
                                             "(a new controller starts with an empty store)"))

    # -- the AuthStore's channel (any thread but ours) -------------------------------------------
    def store_call(self, request: P.StoreRequest, wait_s: float) -> P.StoreReply:
        """Send `request` to the controller and wait (at most `wait_s`) for its answer."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("the processor's own thread cannot wait for a store answer")
        req, done, slot = self._calls.open()
        self._mail.put(self._send_store, dataclasses.replace(request, req=req))
        if not done.wait(wait_s):
            self._calls.close(req, None)
            raise TimeoutError(f"no answer from the TTP controller within {wait_s:g} s")
        outcome = slot[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _send(self, msg: P.Message) -> None:
        if self._conn is None:
            return
        self._conn.queue(msg)
        try:
            done = self._conn.flush()
        except ConnClosed as exc:
            self._controller_lost(f"send failed: {exc}")
            return
        self._sel.modify(self._conn.sock, selectors.EVENT_READ if done
                         else selectors.EVENT_READ | selectors.EVENT_WRITE, "conn")

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - a dead thread would leave the rank unprotected
            log.exception("rank %d: processor failed", self.rank)
            self._exit(Outcome.NO_VERDICT, None, [], f"the TTP processor failed: {exc!r}")

    def _serve(self) -> None:
        cfg = self.cfg
        next_hb = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_hb and self._conn is not None:
                self._seq += 1
                step, updating = STATE.snapshot()
                self._send(P.Heartbeat(self.rank, self._seq, step, updating))
                next_hb = now + cfg.heartbeat_interval
            wake = [next_hb]
            if self._conn is not None:
                wake.append(now + self._conn.last_rx + cfg.heartbeat_timeout - self._clock.now())
            job_deadline = self.handlers.deadline()
            if job_deadline is not None:
                wake.append(job_deadline)
            if self._fault_time is not None:
                wake.append(self._fault_time + self.ot)
            wait = self._clock.waiting(max(0.0, min(wake) - time.monotonic()))
            for key, mask in self._sel.select(wait):
                if key.data == "wake":
                    self._on_mail()
                elif key.data == "signal":
                    self._on_signal_fd()
                elif key.data == "conn" and self._conn is not None:
                    if mask & selectors.EVENT_WRITE:
                        self._send_pending()
                    if mask & selectors.EVENT_READ:
                        self._on_readable()
            if self._stop.is_set():
                break
            self._clock.tick()
            now, seen = time.monotonic(), self._clock.now()
            if self._conn is not None and seen - self._conn.last_rx > cfg.heartbeat_timeout:
                self._controller_lost(f"controller silent for {seen - self._conn.last_rx:.1f} s")
            self.handlers.expire(now)
            if self._fault_time is not None and now > self._fault_time + self.ot:
                self._exit(Outcome.NO_VERDICT, None, [], f"no exit order within TTP_OT="
                           f"{self.ot:g} s after the fault")
        self._drop_conn()

    def _send_pending(self) -> None:
        try:
            done = self._conn.flush() if self._conn else True
        except ConnClosed as exc:
            self._controller_lost(f"send failed: {exc}")
            return
        if done and self._conn is not None:
            self._sel.modify(self._conn.sock, selectors.EVENT_READ, "conn")

    def _on_readable(self) -> None:
        assert self._conn is not None
        try:
            msgs = self._conn.read()
        except ConnClosed as exc:
            return self._controller_lost(f"connection lost: {exc}")
        except P.ProtocolError as exc:
            log.error("rank %d: bad frame from the controller: %s", self.rank, exc)
            return self._controller_lost(f"bad frame: {exc}")
        for m in msgs:
            self._handle(m)

    def _on_signal_fd(self) -> None:
        if self._sigterm.fired():
            self.report_preempted()

    def _on_mail(self) -> None:
        self._mail.run_all()

    def _report_fault(self, kind: str, detail: str) -> None:
        self._note_fault(f"{kind} reported")
        STATE.lock()
        (log.info if kind == "collective" else log.error)(
            "rank %d: reporting %s: %s", self.rank, kind, detail)
        self._send(P.FaultReport(self.rank, kind, detail))

    def _advanced_to(self, flow_id: int, step: Optional[int], updating: bool) -> None:
        self._advanced[flow_id] = (step, updating)
        self._send(P.StateReport(flow_id, 2, self.rank, step, updating))

    def _say_goodbye(self, done: threading.Event) -> None:
        self._send(P.Goodbye(self.rank))
        done.set()

    def _send_store(self, request: P.StoreRequest) -> None:
        if self._conn is None:
            self._calls.close(request.req, ConnectionError(
                "no connection to a TTP controller (failing over)"))
        else:
            self._send(request)

    def _send_result(self, r: Result) -> None:
        cls = P.SaveResult if r.kind == "save" else P.RenameResult
        self._send(cls(r.flow_id, r.rank, r.ok, r.error, r.seconds))

    def _handler_done(self, job: Job, ok: bool, err: str) -> None:
        """On a handler's thread: its result is sent from ours (only we touch the socket)."""
        self._mail.put(self.handlers.finished, job, ok, err)

    def _note_fault(self, why: str) -> None:
        self.machine.move_from(TRAINING_ONLY, RankState.FAULT, why)
        if self._fault_time is None:
            self._fault_time = time.monotonic()

    # -- orders ----------------------------------------------------------------------------------
    def _handle(self, m: P.Message) -> None:
        if self._agent is not None:
            kind, inner = self._agent.classify(m)
            if kind == self._agent.LOST:
                return self._upstream_lost(str(inner))
            if kind in (self._agent.HOP, self._agent.REFUSED):
                return
            m = inner  # type: ignore[assignment]
            if isinstance(m, T.Welcome):
                return self._welcomed(m)
            if kind == self._agent.DUPLICATE:
                # sent again to a rank that registered (again) mid-flow: answer, do not redo
                if isinstance(m, P.AdvanceTo) and m.flow_id in self._advanced:
                    done = self._advanced[m.flow_id]
                    if done is not None:
                        self._send(P.StateReport(m.flow_id, 2, self.rank, *done))
                    return
                if not isinstance(m, (P.Lock, P.AdvanceTo, P.Backups)):
                    return
        if isinstance(m, P.HeartbeatAck):
            return
        if isinstance(m, P.StoreReply):
            self._calls.close(m.req, m)
        elif isinstance(m, P.Backups):
            self._backups = m.backups
        elif isinstance(m, P.Lock):
            self._note_fault(f"lock of flow {m.flow_id}")
            step, updating = STATE.lock()
            self._send(P.StateReport(m.flow_id, 1, self.rank, step, updating))
            self.stopper.start(f"lock of flow {m.flow_id}")
        elif isinstance(m, P.AdvanceTo):
            self._note_fault(f"advance of flow {m.flow_id}")
            if m.flow_id in self._advanced:
                return  # already advancing for this flow: its report comes when done
            self._advanced[m.flow_id] = None

            def advance(fid: int = m.flow_id, limit: int = m.limit, grace: float = m.grace) -> None:
                step, updating = STATE.advance_to(limit, grace)
                self._mail.put(self._advanced_to, fid, step, updating)
            threading.Thread(target=advance, name="ttp-advance", daemon=True).start()
        elif isinstance(m, P.SaveOrder):
            RECOVERY.abandon("the controller fell back to the dying checkpoint")
            self.machine.move_from(RECOVERING_ONLY, RankState.FAULT, "save order")
            self.handlers.start_save(m)
        elif isinstance(m, P.RenameOrder):
            self.handlers.start_rename(m)
        elif isinstance(m, P.ExitOrder):
            RECOVERY.abandon(f"exit order: {m.outcome}")
            self._exit(Outcome(m.outcome), m.step, m.ranks, m.reason, m.exit_code)
        elif isinstance(m, P.RecoverOrder):
            self._on_recover(m)
        elif isinstance(m, P.ReplaceOrder):
            self._relay_replacement(m)
        elif isinstance(m, P.RecoverCommit):
            self._on_commit(m)
        elif isinstance(m, P.Closing):
            log.warning("rank %d: controller closed (%s); this rank is no longer protected",
                        self.rank, m.reason)
            self.machine.move_from(LIVE, RankState.UNPROTECTED, "the controller closed")
        elif isinstance(m, P.RegisterAck):
            self._backups = m.backups or self._backups
        else:
            log.warning("rank %d: unexpected %s from the controller", self.rank, type(m).__name__)

    # -- in-memory recovery (docs/recovery.md) --------------------------------------------------
    def _on_recover(self, m: P.RecoverOrder) -> None:
        self._note_fault(f"recover order {m.recovery_id}")
        order = RecoveryOrder(m.recovery_id, m.flow_id, m.step, tuple(m.lost), m.rendezvous, "",
                              m.deadline)
        if RECOVERY.ordered(order):
            self.machine.move_from(FAULT_ONLY, RankState.RECOVERING,
                                   f"recover order {m.recovery_id}")
            STATE.stop()  # the training thread leaves the step at its next update, if not yet
            # TTP_OT counts again once the recovery's own bound has passed
            self._fault_time = time.monotonic() + m.deadline
            self.stopper.start(f"recover order {m.recovery_id}")
            if self.stopper.outcome is not None:
                self._on_stopped(self.stopper.outcome)

    def _on_stopped(self, outcome: StopOutcome) -> None:
        """The fault-time stop ended: a survivor that could not abort, or whose main thread
        would not leave the step, cannot recover in memory; it says so at once, so the
        controller falls back to the dying checkpoint without waiting out the recovery's
        bound (release.py)."""
        if outcome.ok or not RECOVERY.pending:
            return
        why = ("the fault-time stop failed here: " + outcome.describe())[:1500]
        log.error("rank %d: %s; failing the in-memory recovery", self.rank, why)
        RECOVERY.report_ready(False, why)
        RECOVERY.abandon(why[:300])

    def _on_commit(self, m: P.RecoverCommit) -> None:
        RECOVERY.commit(m.recovery_id)
        self._fault_time = None
        self.machine.move_from(IN_FAULT, RankState.TRAINING, f"recovery {m.recovery_id} committed")
        self.stopper.reset()
        order = RECOVERY.order
        if order is not None and order.recovery_id == m.recovery_id:
            log.warning("rank %d: in-memory recovery %d committed: every rank holds iteration "
                        "%d, checked; training goes on", self.rank, m.recovery_id, order.step)
            if self.launcher is not None:
                self.launcher.recovered(m.recovery_id, order.step, order.lost)
        else:
            log.warning("rank %d: in-memory recovery %d committed", self.rank, m.recovery_id)

    def _report_ready(self, recovery_id: int, ok: bool, detail: str, digest: str,
                      seconds: float) -> None:
        """RECOVERY.reporter (training thread): sent from this thread, which owns the socket."""
        self._mail.put(self._send, P.RecoverReady(recovery_id, self.rank, ok, detail, digest,
                                                  seconds))

    def _relay_replacement(self, m: P.ReplaceOrder) -> None:
        """Ask this host's launcher for a replacement (launch/desk.py, handed to us at start)."""
        if self.launcher is None:
            self._send(P.ReplaceStatus(m.recovery_id, m.rank, "failed", 0,
                                       "no launcher desk in this process (not started through "
                                       "the API)"))
            return
        self.launcher.relay_replacement(m, lambda msg: self._mail.put(self._send, msg),
                                        self._stop)

    # -- failover and exit -----------------------------------------------------------------------
    def _upstream_lost(self, why: str) -> None:
        """The node agent lost its parent and fails over for the node: stop training until a
        controller decides, as on losing the controller ourselves; store calls in flight fail."""
        self._note_fault("the node agent lost its parent")
        STATE.lock()
        self._calls.fail_all(ConnectionError(f"the connection to the TTP controller was lost "
                                             f"({why}; a new controller starts with an empty "
                                             "store)"))
        log.error("rank %d: %s; training locked, the node agent fails over", self.rank, why)

    def _agent_lost(self, why: str) -> None:
        """The node agent is gone (or silent): register with the controller ourselves. Not a
        fault: the controller keeps our place for a while (routes.py), training goes on."""
        self._agent = None
        self._drop_conn()
        if not self.machine.protected or self._stop.is_set():
            self._stop.set()
            return
        log.warning("rank %d: node agent lost (%s); registering with the controller itself",
                    self.rank, why)
        ip, port = self._controller_at or ("", 0)
        conn, err = self._try_backup([self.controller_rank or 0, ip, port],
                                     self.cfg.deadlines.failover_try)
        if conn is not None:
            self._set_conn(conn)
            return
        self._controller_lost(f"node agent lost ({why}), controller unreachable ({err})")

    def _controller_lost(self, why: str) -> None:
        if self._agent is not None:
            return self._agent_lost(why)
        self._drop_conn()
        if not self.machine.protected or self._stop.is_set():
            self._stop.set()
            return
        self._note_fault(f"controller lost: {why}"[:200])
        STATE.lock()  # no further updates until a controller decides
        self.stopper.start("controller lost")
        log.error("rank %d: controller lost (%s); failing over to %s", self.rank, why,
                  [b[0] for b in self._backups] or "nobody")
        deadline = self._fault_time + self.ot  # type: ignore[operator]
        conn, entry, tried = failover.rounds(
            lambda: self._backups, self.cfg.deadlines.failover_try, self._failover_handshake,
            self.rank, deadline, self._stop)
        if conn is not None:
            log.warning("rank %d: now served by the standby controller on rank %s", self.rank,
                        entry[0])  # type: ignore[index]
            self._set_conn(conn)
            return
        if not self._stop.is_set():
            said = "; ".join(f"rank {r}: {e}" for r, e in list(tried.items())[:4])
            self._exit(Outcome.NO_VERDICT, None, [], f"controller lost ({why}) and no backup "
                       f"controller answered{f' ({said})' if said else ''}")

    def _try_backup(self, entry: List[Any], per_try: float) -> Tuple[Optional[Conn], str]:
        return failover.try_target(entry, per_try, self._failover_handshake, self.rank)

    def _failover_handshake(self, sock: socket.socket, per_try: float) -> Conn:
        return self._handshake(sock, failover=True,
                               timeout=min(per_try, self.cfg.handshake_timeout))

    def _exit(self, outcome: Outcome, step: Optional[int], ranks: List[int], reason: str,
              code: Optional[int] = None) -> None:
        code = outcome.exit_code if code is None else code
        if not self.machine.move_from(NOT_EXITING, RankState.EXITING, outcome.value):
            log.warning("rank %d: a second exit (%s: %s) after the first: ignored", self.rank,
                        outcome.value, reason)
            return
        if self.launcher is not None:  # the launcher's record of the flow (launch/desk.py)
            saved = outcome is Outcome.SAVED
            self.launcher.exiting(outcome, step, ranks, code, reason,
                                  checkpoint_location(step) if saved else None,
                                  latest_iteration() if saved else None)
        (log.warning if outcome is Outcome.SAVED else log.error)(
            "rank %d: exiting with code %d (%s): %s", self.rank, code, outcome.value, reason)
        for h in logging.getLogger("mindio_ttp").handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - never let logging stop the exit
                pass
        self.exited.set()
        self._stop.set()
        self.exit_fn(code)
