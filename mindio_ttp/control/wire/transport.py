"""Non-blocking framed connections for a selector loop, plus small socket helpers.

A `Conn` owns one socket, an incremental `FrameDecoder` and an output buffer; the controller
keeps thousands of them in one `selectors` loop (one thread, no thread per connection), the
processor keeps one. Only the owning loop thread touches a Conn; other threads hand frames to
the loop through `Mailbox`, which wakes the selector through a socketpair.
"""

from __future__ import annotations

import collections
import selectors
import socket
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Tuple

from mindio_ttp.control.wire.protocol import FrameDecoder, Message
from mindio_ttp.control.wire.session import Sealer

RECV_CHUNK = 65536


class ConnClosed(Exception):
    """The peer closed or reset the connection."""


class Conn:
    __slots__ = ("sock", "tx", "dec", "out", "peer", "rank", "last_rx", "closed", "data",
                 "writing", "handshake", "clock", "ack_due", "child")

    def __init__(self, sock: socket.socket, tx: Sealer, dec: FrameDecoder,
                 peer: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.sock = sock
        self.tx = tx  # key and sequence number of what we send
        self.dec = dec  # key and sequence number of what we accept
        self.handshake: Any = None  # the listener's ListenerHandshake until it is done
        self.out = bytearray()
        self.peer = peer
        self.rank: Optional[int] = None
        self.clock = clock  # what last_rx is stamped with (liveness.LookingClock.now)
        self.last_rx = clock()
        self.closed = False
        self.data: Any = None
        self.writing = False  # registered for EVENT_WRITE in the owner's selector
        self.ack_due: Optional[int] = None  # a heartbeat read, its ack not queued yet
        self.child: Any = None  # a node agent or relay below (control/relay/), once it registered

    def read(self, limit: Optional[int] = None) -> List[Message]:
        """Drain what the socket has (at most `limit` bytes); raises ConnClosed on EOF/reset,
        ProtocolError on a bad frame (the caller closes the connection in both cases)."""
        msgs: List[Message] = []
        while limit is None or limit > 0:
            want = RECV_CHUNK if limit is None else min(RECV_CHUNK, limit)
            try:
                chunk = self.sock.recv(want)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise ConnClosed(str(exc)) from None
            if not chunk:
                if msgs:
                    break  # deliver what came before EOF; EOF is seen on the next read
                raise ConnClosed("connection closed by peer")
            self.last_rx = self.clock()
            msgs.extend(self.dec.feed(chunk))
            if len(chunk) < want:
                break
            if limit is not None:
                limit -= len(chunk)
        return msgs

    def queue(self, msg: Message) -> None:
        self.out += self.tx.seal(msg)

    def queue_payload(self, code: int, payload: bytes) -> None:
        """A message serialised once for many connections, sealed for this one."""
        self.out += self.tx.seal_payload(code, payload)

    def queue_raw(self, data: bytes) -> None:
        self.out += data

    def flush(self) -> bool:
        """Send as much as the kernel takes; True when nothing is left."""
        while self.out:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                raise ConnClosed(str(exc)) from None
            del self.out[:n]
        return True

    def close(self) -> None:
        """Close the socket and free the buffers now: a listener's select() batch may still
        hold this object while it drops thousands of connections."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass
        self.dec.release()
        self.out = bytearray()
        self.handshake = None


def flush(conn: Conn, sel: Any, drop: Callable[[Conn, str], None]) -> None:
    """Send what `conn` has queued without blocking; watch it for writability in `sel` only
    while bytes are left (a selector change is a syscall: made only when the interest changes).
    A connection found closed goes to `drop`. The controller and the node agents share this:
    a relay's loop is the controller's loop for its subtree."""
    if conn.closed:
        return
    try:
        done = conn.flush()
    except ConnClosed as exc:
        drop(conn, f"connection dropped: {exc}")
        return
    if conn.writing == done:
        conn.writing = not done
        try:
            sel.modify(conn.sock, selectors.EVENT_READ if done
                       else selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        except (KeyError, ValueError):
            pass  # no longer registered: dropped by a callback of this same flush


def deliver(conn: Conn, msgs: List[Message], dispatch: Callable[[Conn, Message], None]) -> None:
    """Hand every message of one read to `dispatch`, then the frames that came behind a
    handshake frame (they wait in the decoder for the session key), until `conn` closes."""
    while msgs:
        for m in msgs:
            if conn.closed:
                return
            dispatch(conn, m)
        msgs = conn.dec.feed(b"") if conn.dec.pending and not conn.closed else []


class Mailbox:
    """Thread-safe queue of work for a selector loop, with a wake-up socket: each item is a
    callable and its arguments, run in order on the loop's thread (`run_all`), like asyncio's
    call_soon_threadsafe: no dispatch on strings, and the arguments are the callee's."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._lock = threading.Lock()
        self._items: Deque[Tuple[Any, ...]] = collections.deque()

    @property
    def reader(self) -> socket.socket:
        return self._r

    def put(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            self._items.append((fn, *args))
        self.wake()

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except OSError:
            pass  # buffer full (a wake is already pending) or closed

    def drain(self) -> List[Tuple[Any, ...]]:
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def run_all(self) -> None:
        """Run every queued call, in order (on the loop's thread)."""
        for fn, *args in self.drain():
            fn(*args)

    def close(self) -> None:
        for s in (self._r, self._w):
            try:
                s.close()
            except OSError:
                pass


def connect(host: str, port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_messages(sock: socket.socket, dec: FrameDecoder, timeout: float) -> List[Message]:
    """Blocking read until at least one message arrives (registration handshakes only)."""
    deadline = time.monotonic() + timeout
    msgs = dec.feed(b"")  # frames already buffered behind the previous handshake frame
    if msgs:
        return msgs
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {timeout:g} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(RECV_CHUNK)
        except socket.timeout:
            raise TimeoutError(f"no answer within {timeout:g} s") from None
        if not chunk:
            raise ConnClosed("connection closed during handshake")
        msgs = dec.feed(chunk)
        if msgs:
            return msgs
