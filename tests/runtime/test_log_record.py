"""The decision that keeps the loss curve whole after an in-memory recovery
(megatron_ttp/log_record.py, issue 23): a pure function of every rank's record of the kept
step's `training_log`, gathered during the recovery, so every rank decides alike. The real
Megatron runs are in tests/megatron/test_e2e_recovery.py."""

from __future__ import annotations

from typing import Optional

import pytest

from mindio_ttp.megatron_ttp.log_record import decide

STEP = 5


def record(step: int = STEP, passed: bool = True, last_stage: bool = True,
           loss: float = 1.5) -> dict:
    return {"iteration": step, "loss_dict": {"lm loss": loss}, "total_loss_dict": {},
            "learning_rate": 1e-3, "loss_scale": 1.0, "skipped_iter": 0, "grad_norm": 0.5,
            "params_norm": None, "num_zeros_in_grad": None, "passed": passed,
            "last_stage": last_stage}


def job(*records: Optional[dict], lost=(), scalars_missing: bool = False) -> list:
    """Every rank's entry; the last one is the printing rank."""
    out = [{"step_log": {"record": rec, "survivor": r not in lost}}
           for r, rec in enumerate(records)]
    out[-1]["step_log"]["scalars_missing"] = scalars_missing
    return out


def test_nothing_is_logged_again_when_the_printing_rank_printed():
    assert decide(STEP, job(record(), record(passed=False), record(), record()), 1) is None


def test_a_surviving_printing_rank_that_did_not_print_prints_from_its_own_record():
    everyone = job(record(loss=2.0), None, record(loss=2.0), record(passed=False, loss=2.0),
                   lost={1})
    plan = decide(STEP, everyone, 1)
    assert plan == {"record": record(passed=False, loss=2.0), "print": True, "scalars": False}


def test_a_lost_printing_rank_printed_only_if_every_survivor_passed_the_barrier():
    passed = job(record(), record(), record(), None, lost={3})
    assert decide(STEP, passed, 1) is None
    broken = job(record(), record(passed=False), record(), None, lost={3})
    plan = decide(STEP, broken, 1)
    assert plan is not None and plan["print"] and plan["record"]["last_stage"]


def test_a_survivor_that_never_logged_the_step_means_the_line_was_not_printed():
    """Its parameter all-gather of 5 failed after the update: no record of 5 there."""
    everyone = job(record(), record(step=STEP - 1), record(), None, lost={3})
    assert decide(STEP, everyone, 1)["print"]


def test_scalars_missing_from_disk_are_written_without_printing_the_line_again():
    everyone = job(record(), record(), record(), None, lost={3}, scalars_missing=True)
    assert decide(STEP, everyone, 1) == {"record": record(), "print": False, "scalars": True}


def test_the_values_come_from_the_last_pipeline_stage():
    """PP2: ranks 0, 1 are the first stage (no losses), 2, 3 the last; 3 lost."""
    everyone = job(record(last_stage=False, loss=0.0), record(last_stage=False, loss=0.0),
                   record(passed=False, loss=3.25), None, lost={3})
    assert decide(STEP, everyone, 1)["record"]["loss_dict"] == {"lm loss": 3.25}


def test_without_any_record_of_the_step_nothing_can_be_logged():
    assert decide(STEP, job(None, None, record(step=STEP - 1), None, lost={3}), 1) is None


@pytest.mark.parametrize("interval, due", [(1, True), (5, True), (2, False)])
def test_a_line_is_printed_only_on_the_log_interval(interval, due):
    everyone = job(record(passed=False), None, record(passed=False),
                   record(passed=False), lost={1})
    plan = decide(STEP, everyone, interval)
    assert (plan is not None and plan["print"]) is due
