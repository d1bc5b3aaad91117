"""SIGTERM is preemption: the scheduler takes the node back, and the rank reports it
("preempted") so the controller saves the dying checkpoint before the SIGKILL that follows.

The signal's wakeup fd wakes the processor's selector even while the main thread sits in a long
C call (a collective, a kernel launch), where a Python handler would run only after it returns.
The Python handler covers the case where the wakeup fd already belongs to someone else (an
asyncio loop): then the report waits for the main thread's next bytecode, as any handler's.
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any, Callable, Optional


class SigtermWatch:
    def __init__(self) -> None:
        self.reader: Optional[socket.socket] = None
        self._writer: Optional[socket.socket] = None

    def install(self, report: Callable[[], None]) -> None:
        """Call `report` on SIGTERM; `reader` becomes readable on it when the wakeup fd was
        free (main thread only, as signal.signal requires)."""
        def handler(signum: int, frame: Any) -> None:
            report()
        signal.signal(signal.SIGTERM, handler)
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if old != -1:
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        self.reader, self._writer = r, w

    def fired(self) -> bool:
        """On `reader` readable: whether the bytes waiting say SIGTERM."""
        if self.reader is None:
            return False
        try:
            data = self.reader.recv(64)
        except OSError:
            return False
        return signal.SIGTERM in data

    def restore(self) -> None:
        if self.reader is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
