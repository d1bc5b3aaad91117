"""Attacks on the controller from an outsider on the network, over real loopback sockets.

An outsider without the key must not make the listener buffer large frames, must not exhaust it
with connections that never register, and must not evict a live rank by replaying its recorded
Register frame (which the old controller accepted, then counted the rank dead when the replaying
connection closed, and ran a fault flow)."""

from __future__ import annotations

import socket
import time

import psutil
import pytest

from mindio_ttp.framework_ttp import protocol as P
from mindio_ttp.framework_ttp.config import TTPConfig
from mindio_ttp.framework_ttp.controller import Controller

from .fakes import KEY, FakeRank
from .test_controller import DP, ENV


@pytest.fixture
def ctl():
    c = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0)
    c.listen("127.0.0.1", 0)
    c.start()
    yield c
    c.stop()


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def closed_by_peer(s: socket.socket, timeout_s: float = 5.0) -> bool:
    s.settimeout(timeout_s)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_unauthenticated_large_frames_are_refused_before_buffering(ctl):
    """40 connections each announcing a 15 MiB frame took rank 0 from 20 to 620 MiB."""
    rss_before = psutil.Process().memory_info().rss
    header = P.HEADER.pack(P.MAGIC, P.VERSION, P.Register.TYPE, 15 * 1024 * 1024)
    chunk = b"\0" * (1 << 20)
    socks = []
    for _ in range(40):
        s = socket.create_connection(ctl.address, timeout=5)
        s.sendall(header)
        try:
            for _ in range(15):
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the controller mid-stream: what we want
        socks.append(s)
    try:
        assert all(closed_by_peer(s) for s in socks)
        growth = psutil.Process().memory_info().rss - rss_before
        assert growth < 64 * 1024 * 1024, f"controller buffered {growth / 2**20:.0f} MiB"
        assert ctl.rejected_frames >= 40
        fakes = [FakeRank(ctl.address, r, 4, DP, 2) for r in range(4)]
        assert wait_for(lambda: len(ctl.registered) == 4), "real ranks were not served"
        assert ctl.faults == []
        for f in fakes:
            f.close()
    finally:
        for s in socks:
            s.close()


def test_connections_that_never_register_are_capped(ctl):
    """Beyond world_size + 64 waiting connections the listener closes new ones at once."""
    cap = 4 + 64
    socks = [socket.create_connection(ctl.address, timeout=5) for _ in range(cap + 20)]
    try:
        assert wait_for(lambda: sum(closed_by_peer(s, 0.05) for s in socks[cap:]) == 20)
    finally:
        for s in socks:
            s.close()


def test_replayed_register_does_not_evict_a_live_rank(ctl, caplog):
    fakes = [FakeRank(ctl.address, r, 4, DP, 2) for r in range(4)]
    try:
        assert wait_for(lambda: len(ctl.registered) == 4)
        # The outsider recorded rank 1's Register from the wire (same bytes, same key's MAC).
        recorded = P.encode(P.Register(1, 4, DP, 2, "127.0.0.1", 0, 0, 3, False, False, False),
                            KEY)
        with socket.create_connection(ctl.address, timeout=5) as replay:
            replay.sendall(recorded)
            replay.settimeout(5)
            answer = P.FrameDecoder(KEY).feed(replay.recv(65536))
            assert answer and isinstance(answer[0], P.Reject), answer
            assert "already connected" in answer[0].reason
        replayed_at = time.monotonic()
        # rank 1 keeps heartbeating on its own connection (three intervals of 0.1 s) ...
        assert wait_for(lambda: ctl._ranks[1].last_seen > replayed_at + 0.3)
        assert ctl.registered == [0, 1, 2, 3]
        assert ctl.faults == [], "closing the replaying connection must not be a fault"
        assert "refused a Register for rank 1" in caplog.text and "127.0.0.1:" in caplog.text
    finally:
        for f in fakes:
            f.close()
