"""The Megatron demo's check of the resumed run, on the runs it may be handed (no training:
`_train` is replaced). A dying checkpoint can hold an iteration the interrupted run never
printed; the resumed run then prints that iteration's line first, from the checkpoint's record
of it (log_record.py), and trains from the next one. CI's full run met this case once."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

from mindio_ttp.demo.megatron import MegatronOptions, MegatronRehearsal, TrainingRun


def _rehearsal(tmp_path: Path, losses: Dict[int, str], said: List[str],
               returncode: int = 0) -> MegatronRehearsal:
    demo = MegatronRehearsal(MegatronOptions(source=tmp_path, recovery="dying-checkpoint"),
                             tmp_path, said.append)
    log = tmp_path / "resumed.log"
    log.write_text("the resumed run's log\n")
    demo._train = lambda name, data, ckpt, kill: TrainingRun(  # type: ignore[method-assign]
        name, returncode, 1.0, log, losses)
    return demo


@pytest.mark.parametrize("first, replayed", [(6, False), (5, True)])
def test_the_resumed_run_may_print_the_saved_iteration_from_its_record(
        tmp_path: Path, first: int, replayed: bool) -> None:
    said: List[str] = []
    losses = {i: f"{i}.0" for i in range(first, 11)}
    run = _rehearsal(tmp_path, losses, said)._resume(None, saved=5)  # type: ignore[arg-type]
    assert run is not None, said
    assert any("iterations 6-10" in line for line in said), said
    assert any("iteration 5's line printed from the checkpoint's record" in line
               for line in said) is replayed, said


@pytest.mark.parametrize("losses, returncode", [
    ({i: "x" for i in range(4, 11)}, 0),  # an iteration older than the checkpoint's
    ({i: "x" for i in range(7, 11)}, 0),  # iteration 6 missing: it did not continue from 5
    ({5: "x"}, 0),  # only the replayed line, no training
    ({i: "x" for i in range(6, 11)}, 1),  # the run failed
])
def test_a_resumed_run_that_did_not_continue_from_the_checkpoint_fails(
        tmp_path: Path, losses: Dict[int, str], returncode: int) -> None:
    said: List[str] = []
    run = _rehearsal(tmp_path, losses, said, returncode)._resume(None, saved=5)  # type: ignore[arg-type]
    assert run is None
    assert "RESULT: FAILED - the resumed run did not continue from the checkpoint" in said, said
