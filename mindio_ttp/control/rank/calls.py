"""A rank's AuthStore calls in flight (authstore.py): each caller waits on its own event; the
processor's thread, the only one that reads the connection, answers them, or fails them all at
once when the connection to the controller is lost (a new controller starts with an empty
store, so nothing in flight can be answered any more)."""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Tuple


class PendingCalls:
    """Store calls in flight: each caller waits on its own event; the processor's thread
    answers them, or fails them all at once when the connection is lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._calls: Dict[int, Tuple[threading.Event, List[Any]]] = {}

    def open(self) -> Tuple[int, threading.Event, List[Any]]:
        with self._lock:
            self._next += 1
            call: Tuple[threading.Event, List[Any]] = (threading.Event(), [])
            self._calls[self._next] = call
            return self._next, call[0], call[1]

    def close(self, req: int, outcome: Any) -> bool:
        """Deliver `outcome` (a StoreReply, or an exception to raise) to call `req`."""
        with self._lock:
            call = self._calls.pop(req, None)
        if call is None:
            return False  # it gave up already
        call[1].append(outcome)
        call[0].set()
        return True

    def fail_all(self, error: BaseException) -> int:
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for ev, slot in calls:
            slot.append(error)
            ev.set()
        return len(calls)
