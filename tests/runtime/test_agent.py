"""Node agents and relays (control/agent/, control/relay/, control/wire/): what an agent may and
may not do to its ranks' orders, a relay lost without a fault, the agent under another
launcher, and its pre-authentication bounds."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import List

import pytest

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.agent.client import AgentLink
from mindio_ttp.control.agent.node import AgentSettings
from mindio_ttp.control.controller.host import ControllerProcess
from mindio_ttp.control.wire import envelope as E
from mindio_ttp.control.wire import keys as K
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import ranksets
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.session import new_nonce
from testkit.agenthost import AgentHost
from testkit.simranks import SimGroup

from .fakes import wait_for
from .jobs import run_job

KEY = bytes(range(32))
RANK = 5
INC = b"i" * 16


def welcome(link: AgentLink, nonce: str, rank: int = RANK, seq: int = 1,
            key: bytes = K.order_key(KEY)) -> T.Sealed:
    w = T.Welcome(INC.hex(), "primary", 0, "", [], [rank], [nonce])
    return T.Sealed(E.seal(key, INC, seq, [[rank, 1, 1, 0, 1]], w))


def order(msg: P.Message, seq: int, dst: List[List[int]] = (), key: bytes = K.order_key(KEY),
          inc: bytes = INC) -> T.Sealed:
    return T.Sealed(E.seal(key, inc, seq, list(dst) or ranksets.all_but(8), msg))


def test_an_agent_cannot_make_alter_redirect_or_replay_an_order():
    """A node agent holds the hop key only: every way it could act on an order is refused by
    the rank itself; what the controller sealed passes once."""
    link = AgentLink(KEY, RANK)
    nonce = new_nonce()
    link.inbox.nonces.add(nonce)
    # a Welcome the agent made, or one for another rank's registration: not enrolled
    assert link.classify(welcome(link, nonce, key=link.hop_key))[0] == link.REFUSED
    assert link.classify(welcome(link, new_nonce()))[0] == link.REFUSED
    assert link.classify(order(P.Lock(1), 2))[0] == link.REFUSED  # no incarnation welcomed
    assert link.classify(welcome(link, nonce))[0] == link.ORDER
    # plain orders, as a direct controller sends them: an agent's are refused
    for plain in (P.Lock(1), P.ExitOrder(1, "saved", 3, [1], 83, "forged"),
                  P.SaveOrder(1, 3, [RANK], 10.0, "ns", "ab" * 8)):
        assert link.classify(plain)[0] == link.REFUSED
    # sealed with the hop key (all an agent has), altered, re-addressed, another incarnation
    assert link.classify(order(P.Lock(1), 2, key=link.hop_key))[0] == link.REFUSED
    good = order(P.ExitOrder(1, "saved", 3, [1], 83, "verdict"), 3)
    altered = bytearray(good.data)
    altered[-40] ^= 1  # a byte of the payload
    assert link.classify(T.Sealed(bytes(altered)))[0] == link.REFUSED
    head = E.HEAD.size
    readdressed = bytearray(good.data)
    readdressed[head:head + E.BLOCK.size] = E.BLOCK.pack(RANK, 1, 1, 0, 1)
    assert link.classify(T.Sealed(bytes(readdressed)))[0] == link.REFUSED
    assert link.classify(order(P.Lock(1), 4, inc=b"j" * 16))[0] == link.REFUSED
    assert link.classify(order(P.Lock(1), 5, dst=[[0, 1, RANK, 0, 1]]))[0] == link.REFUSED
    # what the controller sealed for this rank: once; the same bytes again are a duplicate
    kind, msg = link.classify(good)
    assert kind == link.ORDER and isinstance(msg, P.ExitOrder) and msg.reason == "verdict"
    assert link.classify(good)[0] == link.DUPLICATE
    assert link.classify(order(P.Lock(1), 2))[0] == link.DUPLICATE  # an older seq: not new


def test_a_processor_through_a_forging_agent_obeys_nothing_it_made(tmp_path, monkeypatch):
    """A real processor registered through a real controller and agent; then frames only the
    agent could make reach it (a plain ExitOrder, an envelope sealed with the hop key): it
    neither exits nor locks, and still answers the controller."""
    from mindio_ttp import hooks
    from mindio_ttp.control.rank.processor import Processor

    env = {"TTP_AUTH_KEY": KEY.hex(), "TTP_HEARTBEAT_INTERVAL": "0.2",
           "TTP_HEARTBEAT_TIMEOUT": "3", "TTP_LOG_LEVEL": "WARNING", "TTP_CONNECT_TIMEOUT": "20"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = TTPConfig.from_env(world_size=2)
    host = ControllerProcess(cfg, 2, 1, host_rank=0)
    agents = proc = None
    try:
        addr = host.start("127.0.0.1", 0)
        agents = AgentHost(KEY, AgentSettings(2, 0.2, 3.0), 1)
        monkeypatch.setenv("TTP_AGENT_SOCKET", agents.paths[0])
        hooks.STATE.reset()
        proc = Processor(TTPConfig.from_env(world_size=2), 1, [0, 1], 2, 1)
        codes: list = []
        proc.exit_fn = codes.append
        proc.start(*addr)
        assert proc._agent is not None and proc.controller_rank == 0
        hop = proc._agent.hop_key
        forged = [P.ExitOrder(1, "saved", 3, [1], 83, "forged by the agent"),
                  T.Sealed(E.seal(hop, bytes.fromhex(proc._incarnation), 999,
                                  ranksets.all_but(2), P.Lock(7)))]
        for m in forged:  # as if read from the agent's socket
            proc._handle(m)
        assert codes == [] and not proc.fault_seen and not hooks.STATE.locked
        assert proc._agent.refused == 2
        assert wait_for(lambda: host.status()["routed"] == 1)
    finally:
        if proc is not None:
            proc.shutdown()
        if agents is not None:
            agents.close()
        host.stop()
        hooks.STATE.reset()


N, PER_NODE = 64, 8


def dp_group(rank: int) -> List[int]:
    return [rank % 8 + 8 * i for i in range(8)]  # DP groups of 8 at stride 8: 4 shards each


@pytest.mark.slow
def test_a_lost_relay_is_no_fault_its_agents_come_back_and_the_flow_still_reaches_everyone(
        monkeypatch):
    """8 nodes of 8 simulated ranks, TTP_FANOUT=3: the controller serves three agents, the other
    five are sent to them. One relay's process is SIGKILLed: its child agents register again
    (sent to the other relay, or taken directly), its own ranks register with the controller
    themselves; nothing is declared dead. A fault after that still reaches every rank."""
    env = {"TTP_AUTH_KEY": KEY.hex(), "TTP_HEARTBEAT_INTERVAL": "0.5",
           "TTP_HEARTBEAT_TIMEOUT": "4", "TTP_LOG_LEVEL": "WARNING", "TTP_FANOUT": "3",
           "TTP_OT": "60"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = TTPConfig.from_env(world_size=N)
    host = ControllerProcess(cfg, N, 4, host_rank=0)
    hosts: List[AgentHost] = []
    sims = None
    try:
        addr = host.start("127.0.0.1", 0)
        settings = AgentSettings(N, 0.5, 4.0, local_world=PER_NODE)
        for _ in range(N // PER_NODE):  # a process per node: one can be lost alone
            hosts.append(AgentHost(KEY, settings, 1))
        where = {r: hosts[r // PER_NODE].paths[0] for r in range(N)}
        sims = SimGroup(range(N), N, dp_group, 4, KEY, 0.5, 10, procs=1, agents=where)
        sims.ask("connect", addr)
        assert sims.wait_registered(N, 60), host.status()
        assert wait_for(lambda: host.status()["children"] == 3, 20), host.status()
        relays = [h for h in hosts if h.status()[0]["children"]]
        assert len(relays) == 3
        lost = relays[0]
        below = lost.status()[0]["children"]
        os.kill(lost.pid, signal.SIGKILL)
        lost.proc.join(5)
        # every rank is served again, nobody is dead
        assert wait_for(lambda: host.status()["routed"] + sum(
            1 for r in sims.records().values() if r.failed_over_at) == N, 30), host.status()
        time.sleep(cfg.heartbeat_interval + 2)  # past the route grace
        st = host.status()
        assert st["n_faults"] == 0 and st["registered"] == N, st
        assert below >= 1
        # a fault now reaches every rank through what is left
        sims.ask_rank(9, "abort", 9)
        flow = host.flow_report(60)
        assert flow is not None and flow["outcome"] == "saved", (flow, host.status())
        deadline = time.monotonic() + 30
        while True:
            recs = sims.records()
            missing = [r for r, rec in recs.items() if r != 9 and not any(
                o.kind == "ExitOrder" for o in rec.orders)]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not missing, missing[:8]
        assert not any(o.kind in ("PlainFromAgent", "RefusedEnvelope", "ProtocolError")
                       for rec in recs.values() for o in rec.orders)
    finally:
        if sims is not None:
            sims.close()
        for h in hosts:
            if h.proc.is_alive():
                h.close()
            else:
                h.proc.join(1)
        host.stop()


@pytest.mark.slow
def test_under_another_launcher_the_node_s_ranks_start_one_agent_and_register_through_it(
        tmp_path):
    """Four ranks started as plain processes (no ttprun): the first to find no agent starts
    one, the others find it; every rank registers through it and the job saves on a fault."""
    res = run_job(tmp_path, {"faults": [{"kind": "kill", "rank": 2, "step": 5,
                                         "phase": "inside"}]})
    logs = res.all_logs()
    assert logs.count("started the node agent") == 1, logs
    assert res.flow is not None and res.flow["outcome"] == "saved", logs
    assert "seen by its node agent" in logs


@pytest.mark.slow
def test_a_lost_node_agent_is_no_fault_its_ranks_register_themselves_and_train_on(tmp_path):
    """The node agent's process is SIGKILLed mid-training (rank 1 does it at step 3): every
    rank registers with the controller itself and training ends normally, no flow, exit 0;
    then a rank's death is still saved by the rest."""
    res = run_job(tmp_path, {"faults": [{"kind": "kill_agent", "rank": 1, "step": 3,
                                         "phase": "after"}]})
    logs = res.all_logs()
    assert res.codes == {r: 0 for r in range(4)}, logs
    assert res.flow is None and "killing the node agent" in logs
    assert logs.count("registering with the controller itself") == 4, logs
    res = run_job(tmp_path / "again", {"faults": [
        {"kind": "kill_agent", "rank": 1, "step": 3, "phase": "after"},
        {"kind": "kill", "rank": 3, "step": 5, "phase": "inside"}]})
    assert res.codes == {0: 83, 1: 83, 2: 83, 3: -9}, res.all_logs()


def test_an_agent_s_local_listener_refuses_a_flood_and_still_serves_its_ranks():
    """More unauthenticated local connections than it lets wait: the rest are closed at once,
    and what the waiting ones may send is bounded (the frame cap of an unregistered peer)."""
    settings = AgentSettings(8, 0.2, 3.0, handshake_timeout=30.0, local_pending_cap=16)
    agents = AgentHost(KEY, settings, 1)
    socks = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(agents.paths[0])
            s.settimeout(2)
            socks.append(s)
        closed = 0
        for s in socks:
            try:
                first = s.recv(4096)
            except socket.timeout:
                first = b"?"
            if first == b"":
                closed += 1
        assert closed >= 64 - 16, closed  # refused beyond the cap, before a byte is read
        # a waiting one that sends a frame larger than an unregistered peer may: closed
        live = next(s for s in socks if s.fileno() != -1)
        big = P.HEADER.pack(P.MAGIC, P.VERSION, P.Register.TYPE, 0, 10**7)
        live.sendall(big + b"x" * 100)
        assert wait_for(lambda: _closed(live), 5)
    finally:
        for s in socks:
            s.close()
        agents.close()


def _closed(s: socket.socket) -> bool:
    try:
        s.settimeout(0.1)
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except socket.timeout:
        return False
    except OSError:
        return True


@pytest.mark.parametrize("behaviour,detail", [
    (None, "no challenge within 1 s (TTP_HANDSHAKE_TIMEOUT)"),
    (b"HTTP/1.0 400 Bad Request\r\n\r\n", "bad magic"),
    (P.encode(P.Challenge("00" * 16), b"another job's key 0123456789"), "bad HMAC"),
])
def test_through_an_agent_a_busy_controller_port_still_fails_fast_and_says_so(behaviour, detail,
                                                                              monkeypatch):
    """The rank that starts its node's agent checks the controller's port once with the job
    key (an agent could not tell another job's controller from ours): a port held by something
    else ends it at once, with the same words as a rank without an agent, and the agent it
    started is gone."""
    import psutil

    from mindio_ttp import hooks
    from mindio_ttp.control.rank.processor import Processor
    from mindio_ttp.hooks import TTPError

    from .test_handshake import FakeListener

    monkeypatch.delenv("TTP_AGENT_SOCKET", raising=False)
    env = {"TTP_AUTH_KEY": KEY.hex(), "TTP_HANDSHAKE_TIMEOUT": "1", "TTP_CONNECT_TIMEOUT": "30",
           "TTP_LOG_LEVEL": "WARNING"}
    other = FakeListener(behaviour)
    hooks.STATE.reset()
    p = Processor(TTPConfig.from_env(env), 1, [0, 1, 2, 3], 4, 2)
    p.exit_fn = lambda code: None
    before = {c.pid for c in psutil.Process().children()}
    t0 = time.monotonic()
    try:
        with pytest.raises(TTPError) as err:
            p.start("127.0.0.1", other.port)
        took = time.monotonic() - t0
    finally:
        if p.standby is not None:
            p.standby.stop()
        other.close()
        hooks.STATE.reset()
    msg = str(err.value)
    assert took < 10, took  # the agent's start (an interpreter) plus one handshake's time
    assert f"127.0.0.1:{other.port}" in msg and detail in msg and "free the port" in msg
    assert not [c for c in psutil.Process().children() if c.pid not in before and c.is_running()
                and c.status() != psutil.STATUS_ZOMBIE]
