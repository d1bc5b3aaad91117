"""The node agents one listener serves, and which ranks each one serves.

A controller and a node agent acting as a relay own one `Children` each: every registered tier
connection is a `Child` with the ranks of its subtree (kept sorted, so a destination made of
ranges is matched in O(log ranks) per child). An envelope is queued once per child it reaches
(`forward`), never per rank: the controller's cost of an order is O(children), whatever the job.

It does no I/O: the owner's loop reads the frames, calls in here, and flushes the connections
`forward` returns. Only the owner's loop thread touches it.
"""

from __future__ import annotations

import bisect
from typing import Dict, Iterable, List, Optional, Sequence, Set

from mindio_ttp.control.wire import ranksets
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.transport import Conn


class Child:
    """One node agent (or relay) below, and the ranks it serves."""

    __slots__ = ("conn", "ranks", "_sorted", "host", "relay_port", "assigned", "progress",
                 "alive", "pid", "failover", "serves")

    def __init__(self, conn: Conn, reg: T.NodeRegister) -> None:
        self.conn = conn
        self.ranks: Set[int] = set()
        self._sorted: Optional[List[int]] = []
        self.host, self.relay_port, self.pid = reg.host, reg.relay_port, reg.pid
        self.failover = reg.failover
        self.serves = reg.children  # agents it already served when it registered
        self.assigned = 0  # agents a controller sent to it since (redirects)
        self.progress = 0  # its subtree's step changes (TierBeat)
        self.alive = 0

    @property
    def sorted_ranks(self) -> List[int]:
        if self._sorted is None:
            self._sorted = sorted(self.ranks)
        return self._sorted

    def add(self, ranks: Iterable[int]) -> None:
        self.ranks.update(ranks)
        self._sorted = None

    def discard(self, ranks: Iterable[int]) -> None:
        self.ranks.difference_update(ranks)
        self._sorted = None

    def reached_by(self, dst: Sequence[Sequence[int]]) -> bool:
        """Whether any rank of this subtree is in the destination blocks `dst`."""
        ranks = self.sorted_ranks
        if not ranks:
            return False
        for block in dst:
            start, step, count, ostep, ocount = block
            if ocount == 1 and step == 1:  # a range: the common destination (all, all but one)
                i = bisect.bisect_left(ranks, start)
                if i < len(ranks) and ranks[i] < start + count:
                    return True
            elif ocount == 1 and step > 1:
                i = bisect.bisect_left(ranks, start)
                end = start + step * count
                while i < len(ranks) and ranks[i] < end:
                    if (ranks[i] - start) % step == 0:
                        return True
                    i += 1
            elif any(ranksets.contains([block], r) for r in ranks):
                return True
        return False

    def __repr__(self) -> str:
        return f"<child {self.conn.peer} serving {len(self.ranks)} rank(s)>"


class Children:
    def __init__(self) -> None:
        self.by_conn: Dict[Conn, Child] = {}
        self.route: Dict[int, Child] = {}  # rank -> the child that serves it

    def __len__(self) -> int:
        return len(self.by_conn)

    def __iter__(self):
        return iter(list(self.by_conn.values()))

    def add(self, conn: Conn, reg: T.NodeRegister) -> Child:
        child = Child(conn, reg)
        conn.child = child
        self.by_conn[conn] = child
        return child

    def remove(self, child: Child) -> List[int]:
        """Forget `child`; returns the ranks it still served (now without a route)."""
        self.by_conn.pop(child.conn, None)
        lost = [r for r in child.ranks if self.route.get(r) is child]
        for r in lost:
            del self.route[r]
        child.ranks = set()
        child._sorted = []
        return sorted(lost)

    def attach(self, child: Child, ranks: Iterable[int]) -> List[Child]:
        """`ranks` are served by `child` from now on; returns the children they moved from."""
        ranks = list(ranks)
        moved_from = []
        for r in ranks:
            old = self.route.get(r)
            if old is not None and old is not child:
                old.discard([r])
                moved_from.append(old)
            self.route[r] = child
        child.add(ranks)
        return moved_from

    def detach(self, ranks: Iterable[int], child: Optional[Child] = None) -> List[int]:
        """Stop routing `ranks` (only those `child` serves, when given); returns them."""
        out = []
        for r in ranks:
            c = self.route.get(r)
            if c is not None and (child is None or c is child):
                del self.route[r]
                c.discard([r])
                out.append(r)
        return out

    def reached(self, dst: Sequence[Sequence[int]]) -> List[Child]:
        return [c for c in self.by_conn.values() if c.reached_by(dst)]

    def forward(self, blob: bytes, dst: Sequence[Sequence[int]]) -> List[Conn]:
        """Queue the envelope `blob` on every child serving one of its destinations; returns
        their connections, for the owner to flush."""
        conns = []
        for c in self.reached(dst):
            if not c.conn.closed:
                c.conn.queue_payload(T.Sealed.TYPE, blob)
                conns.append(c.conn)
        return conns
