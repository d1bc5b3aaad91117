"""Thousands of simulated processors in a few processes, for the scale test and bench.

Each simulated rank speaks the real protocol over a real TCP connection: the listener's
challenge, a Register under the job key, per-connection session keys and sequence numbers
(session.py), heartbeats every TTP_HEARTBEAT_INTERVAL, the flow's answers (state reports,
save/rename results), and on losing the controller a failover to the announced backups in
order, like processor.py. What it does not have is training: every rank finished `step` and
is not updating. One process serves a few thousand ranks from one selector loop, so 16,384
ranks cost a handful of processes, not 16,384 threads.

Everything a rank received after registering is recorded (which order, when, what it said), so
a test can check that every rank got exactly the orders it should, and a bench can time the
last rank to get each. Bytes sent and received are counted per rank from `mark()` on.

A `SimGroup` runs the processes (forked from a clean server: testkit/forking.py) and talks to each
over a pipe; `SimGroup.close` ends them all, also when a test fails. A process keeps at most
`INFLIGHT` of its ranks between connect and registered: a real rank answers its challenge from its
own CPU at once, a few thousand simulated ones share one, and answered all at once they would
answer late (past the listener's handshake timeout) and fail, which real ranks would not.
Connections come from loopback source addresses (127.0.0.2, .3, ...; IP_BIND_ADDRESS_NO_PORT),
`RANKS_PER_SOURCE` from each, as from nodes: a listener admits at most 64 waiting connections from
one address (control/wire/admission.py), and one source has ~28,000 ephemeral ports towards one
listener. """

from __future__ import annotations

import collections
import errno
import os
import random
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from mindio_ttp.control.wire import envelope as E
from mindio_ttp.control.wire import keys as K
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.session import RankHandshake
from testkit.forking import Helper, answer, clean_context, helper_setup

IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h
INFLIGHT = 256
RANKS_PER_SOURCE = 32  # a node's worth: under admission.PER_SOURCE_PENDING (64)
ORDERS = (P.Lock, P.AdvanceTo, P.SaveOrder, P.RenameOrder, P.ExitOrder)


@dataclass
class Order:
    """One order a simulated rank received: its type, when, and what it said."""
    kind: str
    at: float
    flow_id: int
    step: Optional[int] = None
    ranks: Tuple[int, ...] = ()  # save_ranks of a SaveOrder, ranks of an ExitOrder
    outcome: str = ""


@dataclass
class RankRecord:
    rank: int
    registered_at: Optional[float] = None
    failed_over_at: Optional[float] = None  # registered with a backup
    orders: List[Order] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    aborted_at: Optional[float] = None


class _Rank:
    __slots__ = ("rank", "dp", "sock", "hs", "tx", "dec", "rec", "live", "out", "failover",
                 "backup_idx", "done", "source", "writing", "gen", "attempts", "paced", "agent",
                 "inbox", "via_agent")

    def __init__(self, rank: int, dp: List[int], source: str) -> None:
        self.rank, self.dp, self.source = rank, dp, source
        self.sock: Optional[socket.socket] = None
        self.hs: Optional[RankHandshake] = None
        self.tx: Any = None
        self.dec: Any = None
        self.rec = RankRecord(rank)
        self.live = False  # registered and serving
        self.out = bytearray()
        self.failover = False
        self.backup_idx = 0
        self.done = False  # got its exit order, or aborted
        self.writing = False  # registered for EVENT_WRITE
        self.gen = 0  # registrations so far: a heartbeat slot of an older one is dropped
        self.attempts = 0  # failover connection attempts
        self.paced = False  # counted in the worker's in-flight connects
        self.agent: Optional[str] = None  # its node agent's socket (None: direct)
        self.inbox: Any = None  # envelopes it accepts (through its agent)
        self.via_agent = False


class SimWorker:
    """The loop of one simulated-ranks process (runs in the child)."""

    def __init__(self, ranks: Sequence[int], world: int, dp_of: Callable[[int], List[int]],
                 replica: int, key: bytes, interval: float, step: int, sources: List[str],
                 conn: Any, agents: Optional[Dict[int, str]] = None) -> None:
        self.world, self.replica, self.key = world, replica, key
        self.interval, self.step = interval, step
        self.ranks = {r: _Rank(r, dp_of(r), sources[i % len(sources)])
                      for i, r in enumerate(ranks)}
        self.pipe = conn
        self.sel = selectors.DefaultSelector()
        self.target: Optional[Tuple[str, int]] = None
        self.backups: List[List[Any]] = []
        self.wheel: Deque[Tuple[float, _Rank, int]] = collections.deque()
        self.retry: Deque[Tuple[float, _Rank]] = collections.deque()
        self.counting = False
        self.fd_of: Dict[int, _Rank] = {}
        self.queued: Deque[_Rank] = collections.deque()  # to connect, at most INFLIGHT at once
        self.inflight = 0
        self.hop_key, self.order_key = K.hop_key(key), K.order_key(key)
        for r, path in (agents or {}).items():
            if r in self.ranks:
                self.ranks[r].agent = path

    # -- connections ------------------------------------------------------------------------
    def _connect(self, r: _Rank, addr: Tuple[str, int]) -> None:
        if r.agent is not None and not r.failover:
            return self._connect_agent(r)
        r.via_agent = False
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((r.source, 0))
        except OSError:
            pass  # an address we cannot use: the kernel picks 127.0.0.1
        s.setblocking(False)
        err = s.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            self._lost(r, f"connect: {os.strerror(err)}")
            return
        r.sock, r.hs = s, RankHandshake(self.key)
        r.tx, r.dec, r.live, r.out, r.writing = r.hs.tx, r.hs.dec, False, bytearray(), False
        self.fd_of[s.fileno()] = r
        self.sel.register(s, selectors.EVENT_READ, r)

    def _connect_agent(self, r: _Rank) -> None:
        """Through its node agent (AF_UNIX, the hop key), as a processor does by default."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex(r.agent)  # type: ignore[arg-type]
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            s.close()
            self._lost(r, f"connect: {os.strerror(err)}")
            return
        r.sock, r.hs, r.via_agent = s, RankHandshake(self.hop_key, registry=T.CODEC), True
        if r.inbox is None:
            r.inbox = E.Inbox(self.order_key, r.rank, T.CODEC)
        r.tx, r.dec, r.live, r.out, r.writing = r.hs.tx, r.hs.dec, False, bytearray(), False
        self.fd_of[s.fileno()] = r
        self.sel.register(s, selectors.EVENT_READ, r)

    def _close(self, r: _Rank, rst: bool = False) -> None:
        if r.sock is None:
            return
        self.fd_of.pop(r.sock.fileno(), None)
        try:
            self.sel.unregister(r.sock)
        except (KeyError, ValueError):
            pass
        if rst:  # SO_LINGER 0: the peer sees a reset, like a killed process's socket
            r.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        r.sock.close()
        r.sock, r.live = None, False

    def _lost(self, r: _Rank, why: str) -> None:
        """The controller went away: fail over to the backups in order, as processors do
        (a round over all of them, then 0.2 s, then the next round)."""
        was_agent = r.via_agent and r.sock is not None
        self._close(r)
        self._unpace(r)
        if was_agent and not r.done and self.target is not None:
            # its node agent is gone: the controller itself, as processor.py does
            r.failover, r.via_agent, r.backup_idx = True, False, 0
            self._connect(r, self.target)
            return
        if r.done or not self.backups or r.attempts >= 200:
            r.done = True
            return
        r.failover = True
        r.attempts += 1
        if r.backup_idx >= len(self.backups):
            r.backup_idx = 0
            self.retry.append((time.monotonic() + 0.2, r))
            return
        _, host, port = self.backups[r.backup_idx]
        r.backup_idx += 1
        self._connect(r, (host, port))

    def _send(self, r: _Rank, msg: P.Message) -> None:
        if r.sock is None:
            return
        data = r.tx.seal(msg)
        if self.counting:
            r.rec.bytes_out += len(data)
        r.out += data
        self._flush(r)

    def _flush(self, r: _Rank) -> None:
        try:
            while r.out:
                n = r.sock.send(r.out)  # type: ignore[union-attr]
                del r.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._lost(r, str(exc))
            return
        if r.sock is not None and r.writing != bool(r.out):
            r.writing = bool(r.out)
            self.sel.modify(r.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if r.out else 0),
                            r)

    # -- frames -----------------------------------------------------------------------------
    def _readable(self, r: _Rank) -> None:
        try:
            data = r.sock.recv(65536)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(r, str(exc))
        if not data:
            return self._lost(r, "closed")
        if self.counting:
            r.rec.bytes_in += len(data)
        try:
            msgs = r.dec.feed(data)
            while msgs:
                for m in msgs:
                    self._handle(r, m)
                    if r.sock is None:
                        return
                msgs = r.dec.feed(b"") if r.dec.pending else []
        except P.ProtocolError as exc:
            r.rec.orders.append(Order("ProtocolError", time.monotonic(), -1, outcome=str(exc)))
            self._close(r)
            r.done = True

    def _handle(self, r: _Rank, m: P.Message) -> None:
        now = time.monotonic()
        if isinstance(m, P.Challenge):
            reg = P.Register(r.rank, self.world, r.dp, self.replica, r.source, 0, os.getpid(),
                             self.step, False, r.failover, r.failover)
            data = r.hs.answer(m, reg)  # type: ignore[union-attr]
            if r.via_agent:
                r.inbox.nonces.add(r.hs.nonce)
                host, port = self.target  # type: ignore[misc]
                data += r.hs.tx.seal(T.Upstream(host, port, 0))
            r.out += data
            self._flush(r)
            return
        if r.via_agent:
            if isinstance(m, P.RegisterAck):  # the agent took it; the controller's Welcome comes
                r.live = True
                self._unpace(r)
                r.gen += 1
                self.wheel.append((now + random.random() * self.interval, r, r.gen))
                return
            if isinstance(m, T.UpstreamLost):
                r.rec.orders.append(Order("UpstreamLost", now, -1, outcome=m.reason))
                return
            if isinstance(m, T.Sealed):
                status, inner, why = r.inbox.open(m.data)
                if status == E.REFUSED:
                    r.rec.orders.append(Order("RefusedEnvelope", now, -1, outcome=why))
                    return
                if isinstance(inner, T.Welcome):
                    if r.rec.registered_at is None:
                        r.rec.registered_at = now
                    if inner.backups:
                        self.backups = inner.backups
                    return
                if status == E.DUPLICATE and not isinstance(inner, (P.Lock, P.AdvanceTo)):
                    return
                m = inner  # type: ignore[assignment]
            elif not isinstance(m, (P.HeartbeatAck, P.Reject)):
                r.rec.orders.append(Order("PlainFromAgent", now, -1,
                                          outcome=type(m).__name__))
                return
        if isinstance(m, P.RegisterAck):
            r.live = True
            self._unpace(r)
            if r.failover:
                r.rec.failed_over_at = now
            else:
                r.rec.registered_at = now
            if m.backups:
                self.backups = m.backups
            r.gen += 1
            r.attempts = 0
            self.wheel.append((now + random.random() * self.interval, r, r.gen))
            return
        if isinstance(m, P.Reject):
            self._unpace(r)
            r.rec.orders.append(Order("Reject", now, -1, outcome=m.reason))
            self._close(r)
            r.done = True
            return
        if isinstance(m, P.Backups):
            self.backups = m.backups
            return
        if isinstance(m, (P.HeartbeatAck, P.Closing)):
            return
        if isinstance(m, ORDERS):
            ranks = getattr(m, "save_ranks", None) or getattr(m, "ranks", None) or ()
            r.rec.orders.append(Order(type(m).__name__, now, m.flow_id, getattr(m, "step", None),
                                      tuple(ranks), getattr(m, "outcome", "")))
        if isinstance(m, P.Lock):
            self._send(r, P.StateReport(m.flow_id, 1, r.rank, self.step, False))
        elif isinstance(m, P.AdvanceTo):
            self._send(r, P.StateReport(m.flow_id, 2, r.rank, self.step, False))
        elif isinstance(m, P.SaveOrder):
            ok = m.step == self.step and r.rank in m.save_ranks
            self._send(r, P.SaveResult(m.flow_id, r.rank, ok, "" if ok else "wrong order", 0.0))
        elif isinstance(m, P.RenameOrder):
            self._send(r, P.RenameResult(m.flow_id, r.rank, True, "", 0.0))
        elif isinstance(m, P.ExitOrder):
            r.done = True
            self._close(r)

    # -- the loop ---------------------------------------------------------------------------
    def _start_queued(self) -> None:
        while self.queued and self.inflight < INFLIGHT:
            r = self.queued.popleft()
            self.inflight += 1
            r.paced = True
            self._connect(r, self.target)  # type: ignore[arg-type]

    def _unpace(self, r: _Rank) -> None:
        if r.paced:
            r.paced = False
            self.inflight -= 1
            self._start_queued()

    def _beat(self, now: float) -> None:
        wheel = self.wheel
        while wheel and wheel[0][0] <= now:
            _, r, gen = wheel.popleft()
            if not r.live or r.sock is None or gen != r.gen:
                continue
            self._send(r, P.Heartbeat(r.rank, 0, self.step, False))
            wheel.append((now + self.interval, r, gen))
        while self.retry and self.retry[0][0] <= now:
            _, r = self.retry.popleft()
            if not r.done and r.sock is None:
                self._lost(r, "retry")

    def _command(self, cmd: str, arg: Any) -> Any:
        if cmd == "connect":
            self.target = tuple(arg)
            self.queued.extend(self.ranks.values())
            self._start_queued()
            return len(self.ranks)
        if cmd == "registered":
            return sum(1 for r in self.ranks.values()  # through an agent: once welcomed
                       if (r.live and not r.via_agent) or r.rec.registered_at is not None)
        if cmd == "mark":  # count bytes from now on
            self.counting = True
            for r in self.ranks.values():
                r.rec.bytes_in = r.rec.bytes_out = 0
            return True
        if cmd == "abort":
            r = self.ranks[arg]
            r.rec.aborted_at = time.monotonic()
            r.done = True
            self._close(r, rst=True)
            return r.rec.aborted_at
        if cmd == "report":
            return [r.rec for r in self.ranks.values()]
        if cmd == "backups":
            return self.backups
        if cmd == "reset":  # forget everything: a fresh job on the same ranks
            for r in self.ranks.values():
                self._close(r)
                r.rec, r.done, r.failover, r.backup_idx = RankRecord(r.rank), False, False, 0
            self.backups, self.counting = [], False
            self.wheel.clear()
            self.retry.clear()
            self.queued.clear()
            self.inflight = 0
            for r in self.ranks.values():
                r.paced = False
            return True
        raise ValueError(f"unknown command {cmd!r}")

    def run(self) -> None:
        self.sel.register(self.pipe, selectors.EVENT_READ, "pipe")
        while True:
            timeout = max(0.0, min(0.05, self.wheel[0][0] - time.monotonic())) \
                if self.wheel else 0.05
            for i, (key, mask) in enumerate(self.sel.select(timeout)):
                if i % 128 == 127:  # a long batch must not make this process's ranks late
                    self._beat(time.monotonic())
                if key.data == "pipe":
                    if not answer(self.pipe, self._command):
                        return
                    continue
                r: _Rank = key.data
                if r.sock is None:
                    continue
                if mask & selectors.EVENT_WRITE:
                    self._flush(r)
                if mask & selectors.EVENT_READ and r.sock is not None:
                    self._readable(r)
            self._beat(time.monotonic())


def _worker_main(conn: Any, args: tuple, cpus: Optional[set],
                 agents: Optional[Dict[int, str]] = None) -> None:
    helper_setup(cpus)
    SimWorker(*args, conn=conn, agents=agents).run()


def loopback(i: int) -> str:
    """The i-th source address: 127.0.0.2, 127.0.0.3, ... 127.0.0.254, 127.0.1.1, ..."""
    hi, lo = divmod(i, 253)
    return f"127.{hi // 256}.{hi % 256}.{2 + lo if hi == 0 else 1 + lo}"


class ProcGroup:
    """Forked processes that each serve part of a simulation, talked to over pipes: send a
    command to all (`ask`) or to the one holding a rank (`ask_rank`); `close` ends them all,
    also when a test fails."""

    what = "simulated ranks"

    def _spawn(self, target: Callable[..., None], args: List[tuple],
               where: Dict[int, int]) -> None:
        self._where = where
        ctx = clean_context()
        self.procs: List[Any] = []
        self.pipes: List[Any] = []
        for part in args:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, daemon=True, args=(theirs, *part))
            p.start()
            theirs.close()
            self.procs.append(p)
            self.pipes.append(mine)

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def pin(self, cpus: set) -> None:
        for pid in self.pids:
            os.sched_setaffinity(pid, cpus)

    def ask(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> List[Any]:
        """Send `cmd` to every process, then collect the answers (in process order)."""
        for pipe in self.pipes:
            pipe.send((cmd, arg))
        out = []
        for pipe in self.pipes:
            if not pipe.poll(timeout):
                raise TimeoutError(f"{self.what}: no answer to {cmd!r} within {timeout} s")
            ans = pipe.recv()
            if isinstance(ans, Exception):
                raise ans
            out.append(ans)
        return out

    def ask_rank(self, rank: int, cmd: str, arg: Any, timeout: float = 60.0) -> Any:
        """A command for the process that holds `rank`."""
        pipe = self.pipes[self._where[rank]]
        pipe.send((cmd, arg))
        if not pipe.poll(timeout):
            raise TimeoutError(f"{self.what}, rank {rank}: no answer to {cmd!r}")
        return pipe.recv()

    def wait_registered(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(self.ask("registered")) >= n:
                return True
            time.sleep(0.05)
        return False

    def records(self) -> Dict[int, RankRecord]:
        return {rec.rank: rec for part in self.ask("report") for rec in part}

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for pipe in self.pipes:
            pipe.close()


class SimGroup(ProcGroup):
    """`ranks` simulated processors split over `procs` processes (testkit/forking.py: `dp_of`
    must pickle, a module-level function or a picklable callable)."""

    def __init__(self, ranks: Sequence[int], world: int, dp_of: Callable[[int], List[int]],
                 replica: int, key: bytes, interval: float, step: int = 10, procs: int = 2,
                 cpus: Optional[set] = None, agents: Optional[Dict[int, str]] = None) -> None:
        """`agents`: rank -> the socket of its node agent (those ranks register through it;
        the others, and all of them after losing their agent, with the controller itself)."""
        ranks = list(ranks)
        n_src = max(1, -(-len(ranks) // RANKS_PER_SOURCE))
        sources = [loopback(i) for i in range(n_src)]
        self._spawn(_worker_main, [
            ((ranks[i::procs], world, dp_of, replica, key, interval, step, sources), cpus,
             agents) for i in range(procs)], {r: i % procs for i, r in enumerate(ranks)})


# -- one real rank ---------------------------------------------------------------------------
def _real_rank_main(conn: Any, env: Dict[str, str], rank: int, dp: List[int], world: int,
                    replica: int, addr: Tuple[str, int], step: int, cpus: Optional[set]) -> None:
    """A real Processor (hence a real standby controller) at `step`, in this process."""
    helper_setup(cpus)
    os.environ.update(env)
    from mindio_ttp import hooks
    from mindio_ttp.config import TTPConfig
    from mindio_ttp.control.rank.processor import Processor
    from mindio_ttp.handlers import HANDLERS
    from mindio_ttp.log import setup_logging

    setup_logging(rank)  # its own handler on its own stderr (a forked parent's may be gone)

    hooks.STATE.reset()
    hooks.start_updating_os(-1)
    hooks.end_updating_os(step)
    calls: List[Tuple[Any, ...]] = []
    HANDLERS["save"] = lambda s, ranks, args: calls.append(("save", s, tuple(ranks)))
    HANDLERS["rename"] = lambda s, args: calls.append(("rename", s))
    proc = Processor(TTPConfig.from_env(world_size=world), rank, dp, world, replica)
    exited: List[int] = []
    proc.exit_fn = exited.append
    proc.start(*addr)
    conn.send(proc.standby.address)
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd == "report":
            sb = proc.standby
            d = sb.decision
            conn.send({"exit": exited[:1], "calls": calls, "timeline": dict(sb.timeline),
                       "standby_outcome": d.outcome.value if d else None,
                       "standby_state": sb.sm.state.value, "faults": sb.faults[:20]})
        elif cmd == "stop":
            conn.send(True)
            return


class RealRank:
    """A real processor of rank `rank` (and the standby controller it hosts) in a helper
    process; `report()` says how it exited, which handlers ran, and what its standby did."""

    def __init__(self, env: Dict[str, str], rank: int, dp: List[int], world: int, replica: int,
                 addr: Tuple[str, int], step: int = 10, cpus: Optional[set] = None) -> None:
        self._helper = Helper(_real_rank_main, (env, rank, dp, world, replica, addr, step, cpus),
                              f"real rank {rank}", 120)
        self.proc = self._helper.proc
        self.standby_address = self._helper.first

    def report(self) -> Dict[str, Any]:
        return self._helper.ask("report", 30)

    def close(self) -> None:
        self._helper.close()
