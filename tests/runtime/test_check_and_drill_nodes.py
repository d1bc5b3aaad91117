"""`ttprun --check` and `ttprun --drill` on two real nodes: network namespaces on one switch
(testkit/netns.py), a launcher in each, as a user runs them on a cluster.

The check meets the other node through the launch's own rendezvous and passes on a healthy
pair; with node 0's controller port behind a firewall (a DROP, so the other node's connection
times out), a loopback gloo interface on node 1, or the standby listeners' ports blocked, it
fails and its table names the port or the setting. The drill provokes one real fault in the
4-rank demo job (2 ranks per node), and ttprun on both nodes says what the job did (recovered in
memory: demo/recovery.py, or wrote the dying checkpoint) and that the result checks out; the
same with real Megatron: tests/megatron/test_drill_megatron.py.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from pathlib import Path
from typing import Iterator, List

import pytest

from testkit.netns import TwoNodes, namespaces_unavailable
from testkit.netns import two_nodes as two_nodes_made

pytestmark = pytest.mark.slow

ENV = {
    "TTP_OT": "40",
    "TTP_HEARTBEAT_INTERVAL": "0.25",
    "TTP_HEARTBEAT_TIMEOUT": "2",
    "TTP_SAVE_TIME_LIMIT": "15",
    "TTP_RENAME_TIME_LIMIT": "5",
    "TTP_COLLECT_TIMEOUT": "3",
    "TTP_UPDATE_GRACE": "0.5",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
TIMEOUT = 90.0


class Cluster(TwoNodes):
    """Two nodes, one key, one controller port, a shared checkpoint directory."""

    def env(self, **extra: str) -> dict:
        env = {**os.environ, **ENV, **extra}
        env.setdefault("TTP_AUTH_KEY", self.key)
        env.setdefault("TTP_CONTROLLER_PORT", str(self.controller_port))
        return env

    def setup(self) -> None:
        self.key = secrets.token_hex(32)
        self.controller_port = 20000 + secrets.randbelow(10000)
        self.ckpt.mkdir(parents=True, exist_ok=True)

    def start_all(self, ttprun: List[str], job: List[str], per_node_env=None,
                  rdzv: str = "static") -> None:
        """The same command on both nodes; `per_node_env(node)`: more variables for one."""
        port = 40000 + secrets.randbelow(20000)
        for n in self.nodes:
            n.lines.clear()
            cmd = [sys.executable, "-m", "mindio_ttp.launch.agent", *ttprun,
                   *self.ttprun_args(n, nproc=2, port=port, rdzv=rdzv), *job]
            extra = per_node_env(n) if per_node_env else {}
            self.launch(n, cmd, self.env(**extra), gloo_ifname="GLOO_SOCKET_IFNAME" not in extra)

    def codes(self) -> List[int]:
        return [self.wait(n, TIMEOUT) for n in self.nodes]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    with two_nodes_made(tmp_path, Cluster) as nodes:
        nodes.setup()
        yield nodes


def _check_job(cluster: Cluster) -> List[str]:
    return ["-m", "mindio_ttp.demo.job", "--steps=5", f"--out={cluster.work / 'out'}",
            "--ckpt-dir=unused", "--save", str(cluster.ckpt), "--load", str(cluster.ckpt)]


def _table(text: str) -> dict:
    """{check: (result, detail)} from ttprun --check's table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^  (\S.*?)\s{2,}(ok|FAIL|-)\s{2,}(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_check_passes_on_two_healthy_nodes_and_starts_nothing(cluster: Cluster,
                                                              rdzv: str) -> None:
    cluster.start_all(["--check"], _check_job(cluster), rdzv=rdzv)
    assert cluster.codes() == [0, 0], cluster.outputs()
    for n in cluster.nodes:
        out = n.output()
        assert "ttprun --check: every check passed: exit 0" in out, cluster.outputs()
        rows = _table(out)
        assert {name for name, (result, _) in rows.items() if result != "ok"} == set(), rows
        for name in ("rendezvous store", f"controller port {cluster.controller_port}",
                     "standby listeners", "gloo interface", "clocks", "checkpoint directory",
                     "settings agree"):
            assert name in rows, (name, out)
        gloo = rows["gloo interface"][1]  # each node's own address, reached from the other
        assert gloo.startswith(f"node 0 {cluster.nodes[0].addr} (GLOO_SOCKET_IFNAME="), gloo
        assert f"node 1 {cluster.nodes[1].addr} (" in gloo and "reached from the others" in gloo
        assert "shared by every node" in rows["checkpoint directory"][1]
        assert "rank 0 |" not in out  # no worker ran
        assert f"{rdzv} rendezvous at {cluster.nodes[0].addr}:" in out
    assert not list(cluster.ckpt.glob(".ttp-check-*"))  # the probe files are removed


def test_check_names_the_blocked_controller_port(cluster: Cluster) -> None:
    """A firewall on node 0 drops TCP to the controller port: before, the first sign was
    every rank's `cannot reach the TTP controller` after TTP_CONNECT_TIMEOUT (60 s)."""
    node0 = cluster.nodes[0]
    cluster.block_port(node0, cluster.controller_port)
    cluster.start_all(["--check"], _check_job(cluster))
    assert cluster.codes() == [1, 1], cluster.outputs()
    for n in cluster.nodes:
        rows = _table(n.output())
        result, detail = rows[f"controller port {cluster.controller_port}"]
        assert result == "FAIL", rows
        assert detail.startswith(f"node(s) [1] cannot connect to {node0.addr}:"
                                 f"{cluster.controller_port} (timed out"), detail
        assert f"open TCP port {cluster.controller_port} on node 0 ({node0.addr})" in detail
        assert "TTP_CONTROLLER_PORT" in detail
        assert rows["standby listeners"][0] == "ok" and rows["settings agree"][0] == "ok", rows
        assert (f"1 check(s) failed (controller port {cluster.controller_port}): exit 1"
                in n.output())


def test_check_names_blocked_standby_ports_and_a_loopback_gloo_interface(
        cluster: Cluster) -> None:
    node1 = cluster.nodes[1]
    cluster.block_port(node1, 29500, 29509)
    cluster.start_all(["--check"], _check_job(cluster), per_node_env=lambda n: dict(
        TTP_LISTEN_PORTS="29500-29509",
        **({"GLOO_SOCKET_IFNAME": "lo"} if n.index == 1 else {})))
    assert cluster.codes() == [1, 1], cluster.outputs()
    rows = _table(cluster.nodes[0].output())
    result, detail = rows["standby listeners"]
    assert result == "FAIL" and f"node 0 cannot connect to node 1's {node1.addr}:2950" in detail
    assert "open TTP_LISTEN_PORTS=29500-29509 between the nodes" in detail, detail
    result, detail = rows["gloo interface"]
    assert result == "FAIL", rows
    assert detail.startswith("node 1: GLOO_SOCKET_IFNAME=lo is 127.0.0.1, a loopback address"), \
        detail
    assert "set GLOO_SOCKET_IFNAME to the interface the nodes reach each other through" in detail


def test_check_says_when_the_key_differs(cluster: Cluster) -> None:
    cluster.start_all(["--check"], _check_job(cluster), per_node_env=lambda n: (
        {"TTP_AUTH_KEY": secrets.token_hex(32), "TTP_OT": "300"} if n.index == 1 else {}))
    assert cluster.codes() == [1, 1], cluster.outputs()
    result, detail = _table(cluster.nodes[1].output())["settings agree"]
    assert result == "FAIL", detail
    assert "the key (TTP_AUTH_KEY / TTP_AUTH_KEY_FILE) differs between nodes" in detail
    assert "TTP_OT (node 0: 40, node 1: 300)" in detail
    assert cluster.key not in cluster.outputs()  # compared by digest, never shown


DEMO = ["-m", "mindio_ttp.demo.job", "--steps=30", "--step-delay=0.02"]


@pytest.mark.parametrize("spec, rank, mode", [
    ("kill:rank=3:iter=6", 3, "in-memory"),
    ("hang:iter=6", None, "dying-checkpoint"),
    ("exception:rank=1:iter=6", 1, "in-memory"),
    ("kill:rank=2:iter=6", 2, "dying-checkpoint"),
])
def test_drill_on_two_nodes_says_what_the_job_did_and_that_it_checks_out(
        cluster: Cluster, spec: str, rank, mode: str) -> None:
    out = cluster.work / "out"
    job = [*DEMO, f"--ckpt-dir={cluster.ckpt}", f"--out={out}"]
    cluster.start_all([f"--drill={spec}"], job, per_node_env=lambda n: {"TTP_RECOVERY": mode})
    codes = cluster.codes()
    assert codes == ([0, 0] if mode == "in-memory" else [1, 1]), cluster.outputs()
    said = set()
    for n in cluster.nodes:
        text = n.output()
        m = re.search(r"ttprun: DRILL \(--drill (\S+)\): rank (\d+)", text)
        assert m, text
        said.add(int(m.group(2)))
        verdict = [ln for ln in text.splitlines() if ln.startswith("ttprun: DRILL RESULT: ")]
        assert len(verdict) == 1, text
        if mode == "in-memory":
            assert verdict[0].startswith("ttprun: DRILL RESULT: PASSED: the job recovered in "
                                         "memory: recovery 1 committed at iteration 6, "
                                         "replacing rank(s) ["), verdict
            assert "every refilled copy passed its hash check" in verdict[0]
        else:
            assert verdict[0].startswith("ttprun: DRILL RESULT: PASSED: the job wrote the "
                                         "dying checkpoint: iteration 6 in "), verdict
            assert "its manifest verifies" in verdict[0] and "marked latest" in verdict[0]
            assert "6 is the newest consistent iteration" in verdict[0], verdict
    assert len(said) == 1, said  # random: the same rank on both nodes
    struck = said.pop()
    if rank is not None:
        assert struck == rank
    armed = [n for n in cluster.nodes if n.printed(f"DRILL ARMED: this rank ({struck})")]
    assert [n.index for n in armed] == [struck // 2], cluster.outputs()
    # the fault was the drill's, of the kind asked for, and nothing fired twice
    assert cluster.outputs().count("DRILL: rank ") == 1, cluster.outputs()
    if mode == "in-memory":  # trained on to the end, the same as without a fault
        assert "rank 0 | finished step 30" in cluster.nodes[0].output(), cluster.outputs()
        # the recovery path's lines say what happens, at its level: no failure words
        text = cluster.outputs()
        assert "starting the dying-checkpoint flow" not in text
        assert "process is gone" not in text
        # (the struck rank's own exception is its fault, said at ERROR; nobody else's is)
        assert not [ln for ln in text.splitlines()
                    if " ERROR " in ln and f"[ttp rank {struck}]" not in ln], text


def test_a_drill_left_in_the_environment_does_nothing(cluster: Cluster) -> None:
    """TTP_DRILL is not a switch: without --drill ttprun drops it and no rank arms."""
    out = cluster.work / "out"
    job = ["-m", "mindio_ttp.demo.job", "--steps=8", f"--ckpt-dir={cluster.ckpt}",
           f"--out={out}"]
    cluster.start_all([], job, per_node_env=lambda n: {
        "TTP_DRILL": '{"kind": "kill", "rank": 0, "iteration": 2, "run_dir": "/x"}'})
    assert cluster.codes() == [0, 0], cluster.outputs()
    text = cluster.outputs()
    assert "TTP_DRILL is set in the environment: ignored and not passed on" in text
    assert "DRILL ARMED" not in text and "DRILL RESULT" not in text
