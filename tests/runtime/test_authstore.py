"""The authenticated store: the controller's key space on its own (torch's store semantics,
budgets, waits, namespaces), then `AuthStore` as the rendezvous of real gloo process groups of
four processes, and the per-save store that used to be a plain TCPStore anyone could read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import List

import pytest
import torch.distributed as dist  # imported here: the import holds the GIL for a second

from mindio_ttp import hooks
from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.keyspace import KEY_OVERHEAD, KeySpace
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.rank.authstore import AuthStore
from mindio_ttp.control.rank.processor import Processor
from mindio_ttp.control.wire import protocol as P

from .conftest import DP, ENV
from .fakes import wait_for

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def call(ks: KeySpace, rank: int, op: str, keys: List[str], values=(), amount: int = 0,
         timeout: float = 5.0, ns: str = "ns", req: int = 1) -> List[P.StoreReply]:
    """One request; the replies it got so far (a get/wait may answer later: keep the list)."""
    got: List[P.StoreReply] = []
    msg = P.StoreRequest(req, ns, op, keys, [P.b64encode(v) for v in values], amount, timeout)
    assert P.problem(msg) == ""
    ks.handle(rank, msg, got.append)
    return got


def value(reply: P.StoreReply) -> bytes:
    assert reply.ok, reply.error
    return P.b64decode(reply.values[0])


# -- the key space: torch's TCPStore semantics, bounded ----------------------------------------
def test_set_get_add_compare_set_check_delete_num_keys_as_tcpstore():
    ks = KeySpace()
    assert call(ks, 0, "set", ["a"], [b"\x00\xff"])[0].ok
    assert value(call(ks, 1, "get", ["a"])[0]) == b"\x00\xff"
    assert call(ks, 0, "add", ["n"], amount=5)[0].number == 5
    assert call(ks, 1, "add", ["n"], amount=-2)[0].number == 3
    assert value(call(ks, 0, "get", ["n"])[0]) == b"3"  # a decimal string, as TCPStore keeps it
    assert not call(ks, 0, "add", ["a"], amount=1)[0].ok  # not an integer
    # compare_set: absent + empty expected sets; absent + other expected returns expected;
    # present + equal sets; present + different returns the current value
    assert value(call(ks, 0, "compare_set", ["c"], [b"", b"x"])[0]) == b"x"
    assert value(call(ks, 0, "compare_set", ["d"], [b"e", b"y"])[0]) == b"e"
    assert call(ks, 0, "check", ["d"])[0].number == 0
    assert value(call(ks, 0, "compare_set", ["c"], [b"x", b"z"])[0]) == b"z"
    assert value(call(ks, 0, "compare_set", ["c"], [b"x", b"w"])[0]) == b"z"
    assert call(ks, 0, "check", ["a", "n", "c"])[0].number == 1
    assert call(ks, 0, "check", ["a", "missing"])[0].number == 0
    assert call(ks, 0, "num_keys", [])[0].number == 3
    assert call(ks, 0, "delete_key", ["a"])[0].number == 1
    assert call(ks, 0, "delete_key", ["a"])[0].number == 0
    assert call(ks, 0, "num_keys", [])[0].number == 2
    assert call(ks, 0, "num_keys", [], ns="other")[0].number == 0  # namespaces are apart


def test_get_and_wait_answer_when_the_keys_are_set_or_time_out():
    clock = Clock()
    ks = KeySpace(clock=clock)
    got = call(ks, 1, "get", ["k"], req=7)
    waited = call(ks, 2, "wait", ["k", "j", "k"], req=8)  # a key named twice counts once
    assert got == [] and waited == [] and ks.pending == 2
    call(ks, 0, "set", ["k"], [b"v"])
    assert [value(r) for r in got] == [b"v"] and got[0].req == 7
    assert waited == []  # still waits for "j"
    call(ks, 0, "add", ["j"], amount=1)
    assert waited and waited[0].ok and waited[0].req == 8 and ks.pending == 0
    late = call(ks, 3, "wait", ["never"], timeout=2.0)
    clock.now += 1.0
    ks.expire()
    assert late == []
    clock.now += 1.5
    ks.expire()
    assert late and not late[0].ok and "timeout" in late[0].error and "'never'" in late[0].error
    assert ks.pending == 0 and ks.used(3) == 0  # the wait's charge is given back


def test_every_rank_and_all_ranks_together_are_bounded_in_bytes():
    ks = KeySpace(rank_budget=10_000, total_budget=25_000)
    assert call(ks, 0, "set", ["a"], [b"x" * 8_000])[0].ok
    refused = call(ks, 0, "set", ["b"], [b"x" * 2_000])[0]
    assert not refused.ok and "rank 0" in refused.error and "STORE_RANK_BUDGET" in refused.error
    assert call(ks, 0, "set", ["a"], [b"x" * 9_000])[0].ok  # rewriting its own key: refunded
    assert call(ks, 1, "set", ["b"], [b"x" * 9_000])[0].ok
    refused = call(ks, 2, "set", ["c"], [b"x" * 9_000])[0]
    assert not refused.ok and "STORE_TOTAL_BUDGET" in refused.error
    assert call(ks, 1, "delete_key", ["b"])[0].number == 1
    assert call(ks, 2, "set", ["c"], [b"x" * 9_000])[0].ok  # the delete freed its share
    assert ks.total <= 25_000
    # overwriting another rank's key moves the charge to the writer
    assert call(ks, 1, "set", ["a"], [b"y"])[0].ok
    assert ks.used(0) < 1_000 and ks.used(1) == len("a") + len(b"y") + KEY_OVERHEAD


def test_a_rank_may_leave_only_so_many_waits_pending():
    ks = KeySpace(waits_per_rank=3)
    for i in range(3):
        assert call(ks, 5, "wait", [f"k{i}"], req=i + 1) == []
    refused = call(ks, 5, "wait", ["k9"], req=9)[0]
    assert not refused.ok and "STORE_WAITS_PER_RANK" in refused.error
    assert call(ks, 6, "wait", ["k9"], req=10) == []  # other ranks are not affected
    ks.forget(5)  # its connection dropped: its waits go, without answers
    assert ks.pending == 1 and ks.used(5) < 1_000


def test_closing_a_namespace_fails_its_waits_and_frees_everything():
    ks = KeySpace()
    waiting = call(ks, 1, "wait", ["never"], ns="ttp-save/ab")
    call(ks, 0, "set", ["k"], [b"v" * 1000], ns="ttp-save/ab")
    other = call(ks, 0, "set", ["k"], [b"v"], ns="keep")
    assert other[0].ok and ks.namespaces == ["keep", "ttp-save/ab"]
    total_before = ks.total
    assert ks.close("ttp-save/ab", "closed: the save order was answered") == 1
    assert waiting and not waiting[0].ok and "closed: the save order" in waiting[0].error
    assert ks.namespaces == ["keep"] and ks.total < total_before - 1000 and ks.used(1) == 0
    ks.close_all("gone")
    assert ks.total == 0 and ks.namespaces == []


def test_a_request_that_breaks_the_store_rules_never_reaches_it():
    """Arity, key sizes and base64 are checked by the protocol layer, on decode and encode."""
    for bad in [P.StoreRequest(1, "ns", "set", ["k"], [], 0, 1.0),
                P.StoreRequest(1, "ns", "get", ["k" * (P.STORE_KEY_MAX + 1)], [], 0, 1.0),
                P.StoreRequest(1, "ns", "set", ["k"], ["not base64!"], 0, 1.0),
                P.StoreRequest(1, "/abs", "num_keys", [], [], 0, 1.0),
                P.StoreRequest(1, "ns", "wait", [f"k{i}" for i in range(65)], [], 0, 1.0),
                P.StoreRequest(0, "ns", "num_keys", [], [], 0, 1.0)]:
        with pytest.raises(P.ProtocolError):
            P.encode(bad, b"k" * 32)
        payload = json.dumps({f: getattr(bad, f) for f in bad.__dataclass_fields__}).encode()
        with pytest.raises(P.ProtocolError):
            P.FrameDecoder(b"k" * 32).feed(P.seal(bad.TYPE, payload, b"k" * 32, 0))


# -- AuthStore over a real processor ------------------------------------------------------------
@pytest.fixture
def rank_processor(ctl):
    hooks.STATE.reset()
    proc = Processor(TTPConfig.from_env(ENV), 1, DP, 4, 2)
    proc.exit_fn = lambda code: None
    proc.start("127.0.0.1", ctl.address[1])
    try:
        yield proc
    finally:
        proc._stop.set()
        proc._mail.wake()
        proc.standby.stop()
        hooks.STATE.reset()


def test_authstore_from_any_thread_and_through_a_prefix_store(ctl, rank_processor):
    store = AuthStore("job/a", timedelta(seconds=5), channel=rank_processor)
    prefixed = dist.PrefixStore("p", store)  # what gloo and torch wrap it in
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v" and store.get("p/k") == b"v"
    assert prefixed.add("n", 2) == 2 and prefixed.add("n", 3) == 5
    assert prefixed.compare_set("n", "5", "six") == b"six"
    assert prefixed.check(["k", "n"]) and not prefixed.check(["nope"])
    assert store.num_keys() == 2 and prefixed.delete_key("k") and store.num_keys() == 1
    got = []
    t = threading.Thread(target=lambda: got.append(prefixed.get("later")))  # blocks meanwhile
    t.start()
    assert wait_for(lambda: ctl.store.pending == 1) and got == []  # it waits at the controller
    AuthStore("job/a", 5, channel=rank_processor).set("p/later", b"x")
    t.join(5)
    assert got == [b"x"]
    with pytest.raises(dist.DistStoreError, match="timeout"):
        prefixed.wait(["never"], timedelta(seconds=0.3))
    assert ctl.store.namespaces == ["job/a"]


def test_a_lost_controller_fails_the_calls_in_flight_at_once(ctl, rank_processor):
    store = AuthStore("job/b", 60, channel=rank_processor)
    errors = []

    def get() -> None:
        try:
            store.get("never")
        except dist.DistStoreError as exc:
            errors.append(str(exc))
    t = threading.Thread(target=get)
    t.start()
    assert wait_for(lambda: ctl.store.pending == 1)
    t0 = time.monotonic()
    ctl._stop.set()  # the controller dies
    ctl._mail.wake()
    ctl._thread.join(5)
    ctl._close_all()
    t.join(10)
    assert errors and "connection to the TTP controller was lost" in errors[0]
    assert time.monotonic() - t0 < 5, "the call waited out its 60 s timeout"


@pytest.mark.slow
def test_process_groups_of_four_processes_rendezvous_on_the_authstore(tmp_path):
    """init_process_group(store=AuthStore(ns)) with torch's store barrier, then Megatron's
    initialize_model_parallel (TP 2, PP 2) on gloo: every group sums its members' ranks."""
    ctl = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0)
    ctl.listen("127.0.0.1", 0)
    ctl.start()
    env = dict(os.environ, **ENV, TTPW_PORT=str(ctl.address[1]), TTPW_NS="recover/1",
               TORCH_DIST_INIT_BARRIER="1", TTP_CONNECT_TIMEOUT="30", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.store_worker"], cwd=REPO,
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(4)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    try:
        assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)
        results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
        # the sum of each group's ranks, and its size: TP pairs (0,1) (2,3), PP pairs (0,2)
        # (1,3), DP of one, one model-parallel group of all four, embedding = pipeline
        want = {0: {"tensor": 1, "pipeline": 2}, 1: {"tensor": 1, "pipeline": 4},
                2: {"tensor": 5, "pipeline": 2}, 3: {"tensor": 5, "pipeline": 4}}
        for res in results:
            r, sums = res["rank"], res["sums"]
            assert sums["world"] == [6.0, 4.0] and sums["model"] == [6.0, 4.0]
            assert sums["data"] == [float(r), 1.0]
            assert sums["tensor"] == [float(want[r]["tensor"]), 2.0]
            assert sums["pipeline"] == [float(want[r]["pipeline"]), 2.0]
            assert sums["embedding"] == sums["pipeline"]
        assert "recover/1" in ctl.store.namespaces and ctl.store.total > 0
        ctl.close_store("recover/1")
        assert wait_for(lambda: ctl.store.namespaces == []) and ctl.store.total == 0
        assert ctl.faults == [] and ctl.rejected_frames == 0
    finally:
        ctl.stop()
