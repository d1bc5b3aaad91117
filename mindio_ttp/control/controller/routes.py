"""A controller's routes to ranks through node agents and relays (docs/design.md, "The control
plane in tiers").

The controller's I/O thread owns one `Routes`. It takes the tier connections (`NodeRegister`
under the hop key), decides which agents it serves itself and which it sends to a relay
(`Redirect`), admits the ranks each one registers (`Join`, every member checked as a direct
rank's Register is, by the controller's own `_admit`), and turns what comes up (`Left`,
`Reports`, `Up`, `TierBeat`) into the same facts a direct rank's frames give: the flow cannot
tell a routed rank from a direct one. Down, every order for routed ranks is one envelope sealed
with the order key (wire/envelope.py) and queued once per child it reaches.

A child's connection lost is not its ranks' death: they may come back another way within the
route grace (config.Deadlines: their processors fall back to this controller, or their agent to
another relay); only then are those that did not counted dead, and the flow starts.
"""

from __future__ import annotations

import collections
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Sequence, Tuple

from mindio_ttp.control.relay.children import Child, Children
from mindio_ttp.control.wire import envelope as E
from mindio_ttp.control.wire import keys as K
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import ranksets
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.transport import Conn

if TYPE_CHECKING:
    from mindio_ttp.control.controller.server import Controller

log = logging.getLogger("mindio_ttp.controller")

JOIN_SLICE = 256  # members admitted between two looks at the clock
MIN_FANOUT = 32  # agents per relay and per controller at least (TTP_FANOUT=0)
DEFAULT_LOCAL_WORLD = 8  # ranks per node assumed until an agent says


class Routes:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.children = Children()
        self.incarnation = secrets.token_bytes(16)
        self.order_key = K.order_key(ctl.cfg.auth_key)
        self.hop_key = K.hop_key(ctl.cfg.auth_key)
        self._seq = 0
        self._local_world = 0  # ranks per node, as the agents say
        self.limbo: Dict[int, Tuple[float, str]] = {}  # rank -> (since, why): no route
        self.grace = ctl.cfg.deadlines.route_grace  # the route grace, see the docstring
        self.redirects = 0
        # joins read, not admitted yet (admitted a slice per loop turn: `admit`)
        self.joining: Deque[Tuple[Child, List[P.Register]]] = collections.deque()

    # -- sending ---------------------------------------------------------------------------------
    def seal(self, msg: P.Message, dst: Sequence[Sequence[int]]) -> bytes:
        self._seq += 1
        return E.seal(self.order_key, self.incarnation, self._seq, dst, msg)

    def deliver(self, msg: P.Message, dst: Sequence[Sequence[int]]) -> Optional[bytes]:
        """Seal `msg` once for the ranks `dst` (blocks) and queue it on every child that serves
        one of them; returns the envelope (None: no child serves any)."""
        if not self.children:
            return None
        reached = self.children.reached(dst)
        if not reached:
            return None
        blob = self.seal(msg, dst)
        for c in reached:
            if not c.conn.closed:
                c.conn.queue_payload(T.Sealed.TYPE, blob)
                self.ctl._flush(c.conn)
        return blob

    def to_ranks(self, ranks: Sequence[int], msg: P.Message) -> None:
        """`msg` to the routed ones of `ranks` (the caller sends the direct ones)."""
        routed = [r for r in ranks if r in self.children.route]
        if routed:
            self.deliver(msg, ranksets.encode(sorted(routed)))

    def broadcast(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        self.deliver(msg, ranksets.all_but(self.ctl.world_size,
                                           [] if exclude is None else [exclude]))

    # -- a node agent registers -------------------------------------------------------------------
    def fanout(self) -> int:
        cfg = self.ctl.cfg
        if cfg.fanout:
            return cfg.fanout
        nodes = math.ceil(self.ctl.world_size / (self._local_world or DEFAULT_LOCAL_WORLD))
        return max(MIN_FANOUT, math.ceil(math.sqrt(nodes)))

    def on_node_register(self, conn: Conn, reg: T.NodeRegister) -> None:
        ctl = self.ctl
        if conn.child is not None or conn.rank is not None:
            return ctl._refuse(conn, "registered twice on one connection")
        conn.handshake.accept(reg)  # session keys under the hop key from here on
        if reg.world_size != ctl.world_size:
            return ctl._refuse(conn, f"node agent for world_size {reg.world_size}, this job's "
                               f"is {ctl.world_size}")
        if ctl._exiting() and ctl.verdict is None:
            return ctl._refuse(conn, "controller is exiting")
        if reg.local_world and not self._local_world:
            self._local_world = reg.local_world
        k = self.fanout()
        if not (reg.redirected or reg.children) and len(self.children) >= k:
            relay = self._relay_with_room(k)
            if relay is not None:
                relay.assigned += 1
                self.redirects += 1
                conn.queue(T.Redirect(relay.host, relay.relay_port,
                                      f"{len(self.children)} agents served here already"))
                ctl._flush(conn)
                ctl._drop(conn, "redirected to a relay")
                return
        ctl._authenticated(conn)
        child = self.children.add(conn, reg)
        conn.queue(T.NodeAck("standby" if ctl.standby else "primary", ctl.host_rank,
                             list(ctl._backups), ctl.fault_id or "", self.incarnation.hex(),
                             ctl.cfg.heartbeat_interval))
        ctl._flush(conn)
        if reg.failover or reg.children:
            log.info("%s: node agent %s registered (failover=%s, %d agent(s) below it)",
                     ctl.name, conn.peer, reg.failover, reg.children)
        del child  # its ranks come in its Joins

    def _relay_with_room(self, k: int) -> Optional[Child]:
        best: Optional[Child] = None
        for c in self.children:
            load = c.assigned + c.serves
            if c.relay_port and load < k and not c.conn.closed and (
                    best is None or load < best.assigned + best.serves):
                best = c
        return best

    # -- what comes up ----------------------------------------------------------------------------
    def on_message(self, child: Child, msg: P.Message) -> None:
        if isinstance(msg, T.TierBeat):
            child.conn.ack_due = msg.seq
            if msg.progress != child.progress:
                child.progress = msg.progress
                self.ctl._progress_at = self.ctl._clock.now()
            child.alive = msg.alive
        elif isinstance(msg, T.Reports):
            self._on_reports(child, msg)
        elif isinstance(msg, T.Results):
            fid, cls, entries = T.result_entries(msg)
            route = self.children.route
            with self.ctl._cond:
                for rank, secs in entries:
                    if route.get(rank) is child:
                        self.ctl.flow.result(fid, rank, cls(fid, rank, True, "", secs))
        elif isinstance(msg, T.Up):
            rank, inner = T.up_message(msg)
            if self.children.route.get(rank) is not child:
                return  # a child speaks for its own ranks only (a late frame of a moved rank)
            info = self.ctl._ranks.get(rank)
            if info is not None:
                self.ctl._on_rank_msg(info, inner, lambda reply, r=rank: self.to_rank(r, reply),
                                      f"{child.conn.peer} (node agent)")
        elif isinstance(msg, T.Join):
            self._on_join(child, T.members(msg))
        elif isinstance(msg, T.Left):
            self._on_left(child, msg)
        else:
            raise P.ProtocolError(f"a node agent does not send {type(msg).__name__}")

    def to_rank(self, rank: int, msg: P.Message) -> None:
        if rank in self.children.route:
            self.deliver(msg, [[rank, 1, 1, 0, 1]])

    def _on_reports(self, child: Child, msg: T.Reports) -> None:
        fid, phase, entries = T.report_entries(msg)
        route = self.children.route
        with self.ctl._cond:
            for rank, step, updating in entries:
                if route.get(rank) is child:
                    self.ctl.flow.report(fid, phase, rank, step, updating)

    def _on_join(self, child: Child, regs: List[P.Register]) -> None:
        """Queued: the I/O loop admits a bounded slice a turn (`admit`)."""
        self.joining.append((child, regs))

    def admit(self, budget_s: float) -> None:
        """Admit queued joins for about `budget_s` seconds of this thread, at least one."""
        deadline = time.monotonic() + budget_s
        while self.joining:
            child, regs = self.joining[0]
            take = regs[:JOIN_SLICE]
            if len(regs) > JOIN_SLICE:
                self.joining[0] = (child, regs[JOIN_SLICE:])
            else:
                self.joining.popleft()
            if not child.conn.closed:
                self._admit_slice(child, take)
            if time.monotonic() > deadline:
                return

    def _admit_slice(self, child: Child, regs: List[P.Register]) -> None:
        ctl = self.ctl
        if ctl._exiting() and ctl.verdict is not None:
            return self._late(child, regs)
        accepted: List[P.Register] = []
        for reg in regs:
            why = ctl._admit(reg, child=child)
            if why is None:
                accepted.append(reg)
                self.limbo.pop(reg.rank, None)
            else:
                log.warning("%s: refusing rank %d through node agent %s: %s", ctl.name,
                            reg.rank, child.conn.peer, why)
                child.conn.queue(T.Refused(reg.rank, why[:P.MAX_TEXT]))
        if accepted:
            ranks = [r.rank for r in accepted]
            moved_from = self.children.attach(child, ranks)
            for old in moved_from:
                log.info("%s: rank(s) moved from node agent %s to %s", ctl.name, old.conn.peer,
                         child.conn.peer)
            dst = ranksets.encode(sorted(ranks))
            welcome = T.Welcome(self.incarnation.hex(), "standby" if ctl.standby else "primary",
                                ctl.host_rank, ctl.fault_id or "", list(ctl._backups), ranks,
                                [r.nonce for r in accepted])
            blob = self.seal(welcome, dst)
            child.conn.queue_payload(T.Sealed.TYPE, blob)
            for phase_msg in ctl._replayed_on_register():  # the phase orders they missed
                child.conn.queue_payload(T.Sealed.TYPE, self.seal(phase_msg, dst))
            if any(r.failover or r.locked for r in accepted):
                log.info("%s: %d rank(s) registered through node agent %s (failover)", ctl.name,
                         len(accepted), child.conn.peer)
        ctl._flush(child.conn)
        if accepted:
            ctl._after_registration()

    def _late(self, child: Child, regs: List[P.Register]) -> None:
        """Ranks that come after the verdict get it (server.py's `_late`)."""
        ctl = self.ctl
        ranks = [r.rank for r in regs]
        log.warning("%s: %d rank(s) registered through node agent %s after the verdict; "
                    "sending them the exit order", ctl.name, len(ranks), child.conn.peer)
        dst = ranksets.encode(sorted(ranks))
        welcome = T.Welcome(self.incarnation.hex(), "standby" if ctl.standby else "primary",
                            ctl.host_rank, ctl.fault_id or "", [], ranks, [r.nonce for r in regs])
        child.conn.queue_payload(T.Sealed.TYPE, self.seal(welcome, dst))
        child.conn.queue_payload(T.Sealed.TYPE, self.seal(ctl.verdict, dst))  # type: ignore
        ctl._flush(child.conn)

    def _on_left(self, child: Child, msg: T.Left) -> None:
        ctl = self.ctl
        ranks = self.children.detach(msg.ranks, child)
        if not ranks:
            return
        if msg.kind in ("moved", "lost"):
            now = ctl._clock.now()
            why = ("closed its connection to its node agent" if msg.kind == "moved" else
                   f"its route was lost ({msg.detail[:120]})")
            for r in ranks:
                self.limbo[r] = (now, why)
            return
        status = {"dead": "dead", "hung": "hung", "gone": "gone"}[msg.kind]
        with ctl._cond:
            for r in ranks:
                info = ctl._ranks.get(r)
                if info is None or info.status != "alive" or info.conn is not None:
                    continue
                info.route = None
                if status == "gone" or ctl._exiting():
                    ctl._set_status(info, "gone", "left after the exit order"
                                    if status != "gone" else "finished training")
                    continue
                ctl._set_status(info, status, f"{status} ({msg.detail}, seen by its node agent)"
                                [:500])
                ctl.flow.fault(f"rank {r} {info.note}")

    # -- losing a child ---------------------------------------------------------------------------
    def lost(self, child: Child, why: str) -> None:
        """The child's connection is gone: its ranks get the route grace to come back."""
        ranks = self.children.remove(child)
        if not ranks:
            return
        now = self.ctl._clock.now()
        for r in ranks:
            self.limbo[r] = (now, f"its node agent {child.conn.peer} was lost ({why[:80]})")
        log.warning("%s: node agent %s lost (%s); its %d rank(s) have %.1f s to register "
                    "again", self.ctl.name, child.conn.peer, why, len(ranks), self.grace)

    def check(self, seen: float) -> List[Child]:
        """Count ranks whose route was lost longer than the route grace ago dead; returns the
        children silent for TTP_HEARTBEAT_TIMEOUT (the owner drops them)."""
        ctl = self.ctl
        expired = [r for r, (t, _) in self.limbo.items() if seen - t > self.grace]
        if expired:
            with ctl._cond:
                for r in expired:
                    _, why = self.limbo.pop(r)
                    info = ctl._ranks.get(r)
                    if info is None or info.status != "alive" or info.conn is not None or \
                            r in self.children.route:
                        continue
                    info.route = None
                    if ctl._exiting():
                        ctl._set_status(info, "gone", "left after the exit order")
                        continue
                    ctl._set_status(info, "dead", f"dead ({why} and it did not register "
                                    f"again within {self.grace:g} s)")
                    ctl.flow.fault(f"rank {r} {info.note}")
        limit = ctl.cfg.heartbeat_timeout
        return [c for c in self.children if seen - c.conn.last_rx > limit]

    def routed(self, rank: int) -> bool:
        return rank in self.children.route

    def describe(self) -> Tuple[int, int]:
        """(children, routed ranks): for status lines and the bench."""
        return len(self.children), len(self.children.route)
