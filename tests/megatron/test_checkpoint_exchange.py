"""The save-time process groups (mindio_ttp.megatron_ttp.exchange) with real processes and a
real TCPStore, no Megatron: the chosen ranks of a 4-rank "world" build a gloo group among
themselves and exchange tensors while the other world members never show up (dead), and a
second attempt for the same step and ranks does not trip over the first one's store keys."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mindio_ttp.megatron_ttp import exchange

pytestmark = pytest.mark.slow
CHOSEN = [3, 0]  # world ranks 1 and 2 are "dead": they never join
MEMBER = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from mindio_ttp.megatron_ttp import exchange
port, rank, chosen = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
results = []
for _attempt in range(2):  # same step, same ranks, twice
    tag = exchange.attempt_tag(7, chosen)
    group = exchange.gloo_group(chosen, rank, tag + "/dp/", store=store,
                                timeout=timedelta(seconds=20))
    exchange.barrier(group)
    parts = exchange.allgather(group, torch.full((3,), float(rank)), len(chosen))
    results.append([tag, [p.tolist() for p in parts]])
# the save handler's agreement on the live weights: true only when every member says so
agree = [exchange.all_true(group, True), exchange.all_true(group, rank != 3)]
print(json.dumps([results, agree]), flush=True)
# The runtime ends every process with os._exit after the flow; do the same: a gloo group still
# alive at interpreter teardown can abort the process ("terminate called without an active
# exception") after the work is done.
import os
os._exit(0)
"""


def test_chosen_ranks_exchange_without_the_rest_of_the_world(free_port):
    host = dist.TCPStore("127.0.0.1", free_port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=20))
    procs = {r: subprocess.Popen([sys.executable, "-c", MEMBER, str(free_port), str(r),
                                  json.dumps(CHOSEN)], stdout=subprocess.PIPE, text=True)
             for r in CHOSEN}
    got = {}
    try:
        for rank, proc in procs.items():
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0
            got[rank] = json.loads(out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    del host
    for rank in CHOSEN:
        (tag0, parts0), (tag1, parts1) = got[rank][0]
        assert got[rank][1] == [True, False]
        assert tag0 != tag1
        assert parts0 == parts1 == [[0.0] * 3, [3.0] * 3]  # global-rank order


def test_single_rank_needs_no_group():
    assert exchange.gloo_group([5], 5, "x/") is None
    t = torch.ones(2)
    assert exchange.allgather(None, t, 1)[0] is t
    assert exchange.all_true(None, True) and not exchange.all_true(None, False)
