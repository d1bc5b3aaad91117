"""Losing a whole node, and splitting the job in two, with two real `ttprun` "nodes".

The nodes are network namespaces joined by a veth pair (testkit.netns, which
describes how a node is lost, silenced or partitioned and how everything is cleaned up): a
launcher with 2 ranks of the 4-rank demo job runs in each, node 0 hosting torch's rendezvous
store (its agent), the primary controller (rank 0) and MASTER_ADDR.

Layout: one DP group [0, 1, 2, 3], replica 2: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and
3, so either node alone holds a clean replica of every shard and could save.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from mindio_ttp.demo import checkpoint
from mindio_ttp.demo.model import ShardLayout, emulate
from testkit.netns import Node, TwoNodes, namespaces_unavailable
from testkit.netns import two_nodes as two_nodes_made

pytestmark = pytest.mark.slow

HB_INTERVAL, HB_TIMEOUT = 0.25, 2.0
ENV = {
    "TTP_OT": "40",
    "TTP_HEARTBEAT_INTERVAL": str(HB_INTERVAL),
    "TTP_HEARTBEAT_TIMEOUT": str(HB_TIMEOUT),
    "TTP_SAVE_TIME_LIMIT": "15",
    "TTP_RENAME_TIME_LIMIT": "5",
    # a flow waits this long only for a rank that does not answer: room for a rank descheduled
    # for seconds on a loaded 2-core CI machine (at 3 and 0.5 a half of a partition once
    # missed one of its own ranks' reports and ended no_consistent_step instead of not_claimed)
    "TTP_COLLECT_TIMEOUT": "5",
    "TTP_UPDATE_GRACE": "1.0",
    "TTP_LOG_LEVEL": "INFO",
    "TTP_RECOVERY": "dying-checkpoint",  # what a lost node leaves to save
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
LAYOUT = ShardLayout.for_world(4)
JOB_TIMEOUT = 90.0  # a launcher still running after this is a failure (and killed)
SAVED, NOT_CLAIMED = 83, 87
STANDBYS_KNOWN = "standby controllers to fail over to: rank(s) [2, 3]"  # node 1's agent


class DemoNodes(TwoNodes):
    """The 4-rank demo job on the two namespaced nodes."""

    def start(self, steps: int = 100000, step_delay: float = 0.02, rdzv: str = "static") -> None:
        env = dict(os.environ, **ENV)
        env["TTP_AUTH_KEY"] = secrets.token_hex(32)  # multi-node: the user's key, on both
        env["TTP_CONTROLLER_PORT"] = str(20000 + secrets.randbelow(20000))  # fresh namespaces
        port = 40000 + secrets.randbelow(20000)
        self.ckpt.mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            cmd = [
                sys.executable, "-m", "mindio_ttp.launch.agent",
                *self.ttprun_args(n, nproc=2, port=port, rdzv=rdzv),
                "-m", "mindio_ttp.demo.job", f"--steps={steps}", f"--ckpt-dir={self.ckpt}",
                f"--out={self.work / f'out{n.index}'}", f"--step-delay={step_delay}",
            ]  # fmt: skip
            self.launch(n, cmd, env)

    def wait(self, n: Node, timeout: float = JOB_TIMEOUT) -> int:
        return super().wait(n, timeout)

    def step_dirs(self) -> List[Path]:
        return sorted(p for p in self.ckpt.glob("step_*") if p.is_dir()
                      and not p.name.endswith(".tmp"))


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[DemoNodes]:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    with two_nodes_made(tmp_path, DemoNodes) as nodes:
        yield nodes


def check_checkpoint(nodes: DemoNodes, flow: dict, savers: List[int]) -> None:
    """The one dying checkpoint: in place, latest, every shard bit-exact at its step."""
    assert flow["outcome"] == "saved" and flow["ranks"] == savers, (flow, nodes.outputs())
    step = flow["step"]
    assert [p.name for p in nodes.step_dirs()] == [checkpoint.step_dir_name(step)]
    assert checkpoint.latest_step(nodes.ckpt) == step
    loaded = checkpoint.load(nodes.ckpt, LAYOUT)
    assert loaded is not None and loaded.ranks == savers
    assert loaded.state.differences(emulate(LAYOUT, step)) == []
    claims = nodes.claims()
    assert len(claims) == 1 and claims[0]["state"] == "done", claims


def test_losing_node_1_node_0_saves(two_nodes: DemoNodes) -> None:
    two_nodes.start()
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    two_nodes.kill(node1)
    assert two_nodes.wait(node0) == 1, two_nodes.outputs()
    check_checkpoint(two_nodes, two_nodes.flow(node0), [0, 1])


def lose_node_0_and_check_node_1_saved(two_nodes: DemoNodes, silent: bool = False):
    """Kill node 0 mid-training (`silent`: after taking the link down, so no FIN or RST reaches
    node 1); node 1's ranks 2 and 3 must have written a verified checkpoint. Returns node 1's
    flow record and the node."""
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    # training does not wait for registration: on a loaded machine node 0 reached step 3 before
    # node 1's agent knew its standbys (CI of d78da3c: no_verdict, nothing saved). What a fault
    # before that leaves is start-up's window (docs/security.md), not this test's subject.
    two_nodes.wait_for_line(node1, STANDBYS_KNOWN)
    if silent:
        two_nodes.cut()
    two_nodes.kill(node0)
    assert two_nodes.wait(node1) == 1, two_nodes.outputs()
    flow = two_nodes.flow(node1)
    assert flow is not None, two_nodes.outputs()
    check_checkpoint(two_nodes, flow, [2, 3])
    return flow, node1


def test_losing_node_0_standby_on_node_1_saves_without_the_rendezvous_store(
        two_nodes: DemoNodes) -> None:
    """Node 0 held rank 0, the primary controller and torch's store: the save group of ranks 2
    and 3 is built on the store their standby controller hosts for the order."""
    two_nodes.start()
    flow, node1 = lose_node_0_and_check_node_1_saved(two_nodes)
    out = node1.output()
    assert "exactly half: the fault claim decides" in out
    assert "(saving ranks [2, 3]" in out  # the savers' gloo exchange completed


def test_silent_loss_of_node_0_is_detected_within_the_heartbeat_timeout(
        two_nodes: DemoNodes) -> None:
    two_nodes.start()
    flow, _ = lose_node_0_and_check_node_1_saved(two_nodes, silent=True)
    # silence -> failover -> promotion -> collect -> save -> rename: the heartbeat timeout plus
    # a few seconds of flow, never the save time limit (15 s) of a save stuck on node 0's store
    took = flow["time"] - two_nodes.cut_at
    assert took < HB_TIMEOUT + 10.0, (took, two_nodes.outputs())


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_partition_into_halves_saves_at_most_one_checkpoint(two_nodes: DemoNodes,
                                                            rdzv: str) -> None:
    """Both halves keep running and both can save; exactly one flow wins the fault's claim, the
    other saves nothing and says why. c10d: the half without the rendezvous store is not held
    up by it either (its agent's store calls time out, they must not hold the launcher)."""
    two_nodes.start(rdzv=rdzv)
    node0, node1 = two_nodes.nodes
    two_nodes.wait_for_line(node0, "rank 0 | step 3/")
    two_nodes.wait_for_line(node1, STANDBYS_KNOWN)  # as in lose_node_0_and_check_node_1_saved
    two_nodes.cut()
    codes = [two_nodes.wait(n) for n in two_nodes.nodes]
    assert codes == [1, 1], two_nodes.outputs()
    assert two_nodes.cut_at is not None
    # c10d: node 1's store calls would each block for torch's read_timeout (60 s)
    assert time.time() - two_nodes.cut_at < 30, two_nodes.outputs()
    if rdzv == "c10d":
        assert "ttprun: not closing the rendezvous" in node1.output(), two_nodes.outputs()
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


def test_c10d_losing_node_0_which_hosts_the_store_node_1_holds_its_workers_and_saves(
        two_nodes: DemoNodes) -> None:
    """c10d rendezvous: node 0's agent hosts the rendezvous store. Node 1's agent loses it in
    its monitor loop; it must hold its workers (torch's own reaction is SIGTERM, SIGKILL 30 s
    later) until their flow has saved."""
    two_nodes.start(rdzv="c10d")
    flow, node1 = lose_node_0_and_check_node_1_saved(two_nodes)
    assert flow["exit_code"] == SAVED
    out = node1.output()
    assert "ttprun: lost the rendezvous store" in out, out
    assert "closing signal" not in out, out  # torch's SIGTERM to the workers never came
    assert re.search(r"exitcode\s*:\s*83", out), out  # the workers ended by the flow's exit
