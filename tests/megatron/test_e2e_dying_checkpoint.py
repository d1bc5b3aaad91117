"""Real Megatron-LM 285068c, patched with `ttp-patch apply --device cpu`, launched by `ttprun`
on 4 CPU ranks (gloo, --use-distributed-optimizer, dropout 0): a fault mid-training leaves a
dying checkpoint of a known step, and resuming from it reproduces the uninterrupted run exactly
(same printed losses, bit-identical final checkpoint). Needs TTP_MEGATRON_DIR.

Step arithmetic: a fault in the forward step of iteration k (phase "before") happens before any
rank starts updating k, so every survivor last finished k-1; a SIGKILL inside the update window
of k leaves the replica partner able to finish k (no collective runs in the window), so k is
saved.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from megatron_e2e import (
    N_ITERS,
    TTP_OT_S,
    assert_close_losses,
    copy_checkpoints,
    fault_time,
    log_lines,
    loss_table,
    run_job,
    tb_scalars,
    tracker_step,
)

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints, load_checkpoint_file
from mindio_ttp.demo.rehearsal.launch import Launcher
from mindio_ttp.faulttime import manifest
from mindio_ttp.faulttime.manifest import ParallelLayout

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

DP4 = ParallelLayout(tp=1, pp=1, dp=4)
TP2_DP2 = ParallelLayout(tp=2, pp=1, dp=2)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def reference(patched_megatron_tree, tiny_dataset, work):
    """Run 1: N uninterrupted iterations."""
    ckpt = work / "ref_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "ref.log", ckpt)
    assert result.returncode == 0, result.tail()
    assert sorted(result.losses) == list(range(1, N_ITERS + 1))
    return result, ckpt


@pytest.fixture(scope="module")
def killed(patched_megatron_tree, tiny_dataset, work):
    """Run 2: SIGKILL rank 1 in the forward step of iteration 5 (periodic save every 3)."""
    ckpt = work / "killed_ckpt"
    log = work / "killed.log"
    result = run_job(patched_megatron_tree, tiny_dataset, log, ckpt, plan="1:5:sigkill:before",
                     save_interval=3)
    return result, ckpt, log


def resume_and_compare(tree, data, work, name, ckpt, reference, first_resumed):
    """Resume a copy of `ckpt` to N; same losses and bit-identical final checkpoint as run 1."""
    ref_result, ref_ckpt = reference
    resumed_ckpt = copy_checkpoints(ckpt, work / f"{name}_resumed_ckpt")
    resumed = run_job(tree, data, work / f"{name}_resumed.log", resumed_ckpt)
    assert resumed.returncode == 0, resumed.tail()
    want = {i: v for i, v in ref_result.losses.items() if i >= first_resumed}
    print(loss_table({"uninterrupted": ref_result.losses, name: resumed.losses}))
    got = dict(resumed.losses)
    saved = first_resumed - 1
    if saved in got:  # printed from the checkpoint's record: the faulty run stopped before its
        # log line (log_record.py), as a fault that lands at any instant may (preempt_all)
        assert got.pop(saved) == ref_result.losses[saved], (resumed.losses, ref_result.losses)
    assert got == want
    comparison = compare_checkpoints(resumed_ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()
    return resumed


def test_sigkill_of_rank1_saves_step4_within_ttp_ot(killed, reference):
    result, ckpt, log = killed
    assert result.returncode != 0, "the launcher must report the failed job"
    elapsed = result.ended_at - fault_time(log, rank=1)
    print(f"launcher exited {elapsed:.1f} s after the SIGKILL (TTP_OT={TTP_OT_S})")
    assert elapsed < TTP_OT_S
    assert tracker_step(ckpt) == 4
    assert (ckpt / "iter_0000004" / manifest.MANIFEST).is_file()
    said = f"dying checkpoint of iteration 4 saved in {ckpt / 'iter_0000004'} and marked latest"
    assert f"ttprun: {said}" in result.log, result.tail()
    assert manifest.verify(ckpt / "iter_0000004", DP4) is None
    assert manifest.verify(ckpt / "iter_0000003", DP4) is None  # the periodic one is untouched
    assert not list(ckpt.glob(".ttp_tmp_*"))
    assert result.losses == {i: v for i, v in reference[0].losses.items() if i <= 4}


def test_resume_from_dying_checkpoint_is_bit_exact(killed, reference, patched_megatron_tree,
                                                   tiny_dataset, work):
    resume_and_compare(patched_megatron_tree, tiny_dataset, work, "sigkill", killed[1],
                       reference, first_resumed=5)


def test_a_saved_step_whose_line_no_run_printed_is_logged_by_the_resumed_run(
        reference, patched_megatron_tree, tiny_dataset, work):
    """Rank 1 killed as step 5's logging starts, after every rank's update of 5: the survivors
    hold 5 and save it, but Megatron prints 5's line (on rank 3) after a barrier of every rank
    (training.py:602), which the fault broke; the resumed run starts at 6. Before, no run ever
    printed 5's loss (the demo compared 9 of 10). Now the resumed run prints it once, with the
    uninterrupted run's value, and 5's TensorBoard scalars are on disk exactly once."""
    tb = ["--tensorboard-dir", str(work / "unlogged_tb")]
    ckpt = work / "unlogged_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "unlogged.log", ckpt,
                     plan="1:5:sigkill:log", extra=tb,
                     env_extra={"TTP_RECOVERY": "dying-checkpoint"})
    assert "FAULT: SIGKILL rank 1 as the logging starts of step 5" in result.log
    assert tracker_step(ckpt) == 5, result.tail()
    assert 5 not in result.losses, result.tail()  # the hole
    assert manifest.listed(ckpt / "iter_0000005", DP4, manifest.STEP_LOG) is not None

    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "unlogged_resumed.log", ckpt,
                      extra=tb)
    assert resumed.returncode == 0, resumed.tail()
    assert "resume: step 5's log line" in resumed.log, resumed.tail(8000)
    ref_losses = reference[0].losses
    assert {**result.losses, **resumed.losses} == ref_losses, loss_table(
        {"uninterrupted": ref_losses, "killed": result.losses, "resumed": resumed.losses})
    assert log_lines(result.log + resumed.log)[5] == 1
    scalars = tb_scalars(work / "unlogged_tb")
    assert len(scalars.get(5, [])) == 1, scalars
    assert abs(scalars[5][0] - float(ref_losses[5])) <= 1e-5 * abs(float(ref_losses[5]))


def test_sigkill_of_rank0_saves_the_same_bytes_from_other_holders(killed, patched_megatron_tree,
                                                                  tiny_dataset, work):
    """Rank 0 started the controller, whose process outlives it and runs the flow. Other
    holders ([1, 2] instead of [0, 3]) must write the same checkpoint, tensor for tensor."""
    ckpt = work / "rank0_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "rank0.log", ckpt,
                     plan="0:5:sigkill:before", save_interval=3)
    assert result.returncode != 0
    assert tracker_step(ckpt) == 4, result.tail()
    comparison = compare_checkpoints(ckpt, killed[1], 4)
    assert comparison.bit_exact, comparison.summary()


def test_hung_rank_is_saved_around_while_survivors_block_in_a_collective(
        killed, patched_megatron_tree, tiny_dataset, work):
    """SIGSTOP: nothing breaks a connection, the survivors sit in a gloo collective; the
    controller notices missing heartbeats and the processor threads save anyway."""
    ckpt = work / "hung_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "hung.log", ckpt,
                     plan="2:5:sigstop:before", save_interval=3,
                     env_extra={"TTP_HEARTBEAT_TIMEOUT": "6"})
    assert result.returncode != 0
    assert tracker_step(ckpt) == 4, result.tail()
    comparison = compare_checkpoints(ckpt, killed[1], 4)
    assert comparison.bit_exact, comparison.summary()


def test_sigkill_inside_update_window_saves_that_step(reference, patched_megatron_tree,
                                                      tiny_dataset, work):
    ckpt = work / "inside_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "inside.log", ckpt,
                     plan="3:6:sigkill:inside")
    assert result.returncode != 0
    assert tracker_step(ckpt) == 6, result.tail()  # rank 1, rank 3's partner, finished step 6
    assert "dying checkpoint of iteration 6" in result.log
    resume_and_compare(patched_megatron_tree, tiny_dataset, work, "inside", ckpt, reference,
                       first_resumed=7)


def test_exception_in_rank0_forward_saves_previous_step(reference, patched_megatron_tree,
                                                        tiny_dataset, work):
    ckpt = work / "exception_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "exception.log", ckpt,
                     plan="0:5:exception:before")
    assert result.returncode != 0
    assert "injected fault" in result.log
    assert tracker_step(ckpt) == 4, result.tail()
    resume_and_compare(patched_megatron_tree, tiny_dataset, work, "exception", ckpt, reference,
                       first_resumed=5)


def test_tp2_dp2_sigkill_resumes_bit_exact(patched_megatron_tree, tiny_dataset, work):
    ref_ckpt = work / "tp2_ref_ckpt"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / "tp2_ref.log", ref_ckpt, tp=2)
    assert ref.returncode == 0, ref.tail()
    ckpt = work / "tp2_killed_ckpt"
    killed = run_job(patched_megatron_tree, tiny_dataset, work / "tp2_killed.log", ckpt, tp=2,
                     plan="3:5:sigkill:before")
    assert killed.returncode != 0
    assert tracker_step(ckpt) == 4, killed.tail()
    assert manifest.verify(ckpt / "iter_0000004", TP2_DP2) is None
    resumed_ckpt = copy_checkpoints(ckpt, work / "tp2_resumed_ckpt")
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "tp2_resumed.log",
                      resumed_ckpt, tp=2)
    print(loss_table({"tp2 uninterrupted": ref.losses, "tp2 resumed": resumed.losses}))
    assert resumed.losses == {i: v for i, v in ref.losses.items() if i >= 5}
    comparison = compare_checkpoints(resumed_ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


def test_pp2_dp2_default_pipeline_flags_sigkill_resumes_bit_exact(patched_megatron_tree,
                                                                  tiny_dataset, work):
    """Pipeline parallel with Megatron's default ``--scatter-gather-tensors-in-pipeline``."""
    pp2 = ["--pipeline-model-parallel-size", "2"]
    ref_ckpt = work / "pp2_ref_ckpt"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / "pp2_ref.log", ref_ckpt, extra=pp2)
    assert ref.returncode == 0, ref.tail()
    assert sorted(ref.losses) == list(range(1, N_ITERS + 1)), ref.tail()
    ckpt = work / "pp2_killed_ckpt"
    killed = run_job(patched_megatron_tree, tiny_dataset, work / "pp2_killed.log", ckpt,
                     plan="3:5:sigkill:before", extra=pp2)
    assert killed.returncode != 0
    assert tracker_step(ckpt) == 4, killed.tail()
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "pp2_resumed.log", ckpt,
                      extra=pp2)
    print(loss_table({"pp2 uninterrupted": ref.losses, "pp2 resumed": resumed.losses}))
    assert resumed.losses == {i: v for i, v in ref.losses.items() if i >= 5}
    comparison = compare_checkpoints(ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


def _validation_losses(log: str) -> dict:
    return {int(it): loss for it, loss in re.findall(
        r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)", log)}


def _saved_args(ckpt: Path, iteration: int):
    return load_checkpoint_file(
        ckpt / f"iter_{iteration:07d}" / "mp_rank_00" / "model_rng.pt")["args"]


def test_validation_samples_of_the_dying_checkpoint_match_megatrons_own_save(
        patched_megatron_tree, tiny_dataset, work):
    """Evaluation every 2 iterations: Megatron's own save of iteration 4 counts the evaluation
    of iteration 4, so the dying checkpoint of 4 must too, and validation after the resume
    must see the same batches (same validation losses) as the uninterrupted run."""
    evaluate = ["--eval-interval", "2", "--eval-iters", "1"]
    ref_ckpt = work / "eval_ref_ckpt"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / "eval_ref.log", ref_ckpt,
                  save_interval=4, extra=evaluate)
    assert ref.returncode == 0, ref.tail()
    ckpt = work / "eval_killed_ckpt"
    killed = run_job(patched_megatron_tree, tiny_dataset, work / "eval_killed.log", ckpt,
                     plan="1:5:sigkill:before", extra=evaluate)
    assert tracker_step(ckpt) == 4, killed.tail()
    megatron_own = _saved_args(ref_ckpt, 4).consumed_valid_samples
    assert megatron_own > 0
    assert _saved_args(ckpt, 4).consumed_valid_samples == megatron_own
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "eval_resumed.log", ckpt,
                      extra=evaluate)
    reference_valid = _validation_losses(ref.log)
    assert sorted(reference_valid) == [2, 4, 6, 8, 10], ref.tail()
    assert _validation_losses(resumed.log) == {
        i: v for i, v in reference_valid.items() if i > 4}, resumed.tail()


def test_dropout_rng_of_the_saved_step_resumes_bit_exact(patched_megatron_tree, tiny_dataset,
                                                         work):
    """With dropout on, the survivors' RNG has moved on (forward of iteration 5) when they
    save step 4: the checkpoint must carry the RNG state recorded at the end of step 4."""
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    ref_ckpt = work / "dropout_ref_ckpt"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / "dropout_ref.log", ref_ckpt,
                  extra=dropout)
    assert ref.returncode == 0, ref.tail()
    ckpt = work / "dropout_killed_ckpt"
    killed = run_job(patched_megatron_tree, tiny_dataset, work / "dropout_killed.log", ckpt,
                     plan="2:5:sigkill:before", extra=dropout)
    assert tracker_step(ckpt) == 4, killed.tail()
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "dropout_resumed.log", ckpt,
                      extra=dropout)
    print(loss_table({"dropout uninterrupted": ref.losses, "dropout resumed": resumed.losses}))
    assert resumed.losses == {i: v for i, v in ref.losses.items() if i >= 5}
    comparison = compare_checkpoints(ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


def test_both_holders_of_a_shard_killed_leaves_previous_checkpoint(patched_megatron_tree,
                                                                    tiny_dataset, work):
    ckpt = work / "both_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "both.log", ckpt,
                     plan="1:5:sigkill:before,3:5:sigkill:before", save_interval=3)
    assert result.returncode != 0
    assert "no consistent step" in result.log, result.tail()
    assert tracker_step(ckpt) == 3
    assert not (ckpt / "iter_0000004").exists()
    assert not list(ckpt.glob(".ttp_tmp_*"))
    assert manifest.verify(ckpt / "iter_0000003", DP4) is None


def test_corrupt_dying_checkpoint_is_refused_and_previous_used(killed, reference,
                                                               patched_megatron_tree,
                                                               tiny_dataset, work):
    ckpt = copy_checkpoints(killed[1], work / "corrupt_ckpt")
    victim = ckpt / "iter_0000004" / "mp_rank_00_002" / "optim.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    resumed = resume_and_compare(patched_megatron_tree, tiny_dataset, work, "corrupt", ckpt,
                                 reference, first_resumed=4)
    assert "fails its checksum" in resumed.log
    assert "loading the previous complete checkpoint, iteration 3" in resumed.log


def test_stock_megatron_loads_the_dying_checkpoint(killed, reference, unpatched_megatron_tree,
                                                   tiny_dataset, work):
    ckpt = copy_checkpoints(killed[1], work / "stock_load_ckpt")
    stock = run_job(unpatched_megatron_tree, tiny_dataset, work / "stock_load.log", ckpt,
                    launcher=Launcher.TORCHRUN, inject_adaptor=True)
    assert stock.returncode == 0, stock.tail()
    assert "successfully loaded checkpoint" in stock.log and "at iteration 4" in stock.log
    want = {i: v for i, v in reference[0].losses.items() if i >= 5}
    print(loss_table({"ttp uninterrupted": want, "stock from dying ckpt": stock.losses}))
    assert_close_losses(stock.losses, want)  # stock optimizer: fp32 reduction-order noise only


@pytest.mark.parametrize("damage", ["manifest_is_a_list", "manifest_deleted"])
def test_hostile_manifest_is_refused_and_previous_used(killed, reference, patched_megatron_tree,
                                                       tiny_dataset, work, damage):
    """Every rank refuses the same way and reaches the agreement collective (none raises)."""
    ckpt = copy_checkpoints(killed[1], work / f"{damage}_ckpt")
    target = ckpt / "iter_0000004" / manifest.MANIFEST
    if damage == "manifest_is_a_list":
        target.write_text("[]")
    else:
        target.unlink()
    resumed = resume_and_compare(patched_megatron_tree, tiny_dataset, work, damage, ckpt,
                                 reference, first_resumed=4)
    expected = "a JSON list" if damage == "manifest_is_a_list" else "its ttp_manifest.json is gone"
    assert expected in resumed.log, resumed.tail()
    assert "loading the previous complete checkpoint, iteration 3" in resumed.log


def test_garbage_tracker_is_a_clear_nonzero_exit(killed, patched_megatron_tree, tiny_dataset,
                                                 work):
    """Megatron's own reader would print "Invalid metadata file" and exit 0."""
    ckpt = copy_checkpoints(killed[1], work / "garbage_tracker_ckpt")
    (ckpt / manifest.TRACKER).write_text("5.0")
    result = run_job(patched_megatron_tree, tiny_dataset, work / "garbage_tracker.log", ckpt)
    assert result.returncode != 0, result.tail()
    assert f"checkpoint tracker {ckpt / manifest.TRACKER} holds '5.0'" in result.log
    assert not result.losses, "training must not start from a guessed iteration"


def test_slurm_style_preemption_with_dataloader_workers_saves_and_resumes(
        reference, patched_megatron_tree, tiny_dataset, work):
    """Megatron's default --num-workers 2, SIGTERM to every process of the job at once (the
    launcher, the ranks, their DataLoader workers), as Slurm preempts a job step: torch's
    SIGCHLD handler raises in the training threads, and the dying checkpoint is still written."""
    ckpt = work / "preempt_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "preempt.log", ckpt,
                     plan="1:5:preempt_all:before", extra=["--num-workers", "2"])
    assert result.returncode == 143, result.tail()  # ttprun itself got the SIGTERM
    # the DataLoader workers die too; whether torch's SIGCHLD handler raises in a rank (it
    # usually does: "is killed by signal") depends on which process the signal reaches first
    step = tracker_step(ckpt)
    assert step in (4, 5), result.tail()  # every rank stops within the step it was in
    resume_and_compare(patched_megatron_tree, tiny_dataset, work, "preempt", ckpt, reference,
                       first_resumed=step + 1)


def test_max_restarts_recovers_by_itself_through_three_random_faults(
        reference, patched_megatron_tree, tiny_dataset, work):
    """One `ttprun --max-restarts 3` run, three SIGKILLs at random (rank, phase) in three
    attempts: each restarted attempt gets its own store, resumes from the dying checkpoint the
    attempt before wrote, and the job ends with the uninterrupted run's losses and a
    bit-identical final checkpoint."""
    import random

    seed = int(os.environ.get("TTP_CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    steps = [rng.choice((2, 3)), rng.choice((5, 6)), 8]  # each past the last dying checkpoint
    faults = [f"{rng.randrange(4)}:{s}:sigkill:{rng.choice(('before', 'inside', 'after'))}"
              for s in steps]
    plan = "|".join(faults)
    print(f"chaos seed {seed}: {plan}")
    ckpt = work / "chaos_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "chaos.log", ckpt, plan=plan,
                     launcher_args=["--max-restarts", "3"], timeout_s=600)
    assert result.returncode == 0, f"seed {seed} {plan}\n{result.tail()}"
    assert result.log.count("dying checkpoint of iteration") >= 3, result.tail()
    ref_result, ref_ckpt = reference
    # an iteration killed inside or after its update is saved but never printed
    table = loss_table({"uninterrupted": ref_result.losses, "chaos": result.losses})
    assert max(result.losses) == N_ITERS, table
    assert {i: ref_result.losses[i] for i in result.losses} == result.losses, table
    comparison = compare_checkpoints(ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, f"seed {seed} {plan}: {comparison.summary()}"


def test_death_inside_the_guides_barrier_still_saves_and_resumes(
        reference, patched_megatron_tree, tiny_dataset, work):
    """Ranks 0, 2, 3 pass the guide's barrier of iteration 5 and update (rank 3 then dies);
    the barrier raises on rank 1, shard 1's only live holder, with iteration 5's update ready
    (the plan fires it once the others have updated): only its catch-up (ReplicatedOptimizer
    offers the update) gives shard 1 iteration 5, so iteration 5, the newest, must be saved,
    and the resume is bit-exact."""
    ckpt = work / "barrier_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "barrier.log", ckpt,
                     plan="1:5:exception:barrier,3:5:sigkill:after")
    assert result.returncode != 0
    assert tracker_step(ckpt) == 5, result.tail()
    assert "catching up: running the ready update of step 5" in result.log
    resume_and_compare(patched_megatron_tree, tiny_dataset, work, "barrier", ckpt, reference,
                       first_resumed=6)


def test_a_run_without_load_never_moves_latest_back(reference, patched_megatron_tree,
                                                    tiny_dataset, work):
    """Issue 26: a rerun without --load started from iteration 1 in a directory whose latest
    was 605; its dying checkpoint of 209 then replaced 605 as latest, in silence. Now: warned
    at start, the older checkpoint is kept beside the newer one, latest stays the newer one,
    and ttprun says both, and that this command does not resume."""
    ckpt = copy_checkpoints(reference[1], work / "no_load_ckpt")
    assert tracker_step(ckpt) == N_ITERS
    result = run_job(patched_megatron_tree, tiny_dataset, work / "no_load.log", ckpt,
                     plan="1:4:sigkill:inside", load=False)
    log = result.log
    assert result.returncode == 1, result.tail()
    assert f"--save {ckpt} without --load: this run starts from iteration 0" in log
    assert tracker_step(ckpt) == N_ITERS  # not moved back to 4
    assert manifest.verify(ckpt / "iter_0000004", DP4) is None  # kept, complete
    assert manifest.verify(ckpt / f"iter_{N_ITERS:07d}", DP4) is None  # untouched
    said = (f"ttprun: dying checkpoint of iteration 4 saved in {ckpt / 'iter_0000004'}, NOT "
            f"marked latest: latest names iteration {N_ITERS}, which is newer (both are kept)")
    assert said in log, result.tail()
    assert (f"the same command does NOT resume: it has no --load; add --load {ckpt} to resume "
            f"from iteration {N_ITERS}") in log, result.tail()
    assert "run the same command to resume" not in log
