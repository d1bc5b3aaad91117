"""A scripted processor speaking the real protocol, for in-process controller tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator, List, Optional, Tuple

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire.session import RankHandshake

KEY = bytes.fromhex("00112233445566778899aabbccddeeff")


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def read_frames(sock: socket.socket, dec: P.FrameDecoder, timeout: float = 5.0) -> list:
    """Blocking: the next message(s) from `sock` (ProtocolError / ConnectionError propagate)."""
    sock.settimeout(timeout)
    msgs = dec.feed(b"")
    while not msgs:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed by the listener")
        msgs = dec.feed(data)
    return msgs


def handshake(sock: socket.socket, reg: P.Register, key: bytes = KEY,
              timeout: float = 5.0) -> RankHandshake:
    """What a processor does on connect: read the Challenge and answer it with `reg`."""
    hs = RankHandshake(key)
    challenge = read_frames(sock, hs.dec, timeout)[0]
    hs.sent = hs.answer(challenge, reg)  # type: ignore[attr-defined] - what went on the wire
    sock.sendall(hs.sent)  # type: ignore[attr-defined]
    return hs


class FakeRank:
    def __init__(self, addr, rank: int, world: int, dp_ranks: List[int], replica: int,
                 step: Optional[int] = 3, updating: bool = False, save_ok: bool = True,
                 heartbeat: float = 0.1, key: bytes = KEY, standby_port: int = 0) -> None:
        self.rank, self.step, self.updating, self.save_ok = rank, step, updating, save_ok
        self.heartbeat = heartbeat
        self.key = key
        self.received: List[P.Message] = []
        self.received_at: List[float] = []  # time.monotonic() of each message
        self.exit: Optional[P.ExitOrder] = None
        self.silent = False  # stop heartbeating and answering (a hung rank)
        self._send_lock = threading.Lock()
        self.sock = socket.create_connection(addr, timeout=5)
        self.hs = handshake(self.sock, P.Register(rank, world, dp_ranks, replica, "127.0.0.1",
                                                  standby_port, 0, step, updating, False, False),
                            key)
        self.sock.settimeout(heartbeat)
        self.dec = self.hs.dec
        self._stop = threading.Event()
        self.got_exit = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, msg: P.Message) -> None:
        with self._send_lock:  # the test thread and ours both send: keep seq order on the wire
            self.sock.sendall(self.hs.tx.seal(msg))

    def _run(self) -> None:
        seq = 0
        next_hb = 0.0
        while not self._stop.is_set():
            if not self.silent and time.monotonic() >= next_hb:
                seq += 1
                try:
                    self.send(P.Heartbeat(self.rank, seq, self.step, self.updating))
                except OSError:
                    return
                next_hb = time.monotonic() + self.heartbeat
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            for m in self.dec.feed(data):
                self.received.append(m)
                self.received_at.append(time.monotonic())
                if not self.silent:
                    try:
                        self._answer(m)
                    except OSError:  # closed by the test while a flow was talking to us
                        return

    def _answer(self, m: P.Message) -> None:
        if isinstance(m, P.Lock):
            self.send(P.StateReport(m.flow_id, 1, self.rank, self.step, self.updating))
        elif isinstance(m, P.AdvanceTo):
            self.send(P.StateReport(m.flow_id, 2, self.rank, self.step, self.updating))
        elif isinstance(m, P.SaveOrder):
            self.send(P.SaveResult(m.flow_id, self.rank, self.save_ok,
                                   "" if self.save_ok else "disk full", 0.01))
        elif isinstance(m, P.RenameOrder):
            self.send(P.RenameResult(m.flow_id, self.rank, True, "", 0.01))
        elif isinstance(m, P.ExitOrder):
            self.exit = m
            self.got_exit.set()

    def of_type(self, cls) -> list:
        return [m for m in self.received if isinstance(m, cls)]

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self.thread.join(2)


@contextlib.contextmanager
def real_processor(env: dict, rank: int, dp: List[int], world: int,
                   replica: int) -> Iterator[Tuple[object, list]]:
    """A real processor (not started: the test starts it where it wants) and the exit codes it
    asked for; stopped, with its standby, afterwards."""
    from mindio_ttp import hooks
    from mindio_ttp.config import TTPConfig
    from mindio_ttp.control.rank.processor import Processor

    hooks.STATE.reset()
    proc = Processor(TTPConfig.from_env(env), rank, dp, world, replica)
    codes: list = []
    proc.exit_fn = codes.append
    try:
        yield proc, codes
    finally:
        proc._stop.set()
        proc._mail.wake()
        if proc.standby:
            proc.standby.stop()
        hooks.STATE.reset()
