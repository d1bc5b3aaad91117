"""Connections that have not registered yet, at a node agent's listeners: bounded as RSS.

The same rules as the controller's (docs/security.md), at the agent's size: at most `cap`
connections wait for their handshake (the rest are refused at accept, before a byte is read),
each is read no further than the frame it is sending (capped per connection), all of them
together hold at most `budget` bytes of partial frames, and each has `timeout` seconds to finish.
"""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire.transport import Conn

PRE_AUTH_READ = 4096


class Gate:
    def __init__(self, cap: int, budget: int, timeout: float) -> None:
        self.cap, self.budget, self.timeout = cap, budget, timeout
        self.pending: Dict[Conn, float] = {}
        self._held: Dict[Conn, int] = {}
        self.held = 0
        self.refused = 0

    def full(self) -> bool:
        return len(self.pending) >= self.cap

    def admit(self, conn: Conn) -> None:
        self.pending[conn] = time.monotonic()

    def read(self, conn: Conn) -> List[P.Message]:
        """Read what the budget allows of `conn`'s frame; ProtocolError when it is spent."""
        room = self.budget - self.held
        if room <= 0:
            self.refused += 1
            raise P.ProtocolError("the pre-authentication buffer budget is spent")
        msgs = conn.read(min(max(conn.dec.wanted(), PRE_AUTH_READ), room))
        if not conn.closed and conn in self.pending:
            now_held = conn.dec.pending
            self.held += now_held - self._held.get(conn, 0)
            self._held[conn] = now_held
        return msgs

    def done(self, conn: Conn) -> None:
        """`conn` registered, or is closed: it no longer counts."""
        self.pending.pop(conn, None)
        self.held -= self._held.pop(conn, 0)

    def expired(self) -> List[Tuple[Conn, float]]:
        now = time.monotonic()
        return [(c, t) for c, t in self.pending.items() if now - t > self.timeout]
