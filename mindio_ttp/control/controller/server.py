"""The controller: one selector thread serving every processor, one flow thread per fault.

The I/O thread turns socket events into facts (registered, heartbeat, dropped, silent, bad
frame, report) and never blocks on policy. The first fault starts the flow thread, which runs
the dying-checkpoint sequence with bounded waits: collect+lock -> choose_step -> save orders
-> rename on one rank -> exit orders. A standby controller (hosted by a backup rank's
processor) runs the same code in STANDBY until at least half of the world has failed over to
it, then runs the flow itself; ranks that never reached it count as dead. Half is not a
majority: a split job's two halves may both promote, so every flow must win the fault's claim
(claim.py) before its first save order (docs/node-loss.md).

The controller is composed, not mixed: it owns a `Roster` (roster.py), a `Flow` (flow.py), a
`KeySpace` (keyspace.py: the authenticated store) and a `MailOutbox`, and hands the flow only
those, its condition and its state machine; the flow reports back through its own methods
(`fault`, `joined`, `left`, `report`, `result`).

What a peer can do to the I/O thread is bounded (docs/security.md): a peer that has not
registered is read no further than the frame it is sending and the pre-authentication budget,
and only `PRE_AUTH_EVENTS_PER_LOOP` of them (and as many new connections) are served per loop
turn, for at most `PRE_AUTH_BUDGET_S`, after every registered rank, so neither a flood nor a
registration storm of the whole job can delay a heartbeat. Who may wait for a handshake, and
who gives way when too many wait, is admission.py's: at most `world_size + 64` (never more
than PENDING_CAP) and 64 per source address; connections that have had their chance give way
to new ones, a recovery's replacements keep their slots, and in a storm (every waiting rank
about to be served) the rest wait in the kernel's accept queue, where no timer of ours runs (a
rank's connect just takes longer; it retries), instead of timing out half-served; while
nothing can be admitted the listener is not watched. Silences are measured on the time
this loop was running (liveness.py), and a rank is declared hung only once its socket is read
dry. Warnings an outsider
can cause are rate-limited (`LogLimit`). An unexpected error while serving one connection
closes that connection, is logged with its peer, and the loop goes on.
"""

from __future__ import annotations

import errno
import heapq
import logging
import resource
import select
import selectors
import socket
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from mindio_ttp.config import PRE_AUTH_BUFFER_BUDGET, TTPConfig
from mindio_ttp.control.controller.flow import Decision, Flow
from mindio_ttp.control.controller.keyspace import KeySpace
from mindio_ttp.control.controller.roster import RankInfo, Roster
from mindio_ttp.control.controller.routes import Routes
from mindio_ttp.control.controller.state import ControllerState as S
from mindio_ttp.control.controller.state import StateMachine
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire import transport
from mindio_ttp.control.wire.admission import PENDING_CAP, Admission
from mindio_ttp.control.wire.liveness import LookingClock
from mindio_ttp.control.wire.session import ListenerHandshake
from mindio_ttp.control.wire.transport import Conn, ConnClosed, Mailbox, deliver
from mindio_ttp.faulttime import claim as C
from mindio_ttp.hooks import TTPError

log = logging.getLogger("mindio_ttp.controller")

# Work per loop turn for peers that have not registered (new connections, and readable ones):
# bounded, and done after every registered rank's frames, so no flood delays a heartbeat.
PRE_AUTH_EVENTS_PER_LOOP = 256
BACKUPS_COALESCE_S = 0.1  # at most one Backups broadcast per this: a fault soon after the
# start must find every rank with the same list (ranks that fail over to different standbys
# split the job), and the best two change only ~ln(N) times in a start-up storm
PRE_AUTH_BUDGET_S = 0.05  # a handshake costs ~100 us of this thread: a storm waits its turn
JOIN_BUDGET_S = 0.05  # admissions of ranks joining through node agents, per loop turn
# Before registration a read takes the rest of the frame being sent (or this much, so a short
# junk line is read whole and the peer sees a clean close, not a reset), never more.
PRE_AUTH_READ = 4096
# Warnings an outsider can trigger: at most LOG_BURST of each kind per LOG_WINDOW seconds,
# then one line that says how many more were suppressed.
LOG_BURST, LOG_WINDOW = 10, 60.0


class LogLimit:
    """One kind of warning, rate-limited: `burst` lines per `window` seconds, the rest counted
    and summarised ("N more ... suppressed") once the window is over (`flush`, called on every
    tick of the I/O loop). A connection that reads the challenge and sends junk would
    otherwise cost one line each: about 1 GiB of log an hour from one client."""

    def __init__(self, what: str, burst: int = LOG_BURST, window: float = LOG_WINDOW) -> None:
        self.what, self.burst, self.window = what, burst, window
        self.logged = self.suppressed = 0
        self._start = time.monotonic()
        self._last = ""

    def warning(self, fmt: str, *args: object) -> None:
        self.flush()
        if self.logged < self.burst:
            self.logged += 1
            log.warning(fmt, *args)
        else:
            self.suppressed += 1
            self._last = fmt % args if self.suppressed == 1 else self._last

    def flush(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._start < self.window:
            return
        if self.suppressed:
            log.warning("%d more %s suppressed in the last %.0f s (the first: %s)",
                        self.suppressed, self.what, now - self._start, self._last)
        self._start, self.logged, self.suppressed = now, 0, 0


class MailOutbox:
    """The flow's `Outbox` over the I/O thread's mailbox: each call is queued as the I/O
    thread's own method and run there, the only thread that touches a connection."""

    def __init__(self, mail: Mailbox, broadcast: Callable[[P.Message, Optional[int]], None],
                 send_many: Callable[[List[int], P.Message], None],
                 send: Callable[[int, P.Message], None],
                 on_flushed: Callable[[threading.Event], None]) -> None:
        self._mail = mail
        self._broadcast, self._send_many, self._send = broadcast, send_many, send
        self._on_flushed = on_flushed

    def broadcast(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        self._mail.put(self._broadcast, msg, exclude)

    def send_many(self, ranks: List[int], msg: P.Message) -> None:
        self._mail.put(self._send_many, ranks, msg)

    def send(self, rank: int, msg: P.Message) -> None:
        self._mail.put(self._send, rank, msg)

    def flush(self, timeout: float) -> bool:
        ev = threading.Event()
        self._mail.put(self._on_flushed, ev)
        return ev.wait(timeout)


class Controller:
    def __init__(self, cfg: TTPConfig, world_size: int, replica: int, host_rank: int,
                 standby: bool = False,
                 claims: Optional[Callable[[], Optional[C.ClaimSpace]]] = None) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.replica = replica
        self.host_rank = host_rank
        self.standby = standby
        self.name = f"{'standby ' if standby else ''}controller@rank{host_rank}"
        self.sm = StateMachine(self.name)
        self.address: Optional[Tuple[str, int]] = None
        self.rejected_frames = 0
        # the launch's fault id (claim.py): made by the primary, handed to every rank in its
        # RegisterAck; a standby gets it from the processor that hosts it
        self.fault_id: Optional[str] = None if standby else C.new_fault_id()
        self.loops = 0  # turns of the I/O loop (tests wait for the loop to have acted)
        self.checked_at = 0.0  # when the silence checks last ran
        self._ranks = Roster()
        self._cond = threading.Condition(threading.RLock())
        self._mail = Mailbox()
        self._outbox = MailOutbox(self._mail, self._send_alive_now, self._send_many_now,
                                  self._send_to, lambda ev: self._flush_waiters.append(ev))
        self._sel = selectors.DefaultSelector()
        self._listener: Optional[socket.socket] = None
        # accepted, not registered yet (admission.py): every rank may connect at once at
        # start-up; beyond that, only floods. Memory before authentication is bounded per
        # connection by pre_auth_max_payload(world_size) and in all by PRE_AUTH_BUFFER_BUDGET
        # (partial frames of unregistered connections)
        self._pending: Admission[Conn] = Admission(min(world_size + 64, PENDING_CAP))
        self._accepting = False  # the listener is watched (not while nothing can be admitted)
        self._refused_pending = 0  # connections closed at accept (their source was full)
        self.evicted = 0  # waiting connections closed to make room for newer ones
        self._warn_refused = LogLimit("refused connections")
        self._warn_pre_auth = LogLimit("warnings about unregistered connections")
        self._pre_auth_held: Dict[Conn, int] = {}
        self._pre_auth_total = 0
        self.pre_auth_budget = PRE_AUTH_BUFFER_BUDGET
        self.pre_auth_refused = 0  # connections closed because the budget was spent
        self._conns: Dict[int, Conn] = {}  # fileno -> conn
        self._flush_waiters: List[threading.Event] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._backups: List[List[object]] = []
        self._backups_sent: List[List[object]] = []  # what the last Backups broadcast said
        # the running flow's phase orders (lock, advance) as this thread broadcast them: a rank
        # registering while the flow collects or saves gets exactly these, and the broadcast it
        # missed, never twice (`_replayed_on_register`)
        self._phase_msgs: List[P.Message] = []
        # the flow's exit order once sent: a rank that registers after it (its failover or its
        # node agent's took longer than the flow) gets the verdict instead of a refusal
        self.verdict: Optional[P.ExitOrder] = None
        self._progress_at: Optional[float] = None  # last heartbeat showing a step change
        self._clock = LookingClock()  # silences count only while the I/O loop runs
        self.store = KeySpace()  # the authenticated store; only the I/O thread touches it
        self.flow = Flow(cfg, world_size, replica, host_rank, self.name, self.sm, self._cond,
                         self._ranks, self._outbox, self.close_store,
                         claims or (lambda: C.registered(self.fault_id)),
                         address=lambda: self.address, rearmed=self._refresh_backups)
        # ranks served through node agents and relays (docs/design.md, the tiers)
        self.routes = Routes(self)

    # -- what the flow found (read by tests, benchmarks and the API) ---------------------------
    @property
    def decision(self) -> Optional[Decision]:
        return self.flow.decision

    @property
    def decided(self) -> threading.Event:
        return self.flow.decided

    @property
    def fault_at(self) -> Optional[float]:
        return self.flow.fault_at

    @property
    def timeline(self) -> Dict[str, float]:
        return self.flow.timeline

    @property
    def faults(self) -> List[str]:
        return self.flow.faults

    # -- life cycle --------------------------------------------------------------------------
    def listen(self, ip: str, port: int, ports: Optional[Tuple[int, int]] = None,
               first: int = 0) -> Tuple[str, int]:
        """Listen on ip:port; with `ports` (TTP_LISTEN_PORTS), on the first free port of that
        range from its `first`-th one on (ranks on one host start at different ones)."""
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        candidates = [port] if ports is None else [
            ports[0] + (first + i) % (ports[1] - ports[0] + 1)
            for i in range(ports[1] - ports[0] + 1)]
        for candidate in candidates:
            try:
                sock.bind((ip, candidate))
                break
            except OSError as exc:
                if ports is not None and exc.errno == errno.EADDRINUSE:
                    continue
                sock.close()
                raise TTPError(listen_error(ip, candidate, exc, self.standby)) from None
        else:
            sock.close()
            raise TTPError(f"TTP standby controller cannot listen on {ip}: every port of "
                           f"TTP_LISTEN_PORTS={ports[0]}-{ports[1]} is in use; give a range "
                           "with at least as many free ports as ranks on this host")
        # the kernel caps the backlog at net.core.somaxconn; ask for a whole start-up storm
        sock.listen(min(self.world_size + 64, 65535))
        sock.setblocking(False)
        self._listener = sock
        self.address = sock.getsockname()[:2]
        # one socket per rank without node agents; with them, one per relay or agent it serves
        # (and per rank that fell back): a few thousand at most
        raise_fd_limit((self.world_size if not self.cfg.node_agent
                        else min(self.world_size, 8192)) + 256, self.name)
        return self.address

    def start(self) -> None:
        assert self._listener is not None, "listen() first"
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._accepting = True
        self._sel.register(self._mail.reader, selectors.EVENT_READ, "wake")
        self.sm.transition_to(S.STANDBY if self.standby else S.SERVING,
                              f"listening on {self.address[0]}:{self.address[1]}")
        self._thread = threading.Thread(target=self._loop, name=f"ttp-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, wait_goodbyes: float = 0.0) -> None:
        """Normal end of training: wait (bounded) for every rank's goodbye, tell the rest the
        controller is closing on purpose, then stop. Refuses to cut a running flow short."""
        if self.sm.is_in(S.COLLECTING, S.RECOVERING, S.SAVING, S.RENAMING):
            log.warning("%s: a fault flow is running; not stopping", self.name)
            return
        if self.sm.is_in(S.SERVING) and wait_goodbyes > 0:
            deadline = time.monotonic() + wait_goodbyes
            with self._cond:
                while self._ranks.alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        busy = sorted(self._ranks.alive())
                        log.warning("%s: stopping while rank(s) %s still train: they are no "
                                    "longer protected", self.name, busy[:16])
                        break
                    self._cond.wait(min(left, 0.2))
            self._send_alive(P.Closing("training finished on the controller's rank"))
            self.flush(1.0)
        if not self.sm.is_in(S.STOPPED):
            self.sm.transition_to(S.STOPPED, "stop requested")
        self._stop.set()
        self._mail.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._close_all()

    def flush(self, timeout: float) -> bool:
        return self._outbox.flush(timeout)

    def close_store(self, namespace: str, why: str = "closed by the controller") -> None:
        """Drop a namespace of the authenticated store (any thread): its pending gets and
        waits fail, its memory is freed."""
        self._mail.put(self._close_store_now, namespace, why)

    @property
    def flow_running(self) -> bool:
        return self.sm.is_in(S.COLLECTING, S.RECOVERING, S.SAVING, S.RENAMING)

    @property
    def registered(self) -> List[int]:
        with self._cond:
            return sorted(self._ranks.alive())

    # -- I/O thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        self._clock = LookingClock()  # from the first turn: starting up is not a stall
        tick = self.cfg.deadlines.controller_tick
        next_check = time.monotonic() + tick
        next_backups = 0.0
        while not self._stop.is_set():
            wake = next_check
            if self._backups != self._backups_sent:  # a changed list goes out within its bound
                wake = min(wake, next_backups)
            if self.routes.joining:  # admissions left over from the last turn: no sleep
                wake = time.monotonic()
            try:
                events = self._sel.select(self._clock.waiting(
                    max(0.0, wake - time.monotonic())))
            except OSError:
                if self._stop.is_set():
                    break
                raise
            self.loops += 1
            pre_auth = []
            for key, mask in events:  # registered ranks first
                if key.data == "listen":
                    pre_auth.append((key, mask))
                elif key.data == "wake":
                    self._guarded(None, self._on_mail)
                elif key.data in self._pending:
                    pre_auth.append((key, mask))
                else:
                    self._on_event(key.data, mask)
            # ranks joining through node agents: a bounded slice a turn, so that a storm of
            # 100,000 admissions never keeps this loop from acking its children's heartbeats
            self._guarded(None, self.routes.admit, JOIN_BUDGET_S)
            budget = time.monotonic() + PRE_AUTH_BUDGET_S
            for key, mask in pre_auth[:PRE_AUTH_EVENTS_PER_LOOP]:  # the rest: next turn
                if time.monotonic() > budget:
                    break
                if key.data == "listen":
                    self._guarded(None, self._accept)
                else:
                    self._on_event(key.data, mask)
            stall = self._clock.tick()
            if stall > 1.0:
                log.warning("%s: this loop did not run for %.1f s (busy, or short of CPU on "
                            "this node); that time does not count against any rank's heartbeat",
                            self.name, stall)
            now = time.monotonic()
            if now >= next_check:
                self._guarded(None, self._check_silence, now)
                self.checked_at = now
                next_check = now + tick
            if self._backups != self._backups_sent and now >= next_backups:
                # coalesced (BACKUPS_COALESCE_S): each broadcast is a frame per registered
                # rank; registering ranks get the list in their ack
                self._backups_sent = list(self._backups)
                self._send_alive_now(P.Backups(self._backups_sent))
                next_backups = now + BACKUPS_COALESCE_S
            if self._flush_waiters and all(not c.out for c in self._conns.values()):
                for ev in self._flush_waiters:
                    ev.set()
                self._flush_waiters.clear()

    def _on_event(self, conn: Conn, mask: int) -> None:
        if conn.closed:  # dropped earlier in this turn
            return
        if mask & selectors.EVENT_READ:
            self._guarded(conn, self._on_readable, conn)
        if mask & selectors.EVENT_WRITE and not conn.closed:
            self._guarded(conn, self._flush, conn)

    def _guarded(self, conn: Optional[Conn], fn: Callable[..., None], *args: object) -> None:
        """Run one piece of the I/O loop's work; an unexpected error closes `conn` (if the work
        was for one connection) and is logged, and the loop serves everyone else."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one peer's bad luck must not stop the listener
            if conn is None:
                log.exception("%s: error in the I/O loop (%s); serving on", self.name,
                              getattr(fn, "__name__", fn))
                return
            log.exception("%s: error while serving %s (rank %s); closing that connection",
                          self.name, conn.peer, conn.rank)
            try:
                self._drop(conn, "error while serving it")
            except Exception:  # noqa: BLE001
                log.exception("%s: error while closing %s", self.name, conn.peer)
                conn.close()

    def _accept(self) -> None:
        """Admit new connections while there is room (admission.py), at most
        PRE_AUTH_EVENTS_PER_LOOP a turn; with none, make room from the connections that have
        had their chance, or stop watching the listener until a slot frees."""
        assert self._listener is not None
        now = time.monotonic()
        give_way: Optional[Iterator[Conn]] = None
        for _ in range(PRE_AUTH_EVENTS_PER_LOOP):  # the rest wait for the next turn
            if self._pending.room <= 0:
                if not _readable(self._listener):
                    return  # nobody waits in the kernel's queue: nothing to make room for
                if give_way is None:
                    give_way = self._pending.give_way(now, self._idle, self._kept_slots())
                victim = next(give_way, None)
                if victim is None:
                    self._watch_listener(False)  # the kernel's queue holds the rest meanwhile
                    return
                self._evict(victim, "every waiting slot was taken")
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: log and keep serving the others
                log.error("%s: accept failed: %s (raise `ulimit -n`?)", self.name, exc)
                return
            source = str(addr[0])
            full, victim = self._pending.crowded(source, self._idle)
            if full and victim is None:
                # every connection from there has sent what we have not read yet: refused
                # here, before any byte is buffered (a rank retries)
                self._refused_pending += 1
                self._warn_refused.warning(
                    "%s: %d connections from %s waiting to register; refused %s:%s (%d refused "
                    "so far)", self.name, self._pending.from_source(source), source, source,
                    addr[1], self._refused_pending)
                sock.close()
                continue
            if victim is not None:
                self._evict(victim, f"{source} had {self._pending.per_source} waiting")
            hs = ListenerHandshake(self.cfg.auth_key, P.pre_auth_max_payload(self.world_size),
                                   {P.Register: self.cfg.auth_key,
                                    T.NodeRegister: self.routes.hop_key}, T.CODEC)
            conn = Conn(sock, hs.tx, hs.dec, f"{source}:{addr[1]}")
            conn.handshake = hs
            self._conns[sock.fileno()] = conn
            self._pending.add(conn, source, now)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.queue_raw(hs.challenge())
            self._flush(conn)

    def _free_pre_auth(self, reader: Conn) -> int:
        """The budget is spent and `reader` has more to send: connections that have had their
        chance and hold partial frames give way (admission.py), so an outsider's stalled
        frames cannot keep a rank's Register out; the budget left afterwards."""
        room = self.pre_auth_budget - self._pre_auth_total
        for victim in self._pending.give_way(time.monotonic(), self._idle, self._kept_slots()):
            if room > 0:
                break
            if victim is reader or not self._pre_auth_held.get(victim):
                continue
            self.pre_auth_refused += 1
            self._evict(victim, "the pre-authentication budget was spent")
            room = self.pre_auth_budget - self._pre_auth_total
        return room

    def _idle(self, conn: Conn) -> bool:
        """Nothing `conn` sent waits unread: if it is late, it is late on its own."""
        return not _unread(conn.sock)

    def _evict(self, conn: Conn, why: str) -> None:
        self.evicted += 1
        self._warn_refused.warning(
            "%s: closing %s, which has not registered, to make room for a newer connection "
            "(%s)", self.name, conn.peer, why)
        self._drop(conn, "gave way to a newer connection")

    def _kept_slots(self) -> Dict[str, int]:
        """Source address -> waiting connections that never give way: one per replacement the
        running recovery expects from that host (its lost rank's)."""
        if not self.sm.is_in(S.RECOVERING):
            return {}
        kept: Dict[str, int] = {}
        with self._cond:
            for rank in self.flow.recovery.expecting:
                info = self._ranks.get(rank)
                host = info.host if info is not None else self.flow.known_hosts.get(rank)
                if host:
                    kept[host] = kept.get(host, 0) + 1
        return kept

    def _watch_listener(self, on: bool) -> None:
        """Watch the listener (or stop: nothing can be admitted, and a listener left readable
        would wake every loop turn for nothing) until a slot frees or the next tick."""
        if on == self._accepting or self._listener is None:
            return
        self._accepting = on
        if on:
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        else:
            self._sel.unregister(self._listener)

    def _on_mail(self) -> None:
        self._mail.run_all()

    def _send_many_now(self, ranks: List[int], msg: P.Message) -> None:
        """One serialisation for all (save orders to N/2 ranks); one envelope for the routed."""
        payload = P.encode_payload(msg)
        for r in ranks:
            info = self._ranks.get(r)
            if info is not None and info.conn is not None:
                info.conn.queue_payload(msg.TYPE, payload)
                self._flush(info.conn)
        self.routes.to_ranks(ranks, msg)

    def _close_store_now(self, namespace: str, why: str) -> None:
        n = self.store.close(namespace, why)
        log.info("%s: store namespace %s closed (%d key(s))", self.name, namespace, n)

    def _send_alive_now(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        if isinstance(msg, P.Lock):
            self._phase_msgs = [msg]
        elif isinstance(msg, P.AdvanceTo):
            self._phase_msgs.append(msg)
        elif isinstance(msg, P.ExitOrder):
            self.verdict = msg
        payload = None
        for conn in list(self._conns.values()):  # the direct ranks; routed ones below
            info = self._ranks.get(conn.rank) if conn.rank is not None else None
            if info is not None and info.conn is conn and info.status == "alive" \
                    and info.rank != exclude:
                payload = payload or P.encode_payload(msg)
                conn.queue_payload(msg.TYPE, payload)
                self._flush(conn)
        self.routes.broadcast(msg, exclude)

    def _send_to(self, rank: int, msg: P.Message) -> None:
        """One rank, directly or in an envelope through its node agent."""
        info = self._ranks.get(rank)
        if info is not None and info.conn is not None:
            info.conn.queue(msg)
            self._flush(info.conn)
        else:
            self.routes.to_rank(rank, msg)

    def _flush(self, conn: Conn) -> None:
        transport.flush(conn, self._sel, self._drop)

    def _on_readable(self, conn: Conn) -> None:
        try:
            if conn in self._pending:
                # read no further than this frame and the budget: memory is bounded, not counted
                room = self.pre_auth_budget - self._pre_auth_total
                if room <= 0:
                    room = self._free_pre_auth(conn)
                if room <= 0:
                    self._warn_pre_auth.warning(
                        "%s: unregistered connections hold %d bytes of partial frames, the "
                        "budget; closing %s, which sent more", self.name, self._pre_auth_total,
                        conn.peer)
                    self.pre_auth_refused += 1
                    self._drop(conn, "pre-authentication buffer budget exceeded")
                    return
                msgs = conn.read(min(max(conn.dec.wanted(), PRE_AUTH_READ), room))
                self._hold_pre_auth(conn)
            else:
                msgs = conn.read()
            deliver(conn, msgs, self._dispatch)
            ack = T.ack_due(conn)  # one for every heartbeat of this read
            if ack is not None:
                conn.queue(ack)
                self._flush(conn)
        except ConnClosed as exc:
            self._drop(conn, f"connection dropped: {exc}")
        except P.ProtocolError as exc:
            self.rejected_frames += 1
            # a registered rank's bad frame ends that rank: always said; before registration it
            # is anyone's junk, rate-limited
            warn = log.warning if conn.rank is not None else self._warn_pre_auth.warning
            warn("%s: rejected frame from %s (rank %s): %s; closing that connection",
                 self.name, conn.peer, conn.rank, exc)
            self._drop(conn, f"sent a bad frame: {exc}")

    @property
    def pre_auth_buffered(self) -> int:
        """Bytes of partial frames that unregistered connections make this listener hold."""
        return self._pre_auth_total

    def _hold_pre_auth(self, conn: Conn) -> None:
        """Account what `conn` (not registered) now buffers."""
        if conn.closed or conn not in self._pending:
            return
        held = conn.dec.pending
        self._pre_auth_total += held - self._pre_auth_held.get(conn, 0)
        self._pre_auth_held[conn] = held

    def _drop(self, conn: Conn, why: str) -> None:
        if conn.closed:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._conns.pop(conn.sock.fileno(), None)
        if self._pending.remove(conn):
            self._watch_listener(True)
        self._pre_auth_total -= self._pre_auth_held.pop(conn, 0)
        conn.close()  # frees its buffers now
        if conn.child is not None:
            self.routes.lost(conn.child, why)
            conn.child = None
        if conn.rank is not None:
            self.store.forget(conn.rank)
        with self._cond:
            info = self._ranks.get(conn.rank) if conn.rank is not None else None
            if info is not None and info.conn is conn:
                info.conn = None
                if info.status == "alive":
                    if self.sm.is_in(S.EXITING, S.STOPPED):
                        self._set_status(info, "gone", "left after the exit order")
                    else:
                        self._set_status(info, "dead", f"dead ({why})")
                        self.flow.fault(f"rank {info.rank} {info.note}")

    def _set_status(self, info: RankInfo, status: str, note: str) -> None:
        """Change a rank's status (caller holds _cond); a rank leaving 'alive' is no longer
        awaited by the flow."""
        if self._ranks.set_status(info, status, note):
            self.flow.left(info.rank)
        self._cond.notify_all()

    def _check_silence(self, now: float) -> None:
        """Close handshakes past their time (`now`: monotonic) and declare ranks silent for
        TTP_HEARTBEAT_TIMEOUT of this loop's looking time (liveness.py) hung."""
        self.store.expire(now)
        self._warn_refused.flush(now)
        self._warn_pre_auth.flush(now)
        self._watch_listener(True)  # connections may have had their chance since: look again
        for conn, since in self._pending.items():
            if now - since > self.cfg.handshake_timeout:
                if _unread(conn.sock):
                    continue  # its Register waits for a turn with time for it: not idle
                self._warn_pre_auth.warning(
                    "%s: %s did not complete the handshake within TTP_HANDSHAKE_TIMEOUT=%g s; "
                    "closing", self.name, conn.peer, self.cfg.handshake_timeout)
                self._drop(conn, "no registration")
        if not self.sm.is_in(S.SERVING, S.COLLECTING, S.RECOVERING, S.SAVING, S.RENAMING):
            return
        seen = self._clock.now()
        stall = self.cfg.step_timeout
        if stall and self._progress_at is not None and seen - self._progress_at > stall \
                and self.sm.is_in(S.SERVING):
            with self._cond:  # every rank alive yet none advanced: a job-wide stall
                self.flow.fault(f"no training progress for {seen - self._progress_at:.1f} s "
                            f"(TTP_STEP_TIMEOUT={stall:g}) while every processor heartbeats")
        for child in self.routes.check(seen):
            self._warn_pre_auth.warning("%s: node agent %s silent for TTP_HEARTBEAT_TIMEOUT="
                                        "%g s; closing", self.name, child.conn.peer,
                                        self.cfg.heartbeat_timeout)
            self._drop(child.conn, "silent")
        limit = self.cfg.heartbeat_timeout
        direct = [self._ranks.get(c.rank) for c in list(self._conns.values())
                  if c.rank is not None]
        for info in direct:
            if info is None:
                continue
            if info.status == "alive" and seen - info.last_seen > limit:
                if info.conn is not None and not info.conn.closed:
                    self._on_readable(info.conn)  # a heartbeat may wait unread: read it first
                    if info.status != "alive" or self._clock.now() - info.last_seen <= limit:
                        continue
                seen = self._clock.now()
                with self._cond:
                    self._set_status(info, "hung",
                                     f"hung (no heartbeat for {seen - info.last_seen:.1f} s)")
                    self.flow.fault(f"rank {info.rank} {info.note}")
                if info.conn is not None:
                    conn, info.conn = info.conn, None
                    self._drop(conn, "hung")

    # -- messages ------------------------------------------------------------------------------
    def _dispatch(self, conn: Conn, msg: P.Message) -> None:
        if isinstance(msg, P.Register):
            self._on_register(conn, msg)
            return
        if isinstance(msg, T.NodeRegister):
            self.routes.on_node_register(conn, msg)
            return
        if conn.child is not None:
            self.routes.on_message(conn.child, msg)
            return
        info = self._ranks.get(conn.rank) if conn.rank is not None else None
        if info is None or info.conn is not conn or type(msg).TYPE in T.TYPES:
            self.rejected_frames += 1
            self._warn_pre_auth.warning("%s: %s from unregistered peer %s; closing", self.name,
                                        type(msg).__name__, conn.peer)
            self._drop(conn, "not registered")
            return
        info.last_seen = self._clock.now()
        if isinstance(msg, P.Heartbeat):
            if msg.step != info.step or msg.updating != info.updating:
                self._progress_at = info.last_seen  # armed by the first change seen
            info.step, info.updating = msg.step, msg.updating
            conn.ack_due = msg.seq  # acked once the read is done (_on_readable)
            return
        self._on_rank_msg(info, msg, lambda reply: self._reply(conn, reply), conn.peer)

    def _on_rank_msg(self, info: RankInfo, msg: P.Message, reply: Callable[[P.Message], None],
                     peer: str = "") -> None:
        """What a registered rank said, directly or through its node agent (routes.py)."""
        if isinstance(msg, P.FaultReport):
            with self._cond:
                self.flow.fault(f"rank {info.rank} reported {msg.kind}: {msg.detail}",
                                rank=info.rank, kind=msg.kind)
        elif isinstance(msg, P.RecoverReady):
            with self._cond:
                self.flow.recovery.ready(msg, info.rank, peer)
        elif isinstance(msg, P.ReplaceStatus):
            with self._cond:
                self.flow.recovery.replace_status(msg, info.rank, peer)
        elif isinstance(msg, P.StateReport):
            with self._cond:
                self.flow.report(msg.flow_id, msg.phase, info.rank, msg.step, msg.updating)
        elif isinstance(msg, (P.SaveResult, P.RenameResult)):
            with self._cond:
                self.flow.result(msg.flow_id, info.rank, msg)
        elif isinstance(msg, P.StoreRequest):
            self.store.handle(info.rank, msg, reply, peer)
        elif isinstance(msg, P.Goodbye):
            with self._cond:
                self._set_status(info, "gone", "finished training")
        else:
            log.warning("%s: unexpected %s from rank %s", self.name, type(msg).__name__, info.rank)

    def _reply(self, conn: Conn, msg: P.Message) -> None:
        if not conn.closed:
            conn.queue(msg)
            self._flush(conn)

    def _refuse(self, conn: Conn, reason: str) -> None:
        log.warning("%s: refusing registration from %s: %s", self.name, conn.peer, reason)
        conn.queue(P.Reject(reason))
        try:
            conn.flush()
        except ConnClosed:
            pass
        self._drop(conn, reason)

    def _on_register(self, conn: Conn, m: P.Register) -> None:
        if conn.rank is not None or conn.child is not None:
            return self._refuse(conn, "registered twice on one connection")
        # a Register recorded on another connection raises ProtocolError here (a rejected
        # frame); from here on both directions use this connection's session keys
        conn.handshake.accept(m)
        if self._exiting() and self.verdict is not None:
            return self._late(conn, m)
        why = self._admit(m, conn=conn)
        if why is not None:
            return self._refuse(conn, why)
        conn.queue(P.RegisterAck("standby" if self.standby else "primary", self.host_rank,
                                 self._backups, self.fault_id or ""))
        for phase_msg in self._replayed_on_register():
            conn.queue(phase_msg)
        self._flush(conn)
        if m.failover or m.locked:
            log.info("%s: rank %d registered (failover=%s)", self.name, m.rank, m.failover)
        self._after_registration()

    def _admit(self, m: P.Register, conn: Optional[Conn] = None,
               child: Optional[object] = None) -> Optional[str]:
        """Check and record one rank's registration, on its own connection `conn` or through
        the node agent `child` (routes.py); None when it is admitted, else why not."""
        if m.world_size != self.world_size or not 0 <= m.rank < self.world_size:
            return (f"rank {m.rank} / world_size {m.world_size} do not match this job's "
                    f"world_size {self.world_size}")
        if m.rank not in m.dp_ranks or m.replica != self.replica:
            return (f"rank {m.rank}: dp_ranks {m.dp_ranks[:8]} / replica {m.replica} do not "
                    f"match (controller replica {self.replica})")
        if self._exiting():
            return "controller is exiting"
        now = self._clock.now()
        with self._cond:
            old = self._ranks.get(m.rank)
            joining = self.sm.is_in(S.RECOVERING) and m.rank in self.flow.recovery.expecting
            if old is not None and old.status in ("dead", "hung", "replaced") and not joining:
                return f"rank {m.rank} was already declared {old.note}"
            if joining:
                self.flow.recovery.replacement_registered(m.rank)
            if old is not None and old.conn is not None and old.conn is not conn:
                if now - old.last_seen < self.cfg.heartbeat_timeout and not joining:
                    # the rank's own connection is live and heartbeating: a second Register
                    # for it is a replay or an impostor, never a reason to drop the real one
                    log.warning("%s: refused a Register for rank %d from %s: that rank is "
                                "connected from %s and heartbeating", self.name, m.rank,
                                conn.peer if conn is not None else "a node agent",
                                old.conn.peer)
                    return f"rank {m.rank} is already connected"
                stale, old.conn = old.conn, None
                self._drop(stale, "replaced by a new connection")
            if conn is not None:
                self._authenticated(conn)
                conn.rank = m.rank
                self.routes.children.detach([m.rank])  # it left its node agent
                self.routes.limbo.pop(m.rank, None)
            info = RankInfo(m.rank, tuple(m.dp_ranks), m.host, m.standby_port, conn, now,
                            m.step, m.updating)
            info.route = child
            self._ranks.register(info)
            self.flow.joined(m.rank)  # if mid-flow: it gets the phase orders
            self._cond.notify_all()
        if self.sm.is_in(S.SERVING) and m.standby_port > 0 and m.rank != self.host_rank:
            # before the ack, so the list it carries counts this rank too: a rank that is
            # itself one of the two best backups must not learn a list without it and rely
            # on a later broadcast reaching it before the controller is lost
            with self._cond:  # the flow thread refreshes the list after a recovery
                self._consider_backup(m.rank, m.host, m.standby_port)
        return None

    def _late(self, conn: Conn, m: P.Register) -> None:
        """A rank registers after the verdict: it gets the verdict (it took part in the flow's
        fault, or it would be waiting TTP_OT for an exit order that was sent before it came)."""
        log.warning("%s: rank %d registered after the verdict; sending it the exit order",
                    self.name, m.rank)
        self._authenticated(conn)
        conn.queue(P.RegisterAck("standby" if self.standby else "primary", self.host_rank,
                                 self._backups, self.fault_id or ""))
        conn.queue(self.verdict)  # type: ignore[arg-type]
        self._flush(conn)

    def _authenticated(self, conn: Conn) -> None:
        """`conn` registered (a rank or a node agent): no longer counted before authentication."""
        if self._pending.remove(conn):
            self._watch_listener(True)
        self._pre_auth_total -= self._pre_auth_held.pop(conn, 0)
        conn.dec.authenticated()

    def _exiting(self) -> bool:
        return self.sm.is_in(S.EXITING, S.STOPPED)

    def _after_registration(self) -> None:
        """A standby takes over once half of the world's ranks registered with it."""
        if self.sm.is_in(S.STANDBY):
            alive = self._ranks.n_alive
            if 2 * alive >= self.world_size:  # exactly half: the fault claim decides
                share = "a majority" if 2 * alive > self.world_size else \
                    "exactly half: the fault claim decides whether it saves"
                self.sm.transition_to(S.SERVING, f"{alive} of {self.world_size} ranks failed "
                                      f"over ({share})")
                with self._cond:
                    self._refresh_backups()  # it learned none while it stood by
                    self.flow.fault(f"primary controller lost ({alive} ranks failed over to "
                                    f"rank {self.host_rank})", promoted=True)

    def _replayed_on_register(self) -> List[P.Message]:
        """The phase orders a rank registering now must get: the flow's Lock and AdvanceTo while
        the flow collects, saves or renames (a rank failing over late to a promoted standby
        must stop like the others). Not while a recovery runs: a rank registering then is a
        replacement, which is not part of the collect; locked, it reported a state the flow no
        longer reads and then stopped training (TTPForceStop) once the grace ran out after the
        commit. Not while serving: the orders of a flow that ended in a committed recovery.
        A replacement gets its RegisterAck, then the recovery's commit or the exit order."""
        if self.sm.is_in(S.COLLECTING, S.SAVING, S.RENAMING):
            return self._phase_msgs
        return []

    def _backup_key(self, b: List[object]) -> Tuple[bool, int]:
        """The best standby candidates: other hosts first, then lowest rank."""
        return (b[1] == (self.address[0] if self.address else ""), int(b[0]))  # type: ignore

    def _consider_backup(self, rank: int, host: str, port: int) -> None:
        """A registration: one candidate against the two kept (O(1), at every start-up)."""
        cands = [b for b in self._backups if b[0] != rank] + [[rank, host, port]]
        self._backups = sorted(cands, key=self._backup_key)[:2]  # broadcast by the loop

    def _refresh_backups(self) -> None:
        """The two best backups among the live ranks, from scratch (O(N), once per recovery
        or promotion): after an in-memory recovery a lost rank's entry names a dead listener
        (its replacement listens on a new port, and registered while the list stood still),
        and a standby promoted on a failover learned no list while it stood by. Without this,
        losing the serving controller after a recovery found no backup alive: no verdict,
        nothing saved. The caller holds the condition."""
        cands = [[i.rank, i.host, i.standby_port] for i in self._ranks.values()
                 if i.status == "alive" and i.standby_port > 0 and i.rank != self.host_rank]
        self._backups = heapq.nsmallest(2, cands, key=self._backup_key)
        self._mail.wake()  # out within BACKUPS_COALESCE_S, not at the next tick

    def _send_alive(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        self._outbox.broadcast(msg, exclude)

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        self.store.close_all("gone: the controller stopped")  # nobody left to answer
        if self._listener is not None:
            self._listener.close()
        try:
            self._sel.close()
        except (OSError, RuntimeError):
            pass
        self._mail.close()


def _readable(sock: socket.socket) -> bool:
    """A listener with a connection waiting in the kernel's accept queue."""
    poll = select.poll()  # not select(): a listener's descriptor may be past FD_SETSIZE
    try:
        poll.register(sock, select.POLLIN)
        return bool(poll.poll(0))
    except (OSError, ValueError):
        return False


def _unread(sock: socket.socket) -> bool:
    """Whether the peer sent bytes this loop has not read yet."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing yet, or the peer is gone
        return False


def raise_fd_limit(need: int, who: str) -> None:
    """One socket per rank: lift this process's soft RLIMIT_NOFILE to what the job needs (up to
    the hard limit), and say what to do when the hard limit is too low. Only logged: a job
    whose ranks do not all connect still gets its dying checkpoint from those that did."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("%s: cannot raise the open-file limit to %d: %s", who, target, exc)
        target = soft
    if target < need:
        log.error("%s: serving all ranks needs %d open files, but the hard limit (`ulimit -Hn`) "
                  "is %d: raise it on this node (e.g. `ulimit -n %d` in the job script, or the "
                  "container's nofile limit), or ranks past the limit cannot register",
                  who, need, hard, need)


def listen_error(ip: str, port: int, exc: OSError, standby: bool) -> str:
    """What to do when a listener cannot bind: a busy controller port is the common case."""
    what = "standby controller" if standby else "controller"
    if exc.errno == errno.EADDRINUSE:
        return (f"TTP {what} cannot listen on {ip}:{port}: the port is in use (another program "
                f"or another job's controller holds it). Free the port, or give every rank "
                f"another free port in TTP_CONTROLLER_PORT")
    return (f"TTP {what} cannot listen on {ip}:{port}: {exc.strerror or exc} (is {ip} an "
            f"address of this host? the controller's rank must own MASTER_ADDR)")
