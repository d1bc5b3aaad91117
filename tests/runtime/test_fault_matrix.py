"""The fault matrix on the demo job: every case is a real 4-rank gloo job under ttprun with the
real runtime, and asserts the exact step of the dying checkpoint (known in advance from where the
fault fires) plus a bit-exact resume, or the documented refusal.

Expected step for a fault at step k: before the update -> k-1 (every survivor last finished
k-1), inside the update window -> k (the replica partner finishes k), after it -> k.

Resume: the checkpoint's contents must equal the uninterrupted run's state at that step bit for
bit, and continuing from it in the single-process emulation (shown equal to the 4-process job by
`test_reference_matches_emulation`) must land on the reference's final state. Two cases also
resume with a real ttprun launch, and `test_demo.py` runs the whole `ttp-demo` pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict

import pytest

from mindio_ttp.demo.checkpoint import latest_step, step_dir_name
from mindio_ttp.demo.faults import Fault, FaultPlan, Phase
from mindio_ttp.demo.model import FullState, ShardLayout, emulate
from mindio_ttp.demo.runner import WORLD, LaunchResult, launch

pytestmark = pytest.mark.slow

STEPS = 4
KILL_STEP = 3
LAYOUT = ShardLayout.for_world(WORLD)


class Reference:
    def __init__(self, result: LaunchResult) -> None:
        self.result = result
        self.final = result.final_state()
        self.snapshots: Dict[int, FullState] = result.snapshots()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run, computed once per session with every step's state kept."""
    result = launch(tmp_path_factory.mktemp("reference"), STEPS, snapshots=True)
    assert result.returncode == 0, result.output
    return Reference(result)


def expected_step(phase: Phase, k: int) -> int:
    return k - 1 if phase is Phase.BEFORE else k


def _assert_saved(
    result: LaunchResult, step: int, reference: Reference, launcher_exit: int = 1
) -> None:
    __tracebackhide__ = True
    assert result.returncode == launcher_exit, f"ttprun exit code\n{result.output}"
    flow = result.flow
    assert flow is not None, f"the runtime wrote no flow-finished.json\n{result.output}"
    assert (flow["outcome"], flow["step"]) == ("saved", step), f"{flow}\n{result.output}"
    assert latest_step(result.ckpt_dir) == step, result.output
    loaded = result.load_checkpoint()
    assert loaded is not None and loaded.path.name == step_dir_name(step)
    assert loaded.state.differences(reference.snapshots[step]) == [], (
        f"checkpoint of step {step} differs from the uninterrupted run's state at that step"
    )
    resumed = emulate(LAYOUT, STEPS, start=loaded.state)
    assert resumed.differences(reference.final) == []


def test_reference_matches_emulation(reference: Reference) -> None:
    """The 4-process gloo job and the single-process emulation give the same bits."""
    assert reference.final.differences(emulate(LAYOUT, STEPS)) == []
    for step, snap in reference.snapshots.items():
        assert snap.differences(emulate(LAYOUT, step)) == [], f"step {step}"


CASES = [
    pytest.param(fault, phase, rank, id=f"{fault.value}-{phase.value}-rank{rank}")
    for fault in (Fault.SIGKILL, Fault.EXCEPTION, Fault.SIGSTOP)
    for phase in (Phase.BEFORE, Phase.INSIDE, Phase.AFTER)
    for rank in (1, 0)
]


@pytest.mark.parametrize("fault,phase,rank", CASES)
def test_single_fault_saves_expected_step(
    fault: Fault, phase: Phase, rank: int, reference: Reference, tmp_path: Path
) -> None:
    plan = FaultPlan().fail_at(rank, KILL_STEP, fault, phase)
    start = time.monotonic()
    result = launch(tmp_path, STEPS, plan)
    step = expected_step(phase, KILL_STEP)
    _assert_saved(result, step, reference)
    if fault is not Fault.EXCEPTION:
        # ttprun's outcome line names the rank that failed first, not the survivors that exited
        # with the flow's exit code afterwards (a stopped rank is the one ttprun killed)
        named = [ln for ln in result.output.splitlines() if ln.startswith("ttprun: rank ")]
        assert named and named[-1].startswith(f"ttprun: rank {rank} (node "), result.output
    if fault is not Fault.EXCEPTION or phase is Phase.INSIDE:
        # dead, hung, or stuck half-updated: never a saver (a rank that threw outside the
        # window is alive with a clean state, so it may serve)
        assert rank not in result.flow["ranks"], "the faulty rank must not be among the savers"
    print(f"{plan.describe()}: checkpoint {step} in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize(
    "fault,phase,rank", [(Fault.SIGKILL, Phase.INSIDE, 1), (Fault.SIGSTOP, Phase.BEFORE, 0)]
)
def test_real_resume_matches_uninterrupted_run(
    fault: Fault, phase: Phase, rank: int, reference: Reference, tmp_path: Path
) -> None:
    faulty = launch(tmp_path / "faulty", STEPS, FaultPlan().fail_at(rank, KILL_STEP, fault, phase))
    _assert_saved(faulty, expected_step(phase, KILL_STEP), reference)
    resumed = launch(tmp_path / "resumed", STEPS, resume=True, ckpt_dir=faulty.ckpt_dir)
    assert resumed.returncode == 0, resumed.output
    assert resumed.final_state().differences(reference.final) == []


def test_two_ranks_with_different_shards_killed_together_are_saved(
    reference: Reference, tmp_path: Path
) -> None:
    # ranks 1 (shard 1) and 2 (shard 0) die at the same instant inside step 3's window;
    # ranks 0 (shard 0) and 3 (shard 1) finish step 3 and save it
    plan = FaultPlan().fail_at(1, KILL_STEP, Fault.SIGKILL, Phase.INSIDE)
    plan.fail_at(2, KILL_STEP, Fault.SIGKILL, Phase.INSIDE)
    result = launch(tmp_path, STEPS, plan)
    _assert_saved(result, KILL_STEP, reference)
    assert sorted(result.flow["ranks"]) == [0, 3]


def test_both_holders_of_a_shard_killed_is_refused(tmp_path: Path) -> None:
    plan = FaultPlan().fail_at(1, KILL_STEP, Fault.SIGKILL, Phase.BEFORE)
    plan.fail_at(3, KILL_STEP, Fault.SIGKILL, Phase.BEFORE)
    result = launch(tmp_path, STEPS, plan)
    assert result.returncode == 1, result.output
    assert result.flow is not None and result.flow["outcome"] == "no_consistent_step", result.output
    assert "shard 1 has no clean replica" in result.flow["reason"]
    assert "shard 1 has no clean replica" in result.output, "the log must say which shard"
    assert latest_step(result.ckpt_dir) is None
    assert not any(p.name.startswith("step_") for p in result.ckpt_dir.iterdir())


@pytest.mark.parametrize("save_fault", [Fault.SIGKILL, Fault.EXCEPTION])
def test_fault_during_the_save_marks_nothing_latest(save_fault: Fault, tmp_path: Path) -> None:
    # rank 1 dies before step 3, so rank 3 is the only clean holder of shard 1 and must save
    # step 2; it then fails half-way through writing its shard file
    plan = FaultPlan().fail_at(1, KILL_STEP, Fault.SIGKILL, Phase.BEFORE)
    plan.fail_at(3, KILL_STEP - 1, save_fault, Phase.SAVE)
    result = launch(tmp_path, STEPS, plan)
    assert result.returncode == 1, result.output
    assert "while saving the checkpoint of step 2" in result.output, "the save fault did not fire"
    assert result.flow is not None and result.flow["outcome"] == "save_failed", result.output
    assert latest_step(result.ckpt_dir) is None
    assert not (result.ckpt_dir / step_dir_name(KILL_STEP - 1)).exists()
    assert result.load_checkpoint() is None


def test_preemption_sigterm_to_ttprun_saves_a_consistent_step(
    reference: Reference, tmp_path: Path
) -> None:
    # no dead rank: ttprun forwards SIGTERM, every rank reports the preemption, and the newest
    # step that every shard finished is saved (2, or 3 if a rank was already past its sleep)
    result = launch(tmp_path, STEPS, step_delay=0.3, preempt_after_step=2)
    assert result.returncode == 143, result.output
    assert "SIGTERM (preemption)" in result.output
    flow = result.flow
    assert flow is not None and flow["outcome"] == "saved", result.output
    assert flow["step"] in (2, 3)
    _assert_saved(result, flow["step"], reference, launcher_exit=143)


@pytest.mark.parametrize("every_process", [False, True], ids=["to-ttprun", "slurm-style"])
def test_preemption_with_dataloader_workers_saves(
    reference: Reference, tmp_path: Path, every_process: bool
) -> None:
    """Megatron's default --num-workers 2: the preemption kills the DataLoader's workers too
    (ttprun signals each rank's process group; Slurm signals every process of the step), and
    torch's SIGCHLD handler raises in the training thread, also while it waits for the verdict."""
    result = launch(tmp_path, STEPS, step_delay=0.3, preempt_after_step=2, loader_workers=2,
                    preempt_every_process=every_process)
    flow = result.flow
    assert flow is not None and flow["outcome"] == "saved", result.output
    assert flow["step"] in (2, 3)
    _assert_saved(result, flow["step"], reference, launcher_exit=143)


def test_death_inside_the_barrier_still_saves(reference: Reference, tmp_path: Path) -> None:
    """The guide's barrier fails unevenly when a rank dies in it: here ranks 0, 2, 3 pass the
    barrier of step 3 and update (rank 3 then dies), while it raises on rank 1, shard 1's only
    live holder, at step 2 with step 3's update ready (the plan fires it once the others have
    updated). Only rank 1's catch-up (ttp_offer_update) gives shard 1 step 3: without it no
    step has every shard and nothing is saved. So the newest step, 3, must be saved."""
    plan = (FaultPlan().fail_at(1, KILL_STEP, Fault.EXCEPTION, Phase.BARRIER)
            .fail_at(3, KILL_STEP, Fault.SIGKILL, Phase.AFTER))
    result = launch(tmp_path, STEPS, plan)
    flow = result.flow
    assert flow is not None and flow["outcome"] == "saved", result.output
    assert flow["step"] == KILL_STEP, flow
    _assert_saved(result, KILL_STEP, reference)
    assert "catching up: running the ready update of step 3" in result.output
