"""Two ttprun of one job on one host (a two-node rehearsal on one machine, two tasks per node):
a lost rank's replacement is asked of the launcher that runs it.

The controller asks the lowest survivor on the lost rank's host to relay the request, and every
rank here has the same host: rank 0, of the other launcher. Before, that launcher answered
"rank 3 is not a worker of this launcher" and the recovery was abandoned for the dying
checkpoint; now it hands the request to its sibling (launch/siblings.py), which starts the
replacement, and the job trains on.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from mindio_ttp.demo.runner import FAST_ENV

pytestmark = pytest.mark.slow


def test_a_rank_of_the_other_launcher_on_this_host_is_replaced(tmp_path: Path,
                                                                free_port: int) -> None:
    from mindio_ttp.demo.ports import pick_free_port

    env = {**os.environ, **FAST_ENV, "TTP_RECOVERY": "in-memory",
           "TTP_AUTH_KEY": secrets.token_hex(32),
           "TTP_CONTROLLER_PORT": str(pick_free_port()), "TTP_RUN_DIR": str(tmp_path / "runs")}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=2",
               "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=127.0.0.1",
               f"--master-port={free_port}", f"--node-rank={node}", "--monitor-interval=0.05",
               "--drill=kill:rank=3:iter=4", "-m", "mindio_ttp.demo.job", "--steps=12",
               "--step-delay=0.02", f"--ckpt-dir={tmp_path / 'ckpt'}",
               f"--out={tmp_path / f'out{node}'}"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    both = "\n===== node 1\n".join(outs)
    assert [p.returncode for p in procs] == [0, 0], both
    assert ("ttprun: rank 3 is run by another ttprun of this job on this host (pid "
            f"{procs[1].pid}): its replacement for recovery 1 is asked of it") in outs[0], both
    assert "ttprun: rank 3 (local 1) replaced by pid" in outs[1], both
    for out in outs:
        assert ("DRILL RESULT: PASSED: the job recovered in memory: recovery 1 committed at "
                "iteration 4, replacing rank(s) [3]") in out, both
        assert "other ttprun of this job on this host" in out, both
    assert "rank 0 | finished step 12" in outs[0], both
    assert not list((tmp_path / "ckpt").glob("step_*")), "nothing saved: recovered in memory"
