"""Partners on different hosts, on real Megatron-LM (CPU ranks that play several hosts through
testkit/hooks/hostname_hook: each worker's socket.gethostname() answers the test's name for its
rank). Needs TTP_MEGATRON_DIR.

* PP2 x DP4 on 8 ranks placed round-robin over 4 hosts, so that pipeline stages span hosts
  and, in every DP group, positions p and p + 2 share a host: the optimizer pairs partners
  across hosts instead (the runtime is told the pairs), and losing a whole host (both of its
  ranks, holders of different shards now) still gives a dying checkpoint, equal tensor for
  tensor to Megatron's own save of the step. With p + DP/2 that host held both copies of a
  shard: nothing could be saved.
* A host holding more than half of a DP group: no pairing helps; refused before any step with
  TTP_REQUIRE_CROSS_HOST_REPLICAS=1 (a warning without it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_e2e import run_job, tracker_step

from mindio_ttp import config
from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from testkit.hooks import HOSTNAME_HOOK_DIR, pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

# global rank r on host ROUND_ROBIN[r]: DP groups (PP2, TP1) are ranks 0-3 and 4-7, pipelines
# (0, 4), (1, 5), ...: every p + 2 pair of a DP group shares a host, every pipeline spans two
ROUND_ROBIN = "hostA,hostB,hostA,hostB,hostC,hostD,hostC,hostD"
CROWDED = "hostA,hostA,hostA,hostB"  # DP4: hostA holds 3 of 4 positions
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]
STEP, ITERS = 4, 5


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hosts")


def _env(hosts: str, require: bool = False) -> dict:
    env = {"PYTHONPATH": pythonpath(HOSTNAME_HOOK_DIR), "TTP_FAKE_HOSTS": hosts}
    if require:
        env[config.ENV_REQUIRE_CROSS_HOST_REPLICAS] = "1"
    return env


def test_pipeline_across_hosts_pairs_partners_across_hosts_and_survives_a_host(
        patched_megatron_tree, tiny_dataset, work):
    kwargs = dict(iters=ITERS, nproc=8, extra=PP2, timeout_s=500)
    ref_ckpt = work / "pp_ref"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / "pp_ref.log", ref_ckpt,
                  save_interval=STEP, **kwargs)
    assert ref.returncode == 0, ref.tail()
    ckpt = work / "pp_host_lost"
    # hostB (ranks 1 and 3) lost in iteration STEP + 1, with TTP_REQUIRE_CROSS_HOST_REPLICAS
    lost = run_job(patched_megatron_tree, tiny_dataset, work / "pp_host_lost.log", ckpt,
                   plan=f"1:{STEP + 1}:sigkill:before,3:{STEP + 1}:sigkill:before",
                   env_extra=_env(ROUND_ROBIN, require=True), **kwargs)
    assert "optimizer partners paired across hosts" in lost.log, lost.tail()
    assert "have both copies on one host" not in lost.log
    assert lost.returncode != 0
    assert tracker_step(ckpt) == STEP, lost.tail()
    comparison = compare_checkpoints(ckpt, ref_ckpt, STEP)
    assert comparison.bit_exact, comparison.summary()


def test_a_host_holding_more_than_half_a_dp_group_is_refused_when_required(
        patched_megatron_tree, tiny_dataset, work):
    """No pairing helps; the message names the pairs and the crowded host (without
    TTP_REQUIRE_CROSS_HOST_REPLICAS it is the same text, as a WARNING on rank 0)."""
    result = run_job(patched_megatron_tree, tiny_dataset, work / "refuse.log",
                     work / "refuse_ckpt", iters=3, load=False,
                     env_extra=_env(CROWDED, require=True))
    assert result.returncode != 0
    assert "1 optimizer shard(s) of 2 have both copies on one host" in result.log, result.tail()
    assert "hostA holds 3 of the 4 ranks of DP group" in result.log
    assert f"refusing to start because {config.ENV_REQUIRE_CROSS_HOST_REPLICAS}=1" in result.log
    assert not result.losses, "no training step may run"
