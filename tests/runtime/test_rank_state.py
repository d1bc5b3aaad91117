"""A rank's processor's life cycle (control/rank/state.py): the table allows what the processor
does and refuses the rest, and the questions the runtime asks of a rank read from it."""

from __future__ import annotations

import pytest

from mindio_ttp.control.rank.state import ALLOWED, RankMachine, RankState
from mindio_ttp.statemachine import InvalidTransition

S = RankState


def test_a_fault_a_recovery_and_its_commit_go_back_to_training():
    m = RankMachine(3)
    m.transition_to(S.TRAINING)
    assert m.protected and not m.fault_seen
    assert m.move_from(frozenset({S.TRAINING}), S.FAULT, "lock")
    assert not m.move_from(frozenset({S.TRAINING}), S.FAULT, "a second sign")  # already there
    assert m.fault_seen
    m.transition_to(S.RECOVERING, "recover order 1")
    assert m.fault_seen and m.protected
    m.transition_to(S.TRAINING, "committed")
    assert not m.fault_seen


def test_a_fallback_to_the_dying_checkpoint_exits_once():
    m = RankMachine(0)
    for s in (S.TRAINING, S.RECOVERING, S.FAULT, S.EXITING):
        m.transition_to(s)
    assert not m.protected
    not_exiting = frozenset(set(S) - {S.EXITING})
    assert not m.move_from(not_exiting, S.EXITING, "a second exit")
    with pytest.raises(InvalidTransition):
        m.transition_to(S.TRAINING, "an exit is final")


def test_after_the_controller_closed_losing_it_is_no_fault():
    m = RankMachine(1)
    m.transition_to(S.TRAINING)
    m.transition_to(S.UNPROTECTED, "closing")
    assert not m.protected and not m.fault_seen
    for s in (S.TRAINING, S.FAULT, S.RECOVERING):
        with pytest.raises(InvalidTransition):
            m.transition_to(s)


def test_every_state_has_a_row_and_only_stopped_and_exiting_are_near_the_end():
    assert set(ALLOWED) == set(S)
    assert ALLOWED[S.EXITING] == {S.STOPPED}
    for s in S:
        if s not in (S.STOPPED, S.EXITING, S.INIT):
            assert S.EXITING in ALLOWED[s], s  # an exit order is obeyed from every live state
