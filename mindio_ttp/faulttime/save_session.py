"""One save order as the save and rename handlers see it: step, ranks, the order's own store.

The chosen ranks need a rendezvous to build their gloo groups. torch's job store lives in
node 0's launcher agent, so losing node 0 (or just its network) breaks every save that uses
it. Instead the acting controller hosts a fresh TCPStore for each save order, on its own host
and a free port, and names it in the SaveOrder: the only process the save then depends on is
the controller that ordered it, which the flow depends on anyway. The order's random `tag`
prefixes every store key (an outsider who can reach the port cannot guess the keys) and names
the flow's own staging directory, so two flows never write into, or delete, each other's.

The handler contract stays MindIO's (`fn(step, save_ranks, ckpt_args)`); the processor makes
the session current for the handler's thread and `current()` hands it out.
"""

from __future__ import annotations

import ipaddress
import secrets
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Tuple

_local = threading.local()
_last: Optional[SaveSession] = None


@dataclass(frozen=True)
class SaveSession:
    flow_id: int
    step: int
    save_ranks: Tuple[int, ...]
    store_host: str
    store_port: int
    tag: str
    time_limit: float
    _store: list = field(default_factory=list, compare=False, repr=False)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.time_limit)

    def store(self) -> Any:
        """A client of the order's TCPStore (one per session and process)."""
        if not self._store:
            import torch.distributed as dist

            self._store.append(dist.TCPStore(self.store_host, self.store_port, is_master=False,
                                             timeout=self.timeout))
        return self._store[0]


def new_tag() -> str:
    return secrets.token_hex(16)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> Tuple[str, int]:
    """"host:port" or "[v6]:port" from a SaveOrder; ValueError with what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"save store address {text[:80]!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    return host, int(port)


def check_tag(tag: str) -> str:
    if not 16 <= len(tag) <= 64 or any(c not in "0123456789abcdef" for c in tag):
        raise ValueError(f"save tag {tag[:80]!r} is not 16..64 lowercase hex characters")
    return tag


def host_store(ip: str, timeout: float) -> Tuple[Any, int]:
    """A TCPStore server for one save order, on a free port; keep the object alive until the
    order is answered (dropping it stops the server)."""
    import torch.distributed as dist

    store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    return store, int(store.port)


def preload() -> None:
    """Import torch.distributed now: the import holds the GIL for a second or more, which inside
    a flow would starve the controller's I/O thread and make live ranks look hung."""
    import torch.distributed  # noqa: F401


def activate(session: Optional[SaveSession]) -> None:
    """Make `session` current in this thread (the handler's) and the process's latest."""
    global _last
    _local.session = session
    if session is not None:
        _last = session


def current() -> Optional[SaveSession]:
    """The save order this handler runs for (in threads the handler starts: the latest)."""
    return getattr(_local, "session", None) or _last
