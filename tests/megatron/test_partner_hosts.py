"""Partners on different hosts: ReplicatedOptimizer compares, at start-up, the hosts of the two
holders of every shard. Real Megatron on 4 CPU ranks that play two hosts through the test-only
TTP_TEST_HOSTNAME (entry r is rank r's host name). DP4 pairs positions (0, 2) and (1, 3).
Needs TTP_MEGATRON_DIR."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_e2e import run_job

from mindio_ttp import config

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

SAME_HOST_PAIRS = "hostA,hostB,hostA,hostB"  # ranks 0 and 2 on A, 1 and 3 on B
CROSS_HOST_PAIRS = "hostA,hostA,hostB,hostB"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hosts")


def _run(tree, data, work: Path, name: str, hosts: str, require: bool):
    env = {config.ENV_TEST_HOSTNAME: hosts}
    if require:
        env[config.ENV_REQUIRE_CROSS_HOST_REPLICAS] = "1"
    return run_job(tree, data, work / f"{name}.log", work / f"{name}_ckpt", iters=3,
                   load=False, env_extra=env)


def test_partners_on_one_host_warn_with_the_rank_order_that_fixes_it(
        patched_megatron_tree, tiny_dataset, work):
    result = _run(patched_megatron_tree, tiny_dataset, work, "warn", SAME_HOST_PAIRS, False)
    assert result.returncode == 0, result.tail()
    assert "WARNING: mindio_ttp: 2 optimizer shard(s) of 2 have both copies on one host" \
        in result.log, result.tail()
    assert "ranks 0 and 2 on hostA, ranks 1 and 3 on hostB" in result.log
    assert "ranks r and r + 2 never share a host" in result.log


def test_partners_on_one_host_refused_when_required(patched_megatron_tree, tiny_dataset, work):
    result = _run(patched_megatron_tree, tiny_dataset, work, "refuse", SAME_HOST_PAIRS, True)
    assert result.returncode != 0
    assert f"refusing to start because {config.ENV_REQUIRE_CROSS_HOST_REPLICAS}=1" in result.log
    assert not result.losses, "no training step may run"


def test_partners_on_different_hosts_pass_silently(patched_megatron_tree, tiny_dataset, work):
    result = _run(patched_megatron_tree, tiny_dataset, work, "cross", CROSS_HOST_PAIRS, True)
    assert result.returncode == 0, result.tail()
    assert "have both copies on one host" not in result.log
    assert sorted(result.losses) == [1, 2, 3]
