"""A node agent's way up: connect, register (`NodeRegister` under the hop key), follow a redirect,
fail over. Runs in a short-lived thread of its own (`ttp-agent-uplink`), so the agent's loop
keeps answering its ranks' heartbeats while a connect or a handshake takes seconds.

Targets are tried in order, in rounds, until a deadline: the controller (the address the ranks
were started with), then the standby controllers it announced. A `Redirect` (the controller serves
enough agents itself) is followed at once; when the relay it names cannot be reached or refuses,
the same controller is asked again with `redirected=True` and then takes the agent itself.
A target that does not send its challenge within `per_try` seconds is skipped (a hung process
accepts TCP connections in the kernel); one that did gets the full handshake timeout, as a
standby taking over a whole job answers late.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.session import RankHandshake
from mindio_ttp.control.wire.transport import ConnClosed, connect, recv_messages

CONNECT_S = 3.5  # two SYN retransmissions (1 s, 3 s): a listener's queue may overflow briefly


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    kind: str  # "controller", "standby", "relay"


def targets(backups: List[object]) -> List[Target]:
    """The standby controllers of a Backups list ([rank, host, port] each), as targets; an
    entry that is not one is left out (the decoder refuses them, but a failover must not
    depend on that)."""
    out = []
    for b in backups:
        try:
            _, host, port = b  # type: ignore[misc]
            out.append(Target(str(host), int(port), "standby"))
        except (TypeError, ValueError):
            continue
    return out


@dataclass
class Linked:
    """A registered upward connection, handed to the agent's loop."""
    sock: socket.socket
    hs: RankHandshake
    ack: T.NodeAck
    early: List[P.Message]
    target: Target
    local_ip: str
    tried: List[str] = field(default_factory=list)


def link(targets: List[Target], hop_key: bytes,
         register: Callable[[str, bool], T.NodeRegister], per_try: float,
         handshake_timeout: float, deadline: float, stop: threading.Event,
         pause: float = 0.2, fallback: Optional[List[Target]] = None) -> Tuple[
             Optional[Linked], List[str]]:
    """The first target (or the relay it redirects to) that takes this agent; (None, why each
    failed) when none did before `deadline`. `register(local_ip, redirected)` makes the
    NodeRegister (the agent opens its relay listener on local_ip first). `fallback` targets
    (the standbys, when the agent lost a relay and not the controller) are tried in a round
    only when every target was unreachable in it: a controller that answers slowly (a storm)
    is kept to, and a standby is never given a job whose controller lives."""
    tried: List[str] = []
    while time.monotonic() < deadline and not stop.is_set():
        before = len(tried)
        unreachable = 0
        for t in list(targets):
            got = _try(t, hop_key, register, per_try, handshake_timeout, False, tried)
            if isinstance(got, T.Redirect):
                relay = Target(got.host, got.port, "relay")
                done = _try(relay, hop_key, register, per_try, handshake_timeout, False, tried)
                if isinstance(done, Linked):
                    done.tried = tried
                    return done, tried
                got = _try(t, hop_key, register, per_try, handshake_timeout, True, tried)
            if isinstance(got, Linked):
                got.tried = tried
                return got, tried
            unreachable += any("unreachable" in w for w in tried[before:])
            if stop.is_set() or time.monotonic() >= deadline:
                break
        if fallback and unreachable >= len(targets):
            got = link(fallback, hop_key, register, per_try, handshake_timeout,
                       min(deadline, time.monotonic() + per_try * (len(fallback) + 1)), stop,
                       pause)[0]
            if got is not None:
                return got, tried
        stop.wait(pause)
    return None, tried


def _try(t: Target, hop_key: bytes, register: Callable[[str, bool], T.NodeRegister],
         per_try: float, handshake_timeout: float, redirected: bool,
         tried: List[str]) -> object:
    where = f"{t.kind} at {t.host}:{t.port}"
    try:
        sock = connect(t.host, t.port, timeout=min(CONNECT_S, per_try))
    except Exception as exc:  # noqa: BLE001 - OSError, or a host that cannot be encoded
        tried.append(f"{where}: unreachable ({exc})")
        return None
    hs = RankHandshake(hop_key, registry=T.CODEC, verify_challenge=False)
    try:
        msgs = recv_messages(sock, hs.dec, per_try)
        local_ip = sock.getsockname()[0]
        sock.sendall(hs.answer(msgs[0], register(local_ip, redirected)))
        msgs = recv_messages(sock, hs.dec, handshake_timeout)
    except (OSError, TimeoutError, ConnClosed, P.ProtocolError) as exc:
        sock.close()
        tried.append(f"{where}: {exc}")
        return None
    first = msgs[0]
    if isinstance(first, T.NodeAck):
        return Linked(sock, hs, first, msgs[1:], t, local_ip)
    sock.close()
    if isinstance(first, T.Redirect):
        return first
    tried.append(f"{where}: refused ({getattr(first, 'reason', type(first).__name__)})")
    return None
