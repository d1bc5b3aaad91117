"""The handshake from both ends over real loopback sockets: deadlines, a busy controller port,
a listener that replays a recorded answer, and fuzzed bytes against a live listener."""

from __future__ import annotations

import collections
import errno
import socket
import struct
import threading
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindio_ttp import hooks
from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.rank.processor import HandshakeFailed, Processor
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire.session import RankHandshake
from mindio_ttp.hooks import TTPError

from .conftest import DP, ENV
from .fakes import KEY, FakeRank, read_frames
from .jobs import run_job


def everything_until_closed(s: socket.socket, timeout_s: float = 5.0) -> bytes:
    s.settimeout(timeout_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return data


class FakeListener:
    """Something else on the controller's port: accepts and then `behaviour` (bytes to send,
    or None to stay silent), keeping each connection open until closed itself."""

    def __init__(self, behaviour=None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self.behaviour = behaviour
        self.conns = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(c)
            if self.behaviour is not None:
                try:
                    c.sendall(self.behaviour)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
        for c in self.conns:
            c.close()


def register(rank: int = 1) -> P.Register:
    return P.Register(rank, 4, DP, 2, "127.0.0.1", 0, 0, 3, False, False, False)


def processor(**over) -> Processor:
    """A processor that connects to the controller itself (TTP_NODE_AGENT=0): these are its
    own handshake's tests (through a node agent: test_agent.py)."""
    hooks.STATE.reset()
    p = Processor(TTPConfig.from_env(dict(ENV, TTP_CONNECT_TIMEOUT="30", TTP_NODE_AGENT="0",
                                          **over)), 1, DP, 4, 2)
    p.exit_fn = lambda code: None
    return p


def stop(p: Processor) -> None:
    p._stop.set()
    p._mail.wake()
    if p.standby is not None:
        p.standby.stop()
    hooks.STATE.reset()


@pytest.mark.parametrize("behaviour,detail", [
    (None, "no challenge within 1 s (TTP_HANDSHAKE_TIMEOUT)"),
    (b"HTTP/1.0 400 Bad Request\r\n\r\n", "bad magic"),
    (P.encode(P.Challenge("00" * 16), b"another job's key 0123456789"), "bad HMAC"),
    (struct.pack("!2sBBI", P.MAGIC, 1, 2, 2) + b"{}" + bytes(32),  # a version-1 controller
     f"peer speaks TTP protocol version 1, this runtime speaks {P.VERSION}: run the same"),
])
def test_a_busy_controller_port_fails_the_processor_fast_and_says_what_to_do(behaviour, detail):
    other = FakeListener(behaviour)
    p = processor(TTP_HANDSHAKE_TIMEOUT="1")
    t0 = time.monotonic()
    try:
        with pytest.raises(TTPError) as err:
            p.start("127.0.0.1", other.port)
        took = time.monotonic() - t0
    finally:
        stop(p)
        other.close()
    msg = str(err.value)
    assert took < 3, f"took {took:.1f} s; TTP_CONNECT_TIMEOUT is 30"
    assert f"127.0.0.1:{other.port}" in msg and detail in msg
    assert "free the port" in msg and "TTP_CONTROLLER_PORT" in msg


def test_the_controller_rank_names_a_busy_port_and_what_to_do():
    other = FakeListener()
    c = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0)
    try:
        with pytest.raises(TTPError) as err:
            c.listen("127.0.0.1", other.port)
    finally:
        other.close()
    msg = str(err.value)
    assert f"cannot listen on 127.0.0.1:{other.port}: the port is in use" in msg
    assert "Free the port" in msg and "TTP_CONTROLLER_PORT" in msg
    assert errno.errorcode[errno.EADDRINUSE]  # the case the message is for


def test_a_connection_that_does_not_finish_the_handshake_is_closed_at_the_deadline(caplog):
    c = Controller(TTPConfig.from_env(dict(ENV, TTP_HANDSHAKE_TIMEOUT="0.5")), 4, 2, host_rank=0)
    c.listen("127.0.0.1", 0)
    c.start()
    try:
        with socket.create_connection(c.address, timeout=5) as s:
            t0 = time.monotonic()
            data = everything_until_closed(s)
            took = time.monotonic() - t0
        assert [type(m) for m in P.FrameDecoder(KEY).feed(data)] == [P.Challenge]
        assert 0.4 < took < 2.0, took
        assert "did not complete the handshake within TTP_HANDSHAKE_TIMEOUT=0.5" in caplog.text
    finally:
        c.stop()


def test_a_controller_that_never_acks_fails_the_processor_after_the_deadline():
    """The listener sends a valid challenge (a key holder) and then hangs."""
    other = FakeListener(P.encode(P.Challenge("ab" * 16), KEY))
    p = processor(TTP_HANDSHAKE_TIMEOUT="1")
    t0 = time.monotonic()
    try:
        with pytest.raises(TTPError, match="registration failed: no answer to our Register"):
            p.start("127.0.0.1", other.port)
        assert time.monotonic() - t0 < 3
    finally:
        stop(p)
        other.close()


def test_a_listener_replaying_a_recorded_answer_is_not_trusted(ctl):
    """Challenge and RegisterAck recorded from a real controller, replayed by an impostor
    listener: the ack is sealed with the session key of the recorded connection, not ours."""
    with socket.create_connection(ctl.address, timeout=5) as s:
        s.settimeout(5)
        hs = RankHandshake(KEY)
        challenge = s.recv(65536)  # one small frame: whole on loopback
        s.sendall(hs.answer(hs.dec.feed(challenge)[0], register(1)))
        ack = s.recv(65536)
        assert isinstance(hs.dec.feed(ack)[0], P.RegisterAck)  # a real registration
    recorded = challenge + ack
    impostor = FakeListener(recorded)
    p = processor()
    try:
        sock = socket.create_connection(("127.0.0.1", impostor.port), timeout=5)
        with pytest.raises(HandshakeFailed, match="registration failed: bad HMAC"):
            p._handshake(sock, failover=True, timeout=2)
    finally:
        stop(p)
        impostor.close()


def test_a_real_processor_registers_and_its_heartbeats_flow_under_the_session_key(ctl):
    p = processor()
    try:
        p.start("127.0.0.1", ctl.address[1])
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5 and (ctl.registered != [1] or
                                             ctl._ranks[1].last_seen < t0 + 0.3):
            time.sleep(0.01)
        assert ctl.registered == [1] and ctl.rejected_frames == 0
        assert p._conn is not None and p._conn.tx.seq > 3  # Register, then heartbeats 1, 2, ...
    finally:
        stop(p)


# -- fuzz: nothing an outsider sends authenticates, crashes or grows the listener ---------------
ATTACKS = st.sampled_from(["random", "truncated", "flipped", "recorded"])


def test_fuzz_the_listener_never_authenticates_and_keeps_serving(ctl):
    """Random bytes, a genuine answer to this connection's challenge cut short or with one bit
    flipped, and a genuine answer recorded on another connection: the listener closes each,
    never acks, stays within its memory bound and then serves a real rank."""
    rank2 = FakeRank(ctl.address, 2, 4, DP, 2)  # registered and heartbeating throughout
    recorded = rank2.hs.sent
    rss_before = psutil.Process().memory_info().rss
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=120, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(ATTACKS, st.data())
    def attack(kind, data):
        seen[kind] += 1
        with socket.create_connection(ctl.address, timeout=5) as s:
            s.settimeout(5)
            dec = P.FrameDecoder(KEY, handshake=True)
            challenge = read_frames(s, dec)[0]
            if kind == "random":
                wire = data.draw(st.binary(max_size=600))
            else:
                genuine = RankHandshake(KEY).answer(challenge, register(1))
                if kind == "truncated":
                    wire = genuine[:data.draw(st.integers(0, len(genuine) - 1))]
                elif kind == "flipped":
                    bit = data.draw(st.integers(0, 8 * len(genuine) - 1))
                    wire = bytearray(genuine)
                    wire[bit // 8] ^= 1 << (bit % 8)
                    wire = bytes(wire)
                else:
                    wire = recorded
            try:
                s.sendall(wire)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # closed by the listener already
            rest = everything_until_closed(s)
        # under the job key, behind the Challenge, there must be nothing at all: no ack, and
        # no Reject (a Reject would mean the Register was accepted as this connection's)
        assert rest == b"", (kind, rest[:64])
        assert 1 not in ctl.registered

    try:
        attack()
    except BaseException:
        rank2.close()
        raise
    assert sum(seen.values()) >= 100 and len(seen) == 4, seen
    assert ctl.registered == [2]
    growth = psutil.Process().memory_info().rss - rss_before
    assert growth < 32 * 1024 * 1024, f"the listener grew by {growth / 2**20:.0f} MiB"
    t0 = time.monotonic()
    while ctl._pending and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert not ctl._pending, "closed connections must leave no pending state"
    fake = FakeRank(ctl.address, 3, 4, DP, 2)
    try:
        t0 = time.monotonic()
        while 3 not in ctl.registered and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert ctl.registered == [2, 3] and ctl.faults == []
    finally:
        fake.close()
        rank2.close()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.data())
def test_fuzz_the_rank_side_never_trusts_a_listener_without_the_key(data, more):
    """Whatever an impostor listener sends, the processor's handshake fails with a reason (or
    times out), never hands back a connection."""
    a, b = socket.socketpair()
    p = Processor(TTPConfig.from_env(ENV), 1, DP, 4, 2)
    try:
        if more.draw(st.booleans()):  # behind a genuine-looking challenge of another key
            data = P.encode(P.Challenge("cd" * 16), bytes(32)) + data
        b.sendall(data)
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(HandshakeFailed):
            p._handshake(a, failover=True, timeout=0.2)
    finally:
        a.close()
        b.close()


# -- a busy port ends every rank of a real job within seconds ------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("behaviour", [None, b"SSH-2.0-OpenSSH_9.6\r\n"])
def test_a_busy_controller_port_ends_every_rank_within_seconds(tmp_path, behaviour):
    """Rank 0 cannot bind; the other ranks reach the port's holder. With the default handshake
    timeout (10 s) every rank exits non-zero with the port in its message, where they used to
    wait TTP_CONNECT_TIMEOUT (60 s by default) and then some."""
    other = FakeListener(behaviour)
    try:
        res = run_job(tmp_path, {"steps": 3}, world=2, timeout=60,
                      env_extra={"TTP_CONTROLLER_PORT": str(other.port),
                                 "TTP_CONNECT_TIMEOUT": "60"})
    finally:
        other.close()
    where = f"127.0.0.1:{other.port}"
    assert all(code not in (0, None) for code in res.codes.values()), res.all_logs()
    assert res.elapsed < 10 + 8, f"{res.elapsed:.1f} s\n{res.all_logs()}"
    assert f"cannot listen on {where}: the port is in use" in res.logs[0], res.logs[0]
    assert f"TTP controller at {where}: no valid TTP handshake" in res.logs[1], res.logs[1]
    for r in (0, 1):
        assert "TTP_CONTROLLER_PORT" in res.logs[r]
