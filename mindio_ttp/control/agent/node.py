"""The node agent: one per node, between the node's ranks and the controller.

It listens on an AF_UNIX socket (in a 0700 directory; the peer's uid is checked with
SO_PEERCRED) and speaks the ranks' own protocol to them under the hop key: their heartbeats
are answered here, their deaths (EOF and the pid gone) and hangs (no heartbeat for
TTP_HEARTBEAT_TIMEOUT) are seen here, whatever the job's size. Up the tree it registers once
(`NodeRegister`), then sends per loop turn one frame of each kind: the ranks that joined, those
it lost, the state reports of a flow's phase, the ranks' other messages, and one heartbeat per
TTP_HEARTBEAT_INTERVAL. Down, it hands every envelope to the local ranks it names, unchanged:
it holds the hop key only, so it can neither make nor alter an order (docs/design.md).

When the controller sends other agents to it, it is also their relay (control/relay/role.py):
a TCP listener on the address it reaches the controller from. When it loses its own parent it
tells its ranks and children (`UpstreamLost`: ranks stop training until a controller decides)
and registers its whole subtree again: with the controller it was started with, then the
standby controllers announced (uplink.py).

One selector thread (`ttp-agent`) does all of it; connecting up runs in a short thread of its
own. Other threads hand work to the loop through a mailbox of callables.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindio_ttp.config import Deadlines
from mindio_ttp.control.agent import uplink
from mindio_ttp.control.agent.gate import Gate
from mindio_ttp.control.relay.role import RelayRole
from mindio_ttp.control.wire import envelope as E
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire import transport
from mindio_ttp.control.wire.liveness import LookingClock
from mindio_ttp.control.wire.session import ListenerHandshake
from mindio_ttp.control.wire.transport import Conn, ConnClosed, Mailbox, deliver

log = logging.getLogger("mindio_ttp.agent")

LOCAL_PENDING_CAP = 64  # local connections waiting for their handshake
CHILD_PENDING_CAP = 256  # node agents waiting for their handshake at a relay
PRE_AUTH_BUDGET = 8 * 1024 * 1024  # bytes of partial frames of all of them together
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# A killed process's sockets close before it becomes a zombie: after EOF, how long the agent
# waits for the pid to exit before it takes the rank for alive (it closed its socket itself)
EXIT_WAIT_S = 1.0


@dataclass
class AgentSettings:
    """What a node agent needs of the job's settings (config.TTPConfig has them all)."""
    world_size: int
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 6.0
    handshake_timeout: float = 10.0
    connect_timeout: float = 60.0
    ot: float = 120.0
    local_world: int = 0
    listen_ports: Optional[Tuple[int, int]] = None
    local_pending_cap: int = LOCAL_PENDING_CAP  # a node runs ≤ 16 ranks; tests simulate more


class LocalRank:
    __slots__ = ("conn", "rank", "pid", "payload", "joined", "goodbye", "step", "updating")

    def __init__(self, conn: Conn, reg: P.Register, pid: int) -> None:
        self.conn, self.rank, self.pid = conn, reg.rank, pid
        self.payload = P.encode_payload(reg)  # what goes up in a Join, as the rank sent it
        self.joined = False
        self.goodbye = False
        self.step, self.updating = reg.step, reg.updating


class Batch:
    """What goes up at the end of a loop turn: one frame of each kind (relay/role.py's Sink)."""

    def __init__(self) -> None:
        self.joins: List[T.Member] = []
        self.lefts: Dict[Tuple[str, str], List[int]] = {}
        self.reps: Dict[Tuple[int, int], List[Tuple[int, Optional[int], bool]]] = {}
        self.res: Dict[Tuple[int, int], List[Tuple[int, float]]] = {}
        self.ups: List[T.Up] = []

    def join(self, members: List[T.Member]) -> None:
        self.joins += members

    def results(self, flow_id: int, code: int, entries: List[Tuple[int, float]]) -> None:
        if entries:
            self.res.setdefault((flow_id, code), []).extend(entries)

    def left(self, kind: str, ranks: List[int], detail: str) -> None:
        self.lefts.setdefault((kind, detail[:200]), []).extend(ranks)

    def reports(self, flow_id: int, phase: int,
                entries: List[Tuple[int, Optional[int], bool]]) -> None:
        if entries:
            self.reps.setdefault((flow_id, phase), []).extend(entries)

    def up(self, msg: T.Up) -> None:
        self.ups.append(msg)

    def frames(self) -> List[P.Message]:
        out: List[P.Message] = []
        if self.joins:
            out.append(T.join(self.joins))
        for (kind, detail), ranks in self.lefts.items():
            out.append(T.Left(sorted(ranks), kind, detail))
        for (fid, phase), entries in self.reps.items():
            out.append(T.reports(fid, phase, entries))
        for (fid, code), done in self.res.items():
            out.append(T.results(fid, code, done))
        out += self.ups
        self.joins, self.lefts, self.reps, self.res, self.ups = [], {}, {}, {}, []
        return out

    def forget_flow(self) -> None:
        """A failover: reports of the lost controller's flow mean nothing to the next one."""
        self.reps, self.res = {}, {}


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has exited: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return False
    rest = data[data.rfind(")") + 1:].split()
    return bool(rest) and rest[0] not in ("Z", "X")


PF_EXITING = 0x4  # include/linux/sched.h: set as a task starts to exit, before its files close
SIGKILL_BIT = 1 << (9 - 1)


def pid_exiting(pid: int) -> bool:
    """Whether process `pid` is dying: exited, or its main thread has begun to exit or holds
    the SIGKILL that every thread of an exiting group is sent. A dying process's sockets close
    before its pidfd says it exited: a rank's EOF read with this true is its death at once, so
    that it reaches the controller before a neighbour's failed collective on the same loss
    (the order a controller reading every rank's socket itself would see)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return True  # gone, or reaped already
    rest = stat[stat.rfind(")") + 1:].split()
    if len(rest) < 7 or rest[0] in ("Z", "X") or int(rest[6]) & PF_EXITING:
        return True
    pending = next((line.split()[1] for line in status.splitlines()
                    if line.startswith("SigPnd:")), "0")
    return bool(int(pending, 16) & SIGKILL_BIT)


def socket_dir_ok(path: str) -> str:
    """'' when `path`'s directory is ours and private (0700), else what is wrong."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        st = os.stat(d)
    except OSError as exc:
        return f"{d}: {exc}"
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return f"{d} must be owned by uid {os.getuid()} with mode 0700"
    return ""


class NodeAgent:
    def __init__(self, hop_key: bytes, settings: AgentSettings, path: str,
                 name: str = "node agent") -> None:
        self.hop_key, self.s, self.path, self.name = hop_key, settings, path, name
        self.ranks: Dict[int, LocalRank] = {}
        self.upstream: Optional[uplink.Target] = None  # the controller the ranks named
        self.backups: List[List[Any]] = []
        self.parent: Optional[Conn] = None
        self.parent_target: Optional[uplink.Target] = None
        self.incarnation = ""
        self.closing = False  # the controller said Closing, or sent exit orders
        self.exit_seen = False
        self.lost_at: Optional[float] = None  # when the parent was lost (failing over)
        self.failovers = 0
        self.relay = RelayRole(Batch())
        self.batch: Batch = self.relay.sink  # type: ignore[assignment]
        self._local_gate = Gate(settings.local_pending_cap, PRE_AUTH_BUDGET,
                                settings.handshake_timeout)
        self._child_gate = Gate(CHILD_PENDING_CAP, PRE_AUTH_BUDGET, settings.handshake_timeout)
        self._sel = selectors.DefaultSelector()
        self._mail = Mailbox()
        self._clock = LookingClock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._listener: Optional[socket.socket] = None
        self._relay_listener: Optional[socket.socket] = None
        self.relay_address: Optional[Tuple[str, int]] = None
        self._linking = False
        self._seq = 0
        self._progress = 0
        self._next_beat = 0.0
        self._up_interval = settings.heartbeat_interval  # the parent's, once it said
        self.started_at = time.monotonic()
        self.last_member_at: Optional[float] = None  # a rank or child last left / was here
        self._exiting: Dict[int, Tuple[LocalRank, float, Optional[int]]] = {}  # EOF, pid runs

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> str:
        bad = socket_dir_ok(self.path)
        if bad:
            raise OSError(f"{self.name}: refusing to listen on {self.path}: {bad}")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(max(256, self.s.local_pending_cap))
        sock.setblocking(False)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, "local")
        self._sel.register(self._mail.reader, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="ttp-agent", daemon=True)
        self._thread.start()
        return self.path

    def stop(self) -> None:
        self._stop.set()
        self._mail.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop thread (any thread may call this)."""
        self._mail.put(fn, *args)

    def use_controller(self, host: str, port: int) -> None:
        """Register with the controller at host:port now, before any rank names it (a relay
        host of the bench; any thread)."""
        self.call(self._on_upstream, T.Upstream(host, port, 0))

    @property
    def members(self) -> int:
        return len(self.ranks) + len(self.relay.children.route)

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - say it; the ranks fall back to the controller
            log.exception("%s: the loop failed; closing (its ranks fall back to the controller)",
                          self.name)
        finally:
            self._close_all()

    def _loop(self) -> None:
        self._clock = LookingClock()
        tick = Deadlines(self.s).agent_tick
        next_check = time.monotonic() + tick
        while not self._stop.is_set():
            now = time.monotonic()
            # a hang is seen TTP_HEARTBEAT_TIMEOUT after the rank's last frame, not a tick later
            next_check = min(next_check, self._silence_due(now))
            wake = min(next_check, self._next_beat if self.parent is not None else next_check)
            for key, mask in self._sel.select(self._clock.waiting(max(0.0, wake - now))):
                self._guarded(key.data, mask)
            self._clock.tick()
            now = time.monotonic()
            if self.parent is not None and now >= self._next_beat:
                self._beat()
            if now >= next_check:
                self._check()
                next_check = now + tick
            self._send_up()

    def _guarded(self, data: Any, mask: int) -> None:
        try:
            if data == "wake":
                self._mail.run_all()
            elif data == "local":
                self._accept(self._listener, local=True)
            elif data == "relay":
                self._accept(self._relay_listener, local=False)
            elif isinstance(data, tuple) and data[0] == "pid":
                self._exited(data[1], "its process exited")
            elif isinstance(data, Conn):
                if mask & selectors.EVENT_WRITE:
                    self._flush(data)
                if mask & selectors.EVENT_READ and not data.closed:
                    self._readable(data)
        except Exception:  # noqa: BLE001 - one peer's bad luck must not stop the agent
            log.exception("%s: error while serving %s", self.name,
                          getattr(data, "peer", data))
            if isinstance(data, Conn):
                self._drop(data, "error while serving it")

    # -- accepting -------------------------------------------------------------------------------
    def _accept(self, listener: Optional[socket.socket], local: bool) -> None:
        gate = self._local_gate if local else self._child_gate
        for _ in range(64):
            try:
                sock, addr = listener.accept()  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("%s: accept failed: %s", self.name, exc)
                return
            if gate.full():
                gate.refused += 1
                sock.close()
                continue
            pid = 0
            if local:
                pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
                if uid != os.getuid():
                    log.warning("%s: refused a local connection of uid %d", self.name, uid)
                    sock.close()
                    continue
                hs = ListenerHandshake(self.hop_key, P.pre_auth_max_payload(self.s.world_size),
                                       {P.Register: self.hop_key}, T.CODEC)
                peer = f"pid {pid}"
            else:
                hs = ListenerHandshake(self.hop_key, 4096, {T.NodeRegister: self.hop_key},
                                       T.CODEC)
                peer = f"{addr[0]}:{addr[1]}"
            conn = Conn(sock, hs.tx, hs.dec, peer, clock=self._clock.now)
            conn.handshake, conn.data = hs, pid
            gate.admit(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.queue_raw(hs.challenge())
            self._flush(conn)

    # -- reading ---------------------------------------------------------------------------------
    def _readable(self, conn: Conn) -> None:
        try:
            if conn in self._local_gate.pending:
                msgs = self._local_gate.read(conn)
            elif conn in self._child_gate.pending:
                msgs = self._child_gate.read(conn)
            else:
                msgs = conn.read()
            deliver(conn, msgs, self._dispatch)
            ack = T.ack_due(conn)
            if ack is not None:
                conn.queue(ack)
                self._flush(conn)
        except ConnClosed as exc:
            self._drop(conn, str(exc))
        except P.ProtocolError as exc:
            log.warning("%s: bad frame from %s: %s; closing it", self.name, conn.peer, exc)
            self._drop(conn, f"bad frame: {exc}")

    def _dispatch(self, conn: Conn, m: P.Message) -> None:
        if conn is self.parent:
            return self._from_parent(m)
        if conn.child is not None:
            return self.relay.on_message(conn.child, m)
        if isinstance(m, P.Register) and conn in self._local_gate.pending:
            return self._on_rank_register(conn, m)
        if isinstance(m, T.NodeRegister) and conn in self._child_gate.pending:
            return self._on_child_register(conn, m)
        local = self.ranks.get(conn.rank) if conn.rank is not None else None
        if local is None or local.conn is not conn:
            raise P.ProtocolError(f"{type(m).__name__} before registering")
        if isinstance(m, P.Heartbeat):
            conn.ack_due = m.seq
            if (m.step, m.updating) != (local.step, local.updating):
                local.step, local.updating = m.step, m.updating
                self._progress += 1
        elif isinstance(m, P.StateReport):
            if m.rank != local.rank:
                raise P.ProtocolError(f"rank {local.rank} reports for rank {m.rank}")
            self.batch.reports(m.flow_id, m.phase, [(m.rank, m.step, m.updating)])
        elif isinstance(m, T.Upstream):
            self._on_upstream(m)
        elif isinstance(m, T.UP_TYPES):
            # a ReplaceStatus names the lost rank it relays for (the sender travels in `Up`,
            # and the controller takes it only from the relay its plan chose)
            if (not isinstance(m, P.ReplaceStatus)
                    and getattr(m, "rank", local.rank) != local.rank):
                raise P.ProtocolError(f"rank {local.rank} sends for rank {m.rank}")
            if isinstance(m, P.Goodbye):
                local.goodbye = True
            if isinstance(m, (P.SaveResult, P.RenameResult)) and m.ok and not m.error:
                self.batch.results(m.flow_id, m.TYPE, [(m.rank, m.seconds)])
            else:
                self.batch.up(T.up(local.rank, m))
        else:
            raise P.ProtocolError(f"a rank does not send {type(m).__name__} to its agent")

    def _on_rank_register(self, conn: Conn, reg: P.Register) -> None:
        conn.handshake.accept(reg)
        self._local_gate.done(conn)
        conn.dec.authenticated()
        if reg.world_size != self.s.world_size:
            return self._refuse(conn, f"world_size {reg.world_size}, this node agent's job has "
                                f"{self.s.world_size}")
        old = self.ranks.get(reg.rank)
        if old is not None and not old.conn.closed:
            return self._refuse(conn, f"rank {reg.rank} is already connected to this agent")
        conn.rank = reg.rank
        self.ranks[reg.rank] = LocalRank(conn, reg, int(conn.data or 0))
        self.last_member_at = time.monotonic()
        conn.queue(P.RegisterAck("agent", 0, [], ""))
        self._flush(conn)

    def _on_child_register(self, conn: Conn, reg: T.NodeRegister) -> None:
        conn.handshake.accept(reg)
        self._child_gate.done(conn)
        conn.dec.authenticated()
        if reg.world_size != self.s.world_size:
            return self._refuse(conn, f"node agent of world_size {reg.world_size}")
        self.relay.accept(conn, reg)
        self.last_member_at = time.monotonic()
        conn.queue(T.NodeAck("relay", 0, list(self.backups), "", self.incarnation or "0" * 32,
                             self.s.heartbeat_interval))
        self._flush(conn)
        log.info("%s: serving node agent %s as its relay (%d agent(s) below)", self.name,
                 conn.peer, len(self.relay.children))

    def _refuse(self, conn: Conn, why: str) -> None:
        log.warning("%s: refusing %s: %s", self.name, conn.peer, why)
        conn.queue(P.Reject(why[:P.MAX_TEXT]))
        self._flush(conn)
        self._drop(conn, why, report=False)

    def _on_upstream(self, m: T.Upstream) -> None:
        if m.local_world and not self.s.local_world:
            self.s.local_world = m.local_world
        if self.upstream is None:
            self.upstream = uplink.Target(m.host, m.port, "controller")
            self._link(failover=False)

    # -- up ----------------------------------------------------------------------------------------
    def _link(self, failover: bool) -> None:
        """Start connecting up (a thread); its result comes back through the mailbox."""
        if self._linking or self.upstream is None or self._stop.is_set():
            return
        self._linking = True
        standbys = uplink.targets(self.backups)
        # the controller lost (or never reached): the standbys are targets as good as it; a
        # relay lost: the controller lives, the standbys only if it cannot be reached at all
        lost_relay = self.parent_target is not None and self.parent_target.kind == "relay"
        targets = [self.upstream] + ([] if lost_relay else standbys)
        fallback = standbys if lost_relay else None
        deadline = time.monotonic() + (self.s.ot if failover else self.s.connect_timeout)
        children = len(self.relay.children)
        per_try = Deadlines(self.s).failover_try

        def register(local_ip: str, redirected: bool) -> T.NodeRegister:
            port = self._relay_port(local_ip)
            return T.NodeRegister(local_ip, port, os.getpid(), self.s.local_world, children,
                                  self.s.world_size, failover, redirected)

        def run() -> None:
            linked, tried = uplink.link(targets, self.hop_key, register, per_try,
                                        self.s.handshake_timeout, deadline, self._stop,
                                        fallback=fallback)
            self.call(self._linked, linked, tried, failover)
        threading.Thread(target=run, name="ttp-agent-uplink", daemon=True).start()

    def _relay_port(self, local_ip: str) -> int:
        """Open the relay listener on the address this node reaches the controller from (in
        the uplink thread: the loop registers it with its selector)."""
        if self._relay_listener is None:
            sock = socket.socket(socket.AF_INET6 if ":" in local_ip else socket.AF_INET,
                                 socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ports = self.s.listen_ports
            candidates = [0] if ports is None else list(range(ports[0], ports[1] + 1))
            for p in candidates:
                try:
                    sock.bind((local_ip, p))
                    break
                except OSError:
                    continue
            else:
                sock.close()
                return 0  # no port: this agent serves no children
            sock.listen(CHILD_PENDING_CAP)
            sock.setblocking(False)
            self._relay_listener = sock
            self.relay_address = sock.getsockname()[:2]
            self.call(self._sel.register, sock, selectors.EVENT_READ, "relay")
        return self.relay_address[1] if self.relay_address else 0

    def _linked(self, linked: Optional[uplink.Linked], tried: List[str], failover: bool) -> None:
        self._linking = False
        if self._stop.is_set():
            if linked is not None:
                linked.sock.close()
            return
        if linked is None:
            log.error("%s: no controller took this node (%s); its ranks fall back to the "
                      "controller themselves", self.name, "; ".join(tried[-4:]) or "no target")
            self._give_up("no controller reachable from the node agent")
            return
        ack = linked.ack
        conn = Conn(linked.sock, linked.hs.tx, linked.hs.dec, f"{linked.target.kind} at "
                    f"{linked.target.host}:{linked.target.port}", clock=self._clock.now)
        self.parent, self.parent_target = conn, linked.target
        self.incarnation = ack.incarnation
        self._up_interval = min(ack.interval or self.s.heartbeat_interval,
                                self.s.heartbeat_interval)
        if ack.backups:
            self.backups = ack.backups
        self.lost_at = None
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)
        self._next_beat = time.monotonic()
        # everyone below registers (again): local ranks and the relay's children's ranks
        members = [(lr.rank, lr.payload) for lr in self.ranks.values()]
        members += list(self.relay.payloads.items())
        for lr in self.ranks.values():
            lr.joined = True
        self.batch.joins = members
        (log.warning if failover else log.info)(
            "%s: registered with the %s (%s)%s", self.name, linked.target.kind, conn.peer,
            f" after {len(linked.tried)} failed attempt(s)" if linked.tried else "")
        for m in linked.early:
            self._from_parent(m)

    def _give_up(self, why: str) -> None:
        """No way up: close every rank's connection, so each falls back to the controller
        itself (processor.py), and every child's, so it registers on its own."""
        for lr in list(self.ranks.values()):
            self._drop(lr.conn, why, report=False)
        for child in list(self.relay.children):
            self._drop(child.conn, why, report=False)

    def _beat(self) -> None:
        self._seq += 1
        alive = len(self.ranks) + self.relay.alive()
        self._to_parent(T.TierBeat(self._seq, self._progress + self.relay.progress(), alive))
        self._next_beat = time.monotonic() + self._up_interval

    def _send_up(self) -> None:
        if self.parent is None:
            return
        for lr in self.ranks.values():  # ranks that registered since the last turn
            if not lr.joined and not lr.conn.closed:
                lr.joined = True
                self.batch.joins.append((lr.rank, lr.payload))
        frames = self.batch.frames()
        for f in frames:
            self._to_parent(f)

    def _to_parent(self, m: P.Message) -> None:
        if self.parent is not None and not self.parent.closed:
            self.parent.queue(m)
            self._flush(self.parent)

    # -- down --------------------------------------------------------------------------------------
    def _from_parent(self, m: P.Message) -> None:
        if isinstance(m, T.TierAck):
            return
        if isinstance(m, T.Sealed):
            self._deliver(m.data)
        elif isinstance(m, T.Refused):
            lr = self.ranks.get(m.rank)
            if lr is not None:
                lr.joined = False
                lr.conn.queue(P.Reject(m.reason))
                self._flush(lr.conn)
                self._drop(lr.conn, "refused by the controller", report=False)
            else:
                conn = self.relay.refused(m)
                if conn is not None:
                    self._flush(conn)
        elif isinstance(m, T.UpstreamLost):
            self._tell_down(m)
        else:
            raise P.ProtocolError(f"a parent does not send {type(m).__name__}")

    def _deliver(self, blob: bytes) -> None:
        env = E.peek(blob)  # routing needs no key; the ranks verify
        self._note(env)
        for lr in list(self.ranks.values()):
            if not lr.conn.closed and env.reaches(lr.rank):
                lr.conn.queue_payload(T.Sealed.TYPE, blob)
                self._flush(lr.conn)
        for conn in self.relay.forward(blob, env.dst):
            self._flush(conn)

    def _note(self, env: E.Envelope) -> None:
        """What an agent reads of what it forwards (it cannot check it; a lie only changes its
        own failover targets, or when it stops)."""
        try:
            if env.code == P.Backups.TYPE:
                backups = P.decode_payload(env.code, env.payload).backups  # type: ignore
                if backups != self.backups:  # a few times a job: at start, after a recovery
                    log.info("%s: standby controllers to fail over to: rank(s) %s", self.name,
                             [b[0] for b in backups])
                self.backups = backups
            elif env.code == P.Closing.TYPE:
                self.closing = True
            elif env.code == P.ExitOrder.TYPE:
                self.exit_seen = True
        except P.ProtocolError:
            pass

    def _tell_down(self, m: T.UpstreamLost) -> None:
        # copies: a flush that finds a connection closed drops it from these very collections
        # (a rank killed in the same instant: "dictionary changed size during iteration" ended
        # the agent's thread, and its ranks' routes with it)
        for lr in list(self.ranks.values()):
            if not lr.conn.closed:
                lr.conn.queue(m)
                self._flush(lr.conn)
        for child in list(self.relay.children):
            child.conn.queue(m)
            self._flush(child.conn)

    # -- losing peers ------------------------------------------------------------------------------
    def _drop(self, conn: Conn, why: str, report: bool = True) -> None:
        if conn.closed:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.close()
        self._local_gate.done(conn)
        self._child_gate.done(conn)
        if conn is self.parent:
            self.parent = None
            self._parent_lost(why)
        elif conn.child is not None:
            self.relay.lost(conn.child, why)
            conn.child = None
            self.last_member_at = time.monotonic()
        elif conn.rank is not None:
            lr = self.ranks.get(conn.rank)
            if lr is None or lr.conn is not conn:
                return
            del self.ranks[conn.rank]
            self.last_member_at = time.monotonic()
            if not report or not lr.joined:
                return
            if why.startswith("hung"):
                self.batch.left("hung", [lr.rank], why)
            elif lr.goodbye:
                self.batch.left("gone", [lr.rank], "finished training")
            else:
                self._watch_exit(lr, why)

    def _watch_exit(self, lr: LocalRank, why: str) -> None:
        """EOF from a rank: dead once its pid has exited (a pidfd says so at once), alive and
        gone elsewhere if it has not within EXIT_WAIT_S."""
        if lr.pid and pid_exiting(lr.pid):
            self.batch.left("dead", [lr.rank], f"process {lr.pid} exited ({why})")
            return
        fd: Optional[int] = None
        try:
            fd = os.pidfd_open(lr.pid) if lr.pid else None
        except (OSError, AttributeError):  # exited and reaped already, or no pidfd here
            fd = None
        if fd is None and not (lr.pid and pid_alive(lr.pid)):
            self.batch.left("dead", [lr.rank], f"process {lr.pid} exited ({why})")
            return
        if fd is not None:
            self._sel.register(fd, selectors.EVENT_READ, ("pid", lr.rank))
        self._exiting[lr.rank] = (lr, time.monotonic() + EXIT_WAIT_S, fd)

    def _exited(self, rank: int, how: str) -> None:
        lr, _, fd = self._exiting.pop(rank, (None, 0.0, None))
        if fd is not None:
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)
        if lr is not None:
            if how == "alive":
                self.batch.left("moved", [rank], "closed its connection and runs on")
            else:
                self.batch.left("dead", [rank], f"process {lr.pid} exited (connection closed)")

    def _parent_lost(self, why: str) -> None:
        if self.closing or self.exit_seen or self._stop.is_set():
            log.info("%s: parent closed after the job's end (%s)", self.name, why)
            return
        if not self.members or all(lr.goodbye for lr in self.ranks.values()) and \
                not self.relay.children:
            log.info("%s: parent closed (%s); no rank here to fail over for", self.name, why)
            return
        self.failovers += 1
        self.lost_at = time.monotonic()
        self.batch.forget_flow()
        log.error("%s: lost its parent %s (%s); its ranks lock, and it registers them with the "
                  "controller or a standby", self.name,
                  self.parent_target.host if self.parent_target else "?", why)
        self._tell_down(T.UpstreamLost(f"node agent lost its parent: {why}"[:500]))
        for lr in list(self.ranks.values()):
            lr.joined = False
        self._link(failover=True)

    def _silence_due(self, now: float) -> float:
        """When the first local rank's silence reaches the timeout (monotonic time)."""
        if not self.ranks:
            return now + 3600.0
        oldest = min(lr.conn.last_rx for lr in self.ranks.values())
        return now + max(0.0, oldest + self.s.heartbeat_timeout - self._clock.now()) + 0.005

    def _check(self) -> None:
        now = time.monotonic()
        for rank, (lr, until, _) in list(self._exiting.items()):
            if now > until:
                self._exited(rank, "alive" if pid_alive(lr.pid) else "its process exited")
        seen = self._clock.now()
        limit = self.s.heartbeat_timeout
        for lr in list(self.ranks.values()):
            if seen - lr.conn.last_rx > limit:
                self._drop(lr.conn, f"hung (no heartbeat for {seen - lr.conn.last_rx:.1f} s)")
        for child in list(self.relay.children):
            if seen - child.conn.last_rx > limit:
                self._drop(child.conn, "silent")
        if self.parent is not None and seen - self.parent.last_rx > limit:
            kind = self.parent_target.kind if self.parent_target else "parent"
            self._drop(self.parent, f"{kind} silent for {seen - self.parent.last_rx:.1f} s")
        for gate in (self._local_gate, self._child_gate):
            for conn, _ in gate.expired():
                self._drop(conn, "no handshake in time", report=False)

    # -- plumbing ----------------------------------------------------------------------------------
    def _flush(self, conn: Conn) -> None:
        transport.flush(conn, self._sel, self._drop)

    def _close_all(self) -> None:
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, Conn):
                key.data.close()
        for sock in (self._listener, self._relay_listener):
            if sock is not None:
                sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self._sel.close()
        self._mail.close()

    def status(self) -> Dict[str, Any]:
        return {"ranks": sorted(self.ranks), "children": len(self.relay.children),
                "routed": len(self.relay.children.route), "parent": getattr(
                    self.parent, "peer", None), "failovers": self.failovers,
                "relay": self.relay_address}


