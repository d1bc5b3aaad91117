"""A spare node takes over a lost node's ranks (mindio_ttp.launch.takeover): the plan every
agent computes from the round's member records, the records' signatures, and three real
`ttprun` nodes in network namespaces (c10d rendezvous), one of them the spare.

The workers here are small scripts, not the TTP runtime: they report the place torch gave them
and wait, so the launcher's part is tested on its own (which node runs which ranks, with which
environment, which processes survive); the recovery that uses it is tested on real Megatron in
tests/megatron."""

from __future__ import annotations

import json
import os
import secrets
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List

import psutil
import pytest
import torch.distributed as dist

from mindio_ttp.launch.replace import ReplacementRequest
from mindio_ttp.launch.takeover import (
    MEMBER_KEY,
    NONCE_KEY,
    WANTED_KEY,
    Assignment,
    Member,
    NodeTakeover,
    TakeoverRefused,
    exchange,
    plan,
)
from testkit.netns import Nodes, made_nodes, namespaces_unavailable

KEY = bytes(range(32))


def survivor(group_rank: int, width: int = 2, nodes: int = 2, asks=()) -> Member:
    return Member(True, width, group_rank, nodes, nodes * width,
                  tuple(range(group_rank * width, (group_rank + 1) * width)), "10.0.0.1", 29500, 1,
                  {str(r): {"TTP_RECOVERY_JOIN": "3", "WHO": str(r)} for r in asks})


NEWCOMER = Member(False, 2)


# -- the plan --------------------------------------------------------------------------------
def test_a_fresh_round_is_left_to_torch() -> None:
    assert plan({0: NEWCOMER, 1: NEWCOMER}) == {}


def test_newcomers_take_the_lost_group_ranks_in_round_order() -> None:
    """Any survivor may hold a request (the relay the controller chose); each rank a newcomer
    takes gets its own."""
    members = {0: NEWCOMER, 1: survivor(1, nodes=4, asks=(0, 7)), 2: NEWCOMER,
               3: survivor(2, nodes=4, asks=(1, 6))}

    def env(r: int) -> dict:
        return {"TTP_RECOVERY_JOIN": "3", "WHO": str(r)}

    assert plan(members) == {
        0: Assignment(0, 4, 8, (0, 1), "10.0.0.1", 29500, 1, {0: env(0), 1: env(1)}),
        2: Assignment(3, 4, 8, (6, 7), "10.0.0.1", 29500, 1, {6: env(6), 7: env(7)}),
    }


def test_a_rank_the_recovery_did_not_ask_for_is_not_taken_over() -> None:
    """torch's view of membership can be wrong (a starved keep-alive): only the recovery's
    requests let a newcomer start a rank, so a live node's ranks are never run twice."""
    with pytest.raises(TakeoverRefused, match=r"no replacement request for rank\(s\) \[3\]"):
        plan({0: survivor(0, asks=(2,)), 1: NEWCOMER})


@pytest.mark.parametrize("members, reason", [
    ({0: survivor(0, asks=(2, 3)), 1: Member(False, 4)}, "same number of workers"),
    ({0: survivor(0), 1: survivor(0)}, "held twice"),
    ({0: survivor(0), 1: NEWCOMER, 2: NEWCOMER}, "1 lost node"),
    ({0: survivor(0), 1: survivor(1, nodes=3)}, "disagree on the job"),
    ({0: Member(True, 2, 0, 2, 4, (0, 2), "a", 1, 0), 1: NEWCOMER}, "not a block of 2"),
])
def test_a_plan_that_does_not_add_up_is_refused(members: Dict[int, Member], reason: str) -> None:
    with pytest.raises(TakeoverRefused, match=reason):
        plan(members)


# -- the records on torch's store ------------------------------------------------------------
def _exchange_all(store, members: List[Member], key: bytes = KEY, tamper=None) -> List:
    results: List = [None] * len(members)

    def run(rank: int) -> None:
        try:
            results[rank] = exchange(dist.PrefixStore("round7", store), rank, len(members),
                                     "run", key, members[rank], timedelta(seconds=10))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(members))]
    for t in threads:
        t.start()
    if tamper is not None:
        tamper()
    for t in threads:
        t.join(30)
    return results


def test_every_agent_reads_every_verified_record() -> None:
    store = dist.HashStore()
    results = _exchange_all(store, [survivor(0), NEWCOMER])
    assert results[0] == results[1] == {0: survivor(0), 1: NEWCOMER}


@pytest.mark.parametrize("forgery", ["no key", "replayed", "another key"])
def test_a_record_not_signed_for_this_round_with_this_key_is_refused(forgery: str) -> None:
    """An outsider writes rank 0's record (here: a new master address, where replacements
    would look for the controller) without the key; or copies the record rank 0 signed in an
    earlier round; or is an agent started with another key. The newcomer refuses the round."""
    store = dist.HashStore()
    earlier = dist.PrefixStore("r1", store)
    _exchange_in(earlier, [survivor(0), NEWCOMER])
    now = dist.PrefixStore("r2", store)
    result: List = [None]

    def newcomer() -> None:
        try:
            result[0] = exchange(now, 1, 2, "run", KEY, NEWCOMER, timedelta(seconds=10))
        except TakeoverRefused as exc:
            result[0] = exc

    thread = threading.Thread(target=newcomer)
    thread.start()
    if forgery == "another key":  # which refuses the newcomer's record in turn
        with pytest.raises(TakeoverRefused):
            exchange(now, 0, 2, "run", b"y" * 32, survivor(0), timedelta(seconds=10))
    else:
        now.set(NONCE_KEY.format(0), secrets.token_hex(16))
        if forgery == "replayed":
            now.set(MEMBER_KEY.format(0), earlier.get(MEMBER_KEY.format(0)))
        else:
            payload = Member(True, 2, 0, 2, 4, (0, 1), "6.6.6.6", 29500, 1).to_json()
            now.set(MEMBER_KEY.format(0), f"{payload}\n{'0' * 64}")
    thread.join(30)
    assert isinstance(result[0], TakeoverRefused), result[0]
    assert "does not carry this job's signature" in str(result[0])


def _exchange_in(store, members: List[Member]) -> None:
    threads = [threading.Thread(target=exchange, args=(store, r, len(members), "run", KEY,
                                                       members[r], timedelta(seconds=10)))
               for r in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_member_records_are_validated_field_by_field() -> None:
    good = json.loads(survivor(0).to_json())
    assert Member.from_json(json.dumps(good)) == survivor(0)
    for bad in ({**good, "ranks": "0,1"}, {**good, "running": 1}, {**good, "extra": 1},
                {**good, "master_port": 70000}, {**good, "local_world_size": 0},
                {**good, "requests": {"x": {}}}, {**good, "requests": {"2": {"A": 1}}}):
        with pytest.raises(ValueError):
            Member.from_json(json.dumps(bad))


# -- issue 24 item 3: "takeover wanted" is bound to its round ------------------------------------
class Rounds:
    """torch's c10d rendezvous as the takeover sees it: every round a prefix of one real
    TCPStore on loopback, each agent with a client of its own; `participants` as the
    handler's synced state says (None: it does not say)."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=10))
        self.round, self.participants = 0, None

    def client(self):
        return dist.TCPStore("127.0.0.1", self.store.port, is_master=False,
                             timeout=timedelta(seconds=10))

    def handler(self, rank: int, world: int):
        rounds, client = self, self.client()

        class Handler:
            def get_run_id(self) -> str:
                return "job24"

            def next_rendezvous(self):
                from types import SimpleNamespace
                return SimpleNamespace(store=rounds.round_store(client), rank=rank,
                                       world_size=world)

        h = Handler()
        if self.participants is not None:
            from types import SimpleNamespace
            h._state_holder = SimpleNamespace(state=SimpleNamespace(
                participants={f"node{r}": r for r in self.participants}))
        return h

    def round_store(self, client=None):
        return dist.PrefixStore(f"torch.rendezvous.job24.{self.round}", client or self.store)

    def next(self, agents: List[NodeTakeover]) -> None:
        """Every agent joins the next round (concurrently: the records wait for each other)."""
        self.round += 1
        threads = [threading.Thread(target=a.handler.next_rendezvous) for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)


def two_survivors(rounds: Rounds, key: bytes = KEY) -> List[NodeTakeover]:
    """Agents of nodes 0 and 1 (ranks 0-1 and 2-3 of a 3-node job whose node 2 was lost)."""
    agents = []
    for g in (0, 1):
        me = survivor(g, nodes=3)
        agents.append(NodeTakeover(rounds.handler(g, 2), lambda requests, me=me: me, key))
    return agents


def request(recovery: int, rank: int) -> ReplacementRequest:
    env = {"TTP_RECOVERY_JOIN": json.dumps({"recovery_id": recovery, "rank": rank})}
    return ReplacementRequest(recovery, rank, env)


def test_a_takeover_wanted_copied_into_a_later_round_is_refused(caplog) -> None:
    """After one real takeover an outsider who can read torch's store copied the signed
    "takeover wanted" into a later round: every survivor joined the next round a spare
    waited in, `plan` refused it (0 lost nodes, 1 newcomer) and the spare exited. The key is
    now signed over its round's nonces: in another round it does not verify."""
    rounds = Rounds()
    a, b = two_survivors(rounds)
    rounds.next([a, b])
    a.hold(request(1, 4))  # the relay's launcher holds the recovery's request for node 2
    a.hold(request(1, 5))
    assert a.announce(rounds.round_store()) == []
    assert b.should_join(rounds.round_store())  # this round: a takeover is wanted
    copied = rounds.round_store().get(WANTED_KEY)
    a.pending.clear()  # the takeover happened; the next rounds want none
    rounds.next([a, b])
    later = rounds.round_store()
    later.set(WANTED_KEY, copied)  # the outsider's copy
    assert not b.should_join(later) and not a.should_join(later)
    assert "not signed for this round" in caplog.text
    # a takeover this round wants is still seen
    a.hold(request(2, 4))
    assert a.announce(later) == [] and b.should_join(later)


def test_a_round_whose_nonce_was_overwritten_is_refused() -> None:
    """Records are signed over the round's nonces; an outsider who overwrote them with an
    earlier round's could replay that round's records. Each agent checks its own."""
    class Overwritten:
        def __init__(self) -> None:
            self.inner = dist.HashStore()

        def set(self, key: str, value) -> None:
            self.inner.set(key, value)
            if key == NONCE_KEY.format(0):
                self.inner.set(key, "00" * 16)  # the outsider, right after

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    with pytest.raises(TakeoverRefused, match="nonce of rank 0 in the round was overwritten"):
        exchange(Overwritten(), 0, 1, "run", KEY, survivor(0, nodes=1), timedelta(seconds=5))


def test_a_takeover_wanted_for_ranks_a_node_still_runs_is_refused(caplog) -> None:
    """Signed for this round, but naming ranks that a node still in the round runs (its
    keep-alive has not expired: torch's participants say so), or this node's own: no
    takeover, whatever the key says."""
    rounds = Rounds()
    rounds.participants = [0, 1]
    a, b = two_survivors(rounds)
    rounds.next([a, b])
    a.hold(request(1, 2))  # node 1's rank, and node 1 is a participant
    assert a.announce(rounds.round_store()) == []
    assert not b.should_join(rounds.round_store())
    assert "which a node of this round still runs" in caplog.text


# -- three nodes: two run the job, the third is the spare ---------------------------------------
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import takeover_test_mod  # the warm spares import this ahead

    out, stop = Path(sys.argv[1]), Path(sys.argv[2])
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TTP_RECOVERY_JOIN", "TORCHELASTIC_RESTART_COUNT")
    record = {k: os.environ.get(k) for k in keys}
    record["pid"] = os.getpid()
    record["imported_by"] = takeover_test_mod.IMPORTED_BY
    tmp = out / f".rank{record['RANK']}-{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{record['RANK']}-{os.getpid()}.json")
    while not stop.exists():
        time.sleep(0.05)
    """
)
MODULE = "import os\nIMPORTED_BY = (os.getpid(), os.environ.get('RANK'))\n"
# torch drops a node whose keep-alive is this old (1 s x 5): on a loaded 2-core machine a
# shorter one drops live nodes too (which then, rightly, no takeover follows)
KEEP_ALIVE = ["keep_alive_interval=1", "keep_alive_max_attempt=5"]
TIMEOUT = 120.0


class SpareNodes(Nodes):
    """Three namespaced nodes; nodes 0 and 1 run a 4-rank job, node 2 is the spare."""

    def start_node(self, index: int, port: int, key: str, spares: int = 0) -> None:
        n = self.nodes[index]
        out = self.work / "out"
        out.mkdir(exist_ok=True)
        (self.work / "takeover_test_mod.py").write_text(MODULE)
        (self.work / "worker.py").write_text(WORKER)
        env = dict(os.environ, TTP_AUTH_KEY=key, TTP_RECOVERY="in-memory",
                   PYTHONPATH=os.pathsep.join([str(self.work), os.environ.get("PYTHONPATH", "")]),
                   PYTHONUNBUFFERED="1", TTPRUN_RDZV_NOTICE_S="1")
        cmd = [sys.executable, "-m", "mindio_ttp.launch.agent",
               *self.ttprun_args(n, nproc=2, port=port, rdzv="c10d", nnodes=2,
                                 rdzv_conf=KEEP_ALIVE),
               f"--warm-spares={spares}", str(self.work / "worker.py"), str(out),
               str(self.work / "stop")]
        self.launch(n, cmd, env)

    def reports(self) -> List[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.work / "out").glob("rank*.json"))]


@pytest.fixture
def spare_nodes(tmp_path: Path) -> Iterator[SpareNodes]:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    with made_nodes(tmp_path, 3, SpareNodes) as nodes:
        yield nodes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spare_node_takes_over_a_lost_nodes_ranks_and_the_survivors_keep_theirs(
        spare_nodes: SpareNodes) -> None:
    nodes = spare_nodes
    port, key = 40000 + secrets.randbelow(20000), secrets.token_hex(32)
    node0, node1, node2 = nodes.nodes
    nodes.start_node(0, port, key)
    nodes.start_node(1, port, key)
    nodes.wait_until(lambda: len(nodes.reports()) == 4, "4 workers up", TIMEOUT)
    before = {r["RANK"]: r for r in nodes.reports()}
    assert {r["GROUP_RANK"] for r in before.values()} == {"0", "1"}
    # lose the node that runs ranks 2 and 3 (the round may have put either node there)
    lost_node = _node_of(nodes, before["2"]["pid"])
    assert _node_of(nodes, before["3"]["pid"]) is lost_node
    survivor_node = node0 if lost_node is node1 else node1
    lost, kept = ["2", "3"], ["0", "1"]

    nodes.start_node(2, port, key, spares=2)  # the spare: its warm spares import meanwhile
    nodes.wait_for_line(node2, "this node is a spare", TIMEOUT)  # on torch's redundancy list
    nodes.wait_until(lambda: _imported_ahead(nodes) >= 2, "node 2's warm spares", TIMEOUT)
    nodes.kill(lost_node)
    killed = time.monotonic()
    # torch's rendezvous alone moves nothing: the waiting node stays a spare
    nodes.wait_for_line(survivor_node, "no takeover is wanted: it stays a spare", TIMEOUT)
    assert not _replacements(nodes, before)
    # the recovery's relay (a survivor's worker, played by the test) asks its launcher for
    # the lost ranks, in the request files of launch/replace.py
    run_dir = next(nodes.run_dir(survivor_node).glob("ttprun-*"))
    (run_dir / "replace").mkdir(mode=0o700, exist_ok=True)
    for rank in lost:
        request = {"recovery_id": 7, "rank": int(rank),
                   "env": {"TTP_RECOVERY_JOIN": "7", "MASTER_PORT": "4242"}}
        (run_dir / "replace" / f"r7-rank{rank}.json").write_text(json.dumps(request))

    nodes.wait_until(lambda: len(_replacements(nodes, before)) == 2,
                     "ranks 2 and 3 replaced on node 2", TIMEOUT)
    print(f"node lost -> both replacements running: {time.monotonic() - killed:.1f} s "
          f"(keep-alive {KEEP_ALIVE})")
    after = nodes.reports()
    for rank in lost:
        new = next(r for r in after if r["RANK"] == rank and r["pid"] != before[rank]["pid"])
        old = before[rank]
        assert new["TTP_RECOVERY_JOIN"] == "7", new  # the request, on top of the worker's env
        assert (new["GROUP_RANK"], new["WORLD_SIZE"]) == (old["GROUP_RANK"], "4"), new
        assert (new["MASTER_ADDR"], new["MASTER_PORT"]) == (old["MASTER_ADDR"], "4242")
        status = json.loads((run_dir / "replace" / f"r7-rank{rank}.status.json").read_text())
        assert status["state"] == "started", status  # the relay hears it started
        assert new["TORCHELASTIC_RESTART_COUNT"] == old["TORCHELASTIC_RESTART_COUNT"]
        assert new["pid"] in {p.pid for p in _namespace_processes(node2)}
        # a warm spare of node 2: it imported the script's imports before it had a rank
        assert new["imported_by"] == [new["pid"], None], new
    for rank in kept:  # the survivors were never restarted: same processes, one report each
        assert psutil.pid_exists(before[rank]["pid"])
        assert [r["pid"] for r in after if r["RANK"] == rank] == [before[rank]["pid"]]
    assert "closing signal" not in survivor_node.output(), nodes.outputs()
    assert "keeps its workers" in survivor_node.output(), nodes.outputs()
    assert "takes over group rank" in node2.output(), nodes.outputs()

    (nodes.work / "stop").touch()  # the job ends normally on both nodes it now has
    assert nodes.wait(survivor_node, TIMEOUT) == 0, nodes.outputs()
    assert nodes.wait(node2, TIMEOUT) == 0, nodes.outputs()


def _namespace_processes(node) -> List[psutil.Process]:
    from testkit.netns import ip

    pids = [int(p) for p in ip("netns", "pids", node.ns, check=False).stdout.split()]
    return [psutil.Process(p) for p in pids if psutil.pid_exists(p)]


def _replacements(nodes: SpareNodes, before: Dict[str, dict]) -> List[dict]:
    return [r for r in nodes.reports() if r["pid"] != before[r["RANK"]]["pid"]]


def _node_of(nodes: SpareNodes, pid: int):
    return next(n for n in nodes.nodes if pid in {p.pid for p in _namespace_processes(n)})


def _imported_ahead(nodes: SpareNodes) -> int:
    """How many processes of node 2 are warm spares (their command line says so)."""
    count = 0
    for proc in _namespace_processes(nodes.nodes[2]):
        try:
            if "mindio_ttp.launch.spares" in " ".join(proc.cmdline()):
                count += 1
        except psutil.NoSuchProcess:
            continue
    return count


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_a_spare_node_the_recovery_hears_at_once_that_nothing_can_take_over(
        spare_nodes: SpareNodes) -> None:
    """No node waits beside the round: the relay's launcher fails the requests at once, so the
    recovery falls back to the dying checkpoint instead of waiting out its timeout."""
    nodes = spare_nodes
    port, key = 40000 + secrets.randbelow(20000), secrets.token_hex(32)
    nodes.start_node(0, port, key)
    nodes.start_node(1, port, key)
    nodes.wait_until(lambda: len(nodes.reports()) == 4, "4 workers up", TIMEOUT)
    before = {r["RANK"]: r for r in nodes.reports()}
    lost_node = _node_of(nodes, before["2"]["pid"])
    survivor_node = nodes.nodes[0] if lost_node is nodes.nodes[1] else nodes.nodes[1]
    nodes.kill(lost_node)
    run_dir = next(nodes.run_dir(survivor_node).glob("ttprun-*"))
    (run_dir / "replace").mkdir(mode=0o700, exist_ok=True)
    asked = time.monotonic()
    for rank in (2, 3):
        request = {"recovery_id": 1, "rank": rank, "env": {"TTP_RECOVERY_JOIN": "1"}}
        (run_dir / "replace" / f"r1-rank{rank}.json").write_text(json.dumps(request))
    statuses = [run_dir / "replace" / f"r1-rank{rank}.status.json" for rank in (2, 3)]
    nodes.wait_until(lambda: all(p.is_file() for p in statuses), "both requests answered", 30)
    took = time.monotonic() - asked
    for path in statuses:
        status = json.loads(path.read_text())
        assert status["state"] == "failed", status
        assert "no spare node waits" in status["detail"], status
    assert took < 10, took  # a monitor tick, not the recovery's timeout
    assert [r["pid"] for r in nodes.reports() if r["RANK"] in ("0", "1")] == [
        before["0"]["pid"], before["1"]["pid"]]  # nothing restarted


GROUP_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist

    out, stop = Path(sys.argv[1]), Path(sys.argv[2])
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    record = {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    record.update(attempt=attempt, sum=float(t), pid=os.getpid())
    (out / f"group-{attempt}-{record['RANK']}.json").write_text(json.dumps(record))
    try:
        while not stop.exists():
            dist.all_reduce(torch.ones(1))  # fails once a peer's node is lost
            time.sleep(0.05)
    except RuntimeError:
        os._exit(83)  # what the dying checkpoint's survivors do
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_started_after_a_loss_joins_the_restarted_job(spare_nodes: SpareNodes) -> None:
    """No spare: the survivors' workers exit (as after a dying checkpoint), `--max-restarts 1`
    restarts them, and a node started later (as a scheduler would) completes the rendezvous.
    torch alone fails this twice: the surviving rank 0 does not republish its workers' store
    address, and the new node's workers would start at attempt 0 (another env:// prefix)."""
    nodes = spare_nodes
    (nodes.work / "group_worker.py").write_text(GROUP_WORKER)
    (nodes.work / "out").mkdir(exist_ok=True)
    port, key = 40000 + secrets.randbelow(20000), secrets.token_hex(32)

    def start(i: int) -> None:
        n = nodes.nodes[i]
        env = dict(os.environ, TTP_AUTH_KEY=key, TTP_RECOVERY="in-memory",
                   PYTHONUNBUFFERED="1", TTPRUN_RDZV_NOTICE_S="1")
        cmd = [sys.executable, "-m", "mindio_ttp.launch.agent",
               *nodes.ttprun_args(n, nproc=2, port=port, rdzv="c10d", nnodes=2,
                                  rdzv_conf=KEEP_ALIVE),
               "--max-restarts=1", str(nodes.work / "group_worker.py"),
               str(nodes.work / "out"), str(nodes.work / "stop")]
        nodes.launch(n, cmd, env)

    def groups(attempt: str) -> List[dict]:
        return [json.loads(p.read_text())
                for p in sorted((nodes.work / "out").glob(f"group-{attempt}-*.json"))]

    start(0)
    start(1)
    nodes.wait_until(lambda: len(groups("0")) == 4, "the job's first group", TIMEOUT)
    lost = _node_of(nodes, int(next(g["pid"] for g in groups("0") if g["RANK"] == "2")))
    survivor = nodes.nodes[1 - lost.index]
    nodes.kill(lost)
    start(2)
    nodes.wait_until(lambda: len(groups("1")) == 4, "the restarted job's group", TIMEOUT)
    assert all(g["sum"] == 4.0 for g in groups("1")), groups("1")
    (nodes.work / "stop").touch()
    assert nodes.wait(survivor, TIMEOUT) == 0, nodes.outputs()
    assert nodes.wait(nodes.nodes[2], TIMEOUT) == 0, nodes.outputs()
