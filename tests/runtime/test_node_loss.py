"""Losing a whole node, and splitting the job in two, with two real `ttprun` "nodes".

Each node is a network namespace with one end of a veth pair (10.213.0.1 and 10.213.0.2, no
other route): a launcher with 2 ranks of the 4-rank demo job runs in each, node 0 hosting
torch's rendezvous store (its agent), the primary controller (rank 0) and MASTER_ADDR. A node
is lost by freezing and then killing every process in its namespace (`ip netns pids`: torch
puts each worker in its own session, so one killpg would miss them); a silent loss takes the
link down first (no FIN, no RST reaches the survivors); a partition takes the link down and
leaves both halves running. Everything made here (processes, namespaces, the veth pair) is
removed by the fixture's finalizer, also when a test fails.

Layout: one DP group [0, 1, 2, 3], replica 2: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and
3, so either node alone holds a clean replica of every shard and could save.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from mindio_ttp.demo import checkpoint
from mindio_ttp.demo.model import ShardLayout, emulate

pytestmark = pytest.mark.slow

SUBNET = "10.213.0"
HB_INTERVAL, HB_TIMEOUT = 0.25, 2.0
ENV = {
    "TTP_OT": "40",
    "TTP_HEARTBEAT_INTERVAL": str(HB_INTERVAL),
    "TTP_HEARTBEAT_TIMEOUT": str(HB_TIMEOUT),
    "TTP_SAVE_TIME_LIMIT": "15",
    "TTP_RENAME_TIME_LIMIT": "5",
    "TTP_COLLECT_TIMEOUT": "3",
    "TTP_UPDATE_GRACE": "0.5",
    "TTP_LOG_LEVEL": "INFO",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
LAYOUT = ShardLayout.for_world(4)
JOB_TIMEOUT = 90.0  # a launcher still running after this is a failure (and killed)
SAVED, NOT_CLAIMED = 83, 87


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


@dataclass
class Node:
    index: int
    ns: str
    veth: str
    proc: Optional[subprocess.Popen] = None
    lines: List[str] = field(default_factory=list)
    reader: Optional[threading.Thread] = None

    @property
    def addr(self) -> str:
        return f"{SUBNET}.{self.index + 1}"

    def output(self) -> str:
        return "\n".join(self.lines)


class TwoNodes:
    """Two namespaces joined by one veth pair, and the demo job launched across them."""

    def __init__(self, work: Path) -> None:
        tag = secrets.token_hex(3)
        self.work = work
        self.nodes = [Node(i, f"ttp-nl{i}-{tag}", f"tnl{i}{tag}") for i in range(2)]
        self.ckpt = work / "ckpt"
        self.cut_at: Optional[float] = None
        self._made: List[str] = []

    # -- set-up and tear-down (the fixture calls these) --------------------------------------
    def create(self) -> None:
        a, b = self.nodes
        for n in self.nodes:
            _ip("netns", "add", n.ns)
            self._made.append(n.ns)
            _ip("-n", n.ns, "link", "set", "lo", "up")
        _ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
        try:
            for n in self.nodes:
                _ip("link", "set", n.veth, "netns", n.ns)
                _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.veth)
                _ip("-n", n.ns, "link", "set", n.veth, "up")
        finally:
            _ip("link", "del", a.veth, check=False)  # only if it is still outside (failure)

    def close(self) -> None:
        for n in self.nodes:
            if n.ns in self._made:
                self.kill(n)
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.kill()
            if n.proc is not None:
                n.proc.wait(10)
            if n.reader is not None:
                n.reader.join(5)
        for ns in self._made:
            _ip("netns", "del", ns, check=False)  # the veth pair goes with its namespaces
        self._made.clear()

    # -- the job ----------------------------------------------------------------------------
    def start(self, steps: int = 100000, step_delay: float = 0.02) -> None:
        env = dict(os.environ, **ENV)
        env["TTP_AUTH_KEY"] = secrets.token_hex(32)  # multi-node: the user's key, on both
        env["TTP_CONTROLLER_PORT"] = str(20000 + secrets.randbelow(20000))  # fresh namespaces
        master_port = str(40000 + secrets.randbelow(20000))
        self.ckpt.mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            run_dir = self.work / f"runs{n.index}"
            run_dir.mkdir(parents=True, exist_ok=True)
            # gloo would resolve the host name (127.0.0.1 here): make it use the node's link
            env_n = dict(env, TTP_RUN_DIR=str(run_dir), GLOO_SOCKET_IFNAME=n.veth)
            cmd = [
                "ip", "netns", "exec", n.ns, sys.executable, "-m", "mindio_ttp.launcher",
                "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=static",
                f"--master-addr={self.nodes[0].addr}", f"--master-port={master_port}",
                f"--node-rank={n.index}", "--monitor-interval=0.05",
                "-m", "mindio_ttp.demo.job", f"--steps={steps}", f"--ckpt-dir={self.ckpt}",
                f"--out={self.work / f'out{n.index}'}", f"--step-delay={step_delay}",
            ]  # fmt: skip
            n.proc = subprocess.Popen(cmd, env=env_n, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
            n.reader = threading.Thread(target=self._pump, args=(n,), daemon=True)
            n.reader.start()

    @staticmethod
    def _pump(n: Node) -> None:
        assert n.proc is not None and n.proc.stdout is not None
        for line in n.proc.stdout:
            n.lines.append(line.rstrip("\n"))

    def wait_for_line(self, n: Node, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in list(n.lines)):
                return
            if n.proc is not None and n.proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"node {n.index} never printed {text!r}; output:\n{self.outputs()}")

    def kill(self, n: Node) -> None:
        """Every process of the node at once: freeze them all (none can react to another's
        death), then SIGKILL them all, until the namespace holds no process."""
        for _ in range(20):
            pids = [int(p) for p in _ip("netns", "pids", n.ns, check=False).stdout.split()]
            if not pids:
                return
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            time.sleep(0.05)

    def cut(self) -> None:
        """Take the link down on both ends: from now on nothing crosses, not even a RST."""
        for n in self.nodes:
            _ip("-n", n.ns, "link", "set", n.veth, "down")
        self.cut_at = time.time()

    def wait(self, n: Node, timeout: float = JOB_TIMEOUT) -> int:
        assert n.proc is not None
        try:
            return n.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {n.index}'s ttprun still runs after {timeout:.0f} s; output:\n"
                        f"{self.outputs()}")

    def flow(self, n: Node) -> Optional[dict]:
        for path in sorted((self.work / f"runs{n.index}").glob("*/flow-finished.json")):
            return json.loads(path.read_text(encoding="utf-8"))
        return None

    def step_dirs(self) -> List[Path]:
        return sorted(p for p in self.ckpt.glob("step_*") if p.is_dir()
                      and not p.name.endswith(".tmp"))

    def claims(self) -> List[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.ckpt / ".ttp-claims").glob("*"))]

    def outputs(self) -> str:
        return "\n".join(f"===== node {n.index} =====\n{n.output()}" for n in self.nodes)


def _namespaces_unavailable() -> Optional[str]:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"ttp-nlprobe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[TwoNodes]:
    why = _namespaces_unavailable()
    if why:
        pytest.skip(why)
    nodes = TwoNodes(tmp_path)
    try:
        nodes.create()
        yield nodes
    finally:
        nodes.close()


def check_checkpoint(nodes: TwoNodes, flow: dict, savers: List[int]) -> None:
    """The one dying checkpoint: in place, latest, every shard bit-exact at its step."""
    assert flow["outcome"] == "saved" and flow["ranks"] == savers, flow
    step = flow["step"]
    assert [p.name for p in nodes.step_dirs()] == [checkpoint.step_dir_name(step)]
    assert checkpoint.latest_step(nodes.ckpt) == step
    loaded = checkpoint.load(nodes.ckpt, LAYOUT)
    assert loaded is not None and loaded.ranks == savers
    assert loaded.state.differences(emulate(LAYOUT, step)) == []
    claims = nodes.claims()
    assert len(claims) == 1 and claims[0]["state"] == "done", claims


def test_losing_node_1_node_0_saves(two_nodes: TwoNodes) -> None:
    two_nodes.start()
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    two_nodes.kill(node1)
    assert two_nodes.wait(node0) == 1, two_nodes.outputs()
    check_checkpoint(two_nodes, two_nodes.flow(node0), [0, 1])


def test_losing_node_0_standby_on_node_1_saves_without_the_rendezvous_store(
        two_nodes: TwoNodes) -> None:
    """Node 0 held rank 0, the primary controller and torch's store: the save group of ranks 2
    and 3 is built on the store their standby controller hosts for the order."""
    two_nodes.start()
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    two_nodes.kill(node0)
    assert two_nodes.wait(node1) == 1, two_nodes.outputs()
    flow = two_nodes.flow(node1)
    assert flow is not None, two_nodes.outputs()
    check_checkpoint(two_nodes, flow, [2, 3])
    out = node1.output()
    assert "exactly half: the fault claim decides" in out
    assert "(saving ranks [2, 3]" in out  # the savers' gloo exchange completed


def test_silent_loss_of_node_0_is_detected_within_the_heartbeat_timeout(
        two_nodes: TwoNodes) -> None:
    two_nodes.start()
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    two_nodes.cut()  # no FIN or RST will reach node 1 from here on
    two_nodes.kill(node0)
    assert two_nodes.wait(node1) == 1, two_nodes.outputs()
    flow = two_nodes.flow(node1)
    assert flow is not None, two_nodes.outputs()
    check_checkpoint(two_nodes, flow, [2, 3])
    # silence -> failover -> promotion -> collect -> save -> rename: the heartbeat timeout plus
    # a few seconds of flow, never the save time limit (15 s) of a save stuck on node 0's store
    took = flow["time"] - two_nodes.cut_at
    assert took < HB_TIMEOUT + 10.0, (took, two_nodes.outputs())


def test_partition_into_halves_saves_at_most_one_checkpoint(two_nodes: TwoNodes) -> None:
    """Both halves keep running and both can save; exactly one flow wins the fault's claim, the
    other saves nothing and says why."""
    two_nodes.start()
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    two_nodes.cut()
    codes = [two_nodes.wait(n) for n in two_nodes.nodes]
    assert codes == [1, 1], two_nodes.outputs()
    flows: Dict[int, Optional[dict]] = {n.index: two_nodes.flow(n) for n in two_nodes.nodes}
    assert all(flows.values()), (flows, two_nodes.outputs())
    outcomes = sorted(f["outcome"] for f in flows.values())  # type: ignore[index]
    assert outcomes == ["not_claimed", "saved"], (flows, two_nodes.outputs())
    winner = next(i for i, f in flows.items() if f["outcome"] == "saved")  # type: ignore[index]
    loser = flows[1 - winner]
    # refused while the winner's flow ran ("is claimed by a live flow") or after it ended
    # ("was claimed by ... state done"): either way by the claim, never by chance
    assert loser is not None and re.search(r"(is|was) claimed by", loser["reason"]), loser
    assert "this part of the job saves nothing" in loser["reason"]
    assert loser["exit_code"] == NOT_CLAIMED
    check_checkpoint(two_nodes, flows[winner], [0, 1] if winner == 0 else [2, 3])
    assert not list(two_nodes.ckpt.glob("*.tmp"))  # the loser never started a save
