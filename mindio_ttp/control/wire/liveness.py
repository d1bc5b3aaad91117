"""The clock a peer's silence is measured on: time this loop was actually looking.

A heartbeat deadline is only fair while the side that judges it is running. When the judging
loop itself stalls (a long GC pause or a GIL-holding C call in the training thread of the rank
that hosts it, a CPU hog on its node, or a controller busy with a flow's broadcast to every
rank), the frames its peers sent meanwhile sit unread in the kernel, and on waking up it would
find every peer silent for as long as it was away: a false fault on every rank at once (the
controller declaring ranks hung, or a processor failing over from a healthy controller). So each
loop keeps a `LookingClock`, says how long it will wait in the selector (`waiting`) and ticks it
once per turn; a turn that took longer than its planned wait (plus `slack`) was time it could
not see, and is left out of every silence it measures afterwards. A peer that is really dead
is still detected: late by at most the judge's own stall.
"""

from __future__ import annotations

import time
from typing import Callable

# a turn may run this much past its planned wait without being counted as a stall: scheduling
# and GIL hand-over delays are milliseconds, so only real stalls reach it
STALL_SLACK_S = 0.1


class LookingClock:
    def __init__(self, slack: float = STALL_SLACK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._slack = slack
        self._last = clock()
        self._planned = 0.0
        self.blind = 0.0  # seconds not looking, in total

    def waiting(self, seconds: float) -> float:
        """The loop is about to wait this long for events (returns it, for the selector)."""
        self._planned = seconds
        return seconds

    def tick(self) -> float:
        """Call once per loop turn, after handling its events; returns the stall found."""
        now = self._clock()
        stall = now - self._last - self._planned - self._slack
        self._planned = 0.0
        self._last = now
        if stall > 0:
            self.blind += stall
            return stall
        return 0.0

    def now(self) -> float:
        """Monotonic time minus every stall so far: use it for last-seen stamps and deadlines."""
        return self._clock() - self.blind
