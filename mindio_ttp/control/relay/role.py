"""A node agent acting as a relay: serving the node agents a controller sent to it.

What comes up from them (joins, leaves, reports, rank messages) goes into the agent's own batch
for its parent (`Sink`), merged with its own ranks', one frame of each kind per loop turn; what
comes down (envelopes, refusals) goes to the children it concerns. A relay decides nothing: it
checks that a child speaks only for the ranks it serves, and keeps each rank's Register so that
it can register its whole subtree again when it fails over.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from mindio_ttp.control.relay.children import Child, Children
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.transport import Conn


class Sink(Protocol):
    """Where a relay's children's messages go: the agent's batch for its own parent."""

    def join(self, members: List[T.Member]) -> None: ...

    def left(self, kind: str, ranks: List[int], detail: str) -> None: ...

    def reports(self, flow_id: int, phase: int,
                entries: List[Tuple[int, Optional[int], bool]]) -> None: ...

    def up(self, msg: T.Up) -> None: ...

    def results(self, flow_id: int, code: int, entries: List[Tuple[int, float]]) -> None: ...


class RelayRole:
    def __init__(self, sink: Sink) -> None:
        self.children = Children()
        self.sink = sink
        self.payloads: Dict[int, bytes] = {}  # every rank below: its Register, as it came

    def accept(self, conn: Conn, reg: T.NodeRegister) -> Child:
        return self.children.add(conn, reg)

    def on_message(self, child: Child, msg: P.Message) -> None:
        if isinstance(msg, T.TierBeat):
            child.conn.ack_due = msg.seq
            child.progress, child.alive = msg.progress, msg.alive
        elif isinstance(msg, T.Join):
            members = T.join_members(msg)  # checked by the controller, which may refuse one
            for rank, payload in members:
                self.payloads[rank] = payload
            self.children.attach(child, [r for r, _ in members])
            self.sink.join(members)
        elif isinstance(msg, T.Left):
            ranks = self.children.detach(msg.ranks, child)
            for r in ranks:
                self.payloads.pop(r, None)
            if ranks:
                self.sink.left(msg.kind, ranks, msg.detail)
        elif isinstance(msg, T.Reports):
            fid, phase, entries = T.report_entries(msg)
            route = self.children.route
            self.sink.reports(fid, phase, [e for e in entries if route.get(e[0]) is child])
        elif isinstance(msg, T.Results):
            fid, cls, entries = T.result_entries(msg)
            route = self.children.route
            self.sink.results(fid, cls.TYPE, [e for e in entries if route.get(e[0]) is child])
        elif isinstance(msg, T.Up):
            rank, _ = T.up_message(msg)
            if self.children.route.get(rank) is child:
                self.sink.up(msg)
        else:
            raise P.ProtocolError(f"a node agent does not send {type(msg).__name__}")

    def lost(self, child: Child, why: str) -> List[int]:
        """`child`'s connection is gone: its ranks' route is lost (they may come back)."""
        ranks = self.children.remove(child)
        for r in ranks:
            self.payloads.pop(r, None)
        if ranks:
            self.sink.left("lost", ranks, f"node agent {child.conn.peer} lost: {why}"[:200])
        return ranks

    def forward(self, blob: bytes, dst: Sequence[Sequence[int]]) -> List[Conn]:
        return self.children.forward(blob, dst)

    def refused(self, msg: T.Refused) -> Optional[Conn]:
        child = self.children.route.get(msg.rank)
        if child is None:
            return None
        self.children.detach([msg.rank], child)
        self.payloads.pop(msg.rank, None)
        child.conn.queue(msg)
        return child.conn

    def progress(self) -> int:
        return sum(c.progress for c in self.children)

    def alive(self) -> int:
        return sum(c.alive for c in self.children)
