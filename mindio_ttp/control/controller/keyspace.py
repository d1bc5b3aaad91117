"""The controller's half of the authenticated store: namespaces of keys, bounded in bytes.

Ranks rendezvous their fault-time gloo groups (and, in a recovery, every process group) on a
store. torch's TCPStore answers anyone who can reach its port: an outsider could list its keys,
write under them and grow the hosting process without bound. So the store's keys live here, in
the acting controller, and its operations travel as `StoreRequest` / `StoreReply` frames over
the ranks' authenticated TTP connections (control/rank/authstore.py is the rank's side). Only a
registered rank can reach it, and what the ranks can make it hold is bounded:

* every key and value is charged to the rank that wrote it (key + value + a fixed overhead), and
  every pending get/wait to the rank that waits; a rank may hold `STORE_RANK_BUDGET` bytes and
  all ranks together `STORE_TOTAL_BUDGET`; an operation over either is refused with a reason;
* a rank may leave at most `STORE_WAITS_PER_RANK` gets/waits pending;
* a namespace is created by its first operation and dropped whole by `close` (the flow closes
  the save order's namespace when it ends): its pending waits fail and its bytes are freed.

Every operation is O(1) in the size of the job (dict lookups, a heap of wait deadlines), so
100k ranks rendezvousing cost the controller's I/O thread nothing that grows per operation.
There is no lock: the controller's I/O thread is the only caller.

After a failover the new acting controller starts with an empty store: a rendezvous that was
under way at the old one fails (the rank's pending operations fail when its connection drops)
and is started again under the new controller's own orders, in a new namespace.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from mindio_ttp.config import STORE_RANK_BUDGET, STORE_TOTAL_BUDGET, STORE_WAITS_PER_RANK
from mindio_ttp.control.wire import protocol as P

log = logging.getLogger("mindio_ttp.controller")
Reply = Callable[[P.StoreReply], None]
KEY_OVERHEAD = 96  # bytes charged per key on top of its key and value (dict entry, objects)
WAIT_OVERHEAD = 256  # per pending get/wait
NAMESPACE_OVERHEAD = 512  # per namespace, charged to the rank that created it


class StoreRefused(Exception):
    """An operation the store will not do; the text goes back to the rank."""


@dataclass(eq=False)
class _Wait:
    id: int
    rank: int
    req: int
    ns: str
    op: str  # "get" or "wait"
    keys: Tuple[str, ...]
    missing: int
    cost: int
    deadline: float
    reply: Reply
    done: bool = False


@dataclass
class _Namespace:
    creator: int
    values: Dict[str, bytes] = field(default_factory=dict)
    charged: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # key -> (rank, bytes)
    waits: Dict[str, Dict[int, _Wait]] = field(default_factory=dict)  # key -> id -> wait


class KeySpace:
    def __init__(self, rank_budget: int = STORE_RANK_BUDGET,
                 total_budget: int = STORE_TOTAL_BUDGET,
                 waits_per_rank: int = STORE_WAITS_PER_RANK,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank_budget, self.total_budget = rank_budget, total_budget
        self.waits_per_rank = waits_per_rank
        self._clock = clock
        self._spaces: Dict[str, _Namespace] = {}
        self._used: Dict[int, int] = {}  # rank -> bytes charged
        self.total = 0  # bytes charged to all ranks
        self._pending: Dict[int, Dict[int, _Wait]] = {}  # rank -> id -> wait
        self._n_pending = 0
        self._heap: List[Tuple[float, int, _Wait]] = []
        self._ids = itertools.count(1)

    # -- what the controller calls -------------------------------------------------------------
    def handle(self, rank: int, m: P.StoreRequest, reply: Reply, peer: str = "") -> None:
        """Serve one request of a registered rank; `reply` now or (get, wait) when the keys
        exist, the wait times out, or the namespace is closed. A refusal is logged with the
        rank and its address (`peer`): only a key holder gets this far."""
        try:
            ns = self._namespace(m.ns, rank)
            values = [P.b64decode(v) for v in m.values]
            op = m.op
            if op in ("get", "wait"):
                self._wait(rank, m, ns, reply)
                return
            number, out = 0, []
            if op == "set":
                self._put(ns, m.ns, rank, m.keys[0], values[0])
            elif op == "add":
                number = self._add(ns, m.ns, rank, m.keys[0], m.amount)
            elif op == "compare_set":
                out = [self._compare_set(ns, m.ns, rank, m.keys[0], values[0], values[1])]
            elif op == "check":
                number = int(all(k in ns.values for k in m.keys))
            elif op == "delete_key":
                number = int(self._delete(ns, m.keys[0]))
            elif op == "num_keys":
                number = len(ns.values)
            reply(P.StoreReply(m.req, True, [P.b64encode(v) for v in out], number, ""))
        except StoreRefused as exc:
            log.warning("store: refused %s in namespace %s for rank %d (%s): %s", m.op, m.ns,
                        rank, peer, exc)
            reply(P.StoreReply(m.req, False, [], 0, str(exc)))

    def expire(self, now: Optional[float] = None) -> None:
        """Fail the gets/waits whose timeout passed (the controller's loop calls this)."""
        now = self._clock() if now is None else now
        while self._heap and self._heap[0][0] <= now:
            _, _, w = heapq.heappop(self._heap)
            if not w.done:
                missing = [k for k in w.keys if k not in self._spaces[w.ns].values]
                self._finish(w, P.StoreReply(
                    w.req, False, [], 0, f"timeout: key(s) {_keys(missing)} of store namespace "
                    f"{w.ns!r} not set in time"))

    def close(self, ns: str, why: str = "closed") -> int:
        """Drop namespace `ns`: its pending gets/waits fail, its bytes are freed. Returns the
        number of keys it held."""
        space = self._spaces.pop(ns, None)
        if space is None:
            return 0
        for waits in space.waits.values():
            for w in list(waits.values()):
                if not w.done:
                    self._finish(w, P.StoreReply(w.req, False, [], 0,
                                                 f"store namespace {ns!r} {why}"))
        for rank, cost in space.charged.values():
            self._refund(rank, cost)
        self._refund(space.creator, NAMESPACE_OVERHEAD + len(ns))
        return len(space.values)

    def close_all(self, why: str) -> None:
        for ns in list(self._spaces):
            self.close(ns, why)

    def forget(self, rank: int) -> None:
        """`rank`'s connection is gone: drop its pending gets/waits (nobody would read the
        answers). What it wrote stays: the other ranks of its rendezvous may still read it."""
        for w in list(self._pending.get(rank, {}).values()):
            self._finish(w, None)

    # -- introspection (tests, logs) -------------------------------------------------------------
    def used(self, rank: int) -> int:
        return self._used.get(rank, 0)

    @property
    def namespaces(self) -> List[str]:
        return sorted(self._spaces)

    @property
    def pending(self) -> int:
        return self._n_pending

    # -- internals -------------------------------------------------------------------------------
    def _namespace(self, name: str, rank: int) -> _Namespace:
        space = self._spaces.get(name)
        if space is None:
            self._charge(rank, NAMESPACE_OVERHEAD + len(name))
            space = self._spaces[name] = _Namespace(rank)
        return space

    def _charge(self, rank: int, cost: int, refund: int = 0) -> None:
        """Charge `cost` bytes to `rank` (after giving back `refund` of its own), or refuse."""
        used = self._used.get(rank, 0) - refund + cost
        if used > self.rank_budget:
            raise StoreRefused(f"rank {rank} would hold {used} bytes in the store, over its "
                               f"budget of {self.rank_budget} (STORE_RANK_BUDGET)")
        if self.total - refund + cost > self.total_budget:
            raise StoreRefused(f"the store would hold {self.total - refund + cost} bytes, over "
                               f"its budget of {self.total_budget} (STORE_TOTAL_BUDGET)")
        self._used[rank] = used
        self.total += cost - refund

    def _refund(self, rank: int, cost: int) -> None:
        left = self._used.get(rank, 0) - cost
        if left > 0:
            self._used[rank] = left
        else:
            self._used.pop(rank, None)
        self.total -= cost

    def _put(self, ns: _Namespace, name: str, rank: int, key: str, value: bytes) -> None:
        cost = len(key) + len(value) + KEY_OVERHEAD
        old = ns.charged.get(key)
        if old is not None and old[0] == rank:
            self._charge(rank, cost, refund=old[1])
        else:
            self._charge(rank, cost)
            if old is not None:
                self._refund(*old)
        ns.charged[key] = (rank, cost)
        created = key not in ns.values
        ns.values[key] = value
        if created:
            self._wake(ns, key)

    def _add(self, ns: _Namespace, name: str, rank: int, key: str, amount: int) -> int:
        old = ns.values.get(key)
        try:
            now = (int(old) if old is not None else 0) + amount
        except ValueError:
            raise StoreRefused(f"add: the value of {key!r} is not an integer") from None
        if not -(2**63) <= now < 2**63:
            raise StoreRefused(f"add: {key!r} would overflow 64 bits")
        self._put(ns, name, rank, key, str(now).encode())
        return now

    def _compare_set(self, ns: _Namespace, name: str, rank: int, key: str, expected: bytes,
                     desired: bytes) -> bytes:
        """torch's TCPStore semantics: set `desired` if the key holds `expected` (or is absent
        and `expected` is empty); return what the key holds afterwards (for an absent key and
        a non-empty `expected`: `expected`, as TCPStore does)."""
        cur = ns.values.get(key)
        if cur is None and expected:
            return expected
        if cur is None or cur == expected:
            self._put(ns, name, rank, key, desired)
            return desired
        return cur

    def _delete(self, ns: _Namespace, key: str) -> bool:
        if key not in ns.values:
            return False
        del ns.values[key]
        self._refund(*ns.charged.pop(key))
        return True

    def _wait(self, rank: int, m: P.StoreRequest, ns: _Namespace, reply: Reply) -> None:
        missing = [k for k in dict.fromkeys(m.keys) if k not in ns.values]
        if not missing:
            reply(self._answer(m.req, m.op, ns, m.keys))
            return
        mine = self._pending.setdefault(rank, {})
        if len(mine) >= self.waits_per_rank:
            raise StoreRefused(f"rank {rank} has {len(mine)} gets/waits pending, the most a "
                               "rank may (STORE_WAITS_PER_RANK)")
        cost = WAIT_OVERHEAD + sum(len(k) for k in m.keys)
        self._charge(rank, cost)
        w = _Wait(next(self._ids), rank, m.req, m.ns, m.op, tuple(m.keys), len(missing), cost,
                  self._clock() + m.timeout, reply)
        mine[w.id] = w
        self._n_pending += 1
        for k in missing:
            ns.waits.setdefault(k, {})[w.id] = w
        heapq.heappush(self._heap, (w.deadline, w.id, w))
        if len(self._heap) > 2 * self._n_pending + 1024:  # completed waits left in the heap
            self._heap = [e for e in self._heap if not e[2].done]
            heapq.heapify(self._heap)

    def _wake(self, ns: _Namespace, key: str) -> None:
        for w in list(ns.waits.pop(key, {}).values()):
            w.missing -= 1
            if w.missing == 0 and not w.done:
                self._finish(w, self._answer(w.req, w.op, ns, w.keys))

    def _answer(self, req: int, op: str, ns: _Namespace, keys: Tuple[str, ...] | List[str]
                ) -> P.StoreReply:
        if op == "get":
            return P.StoreReply(req, True, [P.b64encode(ns.values[keys[0]])], 0, "")
        return P.StoreReply(req, True, [], 0, "")

    def _finish(self, w: _Wait, reply: Optional[P.StoreReply]) -> None:
        """End a pending wait: take it out of every index, refund it, send `reply` (if any)."""
        w.done = True
        self._n_pending -= 1
        mine = self._pending.get(w.rank)
        if mine is not None:
            mine.pop(w.id, None)
            if not mine:
                del self._pending[w.rank]
        space = self._spaces.get(w.ns)
        if space is not None:
            for k in w.keys:
                waits = space.waits.get(k)
                if waits is not None:
                    waits.pop(w.id, None)
                    if not waits:
                        del space.waits[k]
        self._refund(w.rank, w.cost)
        if reply is not None:
            w.reply(reply)


def _keys(keys: List[str]) -> str:
    shown = ", ".join(repr(k[:80]) for k in keys[:4])
    return shown + (f" (+{len(keys) - 4})" if len(keys) > 4 else "")
