"""ReplicatedOptimizer against Megatron-LM 285068c's own DistributedOptimizer, on real Megatron
(4 CPU ranks, gloo): same losses up to fp32 reduction order, twice the optimizer state per rank
(every shard on two ranks), checkpoints interchangeable both ways, a plain error where the
optimizer is built without --use-distributed-optimizer, and a fused optimizer with per-instance
buffers that trains as under stock. Needs TTP_MEGATRON_DIR."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from megatron_e2e import (
    assert_close_losses,
    assert_same_structure_close_values,
    copy_checkpoints,
    loss_table,
    run_job,
)

from mindio_ttp.config import ExitCode
from mindio_ttp.demo.rehearsal.launch import Launcher
from mindio_ttp.megatron_ttp import manifest
from mindio_ttp.megatron_ttp.args_check import NEEDS_REPLICATED
from testkit.hooks import pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 8
NO_CONSISTENT_STEP = int(ExitCode.NO_CONSISTENT_STEP)  # what the fault flow exits with
FAST_FAIL_S = 120  # start-up of 2 ranks on a loaded 2-core machine, with no TTP_OT wait in it
_MEMORY_RE = re.compile(r"ReplicatedOptimizer rank (\d+) .*?: (\d+) of (\d+) params, optimizer "
                        r"state (\d+) B = ([0-9.]+) B/param; DistributedOptimizer would hold "
                        r"(\d+) params = ([0-9.]+) B/param")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replicated")


@pytest.fixture(scope="module")
def stock_run(unpatched_megatron_tree, tiny_dataset, work):
    """Unpatched Megatron, its DistributedOptimizer, checkpoints at 4 and 8."""
    ckpt = work / "stock_ckpt"
    result = run_job(unpatched_megatron_tree, tiny_dataset, work / "stock.log", ckpt,
                     iters=ITERS, save_interval=4, launcher=Launcher.TORCHRUN,
                     inject_adaptor=True)
    assert result.returncode == 0, result.tail()
    return result, ckpt


@pytest.fixture(scope="module")
def replicated_run(patched_megatron_tree, tiny_dataset, work):
    ckpt = work / "replicated_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "replicated.log", ckpt,
                     iters=ITERS)
    assert result.returncode == 0, result.tail()
    return result, ckpt


def test_losses_match_distributed_optimizer(stock_run, replicated_run):
    stock, replicated = stock_run[0].losses, replicated_run[0].losses
    print(loss_table({"DistributedOptimizer": stock, "ReplicatedOptimizer": replicated}))
    assert sorted(replicated) == list(range(1, ITERS + 1))
    assert_close_losses(replicated, stock)


def test_each_rank_holds_twice_the_distributed_optimizer_state(replicated_run):
    reports = _MEMORY_RE.findall(replicated_run[0].log)
    assert sorted(int(r[0]) for r in reports) == [0, 1, 2, 3], replicated_run[0].tail()
    for _rank, owned, total, state_bytes, per_param, stock_owned, stock_per_param in reports:
        print(f"rank {_rank}: {owned}/{total} params, {state_bytes} B optimizer state, "
              f"{per_param} B/param (DistributedOptimizer {stock_per_param} B/param)")
        assert int(owned) == int(total) // 2  # DP 4 -> 2 shards, each on 2 ranks
        assert int(stock_owned) == int(total) // 4
        assert float(per_param) == pytest.approx(2 * float(stock_per_param), rel=1e-3)
        assert int(state_bytes) == 8 * int(owned)  # Adam exp_avg + exp_avg_sq in fp32


def test_replicated_checkpoint_is_what_distributed_optimizer_writes(stock_run, replicated_run):
    """Megatron's periodic save through ReplicatedOptimizer.state_dict(): per DP rank the
    stock shard, param groups and scheduler state; values equal up to reduction order."""
    ckpt = replicated_run[1]
    assert manifest.read_tracker(ckpt)[0] == ITERS
    assert manifest.verify(ckpt / manifest.iter_dir_name(ITERS),
                           manifest.ParallelLayout(tp=1, pp=1, dp=4)) is None
    assert_same_structure_close_values(ckpt, stock_run[1], ITERS)


def test_replicated_optimizer_resumes_a_stock_checkpoint(stock_run, patched_megatron_tree,
                                                         tiny_dataset, work):
    stock, stock_ckpt = stock_run
    ckpt = copy_checkpoints(stock_ckpt, work / "from_stock_ckpt")
    shutil.rmtree(ckpt / manifest.iter_dir_name(ITERS))
    manifest.write_tracker(ckpt, 4)
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "from_stock.log", ckpt,
                      iters=ITERS)
    assert resumed.returncode == 0, resumed.tail()
    want = {i: v for i, v in stock.losses.items() if i > 4}
    print(loss_table({"stock": want, "replicated from stock@4": resumed.losses}))
    assert_close_losses(resumed.losses, want)


def test_without_distributed_optimizer_fails_at_optimizer_build(patched_megatron_tree,
                                                              tiny_dataset, work):
    """Edit 3.3 refuses the run inside get_megatron_optimizer: a plain error, before data
    loading and before train() starts the TTP controller, so no fault flow and no exit 84."""
    result = run_job(patched_megatron_tree, tiny_dataset, work / "no_distopt.log",
                     work / "no_distopt_ckpt", iters=4, nproc=2, distributed_optimizer=False,
                     load=False, timeout_s=180)
    log = result.log
    print(f"failed after {result.wall_s:.1f} s, exit {result.returncode}")
    assert result.returncode not in (0, NO_CONSISTENT_STEP), result.tail()
    assert NEEDS_REPLICATED.format(kind="FP32Optimizer") in log, result.tail()
    assert "in get_megatron_optimizer" in log, "the check must run where the optimizer is built"
    assert not re.search(r"\bfault", log, re.IGNORECASE), result.tail()  # ("default" is fine)
    assert "no dying-checkpoint flow ran" in log, result.tail()
    assert "AttributeError" not in log
    assert not result.losses, "no training step may run"
    assert not list((work / "no_distopt_ckpt").glob("iter_*")), "nothing may be saved"
    assert result.wall_s < FAST_FAIL_S, f"took {result.wall_s:.1f} s"


FUSED_DOUBLE = Path(__file__).resolve().parent / "fused_double"


def test_a_fused_optimizer_with_per_instance_buffers_trains_as_under_stock(
        unpatched_megatron_tree, patched_megatron_tree, tiny_dataset, work):
    """The partner stripe's inner optimizer is a new instance of the same class (not a copy):
    with an optimizer that keeps per-instance buffer lists like torch_npu's fused ones
    (tests/megatron/fused_double), both stripes step their own params, and the losses are
    those of stock DistributedOptimizer with the same optimizer."""
    env = {"PYTHONPATH": pythonpath(FUSED_DOUBLE), "TTP_TEST_FUSED_DOUBLE": "1"}
    stock = run_job(unpatched_megatron_tree, tiny_dataset, work / "fused_stock.log",
                    work / "fused_stock_ckpt", iters=ITERS, launcher=Launcher.TORCHRUN,
                    inject_adaptor=True, env_extra=env)
    assert stock.returncode == 0, stock.tail()
    replicated = run_job(patched_megatron_tree, tiny_dataset, work / "fused_replicated.log",
                         work / "fused_replicated_ckpt", iters=ITERS, env_extra=env)
    assert replicated.returncode == 0, replicated.tail()
    print(loss_table({"DistributedOptimizer": stock.losses, "ReplicatedOptimizer":
                      replicated.losses}))
    assert sorted(replicated.losses) == list(range(1, ITERS + 1))
    assert_close_losses(replicated.losses, stock.losses)
