"""In-memory recovery on real Megatron-LM 285068c (docs/recovery.md): a fault mid-training, the
survivors stay up, ttprun starts a replacement, the replacement is refilled from its replica
partner, and the job ends as an uninterrupted run would: same printed losses, bit-identical
final checkpoint, exit 0, and no checkpoint written or read for the recovery. When the recovery
cannot finish, the job falls back to the dying checkpoint, bit-identical to Megatron's own save
of that step. Needs TTP_MEGATRON_DIR.

Step arithmetic as in test_e2e_dying_checkpoint.py: a fault in the forward step of iteration k
("before") leaves every survivor at k-1, so the recovery rolls back to k-1 and redoes k.
Every run here evaluates every 3 iterations (2 batches), like its reference, which also saves
every iteration, so a dying checkpoint of any step has Megatron's own save to be compared with.

The fault matrix of issue 22: the fault tests take a *case*, the backend and mode of the run
(megatron_e2e.cases): ``gloo`` (a dead peer's collective raises), ``nccl-like`` (it spins until
aborted, as on NCCL: testkit/nccl_like), ``nccl-like@2.1`` / ``@2.4`` / ``@2.6`` (the NCCL
surface of that torch), each in in-memory mode, or with ``+dying`` with the dying checkpoint
(the step the recovery would roll back to is saved instead, bit-identical to the reference's
save of it). Where the emulated stack cannot abort and re-initialise in-process (torch 2.1 and
2.4, `gated`), asking for in-memory recovery must give the dying checkpoint. The reference runs
are gloo's: a run on the NCCL-like backend must print the same losses and write the same bytes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
from megatron_e2e import (
    N_ITERS,
    NCCL_LIKE,
    TTP_OT_S,
    assert_saved_bit_exact,
    cases,
    copy_checkpoints,
    log_lines,
    run_job,
    split_case,
    tb_scalars,
    tracker_step,
)

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.faulttime import manifest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

DP4 = manifest.ParallelLayout(1, 1, 4)
TP2_DP2 = manifest.ParallelLayout(2, 1, 2)
PP2_DP2 = manifest.ParallelLayout(1, 2, 2)
NL = NCCL_LIKE
RELEASES = (f"{NL}@2.1", f"{NL}@2.4", f"{NL}@2.6")

IN_MEMORY = {"TTP_RECOVERY": "in-memory", "TTP_RECOVER_TIMEOUT": "90"}
EVAL = ["--eval-interval", "3", "--eval-iters", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
_COMMITTED = re.compile(r"recovery (\d+) committed in ([0-9.]+) s: every rank holds iteration "
                        r"(\d+)")
_ABANDONED = re.compile(r"recovery (\d+) abandoned: (.*)")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recovery")


def _tensorboard(work: Path, name: str) -> List[str]:
    return ["--tensorboard-dir", str(work / f"{name}_tb")]


def _tb_of(ckpt: Path) -> Path:
    return ckpt.parent / f"{ckpt.name[:-len('_ckpt')]}_tb"


def _reference(tree, data, work: Path, name: str, tp: int = 1, extra: Sequence[str] = ()):
    """N uninterrupted iterations, saved at every one."""
    ckpt = work / f"{name}_ckpt"
    result = run_job(tree, data, work / f"{name}.log", ckpt, tp=tp, save_interval=1,
                     extra=[*EVAL, *extra, *_tensorboard(work, name)])
    assert result.returncode == 0, result.tail()
    assert sorted(result.losses) == list(range(1, N_ITERS + 1))
    return result, ckpt


@pytest.fixture(scope="module")
def reference(patched_megatron_tree, tiny_dataset, work):
    return _reference(patched_megatron_tree, tiny_dataset, work, "ref")


@pytest.fixture(scope="module")
def reference_tp2(patched_megatron_tree, tiny_dataset, work):
    return _reference(patched_megatron_tree, tiny_dataset, work, "ref_tp2", tp=2)


@pytest.fixture(scope="module")
def reference_pp2(patched_megatron_tree, tiny_dataset, work):
    return _reference(patched_megatron_tree, tiny_dataset, work, "ref_pp2", extra=PP2)


def gated(backend: str) -> bool:
    """Emulated stacks that cannot abort and re-initialise NCCL in-process (torch < 2.5: no
    group abort; issue 22 §3.6): asked for in-memory recovery, they give the dying checkpoint."""
    return backend in (f"{NL}@2.1", f"{NL}@2.4")


def recover(tree, data, work: Path, name: str, plan: str, *,
            env: Optional[Dict[str, str]] = None, tp: int = 1, extra: Sequence[str] = (),
            save_interval: int = 10_000, case: str = "gloo"):
    backend, dying = split_case(case)
    mode = {"TTP_RECOVERY": "dying-checkpoint"} if dying else IN_MEMORY
    if case != "gloo":
        name = f"{name}_{case.replace('@', '').replace('.', '').replace('+', '_')}"
    ckpt = work / f"{name}_ckpt"
    result = run_job(tree, data, work / f"{name}.log", ckpt, plan=plan, tp=tp,
                     save_interval=save_interval, extra=[*EVAL, *extra, *_tensorboard(work, name)],
                     env_extra={**mode, **(env or {})}, timeout_s=420, backend=backend)
    return result, ckpt


def saves_instead(case: str) -> bool:
    """The case ends in the dying checkpoint of the step a recovery would roll back to."""
    backend, dying = split_case(case)
    return dying or gated(backend)


def assert_outcome(case: str, result, ckpt: Path, reference, steps: List[int],
                   layout: manifest.ParallelLayout = DP4, also: Sequence[int] = ()) -> None:
    """In-memory cases: recovered like the reference (`assert_recovered_like_reference`).
    Dying cases (and gated stacks): no recovery, the dying checkpoint of the first step
    `steps` names, bit-identical to the reference's save of it, and every loss printed the
    reference's."""
    if not saves_instead(case):
        assert_recovered_like_reference(result, ckpt, reference, steps, also)
        return
    assert not commits(result.log), result.tail(8000)
    assert_saved_bit_exact(result, ckpt, reference[1], steps[0], layout)
    assert result.losses == {i: reference[0].losses[i] for i in result.losses}


def commits(log: str) -> List[Tuple[int, float, int]]:
    """[(recovery id, seconds, step)] of every committed recovery, in order."""
    return [(int(a), float(b), int(c)) for a, b, c in _COMMITTED.findall(log)]


def assert_recovered_like_reference(result, ckpt: Path, reference, steps: List[int],
                                    also: Sequence[int] = ()) -> None:
    """Exit 0 after `len(steps)` recoveries to those steps; every iteration's log line printed
    exactly once and its TensorBoard loss written exactly once, with the reference's values
    (no hole where a fault took the kept step's: issue 23); final checkpoint (and the periodic
    ones in `also`) bit-identical to its."""
    ref_result, ref_ckpt = reference
    assert result.returncode == 0, result.tail(8000)
    assert [s for _, _, s in commits(result.log)] == steps, result.tail(8000)
    assert not _ABANDONED.search(result.log)
    assert log_lines(result.log) == {it: 1 for it in range(1, N_ITERS + 1)}, \
        (log_lines(result.log), result.tail(8000))
    assert result.losses == ref_result.losses, (result.losses, ref_result.losses)
    scalars, ref_scalars = tb_scalars(_tb_of(ckpt)), tb_scalars(_tb_of(ref_ckpt))
    assert ref_scalars == {it: ref_scalars[it] for it in range(1, N_ITERS + 1)}
    assert scalars == ref_scalars, (scalars, ref_scalars)
    # nothing written for the recovery (no dying checkpoint), nothing read (no load)
    assert tracker_step(ckpt) == N_ITERS
    assert "loading checkpoint from" not in result.log
    assert not list(ckpt.glob(".ttp_tmp_*"))
    for it in (*also, N_ITERS):
        comparison = compare_checkpoints(ckpt, ref_ckpt, it)
        assert comparison.bit_exact, f"iteration {it}: {comparison.summary()}"


def assert_fell_back(result, ckpt: Path, reference, step: int, why: str) -> None:
    """The recovery was abandoned for `why`; the dying checkpoint of `step` was saved instead,
    bit-identical to Megatron's own save of it, and marked latest."""
    assert result.returncode != 0
    abandoned = _ABANDONED.search(result.log)
    assert abandoned and why in abandoned.group(2), result.tail(8000)
    assert f"falling back to the dying checkpoint of iteration {step}" in result.log
    assert tracker_step(ckpt) == step, result.tail(8000)
    assert manifest.verify(ckpt / manifest.iter_dir_name(step),
                           manifest.ParallelLayout(1, 1, 4)) is None
    comparison = compare_checkpoints(ckpt, reference[1], step)
    assert comparison.bit_exact, comparison.summary()


# -- recoveries ------------------------------------------------------------------------------------
# The cases of the fault matrix (module doc): the gloo ones and the main NCCL-like ones run in
# CI, the rest with pytest --extended (README: the test commands).
ALL_MODES = (NL, f"{NL}+dying")
# CI: the DP4 kill and hang in both modes on the newest emulated torch, the kill on 2.1 (its
# in-memory ask gated to the dying checkpoint: D1, D4) and the kill inside the params
# all-gather (D2); with test_save_hazards's they add 2.5-4 min (docs/rehearsal.md: the matrix).
KILL_CASES = cases(ci=["gloo", NL, f"{NL}+dying", f"{NL}@2.1"],
                   extended=[f"{NL}@2.4", f"{NL}@2.1+dying", f"{NL}@2.4+dying"])
HANG_CASES = cases(ci=[NL, f"{NL}+dying"],
                   extended=[f"{NL}@2.1", f"{NL}@2.4", f"{NL}@2.1+dying", f"{NL}@2.4+dying"])
GATHER_CASES = cases(ci=["gloo", NL, f"{NL}+dying"])
OTHER_CASES = cases(ci=["gloo"], extended=ALL_MODES)


@pytest.mark.parametrize("case", KILL_CASES)
def test_dp4_sigkill_recovers_in_memory_bit_exact(case, reference, patched_megatron_tree,
                                                   tiny_dataset, work):
    """SIGKILL of rank 1 in the forward step of 5: rolled back to 4, rank 1 replaced by a cold
    process refilled from rank 3 (its partner), 5..10 redone."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "dp4_kill",
                           "1:5:sigkill:before", case=case)
    assert_outcome(case, result, ckpt, reference, steps=[4])
    if saves_instead(case):
        return
    assert "ttprun: rank 1 (local 1) replaced by pid" in result.log
    assert "refilled from [3]" in result.log
    seconds = commits(result.log)[0][1]
    print(f"recovery committed {seconds:.2f} s after the order (cold replacement, loaded VM)")


@pytest.mark.parametrize("case", HANG_CASES)
def test_dp4_sigstop_recovers_in_memory_bit_exact(case, reference, patched_megatron_tree,
                                                  tiny_dataset, work):
    """Rank 2 stops (SIGSTOP) in the forward step of 5: nothing breaks a connection, the
    survivors' collectives block in every backend; seen after TTP_HEARTBEAT_TIMEOUT, killed,
    replaced and refilled from rank 0 (gloo: in test_an_exception_and_a_hang_are_recovered)."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "dp4_hang",
                           "2:5:sigstop:before", env={"TTP_HEARTBEAT_TIMEOUT": "6"}, case=case)
    assert_outcome(case, result, ckpt, reference, steps=[4])
    assert "rank 2 hung" in result.log
    if not saves_instead(case):
        assert "refilled from [0]" in result.log


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
def test_tp2_dp2_recovers_bit_exact(case, reference_tp2, patched_megatron_tree, tiny_dataset,
                                    work):
    """Rank 3 (tensor rank 1 of DP group 1) killed: refilled from rank 1."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "tp2_kill",
                           "3:5:sigkill:before", tp=2, case=case)
    assert_outcome(case, result, ckpt, reference_tp2, steps=[4], layout=TP2_DP2)
    if not saves_instead(case):
        assert "refilled from [1]" in result.log


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
def test_pp2_dp2_recovers_bit_exact(case, reference_pp2, patched_megatron_tree, tiny_dataset,
                                    work):
    """Rank 1 (first pipeline stage) killed: the last stage's rank 3 mirrors the embedding
    all-reduce of the replacement's model construction; refilled from rank 0."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "pp2_kill",
                           "1:5:sigkill:before", extra=PP2, case=case)
    assert_outcome(case, result, ckpt, reference_pp2, steps=[4], layout=PP2_DP2)
    if not saves_instead(case):
        assert "refilled from [0]" in result.log


@pytest.mark.parametrize("case", GATHER_CASES)
def test_a_kill_inside_the_param_all_gather_recovers_bit_exact(case, reference,
                                                               patched_megatron_tree,
                                                               tiny_dataset, work):
    """Rank 1 dies after its update of 5, before the param all-gather: every survivor updated
    5, and on NCCL their all-gather of 5 spins while their hosts go on (the live params are
    torn, the GATHERED event pending): the recovery, or the dying save, is of step 5, with the
    weights rebuilt from the main params."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "gather_kill",
                           "1:5:sigkill:after", case=case)
    assert_outcome(case, result, ckpt, reference, steps=[5])


# Every fault kind once in one job, in each layout with more than one kind of group: rank 0
# with its controller process (the controller moves to a standby), a second fault right after
# that recovery, one in the evaluation, one at a random instant, one inside a periodic save.
# Ranks 0 and 2 are never lost together (in TP2×DP2 they hold each other's shard).
EVERY_KIND = ("0:3:sigkill-group:before,2:4:sigkill:before,1:6:sigkill:eval,"
              "0:8:sigkill:anytime,2:9:sigkill:periodic-save")


def assert_every_kind_recovered(result, ckpt: Path, reference) -> None:
    steps = [s for _, _, s in commits(result.log)]
    assert len(steps) == 5 and steps[3] in (7, 8), result.tail(8000)
    assert_recovered_like_reference(result, ckpt, reference, steps=[2, 3, 6, steps[3], 9],
                                    also=(3, 6, 9))
    assert re.search(r"standby controller@rank\d: recovery 1 committed", result.log), \
        result.tail(8000)
    assert "during the evaluation after step 6" in result.log
    assert "during the periodic save of step 9" in result.log
    assert [rid for rid, _, _ in commits(result.log)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_every_fault_kind_in_tp2_and_pp2_recovers_bit_exact(layout, case, request,
                                                            patched_megatron_tree,
                                                            tiny_dataset, work):
    """Five recoveries in one job of TP2×DP2 (Megatron's tensor groups regrouped around the
    replacement) and of PP2×DP2 (its pipeline and embedding groups): the end state and the
    periodic saves the faults cut short are bit-identical to the uninterrupted run's."""
    reference = request.getfixturevalue(f"reference_{layout}")
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, f"{layout}_every",
                           EVERY_KIND, save_interval=3, tp=2 if layout == "tp2" else 1,
                           extra=PP2 if layout == "pp2" else (), case=case)
    assert_every_kind_recovered(result, ckpt, reference)


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
@pytest.mark.parametrize("seed, plan", [(1, "1:5:sigkill:anytime"), (2, "3:6:sigkill:anytime")])
def test_a_kill_at_a_random_instant_recovers_bit_exact(seed, plan, case, reference,
                                                       patched_megatron_tree, tiny_dataset,
                                                       work):
    """Wherever the timer lands (a collective, the update window, the param all-gather, the
    logging): every survivor is clean at one step, the one the dying checkpoint would save."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, f"anytime{seed}", plan,
                           env={"TTP_FAULT_SEED": str(seed)}, case=case)
    step = int(plan.split(":")[1])
    if saves_instead(case):
        rolled_back = tracker_step(ckpt)
    else:
        [(_, _, rolled_back)] = commits(result.log)
    assert rolled_back in (step - 1, step), result.tail(8000)
    assert_outcome(case, result, ckpt, reference, steps=[rolled_back])


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
@pytest.mark.parametrize("rank", [1, 3])
def test_the_kept_steps_log_line_and_scalars_appear_exactly_once(rank, case, reference,
                                                                 patched_megatron_tree,
                                                                 tiny_dataset, work):
    """Issue 23: a rank killed as step 5's logging starts, after every rank's update of 5:
    the recovery keeps 5 and does not redo it. Megatron prints 5's line on rank 3 after a
    barrier of every rank (training.py:602), which the fault broke. Rank 1 killed: rank 3
    survives, its scalars of 5 are written, its line is not; rank 3 killed: neither (its
    writer's queue died with it). Either way the line and the scalars of 5 appear once, with
    the uninterrupted run's values (before: the line was missing, CI 2026-12-05 allowed it)."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, f"log_{rank}",
                           f"{rank}:5:sigkill:log", case=case)
    assert f"FAULT: SIGKILL rank {rank} as the logging starts of step 5" in result.log
    assert_recovered_like_reference(result, ckpt, reference, steps=[5])
    what = "log line" if rank == 1 else "log line and scalars"
    assert f"recovery: step 5's {what} written again" in result.log, result.tail(8000)


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
def test_faults_during_evaluation_and_a_periodic_save_recover_bit_exact(
        case, reference, patched_megatron_tree, tiny_dataset, work):
    """Rank 1 killed in the evaluation after step 6, later rank 2 inside Megatron's periodic
    save of 9 (once it wrote its first file): each recovery goes on from that step, and the
    periodic saves the faults cut short (6 and 9) are written again, equal to the reference's.
    With the dying checkpoint the first fault ends the job: step 6 is saved."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "eval_save",
                           "1:6:sigkill:eval,2:9:sigkill:periodic-save", save_interval=3,
                           case=case)
    assert_outcome(case, result, ckpt, reference, steps=[6, 9], also=(3, 6, 9))
    assert "during the evaluation after step 6" in result.log
    if not saves_instead(case):
        assert "during the periodic save of step 9" in result.log


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
def test_a_second_fault_right_after_a_recovery_is_recovered_too(case, reference,
                                                                 patched_megatron_tree,
                                                                 tiny_dataset, work):
    """Rank 1 killed at 5, then rank 2 at 6, the first step after the recovery."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "twice",
                           "1:5:sigkill:before,2:6:sigkill:before", case=case)
    assert_recovered_like_reference(result, ckpt, reference, steps=[4, 5])
    assert [rid for rid, _, _ in commits(result.log)] == [1, 2]


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
def test_rank0_lost_its_controller_process_recovers(case, reference, patched_megatron_tree,
                                                    tiny_dataset, work):
    """The controller runs in a process of its own (control/controller/host.py), which outlives
    rank 0: it
    runs the recovery itself (no failover), and rank 0's replacement registers with it and
    starts no controller of its own."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "rank0",
                           "0:5:sigkill:before", case=case)
    assert_outcome(case, result, ckpt, reference, steps=[4])
    if saves_instead(case):
        return
    assert re.search(r"(?<!standby )controller@rank0: recovery 1 committed", result.log), \
        result.tail(8000)
    assert "standby -> serving" not in result.log  # no failover
    assert "ttp_start_controller after an in-memory recovery" in result.log


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
def test_rank0_and_its_controller_lost_the_standby_recovers(case, reference,
                                                            patched_megatron_tree,
                                                            tiny_dataset, work):
    """Rank 0 and its controller process die together (its process group: what node 0's loss
    does to the control plane): a standby takes over and runs the recovery; rank 0's
    replacement registers with it (not on port 8000)."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "rank0_group",
                           "0:5:sigkill-group:before", case=case)
    assert_outcome(case, result, ckpt, reference, steps=[4])
    if saves_instead(case):
        return
    assert re.search(r"standby controller@rank\d: recovery 1 committed", result.log), \
        result.tail(8000)
    assert "ttp_start_controller after an in-memory recovery" in result.log


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=ALL_MODES))
def test_an_exception_and_a_hang_are_recovered(case, reference, patched_megatron_tree,
                                               tiny_dataset, work):
    """Rank 2 raises in the forward step of 5: its process is replaced (the launcher ends it).
    Later rank 3 stops (SIGSTOP): seen after TTP_HEARTBEAT_TIMEOUT, killed, replaced. With the
    dying checkpoint the exception ends the job: step 4 is saved."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "exc_hang",
                           "2:5:exception:before,3:8:sigstop:before",
                           env={"TTP_HEARTBEAT_TIMEOUT": "6"}, case=case)
    assert_outcome(case, result, ckpt, reference, steps=[4, 7])
    assert "rank 2 reported exception: InjectedFault" in result.log
    if not saves_instead(case):
        assert "rank 3 hung" in result.log


# -- every window of a job, from process start to exit (docs/recovery.md, issue 23) ---------------
RESUME_AT = 4  # the windows before the first step resume from a checkpoint of this iteration


@pytest.fixture(scope="module")
def resumable(patched_megatron_tree, tiny_dataset, work) -> Path:
    """The checkpoint of iteration 4 of a 10-iteration job (--exit-interval: the same
    schedule as the jobs that resume from it)."""
    ckpt = work / "resumable_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "resumable.log", ckpt,
                     extra=[*EVAL, "--exit-interval", str(RESUME_AT)])
    assert result.returncode == 0 and tracker_step(ckpt) == RESUME_AT, result.tail()
    return ckpt


def _resume_with_a_fault(tree, data, work: Path, resumable: Path, name: str, plan: str,
                         case: str = "gloo"):
    backend, _ = split_case(case)
    name = name if case == "gloo" else f"{name}_{backend.replace('-', '_')}"
    ckpt = copy_checkpoints(resumable, work / f"{name}_ckpt")
    result = run_job(tree, data, work / f"{name}.log", ckpt, plan=plan, extra=EVAL,
                     env_extra=IN_MEMORY, timeout_s=420, backend=backend)
    return result, ckpt


def _resumed_checkpoint_stays_latest(ckpt: Path) -> None:
    assert tracker_step(ckpt) == RESUME_AT
    assert manifest.verify(ckpt / manifest.iter_dir_name(RESUME_AT),
                           manifest.ParallelLayout(1, 1, 4)) is None
    assert not list(ckpt.glob(".ttp_tmp_*"))


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
@pytest.mark.parametrize("window", ["startup", "model", "load"])
def test_a_rank_lost_before_the_runtime_starts_ends_the_attempt_at_once(
        window, case, resumable, patched_megatron_tree, tiny_dataset, work):
    """Start-up, model build, checkpoint load: no rank started the runtime yet (it starts in
    train()), and no state exists that the checkpoint being loaded does not hold. The attempt
    ends at once, not held for TTP_OT; that checkpoint stays latest and whole."""
    result, ckpt = _resume_with_a_fault(patched_megatron_tree, tiny_dataset, work, resumable,
                                        f"win_{window}", f"1:1:sigkill:{window}", case)
    assert result.returncode != 0
    assert "FAULT: SIGKILL rank 1" in result.log, result.tail(8000)
    assert "no TTP runtime started in this attempt" in result.log, result.tail(8000)
    assert result.wall_s < TTP_OT_S, result.wall_s
    _resumed_checkpoint_stays_latest(ckpt)


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
def test_a_rank_lost_in_the_first_step_keeps_the_loaded_checkpoint(
        case, resumable, patched_megatron_tree, tiny_dataset, work):
    """The first step after a resume: no rank finished an update in this process, so there is
    nothing newer than the checkpoint just loaded (no recovery, no dying checkpoint: exit 84),
    which stays latest; the restart loads it again and loses that one step."""
    result, ckpt = _resume_with_a_fault(patched_megatron_tree, tiny_dataset, work, resumable,
                                        "win_first", f"1:{RESUME_AT + 1}:sigkill:before",
                                        case)
    assert result.returncode != 0
    assert "no in-memory recovery" in result.log, result.tail(8000)
    assert "outcome no_consistent_step (exit code 84)" in result.log, result.tail(8000)
    _resumed_checkpoint_stays_latest(ckpt)


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
@pytest.mark.parametrize("window", ["final-eval", "final-save"])
def test_a_rank_lost_in_the_final_evaluation_or_save_is_recovered(
        window, case, reference, patched_megatron_tree, tiny_dataset, work):
    """After train() returned, pretrain evaluates and writes its final save: the runtime stays
    up through both (edit 2.9 holds it, edit 2.11 releases it). The recovery keeps step 10,
    its re-run of pretrain trains no step, evaluates and saves again: exit 0, the final
    checkpoint bit-identical to the uninterrupted run's (before: the save cut short, no
    tracker, no dying checkpoint, exit 1, the whole job lost)."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, f"win_{window}",
                           f"1:{N_ITERS}:sigkill:{window}", case=case)
    assert_recovered_like_reference(result, ckpt, reference, steps=[N_ITERS])
    assert f"FAULT: SIGKILL rank 1 during the {window.replace('-', ' ')}" in result.log


@pytest.mark.parametrize("case", cases(ci=["gloo+dying"], extended=[f"{NL}+dying"]))
@pytest.mark.parametrize("window, step", [("periodic-save", 9), ("final-save", N_ITERS)])
def test_a_rank_lost_in_a_save_gets_the_dying_checkpoint(window, step, case, reference,
                                                         patched_megatron_tree, tiny_dataset,
                                                         work):
    """TTP_RECOVERY=dying-checkpoint, a rank killed inside Megatron's periodic save of 9 or
    its final save of 10: the dying checkpoint of that step replaces the save the fault cut
    short (a stock directory of the same step; before, the rename refused it: save_failed),
    is marked latest, and is bit-identical to Megatron's own save of it."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, f"win_{window}_dying",
                           f"1:{step}:sigkill:{window}", save_interval=3, case=case)
    assert result.returncode != 0
    assert "outcome saved (exit code 83)" in result.log, result.tail(8000)
    assert "is replaced by the dying checkpoint" in result.log
    assert tracker_step(ckpt) == step
    comparison = compare_checkpoints(ckpt, reference[1], step)
    assert comparison.bit_exact, comparison.summary()


@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
def test_a_rank_lost_after_the_final_save_completed_everywhere_ends_as_a_success(
        case, reference, patched_megatron_tree, tiny_dataset, work):
    """Past the barrier that ends pretrain's final save (the test evaluation, the exit): the
    job's state is on disk, complete on every rank. ttprun ends the job as a success (exit 0,
    nothing held, no flow); before, exit 1 and a restart for nothing."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "win_exit",
                           f"1:{N_ITERS}:sigkill:exit", case=case)
    assert "FAULT: SIGKILL rank 1 after the final save" in result.log, result.tail(8000)
    assert result.returncode == 0, result.tail(8000)
    assert "nothing is lost, the job succeeds" in result.log
    assert "FAULT " not in result.log.split("FAULT: SIGKILL rank 1 after")[1]  # no flow ran
    assert tracker_step(ckpt) == N_ITERS
    comparison = compare_checkpoints(ckpt, reference[1], N_ITERS)
    assert comparison.bit_exact, comparison.summary()


# -- fallbacks: never worse than the dying checkpoint ----------------------------------------------
# On the NCCL-like backend the survivors' collectives spin: a fallback must end them itself
# (abort) and must not wait out a bound it could have cut short (issue 22 §3.6).
FALLBACK_CASES = cases(ci=["gloo"], extended=[NL])


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_a_replacement_that_dies_at_start_falls_back(case, reference, patched_megatron_tree,
                                                     tiny_dataset, work):
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "fb_dead",
                           "1:5:sigkill:before,1:4:sigkill:replacement", case=case)
    assert_fell_back(result, ckpt, reference, 4, "the replacement for rank 1 exited")


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_a_recovery_past_its_bound_falls_back(case, reference, patched_megatron_tree,
                                              tiny_dataset, work):
    """The replacement hangs (SIGSTOP) before it imports anything: TTP_RECOVER_TIMEOUT runs
    out; the survivors save from where they wait for it (outside the old world)."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "fb_timeout",
                           "1:5:sigkill:before,1:4:sigstop:replacement",
                           env={"TTP_RECOVER_TIMEOUT": "20"}, case=case)
    assert_fell_back(result, ckpt, reference, 4, "not ready within TTP_RECOVER_TIMEOUT=20 s")


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_a_second_fault_during_the_recovery_falls_back(case, reference, patched_megatron_tree,
                                                       tiny_dataset, work):
    """Rank 2 dies as it starts refilling: its partner (0) and rank 1's (3) save step 4."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "fb_second",
                           "1:5:sigkill:before,2:4:sigkill:refill", case=case)
    assert_fell_back(result, ckpt, reference, 4, "another fault during the recovery")


@pytest.mark.parametrize("kind, why", [
    ("sigkill", ""),  # its death, or a casualty's failed collective, whichever comes first
    ("sigstop", "another fault during the recovery: rank 1 hung"),
    ("exception", "another fault during the recovery: rank 1 reported exception: InjectedFault"),
])
@pytest.mark.parametrize("case", cases(ci=["gloo"], extended=[NL]))
def test_a_saver_lost_during_the_recovery_is_not_chosen_to_save(case, kind, why, reference,
                                                                 patched_megatron_tree,
                                                                 tiny_dataset, work):
    """Issue 23: rank 2 killed at 5; as the recovery to 4 starts refilling, survivor rank 1
    (DP position 1, the holder savers_for picks for shard 1 from the states collected before
    the recovery) dies, hangs or raises. Rank 1's partner, rank 3, holds shard 1: the fallback
    saves step 4 from ranks 0 and 3 in one order, within seconds (not after a dead saver's
    save limit, which used to end in save_failed with nothing marked latest)."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, f"fb_saver_{kind}",
                           f"2:5:sigkill:before,1:4:{kind}:refill",
                           env={"TTP_HEARTBEAT_TIMEOUT": "6"}, case=case)
    assert_fell_back(result, ckpt, reference, 4, why)
    assert "ordering save on rank(s) [0, 3]" in result.log, result.tail(8000)
    assert "ordering it again" not in result.log
    [took] = re.findall(r"SaveOrder on 2 rank\(s\) done in ([0-9.]+) s\n", result.log)
    assert float(took) < 10, took  # TTP_SAVE_TIME_LIMIT (derived from TTP_OT=40): 10 s


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_a_refill_that_differs_from_its_holder_falls_back(case, reference,
                                                          patched_megatron_tree,
                                                          tiny_dataset, work):
    """One value of what rank 1's replacement received is changed: the hash check catches it
    on every rank before the weights are rebuilt, and the holders' state is saved."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "fb_corrupt",
                           "1:5:sigkill:before", env={"TTP_FAULT_CORRUPT_REFILL": "1"},
                           case=case)
    assert "FAULT: corrupted the refill" in result.log
    assert_fell_back(result, ckpt, reference, 4, "stripe 1 differs between ranks [1, 3]")


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_both_holders_of_a_shard_lost_is_the_dying_checkpoints_refusal(
        case, patched_megatron_tree, tiny_dataset, work):
    """Ranks 1 and 3 (both holders of shard 1) killed together: nothing to refill from, and
    nothing consistent to save: exit 84 as without the recovery; the periodic 3 stays latest."""
    result, ckpt = recover(patched_megatron_tree, tiny_dataset, work, "fb_both",
                           "1:5:sigkill:before,3:5:sigkill:before", save_interval=3,
                           case=case)
    assert result.returncode != 0
    assert "no in-memory recovery (every holder of lost rank 1's optimizer shard is lost" \
        in result.log, result.tail(8000)
    assert "no iteration had a clean copy of every shard" in result.log
    assert tracker_step(ckpt) == 3
