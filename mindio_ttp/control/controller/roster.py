"""Who registered with a controller, and how each rank is: the one table both of its threads use.

The controller's I/O thread writes it (registrations, heartbeats, deaths) and its flow thread
reads it (who is alive, each rank's DP group, why a rank is missing), both holding the
controller's condition. It is its own object so the flow can be given exactly this table, not
the controller, and tested with a table built by hand. The alive count is kept, not counted:
a promoted standby re-checks it on every registration of up to world_size ranks. DP groups are
kept once each, however many members registered them: at 100,000 ranks a copy per rank of a
group of 1,000 would be 10^8 entries, and the flow would hash every copy to find the layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mindio_ttp.control.wire.transport import Conn


@dataclass
class RankInfo:
    rank: int
    dp_ranks: Tuple[int, ...]
    host: str
    standby_port: int
    conn: Optional[Conn]
    last_seen: float
    step: Optional[int] = None
    updating: bool = False
    status: str = "alive"  # alive | dead | hung | gone (said goodbye)
    note: str = ""
    route: Any = None  # the node agent it registered through (routes.py); None: direct


class Roster:
    """The ranks known to one controller; the caller holds the controller's condition."""

    def __init__(self) -> None:
        self._by_rank: Dict[int, RankInfo] = {}
        self._groups: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
        self.n_alive = 0
        self.changed_at = time.monotonic()  # the last registration

    def get(self, rank: int) -> Optional[RankInfo]:
        return self._by_rank.get(rank)

    def __getitem__(self, rank: int) -> RankInfo:
        return self._by_rank[rank]

    def values(self) -> List[RankInfo]:
        """A copy: the I/O thread may drop a rank while the caller walks the list."""
        return list(self._by_rank.values())

    def alive(self) -> List[int]:
        return [r for r, i in self._by_rank.items() if i.status == "alive"]

    def register(self, info: RankInfo) -> None:
        """Record a (re-)registration; a rank that was not alive counts as alive again."""
        old = self._by_rank.get(info.rank)
        if old is None or old.status != "alive":
            self.n_alive += 1
        self.changed_at = time.monotonic()
        info.dp_ranks = self._groups.setdefault(info.dp_ranks, info.dp_ranks)
        self._by_rank[info.rank] = info

    def groups(self) -> List[Tuple[int, ...]]:
        """Every DP group some registered rank named, each once."""
        return list(self._groups.values())

    def claims(self) -> List[Tuple[Tuple[int, ...], List[int]]]:
        """Each DP group the ranks registered now, with the ranks that registered it (every
        rank known, alive or not); O(ranks): equal groups are one object."""
        by_group: Dict[int, Tuple[Tuple[int, ...], List[int]]] = {}
        for info in self._by_rank.values():
            entry = by_group.get(id(info.dp_ranks))
            if entry is None:
                entry = by_group[id(info.dp_ranks)] = (info.dp_ranks, [])
            entry[1].append(info.rank)
        return list(by_group.values())

    def set_status(self, info: RankInfo, status: str, note: str) -> bool:
        """Change a rank's status; True when this took it out of 'alive'."""
        left = info.status == "alive" and status != "alive"
        if left:
            self.n_alive -= 1
        info.status, info.note = status, note
        return left
