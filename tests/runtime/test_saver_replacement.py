"""A saver that dies while it writes is replaced by its shard's other clean holder (the flow
orders the save again, control/controller/flow.py `Flow._save`): a real 4-rank demo job under
ttprun.

Rank 2 dies before step 3, so every survivor last finished step 2 and the flow picks ranks 0
(shard 0) and 1 (shard 1). Rank 1 is then SIGKILLed half-way through writing its shard file.
Rank 3, the other clean holder of shard 1, saves it in a second order: one checkpoint, of step
2, marked latest only once complete, equal to the uninterrupted run's state at step 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindio_ttp.demo.checkpoint import latest_step, step_dir_name
from mindio_ttp.demo.faults import Fault, FaultPlan, Phase
from mindio_ttp.demo.model import ShardLayout, emulate
from mindio_ttp.demo.runner import WORLD, launch

pytestmark = pytest.mark.slow

STEPS, KILL_STEP = 4, 3


def test_a_saver_killed_during_its_write_is_replaced_by_its_partner(tmp_path: Path) -> None:
    plan = FaultPlan().fail_at(2, KILL_STEP, Fault.SIGKILL, Phase.BEFORE)
    plan.fail_at(1, KILL_STEP - 1, Fault.SIGKILL, Phase.SAVE)
    result = launch(tmp_path, STEPS, plan)
    out = result.output
    assert "while saving the checkpoint of step 2" in out, "the save fault did not fire"
    flow = result.flow
    assert flow is not None and (flow["outcome"], flow["step"]) == ("saved", 2), out
    assert sorted(flow["ranks"]) == [0, 3], f"shard 1 saved by its other holder\n{out}"
    assert "ordering it again, from rank(s) [0, 3]" in out
    steps = sorted(p.name for p in result.ckpt_dir.iterdir() if p.name.startswith("step_")
                   and not p.name.endswith(".tmp"))
    assert steps == [step_dir_name(2)], steps  # one checkpoint
    assert latest_step(result.ckpt_dir) == 2
    loaded = result.load_checkpoint()
    assert loaded is not None and loaded.path.name == step_dir_name(2)
    layout = ShardLayout.for_world(WORLD)
    assert loaded.state.differences(emulate(layout, 2)) == []
