"""In-memory recovery on real Megatron-LM 285068c (docs/recovery.md): a fault mid-training, the
survivors stay up, ttprun starts a replacement, the replacement is refilled from its replica
partner, and the job ends as an uninterrupted run would: same printed losses, bit-identical
final checkpoint, exit 0, and no checkpoint written or read for the recovery. Needs
TTP_MEGATRON_DIR.

Step arithmetic as in test_e2e_dying_checkpoint.py: a fault in the forward step of iteration k
("before") leaves every survivor at k-1, so the recovery rolls back to k-1 and redoes k.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

import pytest
from megatron_e2e import N_ITERS, run_job, tracker_step

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.megatron_ttp import manifest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

IN_MEMORY = {"TTP_RECOVERY": "in-memory", "TTP_RECOVER_TIMEOUT": "90"}
_COMMITTED = re.compile(r"recovery (\d+) committed in ([0-9.]+) s: training goes on from step "
                        r"(\d+)")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recovery")


@pytest.fixture(scope="module")
def reference(patched_megatron_tree, tiny_dataset, work):
    """N uninterrupted iterations."""
    ckpt = work / "ref_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "ref.log", ckpt)
    assert result.returncode == 0, result.tail()
    assert sorted(result.losses) == list(range(1, N_ITERS + 1))
    return result, ckpt


def recover(tree, data, work, name: str, plan: str, *, env: Optional[Dict[str, str]] = None,
            **kwargs):
    ckpt = work / f"{name}_ckpt"
    result = run_job(tree, data, work / f"{name}.log", ckpt, plan=plan,
                     env_extra={**IN_MEMORY, **(env or {})}, timeout_s=420, **kwargs)
    return result, ckpt


def commits(log: str):
    """[(recovery id, seconds, step)] of every committed recovery, in order."""
    return [(int(a), float(b), int(c)) for a, b, c in _COMMITTED.findall(log)]


def assert_recovered_like_reference(result, ckpt, reference, recoveries: int) -> None:
    ref_result, ref_ckpt = reference
    assert result.returncode == 0, result.tail(8000)
    done = commits(result.log)
    assert len(done) == recoveries, (done, result.tail(8000))
    assert result.losses == ref_result.losses, (result.losses, ref_result.losses)
    # nothing written for the recovery: no dying checkpoint, only the final save; nothing read
    assert tracker_step(ckpt) == N_ITERS
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [manifest.iter_dir_name(N_ITERS)]
    assert "loading checkpoint from" not in result.log
    comparison = compare_checkpoints(ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


def test_dp4_sigkill_recovers_in_memory_bit_exact(reference, patched_megatron_tree,
                                                   tiny_dataset, work):
    """SIGKILL of rank 1 in the forward step of 5: rolled back to 4, rank 1 replaced by a cold
    process refilled from rank 3 (its partner), 5..10 redone."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "dp4_kill",
                           "1:5:sigkill:before")
    assert_recovered_like_reference(result, ckpt, reference, recoveries=1)
    assert commits(result.log)[0][2] == 4
    assert "ttprun: rank 1 (local 1) replaced by pid" in result.log
    assert "refilled from [3]" in result.log
