"""One save order as the save and rename handlers see it: step, ranks, the order's own store.

The chosen ranks need a rendezvous to build their gloo groups. torch's job store lives in
node 0's launcher agent, so losing node 0 (or just its network) breaks every save that uses
it, and anyone on the network can read and write it. A plain TCPStore hosted per order by the
controller was no better on the second count: any client could list its keys, write under them
and grow the controller's process. So the order names a namespace of the acting controller's
authenticated store (control/rank/authstore.py): its operations travel over the rank's own TTP
connection, only registered ranks reach it, and it is bounded in bytes and dropped when the
flow ends. The only process the save depends on is the controller that ordered it, which the
flow depends on anyway. The order's random `tag` names the namespace and the flow's own staging
directory, so two flows never write into, or delete, each other's.

The handler contract stays MindIO's (`fn(step, save_ranks, ckpt_args)`); the processor makes
the session current for the handler's thread and `current()` hands it out.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Tuple

_local = threading.local()
_last: Optional[SaveSession] = None
NAMESPACE_PREFIX = "ttp-save/"


@dataclass(frozen=True)
class SaveSession:
    flow_id: int
    step: int
    save_ranks: Tuple[int, ...]
    namespace: str  # of the acting controller's authenticated store
    tag: str
    time_limit: float
    channel: Any = field(default=None, compare=False, repr=False)  # the processor
    # what opens the order's store: the control plane's AuthStore, handed down by the order's
    # handler (mindio_ttp/handlers.py), so the fault-time path does not import the control plane
    opener: Any = field(default=None, compare=False, repr=False)
    _store: list = field(default_factory=list, compare=False, repr=False)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.time_limit)

    def store(self) -> Any:
        """The order's store (one per session and process): an AuthStore over this rank's
        connection to the controller that gave the order."""
        if not self._store:
            if self.opener is None:
                raise RuntimeError("this save session has no store (it was not made by a save "
                                   "order's handler)")
            self._store.append(self.opener(self.namespace, self.timeout, channel=self.channel))
        return self._store[0]


def new_tag() -> str:
    return secrets.token_hex(16)


def namespace_of(tag: str) -> str:
    """The store namespace of the save order with this tag."""
    return NAMESPACE_PREFIX + tag


def activate(session: Optional[SaveSession]) -> None:
    """Make `session` current in this thread (the handler's) and the process's latest."""
    global _last
    _local.session = session
    if session is not None:
        _last = session


def current() -> Optional[SaveSession]:
    """The save order this handler runs for (in threads the handler starts: the latest)."""
    return getattr(_local, "session", None) or _last
