"""Thousands of simulated node agents in a few processes, for the control-plane bench at 64k and
100k ranks.

Each simulated agent stands for one node of `g` ranks and speaks the real tier protocol over a
real TCP connection (control/wire/tier.py): the listener's challenge, a `NodeRegister` under the
hop key, per-connection session keys; a `Redirect` is followed to the relay it names (a real
node agent, control/agent/node.py); then one `Join` for its ranks, one `TierBeat` per
heartbeat interval, and the answers its ranks would give through a real agent: one `Reports`
frame per phase for its ranks, `Up(SaveResult)` and `Up(RenameResult)`, `Left(dead)` when a
rank is aborted (what a real agent sends when a rank's socket closes and its pid is gone) or
exits on its exit order. Every envelope is verified once, with the order key, as each of its
ranks would (the ranks of one node do that in parallel, on their own cores), and recorded for
every rank of the node it names. On losing its parent it fails over, like a real agent: the
controller, then the announced standbys, its whole node again.

What it does not simulate is the last local hop (agent -> rank over AF_UNIX, one frame per rank
of the node): the bench measures that hop on node 0, with a real agent and real ranks.

A `SimAgentGroup` runs the processes (forked from a clean server: testkit/forking.py) and talks to
each over a pipe; `summary()` reduces what every process recorded to the figures a bench row needs
(the last arrival of each kind of order, how many ranks got each kind, bytes), `records()` gives
every rank's orders (tests).
"""

from __future__ import annotations

import collections
import errno
import os
import random
import selectors
import socket
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from mindio_ttp.control.wire import envelope as E
from mindio_ttp.control.wire import keys as K
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import ranksets
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.session import RankHandshake, new_nonce
from testkit.forking import answer, helper_setup
from testkit.simranks import (
    IP_BIND_ADDRESS_NO_PORT,
    Order,
    ProcGroup,
    RankRecord,
    loopback,
)

INFLIGHT = 128  # agents of one process between connect and registered, at most (each frees
# its place when its ranks are welcomed; before, only at the next heartbeat tick, which paced
# the whole storm at INFLIGHT agents per process per heartbeat interval)
AGENTS_PER_SOURCE = 20000


class _Agent:
    __slots__ = ("node", "ranks", "sock", "hs", "tx", "dec", "out", "writing", "state",
                 "target", "relay", "redirected", "failover", "payloads", "recs", "bytes_in",
                 "bytes_out", "done", "last_rx", "seq", "attempts", "paced", "exited",
                 "lost_controller", "source")

    def __init__(self, node: int, ranks: List[int], payloads: List[bytes]) -> None:
        self.node, self.ranks, self.payloads = node, ranks, payloads
        self.sock: Optional[socket.socket] = None
        self.hs: Any = None
        self.tx: Any = None
        self.dec: Any = None
        self.out = bytearray()
        self.writing = False
        self.state = "idle"  # idle | handshake | ready
        self.target: Optional[Tuple[str, int]] = None
        self.relay: Optional[Tuple[str, int]] = None  # where a redirect sent it
        self.redirected = False
        self.failover = False
        self.recs = {r: RankRecord(r) for r in ranks}
        self.bytes_in = self.bytes_out = 0
        self.done = False
        self.last_rx = 0.0
        self.seq = 0
        self.attempts = 0
        self.paced = False
        self.exited: set = set()
        self.lost_controller = False  # the standbys are targets too
        self.source = "127.0.0.1"


class SimAgentWorker:
    """The loop of one simulated-agents process (runs in the child)."""

    def __init__(self, nodes: Sequence[Tuple[int, List[int]]], world: int,
                 dp_of: Callable[[int], List[int]], replica: int, key: bytes, interval: float,
                 timeout: float, step: int, conn: Any) -> None:
        self.world, self.interval, self.timeout, self.step = world, interval, timeout, step
        self.hop_key, self.order_key = K.hop_key(key), K.order_key(key)
        self.agents: List[_Agent] = []
        self.by_rank: Dict[int, _Agent] = {}
        for node, ranks in nodes:
            source = loopback(node)  # a node's own address, as on a cluster (admission.py
            # bounds what one address may hold unregistered)
            payloads = [P.encode_payload(P.Register(
                r, world, dp_of(r), replica, source, 0, os.getpid(), step, False, False,
                False, challenge=new_nonce(), nonce=new_nonce())) for r in ranks]
            a = _Agent(node, ranks, payloads)
            a.source = source
            self.agents.append(a)
            for r in ranks:
                self.by_rank[r] = a
        self.pipe = conn
        self.sel = selectors.DefaultSelector()
        self.controller: Optional[Tuple[str, int]] = None
        self.backups: List[List[Any]] = []
        self.counting = False
        self.queued: Deque[_Agent] = collections.deque()
        self.inflight = 0
        self.retry: Deque[Tuple[float, _Agent]] = collections.deque()
        self.next_beat = time.monotonic()
        self.registered_ranks = 0
        self.decoded: Dict[Tuple[bytes, int], Tuple[P.Message, tuple, frozenset]] = {}

    # -- connections ------------------------------------------------------------------------------
    def _connect(self, a: _Agent, addr: Tuple[str, int]) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((a.source, 0))
        except OSError:
            pass
        s.setblocking(False)
        err = s.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return self._lost(a, f"connect: {os.strerror(err)}")
        a.sock, a.target, a.state = s, addr, "handshake"
        a.hs = RankHandshake(self.hop_key, registry=T.CODEC, verify_challenge=False)
        a.tx, a.dec, a.out, a.writing = a.hs.tx, a.hs.dec, bytearray(), False
        a.last_rx = time.monotonic()
        self.sel.register(s, selectors.EVENT_READ, a)

    def _close(self, a: _Agent) -> None:
        if a.sock is None:
            return
        try:
            self.sel.unregister(a.sock)
        except (KeyError, ValueError):
            pass
        a.sock.close()
        a.sock, a.state = None, "idle"

    def _lost(self, a: _Agent, why: str) -> None:
        """Parent lost (or never reached): the controller, then the standbys, in rounds with a
        pause, the whole node again (like node.py and uplink.py)."""
        was_ready = a.state == "ready"
        at_relay = a.relay is not None and a.target == a.relay
        lost_controller = was_ready and not at_relay  # its parent was the controller itself
        self._close(a)
        self._unpace(a)
        if a.done:
            return
        if was_ready:
            a.failover, a.attempts, a.relay, a.redirected = True, 0, None, False
        elif at_relay:
            a.redirected = True  # the relay it was sent to failed: the controller takes it
        a.attempts += 1
        if a.attempts > 400:
            a.done = True
            return
        # the standbys only once the controller itself was lost: an agent that has not
        # registered yet, or lost a relay, keeps to the controller (node.py does the same)
        if lost_controller:
            a.lost_controller = True
        standbys = [(b[1], b[2]) for b in self.backups if len(b) == 3] \
            if a.lost_controller or why.startswith("connect") else []
        targets = [self.controller] + standbys
        i = (a.attempts - 1) % len(targets)
        if i == 0 and a.attempts > 1:
            self.retry.append((time.monotonic() + 0.2, a))
            return
        self._connect(a, targets[i])  # type: ignore[arg-type]

    def _send(self, a: _Agent, msg: P.Message) -> None:
        if a.sock is None:
            return
        data = a.tx.seal(msg)
        if self.counting:
            a.bytes_out += len(data)
        a.out += data
        self._flush(a)

    def _flush(self, a: _Agent) -> None:
        try:
            while a.out:
                n = a.sock.send(a.out)  # type: ignore[union-attr]
                del a.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            return self._lost(a, str(exc))
        if a.sock is not None and a.writing != bool(a.out):
            a.writing = bool(a.out)
            self.sel.modify(a.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if a.out
                                                            else 0), a)

    # -- frames -----------------------------------------------------------------------------------
    def _readable(self, a: _Agent) -> None:
        try:
            data = a.sock.recv(262144)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(a, str(exc))
        if not data:
            return self._lost(a, "closed")
        a.last_rx = time.monotonic()
        if self.counting:
            a.bytes_in += len(data)
        try:
            msgs = a.dec.feed(data)
            while msgs:
                for m in msgs:
                    self._handle(a, m)
                    if a.sock is None:
                        return
                msgs = a.dec.feed(b"") if a.dec.pending else []
        except P.ProtocolError as exc:
            for rec in a.recs.values():
                rec.orders.append(Order("ProtocolError", time.monotonic(), -1, outcome=str(exc)))
            self._lost(a, f"bad frame: {exc}")

    def _handle(self, a: _Agent, m: P.Message) -> None:
        now = time.monotonic()
        if isinstance(m, P.Challenge):
            reg = T.NodeRegister(a.source, 0, os.getpid(), len(a.ranks), 0, self.world,
                                 a.failover, a.redirected)
            a.out += a.hs.answer(m, reg)
            return self._flush(a)
        if isinstance(m, T.NodeAck):
            a.state, a.attempts, a.lost_controller = "ready", 0, False
            if m.backups:
                self.backups = m.backups
            self._send(a, T.join([(r, p) for r, p in zip(a.ranks, a.payloads)
                                  if r not in a.exited]))
            return
        if isinstance(m, T.Redirect):
            a.relay = (m.host, m.port)
            self._close(a)
            return self._connect(a, a.relay)
        if isinstance(m, P.Reject):
            return self._lost(a, f"refused: {m.reason}")
        if isinstance(m, T.TierAck):
            return
        if isinstance(m, T.Refused):
            a.recs[m.rank].orders.append(Order("Refused", now, -1, outcome=m.reason))
            return
        if isinstance(m, T.UpstreamLost):
            return
        if isinstance(m, T.Sealed):
            return self._envelope(a, m.data, now)
        raise P.ProtocolError(f"unexpected {type(m).__name__}")

    def _envelope(self, a: _Agent, blob: bytes, now: float) -> None:
        env = E.verify(self.order_key, blob)  # once per node: its ranks verify in parallel
        key = (env.incarnation, env.seq)
        if key not in self.decoded:  # a 50,000-rank save order decoded once per process
            msg = P.decode_payload(env.code, env.payload, T.CODEC)
            listed = tuple(getattr(msg, "save_ranks", None) or getattr(msg, "ranks", None) or ())
            self.decoded[key] = (msg, listed, frozenset(listed))
            if len(self.decoded) > 64:
                self.decoded.pop(next(iter(self.decoded)))
        msg, ranks, in_ranks = self.decoded[key]
        mine = [r for r in a.ranks if r not in a.exited and env.reaches(r)]
        if isinstance(msg, T.Welcome):
            welcomed = set(msg.ranks)
            for r in mine:
                if r in welcomed:
                    rec = a.recs[r]
                    if rec.registered_at is None:
                        rec.registered_at = now
                        self.registered_ranks += 1
                    elif a.failover:
                        rec.failed_over_at = now
            if a.paced and all(a.recs[r].registered_at is not None for r in a.ranks):
                self._unpace(a)  # registered: the next queued agent may start now
            if msg.backups:
                self.backups = msg.backups
            return
        if isinstance(msg, P.Backups):
            self.backups = msg.backups
            return
        if isinstance(msg, (P.Closing, P.StoreReply)):
            return
        kind = type(msg).__name__
        step = getattr(msg, "step", None)
        outcome = getattr(msg, "outcome", "")
        fid = getattr(msg, "flow_id", -1)
        for r in mine:
            a.recs[r].orders.append(Order(kind, now, fid, step, ranks, outcome))
        if isinstance(msg, (P.Lock, P.AdvanceTo)):
            phase = 1 if isinstance(msg, P.Lock) else 2
            self._send(a, T.reports(msg.flow_id, phase, [(r, self.step, False) for r in mine]))
        elif isinstance(msg, P.SaveOrder):
            done = []
            for r in mine:  # like a real agent: successes batched, a failure alone
                if msg.step == self.step and r in in_ranks:
                    done.append((r, 0.0))
                else:
                    self._send(a, T.up(r, P.SaveResult(msg.flow_id, r, False, "wrong order",
                                                       0.0)))
            if done:
                self._send(a, T.results(msg.flow_id, P.SaveResult.TYPE, done))
        elif isinstance(msg, P.RenameOrder):
            self._send(a, T.results(msg.flow_id, P.RenameResult.TYPE, [(r, 0.0) for r in mine]))
        elif isinstance(msg, P.ExitOrder):
            a.exited.update(mine)  # each exits on its order: its agent sees it die
            self._send(a, T.Left(sorted(mine), "dead", "exited on its exit order"))
            if len(a.exited) == len(a.ranks):
                a.done = True
                self._close(a)

    # -- the loop ---------------------------------------------------------------------------------
    def _start_queued(self) -> None:
        while self.queued and self.inflight < INFLIGHT:
            a = self.queued.popleft()
            self.inflight += 1
            a.paced = True
            self._connect(a, self.controller)  # type: ignore[arg-type]

    def _unpace(self, a: _Agent) -> None:
        if a.paced:
            a.paced = False
            self.inflight -= 1
            self._start_queued()

    def _tick(self, now: float) -> None:
        if now >= self.next_beat:
            for a in self.agents:
                if a.state == "ready":
                    a.seq += 1
                    self._send(a, T.TierBeat(a.seq, 0, len(a.ranks) - len(a.exited)))
                    if a.paced:
                        self._unpace(a)
                elif a.state == "handshake" and now - a.last_rx > 2 * self.timeout:
                    self._lost(a, "handshake timeout")
            self.next_beat = now + self.interval
        for a in self.agents:
            if a.state == "ready" and now - a.last_rx > self.timeout:
                self._lost(a, "silent")
        while self.retry and self.retry[0][0] <= now:
            _, a = self.retry.popleft()
            if not a.done and a.sock is None:
                self._connect(a, self.controller)  # type: ignore[arg-type]

    def _command(self, cmd: str, arg: Any) -> Any:
        if cmd == "connect":
            self.controller = tuple(arg)
            self.queued.extend(self.agents)
            self._start_queued()
            return len(self.agents)
        if cmd == "registered":
            return self.registered_ranks
        if cmd == "mark":
            self.counting = True
            for a in self.agents:
                a.bytes_in = a.bytes_out = 0
            return True
        if cmd == "abort":  # the rank's process is killed: its agent says so at once
            a = self.by_rank[arg]
            a.exited.add(arg)
            a.recs[arg].aborted_at = time.monotonic()
            self._send(a, T.Left([arg], "dead", "process killed (simulated)"))
            return a.recs[arg].aborted_at
        if cmd == "report":
            return [rec for a in self.agents for rec in a.recs.values()]
        if cmd == "summary":
            return self._summary(arg)
        if cmd == "backups":
            return self.backups
        raise ValueError(f"unknown command {cmd!r}")

    def _summary(self, skip: Sequence[int]) -> Dict[str, Any]:
        skip = set(skip or ())
        last: Dict[str, float] = {}
        count: Dict[str, int] = collections.Counter()
        ranks = 0
        for a in self.agents:
            for r, rec in a.recs.items():
                if r in skip:
                    continue
                ranks += 1
                seen = set()
                for o in rec.orders:
                    last[o.kind] = max(last.get(o.kind, 0.0), o.at)
                    if o.kind not in seen:
                        seen.add(o.kind)
                        count[o.kind] += 1
        return {"ranks": ranks, "last": last, "count": dict(count),
                "bytes": sum(a.bytes_in + a.bytes_out for a in self.agents),
                "registered_last": max((rec.registered_at or 0.0 for a in self.agents
                                        for rec in a.recs.values()), default=0.0),
                "failed_over": sum(1 for a in self.agents for rec in a.recs.values()
                                   if rec.failed_over_at is not None)}

    def run(self) -> None:
        self.sel.register(self.pipe, selectors.EVENT_READ, "pipe")
        while True:
            for i, (key, mask) in enumerate(self.sel.select(0.05)):
                if i % 256 == 255:
                    self._tick(time.monotonic())
                if key.data == "pipe":
                    if not answer(self.pipe, self._command):
                        return
                    continue
                a: _Agent = key.data
                if a.sock is None:
                    continue
                if mask & selectors.EVENT_WRITE:
                    self._flush(a)
                if mask & selectors.EVENT_READ and a.sock is not None:
                    self._readable(a)
            self._tick(time.monotonic())


def _worker_main(conn: Any, args: tuple, cpus: Optional[set]) -> None:
    helper_setup(cpus)
    random.seed(os.getpid())
    SimAgentWorker(*args, conn=conn).run()


class SimAgentGroup(ProcGroup):
    """`nodes` [(node id, its ranks)] simulated as node agents, split over `procs` processes."""

    what = "simulated agents"

    def __init__(self, nodes: Sequence[Tuple[int, List[int]]], world: int,
                 dp_of: Callable[[int], List[int]], replica: int, key: bytes, interval: float,
                 timeout: float, step: int = 10, procs: int = 2,
                 cpus: Optional[set] = None) -> None:
        nodes = list(nodes)
        self._spawn(_worker_main, [
            ((nodes[i::procs], world, dp_of, replica, key, interval, timeout, step), cpus)
            for i in range(procs)],
            {r: i % procs for i, (_, ranks) in enumerate(nodes) for r in ranks})

    def summary(self, skip: Sequence[int] = ()) -> Dict[str, Any]:
        parts = self.ask("summary", list(skip))
        last: Dict[str, float] = {}
        count: Dict[str, int] = collections.Counter()
        for p in parts:
            for k, v in p["last"].items():
                last[k] = max(last.get(k, 0.0), v)
            count.update(p["count"])
        return {"ranks": sum(p["ranks"] for p in parts), "last": last, "count": dict(count),
                "bytes": sum(p["bytes"] for p in parts),
                "registered_last": max(p["registered_last"] for p in parts),
                "failed_over": sum(p["failed_over"] for p in parts)}


def nodes_of(ranks: Sequence[int], per_node: int) -> List[Tuple[int, List[int]]]:
    """Consecutive ranks, `per_node` to a node (as torchrun and ttprun number them)."""
    ranks = list(ranks)
    return [(ranks[i] // per_node, ranks[i:i + per_node]) for i in range(0, len(ranks), per_node)]


__all__ = ["SimAgentGroup", "nodes_of", "ranksets"]
