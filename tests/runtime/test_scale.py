"""The control plane at 2,048 ranks, end to end: the real controller in its own process (as
`ttp_start_controller` starts it), a real processor hosting the real standby controller, and
2,046 simulated processors speaking the real protocol over real sockets (testkit/simranks.py).

Layout as Megatron 285068c builds it for TP 8, PP 4: in each pipeline stage of 512 ranks, DP
groups of 64 ranks at stride 8, 32 shards each (shard i on DP positions i and i + 32). Every
rank finished step 10. The expected savers are computed here from that layout, not by the
runtime: the first holder of each shard, or its partner when the first is dead.

Larger sizes and timings are in the bench (bench/bench_controller_scale.py); these tests check
that every rank got exactly the orders it should, once each.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Dict, List, Set

import pytest
import torch.distributed  # noqa: F401 - imported once here, so forked ranks start at once

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.host import ControllerProcess
from testkit.simranks import RankRecord, RealRank, SimGroup

N, TP, PP, STEP = 2048, 8, 4, 10
STAGE = N // PP
DP = STAGE // TP
REPLICA = DP // 2
REAL = 1  # the real processor: its standby is the first backup (lowest rank, not the host)
KEY = bytes(range(32))
ENV = {"TTP_AUTH_KEY": KEY.hex(), "TTP_LOG_LEVEL": "WARNING", "TTP_OT": "120",
       "TTP_HEARTBEAT_INTERVAL": "2", "TTP_HEARTBEAT_TIMEOUT": "30"}

pytestmark = pytest.mark.slow


def dp_group(rank: int) -> List[int]:
    stage, j = divmod(rank, STAGE)[0], rank % TP
    return list(range(stage * STAGE + j, (stage + 1) * STAGE, TP))


def expected_savers(dead: Set[int]) -> List[int]:
    savers = []
    for stage in range(PP):
        for j in range(TP):
            group = list(range(stage * STAGE + j, (stage + 1) * STAGE, TP))
            for shard in range(REPLICA):
                first, partner = group[shard], group[shard + REPLICA]
                savers.append(partner if first in dead else first)
    return sorted(savers)


@pytest.fixture
def job(monkeypatch):
    """A controller process, the real rank 1 and the simulated rest, all registered."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    cfg = TTPConfig.from_env(world_size=N)
    ctl = ControllerProcess(cfg, N, REPLICA, host_rank=0)
    sims = real = None
    try:
        addr = ctl.start("127.0.0.1", 0)
        real = RealRank(ENV, REAL, dp_group(REAL), N, REPLICA, addr, STEP)
        sims = SimGroup([r for r in range(N) if r != REAL], N, dp_group, REPLICA, KEY,
                        cfg.heartbeat_interval, STEP, procs=2)
        sims.ask("connect", addr)
        assert sims.wait_registered(N - 1, 60), ctl.status()
        deadline = time.monotonic() + 10  # the real rank's standby, announced to everyone
        while not all(b and b[0][0] == REAL for b in sims.ask("backups")):
            assert time.monotonic() < deadline, sims.ask("backups")
            time.sleep(0.1)
        yield ctl, real, sims
    finally:
        for part in (sims, real):
            if part is not None:
                part.close()
        if ctl.proc is not None and ctl.proc.poll() is None:
            ctl.proc.kill()
        ctl.stop()


def records_once_all_exited(sims: SimGroup, dead: Set[int],
                            timeout: float = 60) -> Dict[int, RankRecord]:
    """Every simulated rank's record, once every live one has its exit order (the last are
    still in flight when the controller reports its verdict)."""
    deadline = time.monotonic() + timeout
    while True:
        records = sims.records()
        if all(any(o.kind == "ExitOrder" for o in r.orders)
               for rank, r in records.items() if rank not in dead):
            return records
        if time.monotonic() > deadline:
            return records  # check_orders says which
        time.sleep(0.2)


def check_orders(records: Dict[int, RankRecord], savers: List[int], dead: Set[int]) -> None:
    """Each live simulated rank: lock, advance, its save order iff it saves (naming every
    saver), the rename iff it is the first saver, the exit order (saved, step 10); nothing
    else, nothing twice, all of one flow."""
    wrong = {}
    for rank, rec in records.items():
        if rank in dead:
            assert not rec.orders, (rank, rec.orders)
            continue
        want = ["Lock", "AdvanceTo"] + (["SaveOrder"] if rank in savers else []) + \
            (["RenameOrder"] if rank == savers[0] else []) + ["ExitOrder"]
        got = [o.kind for o in rec.orders]
        flows = {o.flow_id for o in rec.orders}
        save = [o for o in rec.orders if o.kind == "SaveOrder"]
        exits = [o for o in rec.orders if o.kind == "ExitOrder"]
        ok = (got == want and len(flows) == 1 and all(o.step == STEP for o in save + exits)
              and all(list(o.ranks) == savers for o in save + exits)
              and exits[0].outcome == "saved")
        if not ok:
            wrong[rank] = rec.orders
    assert not wrong, f"{len(wrong)} rank(s) got the wrong orders, e.g. {list(wrong.items())[:2]}"


def test_a_dead_saver_at_2048_ranks_every_rank_gets_exactly_its_orders(job):
    ctl, real, sims = job
    victim = 3 * STAGE  # DP position 0 of its group: a saver, replaced by its partner
    sims.ask("mark")
    sims.ask_rank(victim, "abort", victim)
    flow = ctl.flow_report(90)
    assert flow is not None and flow["outcome"] == "saved", (flow, ctl.status())
    assert flow["faults"][0].startswith(f"rank {victim} dead")
    savers = expected_savers({victim})
    assert flow["savers"] == len(savers) == N // 2
    records = records_once_all_exited(sims, {victim})
    check_orders(records, savers, {victim})
    rep = real.report()
    assert rep["exit"] == [83] and rep["calls"] == [("save", STEP, tuple(savers))], rep
    assert rep["standby_state"] == "standby"  # the primary did it all
    # compact orders: a save order and an exit order cost what they cost at 8 ranks
    per_rank = sum(r.bytes_in + r.bytes_out for r in records.values()) / len(records)
    assert per_rank < 2000, per_rank


def test_primary_lost_at_2048_ranks_the_real_standby_takes_over(job):
    ctl, real, sims = job
    os.kill(ctl.pid, signal.SIGKILL)  # node 0's controller gone, every connection with it
    deadline = time.monotonic() + 90
    while True:
        rep = real.report()
        if rep["standby_outcome"] is not None and rep["exit"]:
            break
        assert time.monotonic() < deadline, rep
        time.sleep(0.2)
    assert rep["standby_outcome"] == "saved", rep
    savers = expected_savers(set())
    assert rep["calls"] == [("save", STEP, tuple(savers))], rep
    records = records_once_all_exited(sims, set())
    assert all(r.failed_over_at is not None for r in records.values())
    check_orders(records, savers, set())
