"""ReplicatedOptimizer against Megatron-LM 285068c's own DistributedOptimizer, on real Megatron
(4 CPU ranks, gloo): same losses up to fp32 reduction order, on each rank the optimizer memory of
stock's two DP positions it holds (measured in both runs by the same outside walk of what each
optimizer allocated: testkit/hooks/optim_memory), checkpoints interchangeable both ways, a
plain error where the optimizer is built without --use-distributed-optimizer, and a fused
optimizer with per-instance buffers that trains as under stock. Needs TTP_MEGATRON_DIR."""

from __future__ import annotations

import json
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
from mindio_ttp.faulttime import manifest
from mindio_ttp.megatron_ttp.args_check import NEEDS_REPLICATED
from testkit.hooks import OPTIM_MEMORY_DIR, pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 8
NO_CONSISTENT_STEP = int(ExitCode.NO_CONSISTENT_STEP)  # what the fault flow exits with
RECORD_BYTES = 64 * 1024  # ReplicatedOptimizer's step record: RNG states, no tensor of the model
FAST_FAIL_S = 120  # start-up of 2 ranks on a loaded 2-core machine, with no TTP_OT wait in it


def _measured(work: Path, name: str) -> dict:
    """The environment that makes every rank record its optimizer's memory under work/name."""
    out = work / f"{name}.optim-memory"
    out.mkdir(exist_ok=True)
    return {"PYTHONPATH": pythonpath(OPTIM_MEMORY_DIR), "TTP_OPTIM_MEMORY_DIR": str(out)}


def _memory(work: Path, name: str) -> dict:
    out = work / f"{name}.optim-memory"
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replicated")


@pytest.fixture(scope="module")
def stock_run(unpatched_megatron_tree, tiny_dataset, work):
    """Unpatched Megatron, its DistributedOptimizer, checkpoints at 4 and 8."""
    ckpt = work / "stock_ckpt"
    result = run_job(unpatched_megatron_tree, tiny_dataset, work / "stock.log", ckpt,
                     iters=ITERS, save_interval=4, launcher=Launcher.TORCHRUN,
                     inject_adaptor=True, env_extra=_measured(work, "stock"))
    assert result.returncode == 0, result.tail()
    return result, ckpt


@pytest.fixture(scope="module")
def replicated_run(patched_megatron_tree, tiny_dataset, work):
    ckpt = work / "replicated_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "replicated.log", ckpt,
                     iters=ITERS, env_extra=_measured(work, "replicated"))
    assert result.returncode == 0, result.tail()
    return result, ckpt


def test_losses_match_distributed_optimizer(stock_run, replicated_run):
    stock, replicated = stock_run[0].losses, replicated_run[0].losses
    print(loss_table({"DistributedOptimizer": stock, "ReplicatedOptimizer": replicated}))
    assert sorted(replicated) == list(range(1, ITERS + 1))
    assert_close_losses(replicated, stock)


def test_each_rank_holds_the_stock_state_of_itself_and_its_partner(stock_run, replicated_run,
                                                                    work):
    """Rank p of ReplicatedOptimizer keeps stock's stripe p and its partner's, p + DP/2: what
    it allocated is what stock's DistributedOptimizer allocated on those two ranks, plus its
    step record (the RNG states of the steps it may save: a few KiB, whatever the model). Both
    sides are measured the same way, from outside, so neither optimizer grades itself."""
    stock, replicated = _memory(work, "stock"), _memory(work, "replicated")
    assert sorted(stock) == sorted(replicated) == [0, 1, 2, 3], (stock, replicated)
    for rank in range(4):
        s, r = stock[rank], replicated[rank]
        assert (s["optimizer"], r["optimizer"]) == ("DistributedOptimizer",
                                                   "ReplicatedOptimizer")
        assert s["params"] == r["params"]
        partner = (rank + 2) % 4
        print(f"rank {rank}: {r['params']} params; DistributedOptimizer {s['bytes']} B = "
              f"{s['bytes'] / s['params']:.3f} B/param, ReplicatedOptimizer {r['bytes']} B = "
              f"{r['bytes'] / r['params']:.3f} B/param")
        extra = r["bytes"] - (s["bytes"] + stock[partner]["bytes"])
        assert 0 <= extra <= RECORD_BYTES, extra
        assert s["bytes"] > 0


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
