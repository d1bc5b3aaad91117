"""Free TCP ports for launches on one machine (the demo, the tests, the benchmarks)."""

from __future__ import annotations

import random
import socket

__all__ = ["pick_free_port"]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (pick one per launch).

    The port is bound again later by another process, so it can be taken in between. A port
    from bind(0) lies in the kernel's ephemeral range, which every outgoing connection on the
    machine draws from (gloo, stores, other jobs' tests), and such a collision was seen on a
    loaded machine. Below that range only an explicit bind can take it: pick at random there.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(10000, low) if low > 10001 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
