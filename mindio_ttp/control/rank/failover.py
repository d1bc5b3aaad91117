"""A processor's failover: after losing its controller, register with the announced standby
controllers in order, in rounds, until TTP_OT runs out.

What a target holds (a backups entry [rank, host, port]) is a key holder's word: an entry that
cannot be reached, whatever the reason (a bad address, a refusal, a host that cannot be
encoded), is skipped for the next. A target gets `per_try` seconds to send its challenge (a hung
process accepts TCP connections in the kernel), and then the full handshake timeout to answer
our Register (one taking the whole job's failover answers late). The processor owns the state
around it (locking training, the connection it gets); this module owns the connecting.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindio_ttp.control.wire.transport import Conn, connect

log = logging.getLogger("mindio_ttp.processor")

# long enough for two SYN retransmissions (1 s, 3 s): a backup's accept queue overflows when
# the whole job fails over to it at once
FAILOVER_CONNECT_S = 3.5
ROUND_PAUSE_S = 0.2

Handshake = Callable[[socket.socket, float], Conn]  # (socket, challenge timeout) -> registered


def try_target(entry: List[Any], per_try: float, handshake: Handshake,
               rank: int) -> Tuple[Optional[Conn], str]:
    """Connect to one target and register; (None, why) on any failure."""
    target, host, port = (list(entry) + [None, None, None])[:3]
    try:
        sock = connect(host, port, timeout=min(FAILOVER_CONNECT_S, per_try))
    except Exception as exc:  # noqa: BLE001 - OSError, but also a host that cannot encode
        log.warning("rank %d: backup controller on rank %s at %s:%s unreachable: %s", rank,
                    target, ascii(host)[:80], port, exc)
        return None, f"unreachable ({exc})"
    try:
        return handshake(sock, per_try), ""
    except Exception as exc:  # noqa: BLE001 - HandshakeFailed, OSError, ValueError
        log.warning("rank %d: backup controller on rank %s at %s:%s: %s", rank, target, host,
                    port, exc)
        sock.close()
        return None, str(exc)


def rounds(backups: Callable[[], List[List[Any]]], per_try: float, handshake: Handshake,
           rank: int, deadline: float, stop: threading.Event) -> Tuple[
               Optional[Conn], Optional[List[Any]], Dict[Any, str]]:
    """Every target in order, round after round, until one takes us or `deadline`: (the
    connection, the entry that took us, why each failed last)."""
    tried: Dict[Any, str] = {}
    while time.monotonic() < deadline and not stop.is_set():
        for entry in list(backups()):
            conn, err = try_target(entry, per_try, handshake, rank)
            if conn is not None:
                return conn, entry, tried
            tried[(list(entry) + [None])[0]] = err
        stop.wait(ROUND_PAUSE_S)
    return None, None, tried
