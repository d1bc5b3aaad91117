"""What the chosen ranks of a dying checkpoint say to each other (mindio_ttp.megatron_ttp.exchange),
with real processes and a real TCPStore, no Megatron: the writer's flag and the main params sent
to it while the other world members never show up (dead); a second attempt for the same step
and ranks does not trip over the first one's store keys; and the flag costs every rank O(1)
store operations (one connection), whatever the number of ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist

from mindio_ttp.megatron_ttp import exchange

pytestmark = pytest.mark.slow
WRITER, SENDER = 0, 3  # world ranks 1 and 2 are "dead": they never join
MEMBER = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from mindio_ttp.megatron_ttp import exchange
port, rank, writer = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
timeout = timedelta(seconds=20)
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
results = []
for attempt in range(2):  # same step, same ranks, twice
    tag = exchange.attempt_tag(7, [0, 3])
    prefix = tag + "/dp/"
    if rank == writer:
        exchange.share_flag(store, prefix + "rebuild", attempt == 0)
        got = exchange.receive_from(store, prefix, [3], 3, timeout) if attempt == 0 else {}
        results.append([tag, {str(k): v.tolist() for k, v in got.items()}])
    else:
        flag = exchange.read_flag(store, prefix + "rebuild", timeout)
        if flag:
            exchange.send_to(store, prefix, rank, torch.full((3,), float(rank)), timeout)
        results.append([tag, flag])
print(json.dumps(results), flush=True)
# The runtime ends every process with os._exit after the flow; do the same: a gloo group still
# alive at interpreter teardown can abort the process after the work is done.
import os
os._exit(0)
"""


def test_chosen_ranks_exchange_without_the_rest_of_the_world(free_port):
    host = dist.TCPStore("127.0.0.1", free_port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=20))
    procs = {r: subprocess.Popen([sys.executable, "-c", MEMBER, str(free_port), str(r),
                                  str(WRITER)], stdout=subprocess.PIPE, text=True)
             for r in (WRITER, SENDER)}
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
    (tag0, received0), (tag1, received1) = got[WRITER]
    assert tag0 != tag1
    assert received0 == {str(SENDER): [3.0] * 3} and received1 == {}
    assert [flag for _, flag in got[SENDER]] == [True, False]  # the writer decided, twice


class CountingStore:
    """A store that counts each caller's operations (the flag needs nothing else)."""

    def __init__(self) -> None:
        self.real = dist.HashStore()
        self.ops: Counter = Counter()

    def _count(self) -> None:
        self.ops[threading.current_thread().name] += 1

    def set(self, key, value) -> None:
        self._count()
        self.real.set(key, value)

    def get(self, key) -> bytes:
        self._count()
        return self.real.get(key)

    def wait(self, keys, timeout) -> None:
        self._count()
        self.real.wait(keys, timeout)


@pytest.mark.parametrize("readers", [1, 63])
def test_the_flag_costs_every_rank_a_constant_number_of_store_operations(readers):
    store, seen = CountingStore(), {}

    def read(i: int) -> None:
        seen[i] = exchange.read_flag(store, "tag/dp/rebuild", timedelta(seconds=20))

    threads = [threading.Thread(target=read, args=(i,), name=f"reader-{i}")
               for i in range(readers)]
    for t in threads:
        t.start()
    writer = threading.Thread(target=exchange.share_flag, args=(store, "tag/dp/rebuild", True),
                              name="writer")
    writer.start()
    for t in threads + [writer]:
        t.join(30)
    assert seen == {i: True for i in range(readers)}
    assert store.ops["writer"] == 1
    assert {store.ops[f"reader-{i}"] for i in range(readers)} == {2}  # wait, get: O(1)


def test_a_value_that_is_not_a_flag_is_refused():
    store = dist.HashStore()
    store.set("k", b"yes")
    with pytest.raises(ValueError, match="not a flag"):
        exchange.read_flag(store, "k", timedelta(seconds=1))
    store.set("k2", b"1")
    assert exchange.read_flag(store, "k2", timedelta(seconds=1))
