"""Losing a whole node of a real Megatron-LM 285068c job (patched `--device cpu`, gloo), and
splitting it in two, with two real `ttprun` "nodes" in network namespaces (see
testkit.netns). Needs TTP_MEGATRON_DIR and root.

The tiny GPT runs DP4 with --use-distributed-optimizer, 2 ranks per node: node 0 holds ranks 0
and 1 (DP positions 0, 1), node 1 ranks 2 and 3 (positions 2, 3). ReplicatedOptimizer keeps 2
replicas: positions i and i + 2 hold the same shard (shard 0 on 0 and 2, shard 1 on 1 and 3),
so each node holds a replica of every shard and can write the whole checkpoint alone.

The moment of the node loss is pinned with the test-only fault hook: one rank of the node to be
lost stops itself (SIGSTOP) in the forward step of iteration 5, before any gradient exchange,
so every other rank waits in iteration 5's all-reduce having finished 4; then the test kills
every process of that node at once. The survivors must save iteration 4.
"""

from __future__ import annotations

import random
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from megatron_e2e import (
    FAR_AWAY,
    GLOO,
    N_ITERS,
    NCCL_LIKE,
    backend_setup,
    cases,
    copy_checkpoints,
    loss_table,
    run_job,
)

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.demo.rehearsal.data import TinyDataset
from mindio_ttp.demo.rehearsal.launch import parse_losses, tiny_gpt_args, worker_env
from mindio_ttp.faulttime import manifest
from mindio_ttp.faulttime.manifest import ParallelLayout
from testkit.netns import Node, TwoNodes, namespaces_unavailable, two_nodes

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

DP4 = ParallelLayout(tp=1, pp=1, dp=4)
SAVED, NO_STEP, NOT_CLAIMED = 83, 84, 87
LAST_SAVED = 4  # the fault stops a rank in iteration 5's forward step
HB_TIMEOUT = 6.0  # 2 shared CPU cores: a busy rank's heartbeat may lag
ENV = {
    "TTP_OT": "60",
    "TTP_HEARTBEAT_INTERVAL": "0.5",
    "TTP_HEARTBEAT_TIMEOUT": str(HB_TIMEOUT),
    "TTP_SAVE_TIME_LIMIT": "60",
    "TTP_RENAME_TIME_LIMIT": "20",
}
START_TIMEOUT = 240.0  # both launchers up and Megatron at the fault (model build, data index)
END_TIMEOUT = 150.0  # fault -> launcher exit: detection, flow, save, rename, TTP_OT at worst
TEST_TIMEOUT = 900


class MegatronNodes(TwoNodes):
    """The tiny GPT on the two namespaced nodes, 2 ranks each, one shared --save directory."""

    def start(self, tree: Path, data: TinyDataset, *, iters: int, plan: str = "",
              rdzv: str = "static", backend: str = GLOO) -> None:
        self.faults = self.work / "faults"
        self.faults.mkdir(parents=True, exist_ok=True)
        self.ckpt.mkdir(parents=True, exist_ok=True)
        backend_env, backend_args = backend_setup(backend)
        env = worker_env({
            **ENV,
            **backend_env,
            "TTP_AUTH_KEY": secrets.token_hex(32),  # multi-node: the user's key, on both
            "TTP_CONTROLLER_PORT": str(20000 + secrets.randbelow(20000)),  # fresh namespaces
            "TTP_FAULT_PLAN": plan,
            "TTP_FAULT_RECORD_DIR": str(self.faults),
        })
        port = 40000 + secrets.randbelow(20000)
        args = tiny_gpt_args(data, train_iters=iters, save=self.ckpt, save_interval=FAR_AWAY,
                             extra=backend_args)
        for n in self.nodes:
            cmd = [sys.executable, "-m", "mindio_ttp.launch.agent",
                   *self.ttprun_args(n, nproc=2, port=port, rdzv=rdzv),
                   str(tree / "pretrain_gpt.py"), *args]
            self.launch(n, cmd, env, cwd=tree)

    def wait_for_fault(self, rank: int) -> None:
        self.wait_until((self.faults / f"fault-{rank}.json").is_file,
                        f"rank {rank}'s fault at iteration {LAST_SAVED + 1}", START_TIMEOUT)

    def iter_dirs(self) -> List[str]:
        return sorted(p.name for p in self.ckpt.glob("iter_*") if p.is_dir())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("node_loss_megatron")


def _skip_without_namespaces() -> None:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[MegatronNodes]:
    _skip_without_namespaces()
    with two_nodes(tmp_path, MegatronNodes) as made:
        yield made


@pytest.fixture(scope="module")
def reference(patched_megatron_tree: Path, tiny_dataset: TinyDataset, work: Path):
    """N uninterrupted iterations, single node, same DP4 layout."""
    ckpt = work / "ref_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "ref.log", ckpt, load=False)
    assert result.returncode == 0, result.tail()
    assert sorted(result.losses) == list(range(1, N_ITERS + 1)), result.tail()
    return result, ckpt


def lose_node(nodes: MegatronNodes, tree: Path, data: TinyDataset, lost: int,
              rdzv: str = "static", silent: bool = False, backend: str = GLOO) -> Node:
    """Pin the moment with a rank of node `lost`, kill the node (after taking the link down
    when `silent`: no FIN or RST reaches the survivor); the survivor's node."""
    stopper = 3 if lost == 1 else 0  # node 1: rank 3 (the logging rank); node 0: rank 0
    nodes.start(tree, data, iters=N_ITERS, plan=f"{stopper}:{LAST_SAVED + 1}:sigstop:before",
                rdzv=rdzv, backend=backend)
    nodes.wait_for_fault(stopper)
    if silent:
        nodes.cut()
    nodes.kill(nodes.nodes[lost])
    survivor = nodes.nodes[1 - lost]
    assert nodes.wait(survivor, END_TIMEOUT) == 1, nodes.outputs()  # a failed job, saved
    return survivor


def check_dying_checkpoint(nodes: MegatronNodes, survivor: Node, savers: List[int]) -> dict:
    """The one dying checkpoint: iteration 4, by the survivor's ranks, latest, verified."""
    flow = nodes.flow(survivor)
    assert flow is not None, nodes.outputs()
    assert flow["outcome"] == "saved" and flow["step"] == LAST_SAVED, (flow, nodes.outputs())
    assert flow["exit_code"] == SAVED and flow["ranks"] == savers, flow
    iter_dir = nodes.ckpt / manifest.iter_dir_name(LAST_SAVED)
    assert nodes.iter_dirs() == [iter_dir.name]
    assert manifest.read_tracker(nodes.ckpt)[0] == LAST_SAVED
    assert manifest.verify(iter_dir, DP4) is None
    # every DP position's optimizer file, written by one node's two ranks: one holder of each
    # shard per node, as positions i and i + 2 share a shard
    assert sorted(p.name for p in iter_dir.iterdir() if p.is_dir()) == [
        "mp_rank_00", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_00_002", "mp_rank_00_003"]
    said = (f"ttprun: dying checkpoint of iteration {LAST_SAVED} saved in {iter_dir} and "
            "marked latest")
    assert said in survivor.output(), nodes.outputs()
    assert re.search(rf"exitcode\s*:\s*{SAVED}", survivor.output()), nodes.outputs()
    claims = nodes.claims()
    assert len(claims) == 1 and claims[0]["state"] == "done", claims
    assert not list(nodes.ckpt.glob(".ttp_tmp_*")), list(nodes.ckpt.iterdir())
    return flow


@pytest.fixture(scope="module")
def node1_lost(patched_megatron_tree: Path, tiny_dataset: TinyDataset, work: Path,
               tmp_path_factory: pytest.TempPathFactory):
    """Node 1 lost at iteration 5: node 0's ranks 0 and 1 save iteration 4."""
    _skip_without_namespaces()
    with two_nodes(tmp_path_factory.mktemp("node1_lost"), MegatronNodes) as made:
        survivor = lose_node(made, patched_megatron_tree, tiny_dataset, lost=1)
        flow = check_dying_checkpoint(made, survivor, [0, 1])
        losses = parse_losses(made.nodes[1].output())  # rank 3, the logging rank, is on node 1
        return copy_checkpoints(made.ckpt, work / "node1_lost_ckpt"), flow, losses


@pytest.mark.timeout(TEST_TIMEOUT)
def test_losing_node_1_node_0_saves_and_the_resume_is_bit_exact(
        node1_lost, reference, patched_megatron_tree: Path, tiny_dataset: TinyDataset,
        work: Path) -> None:
    ckpt, _, losses = node1_lost
    ref_result, ref_ckpt = reference
    assert losses == {i: v for i, v in ref_result.losses.items() if i <= LAST_SAVED}
    resumed_ckpt = copy_checkpoints(ckpt, work / "node1_resumed_ckpt")
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "node1_resumed.log",
                      resumed_ckpt)  # one node, 4 ranks: the same DP4 layout
    assert resumed.returncode == 0, resumed.tail()
    print(loss_table({"uninterrupted": ref_result.losses, "after node 1 lost": resumed.losses}))
    assert resumed.losses == {i: v for i, v in ref_result.losses.items() if i > LAST_SAVED}
    comparison = compare_checkpoints(resumed_ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_losing_node_0_node_1_saves_the_same_checkpoint(
        nodes: MegatronNodes, node1_lost, patched_megatron_tree: Path,
        tiny_dataset: TinyDataset, rdzv: str) -> None:
    """Node 0 held rank 0 (the primary controller), MASTER_ADDR and the rendezvous store (its
    agent; c10d: the store at --rdzv-endpoint). Node 1's agent loses the store but holds its
    workers; their standby controller orders the save on a store of its own; ranks 2 and 3, the
    other holders of both shards, write the same checkpoint as node 0's ranks did."""
    survivor = lose_node(nodes, patched_megatron_tree, tiny_dataset, lost=0, rdzv=rdzv)
    check_dying_checkpoint(nodes, survivor, [2, 3])
    out = survivor.output()
    if rdzv == "c10d":
        assert "ttprun: lost the rendezvous store" in out, nodes.outputs()
    assert "closing signal" not in out, out  # no SIGTERM from the agent to its workers
    comparison = compare_checkpoints(nodes.ckpt, node1_lost[0], LAST_SAVED)
    assert comparison.bit_exact, comparison.summary()


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("backend", cases(ci=[GLOO], extended=[NCCL_LIKE]))
def test_silent_loss_of_node_0_is_detected_within_the_heartbeat_timeout(
        backend: str, nodes: MegatronNodes, node1_lost, patched_megatron_tree: Path,
        tiny_dataset: TinyDataset) -> None:
    """Node 0 vanishes without a word (link down, then killed): node 1's ranks sit in
    iteration 5's all-reduce with no error; missing heartbeats end it, and the save does not
    wait on anything node 0 hosted (it would hang to TTP_SAVE_TIME_LIMIT, 60 s here). On the
    NCCL-like backend their collectives spin until the savers abort them."""
    survivor = lose_node(nodes, patched_megatron_tree, tiny_dataset, lost=0, silent=True,
                         backend=backend)
    flow = check_dying_checkpoint(nodes, survivor, [2, 3])
    assert nodes.cut_at is not None
    took = flow["time"] - nodes.cut_at
    print(f"silent loss of node 0: flow finished {took:.1f} s after the cut "
          f"(TTP_HEARTBEAT_TIMEOUT={HB_TIMEOUT:g} s)")
    assert took < HB_TIMEOUT + 20.0, (took, nodes.outputs())
    comparison = compare_checkpoints(nodes.ckpt, node1_lost[0], LAST_SAVED)
    assert comparison.bit_exact, comparison.summary()


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_partition_into_halves_writes_at_most_one_checkpoint(
        nodes: MegatronNodes, patched_megatron_tree: Path, tiny_dataset: TinyDataset,
        rdzv: str) -> None:
    """The link goes down mid-training and both halves keep running, each with a replica of
    every shard: the fault's claim lets at most one flow save, the other refuses and says why.

    The cut lands anywhere in the step. When it splits the gradient reduce (ring collectives
    finish at different moments on different ranks), one half can hold shard 0 at step k and
    shard 1 only at k - 1: that half has no consistent step and refuses (exit 84) before it
    claims; if both halves are split so, nothing is saved (a clear refusal, never a guess)."""
    nodes.start(patched_megatron_tree, tiny_dataset, iters=200, rdzv=rdzv)
    node1 = nodes.nodes[1]
    nodes.wait_until(lambda: node1.printed("iteration        3/"), "iteration 3",
                     START_TIMEOUT)
    delay = random.uniform(0.0, 0.3)  # a few iterations: the cut lands anywhere in the step
    time.sleep(delay)  # not a synchronisation: the instant of the fault
    nodes.cut()
    codes = [nodes.wait(n, END_TIMEOUT) for n in nodes.nodes]
    if codes != [1, 1] or not all(nodes.flows().values()):
        pytest.fail(f"launcher exit codes {codes}, flows {nodes.flows()}:\n{nodes.outputs()}")
    flows: Dict[int, dict] = nodes.flows()  # type: ignore[assignment]
    summary = {i: (f["outcome"], f["exit_code"], f["reason"]) for i, f in flows.items()}
    print(f"partition ({rdzv}, cut {delay:.3f} s after iteration 3): {summary}")
    allowed = {"saved": SAVED, "not_claimed": NOT_CLAIMED, "no_consistent_step": NO_STEP}
    for i, f in flows.items():
        if allowed.get(f["outcome"]) != f["exit_code"]:
            pytest.fail(f"node {i}: {summary[i]}:\n{nodes.outputs()}")
        assert re.search(rf"exitcode\s*:\s*{f['exit_code']}", nodes.nodes[i].output())
    winners = [i for i, f in flows.items() if f["outcome"] == "saved"]
    assert len(winners) <= 1, summary  # never two
    assert not list(nodes.ckpt.glob(".ttp_tmp_*")), list(nodes.ckpt.iterdir())
    for f in flows.values():
        if f["outcome"] == "not_claimed":  # refused by the claim, never by chance
            assert re.search(r"(is|was) claimed by", f["reason"]), summary
            assert "this part of the job saves nothing" in f["reason"], summary
        elif f["outcome"] == "no_consistent_step":
            assert re.search(r"no consistent step: DP group \[0, 1, 2, 3\] shard \d",
                             f["reason"]), summary
    if not winners:
        assert nodes.iter_dirs() == [] and manifest.read_tracker(nodes.ckpt)[0] is None
        assert all(f["outcome"] == "no_consistent_step" for f in flows.values()), summary
        return
    saved = flows[winners[0]]
    assert saved["ranks"] == ([0, 1] if winners[0] == 0 else [2, 3]), saved
    step = saved["step"]
    iter_dir = nodes.ckpt / manifest.iter_dir_name(step)
    assert nodes.iter_dirs() == [iter_dir.name]
    assert manifest.read_tracker(nodes.ckpt)[0] == step
    assert manifest.verify(iter_dir, DP4) is None
    claims = nodes.claims()
    assert len(claims) == 1 and claims[0]["state"] == "done", claims
