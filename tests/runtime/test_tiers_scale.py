"""The control plane in tiers, end to end at 2,048 ranks: the real controller in its own process
(as `ttp_start_controller` starts it), 64 real node agents (control/agent/node.py) in a helper
process, and 2,048 simulated ranks (testkit/simranks.py) registering through them over AF_UNIX
with the hop key, 32 to a node. With TTP_FANOUT=8 the controller serves 8 agents itself and
sends the other 56 to them: the 8 are relays, so every order crosses both tiers.

Layout as Megatron 285068c builds it for TP 8, PP 4 (as in test_scale.py). Every rank finished
step 10. The expected savers are computed here from that layout, not by the runtime.

A saver's connection is reset: its agent sees EOF from a process that still runs (simulated
ranks share one), so the rank is counted dead once it has not registered again within the
controller's route grace; the flow then runs to its verdict, and every simulated rank must
have exactly its orders, each opened and checked by the rank itself (order key, destination,
incarnation, sequence number), none plain from an agent, none refused.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed  # noqa: F401 - imported once here, so forked helpers start at once

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.agent.node import AgentSettings
from mindio_ttp.control.controller.host import ControllerProcess
from testkit.agenthost import AgentHost
from testkit.simranks import SimGroup

from .test_scale import (  # the same job, the same layout, the same oracle
    KEY,
    REPLICA,
    STAGE,
    STEP,
    N,
    dp_group,
    expected_savers,
    records_once_all_exited,
)

PER_NODE = 32
ENV = {"TTP_AUTH_KEY": KEY.hex(), "TTP_LOG_LEVEL": "WARNING", "TTP_OT": "120",
       "TTP_HEARTBEAT_INTERVAL": "1", "TTP_HEARTBEAT_TIMEOUT": "20", "TTP_FANOUT": "8"}

pytestmark = pytest.mark.slow


@pytest.fixture
def job(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    cfg = TTPConfig.from_env(world_size=N)
    ctl = ControllerProcess(cfg, N, REPLICA, host_rank=0)
    agents = sims = None
    try:
        addr = ctl.start("127.0.0.1", 0)
        settings = AgentSettings(N, cfg.heartbeat_interval, cfg.heartbeat_timeout,
                                 cfg.handshake_timeout, cfg.connect_timeout, cfg.ot,
                                 PER_NODE, local_pending_cap=PER_NODE)
        agents = AgentHost(KEY, settings, N // PER_NODE)
        where = {r: agents.paths[r // PER_NODE] for r in range(N)}
        sims = SimGroup(range(N), N, dp_group, REPLICA, KEY, cfg.heartbeat_interval, STEP,
                        procs=2, agents=where)
        t0 = time.monotonic()
        sims.ask("connect", addr)
        assert sims.wait_registered(N, 120), (ctl.status(), sum(sims.ask("registered")))
        storm = time.monotonic() - t0
        yield ctl, agents, sims, storm
    finally:
        for part in (sims, agents):
            if part is not None:
                part.close()
        if ctl.proc is not None and ctl.proc.poll() is None:
            ctl.proc.kill()
        ctl.stop()


def test_a_dead_saver_through_agents_and_relays_every_rank_gets_exactly_its_orders(job):
    ctl, agents, sims, storm = job
    status = ctl.status()
    assert status["children"] == 8 and status["routed"] == N, status  # 8 relays, all routed
    relays = [s for s in agents.status() if s["children"]]
    assert len(relays) == 8 and sum(s["children"] for s in relays) == N // PER_NODE - 8

    victim = 3 * STAGE  # DP position 0 of its group: a saver, replaced by its partner
    sims.ask("mark")
    sims.ask_rank(victim, "abort", victim)
    flow = ctl.flow_report(90)
    assert flow is not None and flow["outcome"] == "saved", (flow, ctl.status())
    assert flow["faults"][0].startswith(f"rank {victim} dead"), flow["faults"][:2]
    savers = expected_savers({victim})
    assert flow["savers"] == len(savers) == N // 2

    records = records_once_all_exited(sims, {victim})
    wrong = {}
    for rank, rec in records.items():
        if rank == victim:
            continue
        want = ["Lock", "AdvanceTo"] + (["SaveOrder"] if rank in savers else []) + \
            (["RenameOrder"] if rank == savers[0] else []) + ["ExitOrder"]
        got = [o.kind for o in rec.orders]
        save = [o for o in rec.orders if o.kind == "SaveOrder"]
        exits = [o for o in rec.orders if o.kind == "ExitOrder"]
        ok = (got == want and len({o.flow_id for o in rec.orders}) == 1
              and all(o.step == STEP for o in save + exits)
              and all(list(o.ranks) == savers for o in save + exits)
              and exits[0].outcome == "saved")
        if not ok:
            wrong[rank] = rec.orders
    assert not wrong, f"{len(wrong)} rank(s) got the wrong orders, e.g. {list(wrong.items())[:2]}"
    # compact on the wire: a flow costs each rank about what it costs at 8 ranks
    per_rank = sum(r.bytes_in + r.bytes_out for r in records.values()) / len(records)
    assert per_rank < 2000, per_rank
    print(f"storm {storm:.1f} s, {per_rank:.0f} B per rank per flow")
