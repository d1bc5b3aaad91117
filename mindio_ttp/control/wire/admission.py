"""Who may wait for a handshake at a listener, and who gives way when too many wait.

A connection that has not registered costs the listener a slot until it registers, is closed
after TTP_HANDSHAKE_TIMEOUT, or gives way to another. The slots are few (`cap`: the whole job
at once, and never more than PENDING_CAP), so before issue 24 an outsider without the key who
held `world_size + 64` idle connections made the listener refuse the newest one: during an
in-memory recovery, the replacement, which then exited, and the job fell back to the dying
checkpoint. Now the policy is:

* **per source address**, at most `per_source` connections wait (a node runs a few ranks: 64
  is well above what one starts at once); a source's next connection takes the place of its
  oldest one with nothing unread (or is refused when all of them have bytes waiting for us),
  so a flood from one address only displaces itself;
* when every slot is taken, the connections that have had their chance give way: the oldest
  of the source that holds the most, first. A connection has had its chance when it was
  accepted at least `evict_after` seconds ago and nothing it sent waits unread: a rank
  answers its challenge within a round trip, and a rank whose Register waits for its turn (a
  start-up storm, the loop busy) is being served late by us, which is not its fault;
* **slots kept for a recovery**: while a recovery expects replacements from a host (the lost
  ranks' hosts), that host's newest connections, one per expected rank, never give way to
  others;
* nothing that has not had its chance is displaced: in a start-up or failover storm of the
  whole job every slot holds a rank that is about to be served, and the rest wait in the
  kernel's accept queue (where no timer of ours runs) as before.

A connection that gives way is closed before or during its handshake; a processor retries a
handshake closed before its challenge until TTP_CONNECT_TIMEOUT, and a replacement retries its
registration until its order's deadline (control/rank/processor.py), so an outsider has to
outrun the listener forever, from more addresses than a node has, to keep a rank out.

Pure bookkeeping, no sockets: the controller's I/O thread owns it and says which connections
have bytes waiting (`idle`), so each decision costs at most a few system calls.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Iterator, List, Mapping, Optional, Tuple, TypeVar

PENDING_CAP = 512  # connections accepted and not registered, at most (control/controller/server.py)
PER_SOURCE_PENDING = 64  # of them from one source address
EVICT_AFTER_S = 1.0  # a connection has had its chance after this long with nothing unread
CANDIDATES = 8  # connections of one source looked at per eviction (their idleness is a syscall)

C = TypeVar("C")


class Admission(Generic[C]):
    """Connections accepted and not registered yet (oldest first, with when each was
    accepted), and the choice of which ones give way (module doc). The caller passes
    `idle(conn)`: True when nothing the peer sent waits unread."""

    def __init__(self, cap: int, per_source: int = PER_SOURCE_PENDING,
                 evict_after: float = EVICT_AFTER_S) -> None:
        self.cap, self.per_source, self.evict_after = cap, per_source, evict_after
        self._since: Dict[C, float] = {}
        self._source: Dict[C, str] = {}
        self._by_source: Dict[str, Dict[C, None]] = {}  # oldest first

    def __len__(self) -> int:
        return len(self._since)

    def __iter__(self) -> Iterator[C]:
        return iter(self._since)

    def __contains__(self, conn: object) -> bool:
        return conn in self._since

    def items(self) -> List[Tuple[C, float]]:
        """A copy: the caller may drop connections while it walks them."""
        return list(self._since.items())

    def add(self, conn: C, source: str, now: float) -> None:
        self._since[conn] = now
        self._source[conn] = source
        self._by_source.setdefault(source, {})[conn] = None

    def remove(self, conn: C) -> bool:
        """Forget `conn` (registered, or closed); False when it was not waiting."""
        if self._since.pop(conn, None) is None:
            return False
        source = self._source.pop(conn)
        mine = self._by_source[source]
        del mine[conn]
        if not mine:
            del self._by_source[source]
        return True

    @property
    def room(self) -> int:
        return self.cap - len(self._since)

    def from_source(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def crowded(self, source: str, idle: Callable[[C], bool]) -> Tuple[bool, Optional[C]]:
        """Before admitting one more connection from `source`: (full, victim). `full` when the
        source already holds `per_source`; then `victim` is its oldest connection with nothing
        unread, which gives way to the newcomer, or None: the newcomer is refused."""
        mine = self._by_source.get(source)
        if mine is None or len(mine) < self.per_source:
            return False, None
        for conn in _first(mine, CANDIDATES):
            if idle(conn):
                return True, conn
        return True, None

    def give_way(self, now: float, idle: Callable[[C], bool],
                 kept: Optional[Mapping[str, int]] = None) -> Iterator[C]:
        """The connections that have had their chance, in the order they give way to newer
        ones: from the source holding the most first, oldest first; `kept`: source -> how many
        of its newest connections never give way (a recovery expects replacements from
        there). Lazy: the caller takes one per connection it admits, and stops when the
        kernel's queue is empty. Looks at `CANDIDATES` connections of a source at most."""
        kept = kept or {}
        for source in sorted(self._by_source, key=lambda s: -len(self._by_source[s])):
            mine = list(self._by_source.get(source, ()))
            keep = kept.get(source, 0)
            if keep:
                mine = mine[:-keep]
            for conn in mine[:CANDIDATES]:
                if conn not in self._since:
                    continue  # gone meanwhile
                if now - self._since[conn] < self.evict_after:
                    break  # the rest of this source are younger still
                if idle(conn):
                    yield conn


def _first(items: Dict[C, None], n: int) -> Iterator[C]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item
