"""Issue 14.5 on the real Megatron-LM 285068c: its process-group timeout is hard-coded at 10
minutes (megatron/initialize.py:174-177) and it has no --distributed-timeout-minutes. A tree
patched by ttp-patch takes the timeout from the runtime (edit 6.2: at least TTP_OT + margin);
for a tree with the guide's edits only, ttprun warns with advice this tree accepts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindio_ttp.demo.rehearsal.launch import pick_free_port
from mindio_ttp.launch.timeouts import timeout_warning

pytestmark = pytest.mark.megatron

FLAG = "--distributed-timeout-minutes"


def guide_only(tree: Path) -> Path:
    """A cpu-patched tree whose megatron/initialize.py is 285068c's again (the guide does not
    touch it): what a hand-patched tree, or one patched by an older ttp-patch, holds."""
    subprocess.run(["git", "-C", str(tree), "checkout", "--", "megatron/initialize.py"],
                   check=True, timeout=60)
    return tree


def test_ttprun_advice_is_true_for_this_commit(megatron_tree_factory) -> None:
    stock = megatron_tree_factory(patched=False)
    script = str(stock / "pretrain_gpt.py")
    assert timeout_warning(script, [], 120) is None
    said = timeout_warning(script, [], 600)
    assert said is not None and "600 s, hard-coded in" in said
    assert "ttp-patch apply" in said and FLAG not in said
    said = timeout_warning(script, [FLAG, "20"], 600)
    assert said is not None and "unrecognized arguments" in said
    patched = megatron_tree_factory(patched=True, device="cuda")
    assert timeout_warning(str(patched / "pretrain_gpt.py"), [], 3600) is None


PROBE = textwrap.dedent(
    """
    import argparse, importlib.util, sys
    tree = sys.argv[1]
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("pretrain_gpt", tree + "/pretrain_gpt.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # compat + CPU adaptor
    import torch, torch.distributed as dist
    from megatron import global_vars, initialize
    global_vars._GLOBAL_ARGS = argparse.Namespace(
        rank=0, world_size=1, local_rank=None, distributed_backend="gloo",
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_split_rank=None)
    initialize._initialize_distributed()  # Megatron's own call
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    print("TIMEOUT", backend.options._timeout.total_seconds())
    dist.destroy_process_group()
    """
)


def _group_timeout(tree: Path, ot: str) -> float:
    env = dict(os.environ, TTP_OT=ot, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pick_free_port()),
               RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-c", PROBE, str(tree)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tree)
    said = [ln for ln in done.stdout.splitlines() if ln.startswith("TIMEOUT ")]
    assert done.returncode == 0 and said, (done.stdout + done.stderr)[-3000:]
    return float(said[-1].split()[1])


@pytest.mark.slow
def test_patched_tree_process_group_outlasts_ttp_ot(megatron_tree_factory) -> None:
    tree = megatron_tree_factory(patched=True, device="cpu")
    assert _group_timeout(tree, "900") == 1200.0  # TTP_OT + 300 s margin (the floor: unit tests)
    assert _group_timeout(guide_only(tree), "900") == 600.0  # what ttprun warns about


@pytest.mark.slow
def test_ttprun_warns_before_megatron_refuses_the_flag(megatron_tree_factory,
                                                      tmp_path: Path) -> None:
    """The old advice, followed: Megatron 285068c exits with 'unrecognized arguments'."""
    tree = guide_only(megatron_tree_factory(patched=True, device="cpu"))
    env = dict(os.environ, TTP_OT="60", TTP_RUN_DIR=str(tmp_path / "runs"))
    cmd = [sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", "--nproc-per-node=1",
           "--rdzv-backend=static", "--master-addr=127.0.0.1",
           f"--master-port={pick_free_port()}", "--node-rank=0", str(tree / "pretrain_gpt.py"),
           FLAG, "20"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"ttprun: warning: {FLAG} is not an argument of the Megatron-LM" in out, out[-3000:]
    assert f"unrecognized arguments: {FLAG} 20" in out, out[-3000:]
