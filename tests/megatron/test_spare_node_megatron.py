"""A whole node lost from a real Megatron-LM 285068c job (patched `--device cpu`, gloo), with
three `ttprun` nodes in network namespaces (testkit.netns): with a spare node, the spare takes
over the lost node's ranks and the job goes on in memory; without one, the job falls back to
the dying checkpoint and a restart. Either way the final state is bit-identical to an
uninterrupted run. Needs TTP_MEGATRON_DIR and root.

The tiny GPT runs DP4 with --use-distributed-optimizer, 2 ranks per node, c10d rendezvous on
node 0 (`--nnodes=2`): the first two launchers in the rendezvous form the job, a third waits as
the spare (torch keeps it on its redundancy list). ReplicatedOptimizer's replicas are positions
i and i + 2, so each node holds a replica of every shard the other held. Exactly half the ranks
survive the loss of a node, so the survivors' controller recovers only after winning the
fault's claim in the shared checkpoint directory (the other half of a split job cannot win it).

The moment of the loss is pinned with the fault hook: rank 3 stops itself in the forward step
of iteration 5; the test then kills every process of its node. Survivors have finished
iteration 4.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from megatron_e2e import GLOO, N_ITERS, NCCL_LIKE, backend_setup, cases, loss_table, run_job

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.demo.rehearsal.data import TinyDataset
from mindio_ttp.demo.rehearsal.launch import parse_losses, tiny_gpt_args, worker_env
from testkit.netns import Node, Nodes, ip, made_nodes, namespaces_unavailable

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

LAST_DONE = 4  # rank 3 stops in iteration 5's forward step
STOPPER = 3
ENV = {
    "TTP_RECOVERY": "in-memory",
    "TTP_OT": "90",
    "TTP_HEARTBEAT_INTERVAL": "0.5",
    "TTP_HEARTBEAT_TIMEOUT": "6",
    "TTP_SAVE_TIME_LIMIT": "60",
    "TTP_RENAME_TIME_LIMIT": "20",
    "TTP_RECOVER_TIMEOUT": "180",  # the spare's replacements build Megatron on 2 loaded cores
    "TTPRUN_RDZV_NOTICE_S": "2",
}
# torch drops a node whose keep-alive is 1 s x 5 old: the takeover starts a few seconds after
# the loss (a shorter one drops live nodes of a loaded 2-core machine too)
RDZV_CONF = ("keep_alive_interval=1", "keep_alive_max_attempt=5")
START_TIMEOUT = 300.0
END_TIMEOUT = 400.0
TEST_TIMEOUT = 1200


class MegatronSpareNodes(Nodes):
    """Three namespaced nodes for the tiny GPT: 2 ranks per node, a shared checkpoint dir."""

    def setup(self, tree: Path, data: TinyDataset) -> None:
        self.tree, self.data = tree, data
        self.faults = self.work / "faults"
        self.faults.mkdir(parents=True, exist_ok=True)
        self.ckpt.mkdir(parents=True, exist_ok=True)
        self.key = secrets.token_hex(32)
        self.port = 40000 + secrets.randbelow(20000)
        self.controller_port = 20000 + secrets.randbelow(20000)

    def start(self, index: int, *, plan: str = "", spares: int = 0,
              launcher: tuple = (), backend: str = GLOO) -> Node:
        n = self.nodes[index]
        backend_env, backend_args = backend_setup(backend)
        env = worker_env({
            **ENV,
            **backend_env,
            "TTP_AUTH_KEY": self.key,  # multi-node: the user's key, on every node
            "TTP_CONTROLLER_PORT": str(self.controller_port),
            "TTP_FAULT_PLAN": plan,
            "TTP_FAULT_RECORD_DIR": str(self.faults),
        })
        args = tiny_gpt_args(self.data, train_iters=N_ITERS, save=self.ckpt, load=self.ckpt,
                             save_interval=N_ITERS, extra=backend_args)
        cmd = [sys.executable, "-m", "mindio_ttp.launch.agent",
               *self.ttprun_args(n, nproc=2, port=self.port, rdzv="c10d", nnodes=2,
                                 rdzv_conf=RDZV_CONF),
               f"--warm-spares={spares}", *launcher, str(self.tree / "pretrain_gpt.py"), *args]
        self.launch(n, cmd, env, cwd=self.tree)
        return n

    def node_of_rank(self, rank: int) -> Node:
        """The node whose namespace runs global rank ``rank`` (read from its environment)."""
        for n in self.nodes:
            for pid in ip("netns", "pids", n.ns, check=False).stdout.split():
                with contextlib.suppress(psutil.Error):
                    env = psutil.Process(int(pid)).environ()
                    if env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
                        return n
        raise AssertionError(f"no node runs rank {rank}:\n{self.outputs()}")

    def lose_the_stoppers_node(self) -> Node:
        """Wait for rank 3's stop in iteration 5, then kill its node whole; that node."""
        self.wait_until((self.faults / f"fault-{STOPPER}.json").is_file,
                        f"rank {STOPPER}'s stop at iteration {LAST_DONE + 1}", START_TIMEOUT)
        lost = self.node_of_rank(STOPPER)
        self.kill(lost)
        return lost


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spare_node_megatron")


@pytest.fixture
def nodes(tmp_path: Path, patched_megatron_tree: Path,
          tiny_dataset: TinyDataset) -> Iterator[MegatronSpareNodes]:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    with made_nodes(tmp_path, 3, MegatronSpareNodes) as made:
        made.setup(patched_megatron_tree, tiny_dataset)
        yield made


@pytest.fixture(scope="module")
def reference(patched_megatron_tree: Path, tiny_dataset: TinyDataset, work: Path):
    """N uninterrupted iterations, one node, the same DP4 layout, saved at the end."""
    ckpt = work / "ref_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "ref.log", ckpt, load=False,
                     save_interval=N_ITERS)
    assert result.returncode == 0, result.tail()
    assert sorted(result.losses) == list(range(1, N_ITERS + 1)), result.tail()
    return result.losses, ckpt


def _losses(nodes: MegatronSpareNodes, after: int) -> dict:
    """Megatron's printed losses (the last rank prints them: rank 3, wherever it runs)."""
    found = {}
    for n in nodes.nodes:
        found.update({i: v for i, v in parse_losses(n.output()).items() if i > after})
    return found


def _check_final_state(nodes: MegatronSpareNodes, reference, label: str) -> None:
    ref_losses, ref_ckpt = reference
    losses = _losses(nodes, LAST_DONE)
    print(loss_table({"uninterrupted": ref_losses, label: losses}))
    assert losses == {i: v for i, v in ref_losses.items() if i > LAST_DONE}, nodes.outputs()
    comparison = compare_checkpoints(nodes.ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("backend", cases(ci=[GLOO], extended=[NCCL_LIKE]))
def test_a_spare_node_takes_over_a_lost_node_and_training_goes_on_bit_exact(
        backend: str, nodes: MegatronSpareNodes, reference) -> None:
    """All three launchers start at once: the first two in the rendezvous form the job, the
    third waits as the spare (with 2 warm spares). The node running ranks 2 and 3 is lost. On
    the NCCL-like backend the survivors' collectives with the lost node spin until aborted."""
    plan = f"{STOPPER}:{LAST_DONE + 1}:sigstop:before"
    for i in range(3):
        nodes.start(i, plan=plan, spares=2, backend=backend)
    nodes.wait_until(lambda: any(n.printed("this node is a spare") for n in nodes.nodes),
                     "a spare node", START_TIMEOUT)
    spare = next(n for n in nodes.nodes if n.printed("this node is a spare"))
    lost = nodes.lose_the_stoppers_node()
    survivor = next(n for n in nodes.nodes if n not in (spare, lost))
    assert nodes.wait(survivor, END_TIMEOUT) == 0, nodes.outputs()
    assert nodes.wait(spare, END_TIMEOUT) == 0, nodes.outputs()
    out_survivor, out_spare = survivor.output(), spare.output()
    assert "this node takes over group rank 1 of a lost node: ranks [2, 3]" in out_spare
    assert re.search(r"local rank [01] replaced by warm spare pid \d+", out_spare), out_spare
    assert "keeps its workers (group rank 0)" in out_survivor, out_survivor
    assert "closing signal" not in out_survivor, out_survivor  # never restarted
    assert nodes.flow(survivor) is None, nodes.flows()  # no dying-checkpoint flow ran
    assert re.search(r"recovery \d+ committed", out_survivor), out_survivor
    assert [p.name for p in sorted(nodes.ckpt.glob("iter_*"))] == [f"iter_{N_ITERS:07d}"]
    _check_final_state(nodes, reference, "a node lost, the spare took over")


@pytest.mark.timeout(TEST_TIMEOUT)
def test_without_a_spare_node_a_lost_node_ends_in_the_dying_checkpoint_and_a_restart(
        nodes: MegatronSpareNodes, reference) -> None:
    """No spare waits: the recovery hears it at once (the relay's launcher fails the request),
    the survivors save iteration 4, and `--max-restarts 1` restarts the job from it once a
    second node joins the rendezvous (here node 2, started after the loss, as a scheduler would
    start a new node)."""
    plan = f"{STOPPER}:{LAST_DONE + 1}:sigstop:before"
    for i in (0, 1):
        nodes.start(i, plan=plan, launcher=("--max-restarts=1",))
    lost = nodes.lose_the_stoppers_node()
    survivor = nodes.nodes[1 - lost.index]
    nodes.wait_until(lambda: nodes.flow(survivor) is not None, "the survivor's dying "
                     "checkpoint", END_TIMEOUT)
    flow = nodes.flow(survivor)
    if flow["outcome"] != "saved" or flow["step"] != LAST_DONE:
        pytest.fail(f"{flow}\n{nodes.outputs()}")
    assert "no spare node waits" in survivor.output(), survivor.output()
    new = nodes.start(2, plan=plan, launcher=("--max-restarts=1",))
    assert nodes.wait(survivor, END_TIMEOUT) == 0, nodes.outputs()
    assert nodes.wait(new, END_TIMEOUT) == 0, nodes.outputs()
    _check_final_state(nodes, reference, "a node lost, no spare: restart")

