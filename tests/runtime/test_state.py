"""The controller state machine: every legal transition works, every illegal one raises."""

from __future__ import annotations

import itertools

import pytest

from mindio_ttp.control.controller.state import (
    ALLOWED,
    ControllerState,
    InvalidTransition,
    StateMachine,
)

S = ControllerState
ALL_PAIRS = list(itertools.product(S, S))
LEGAL = [(a, b) for a, b in ALL_PAIRS if b in ALLOWED[a]]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if b not in ALLOWED[a]]

# a path from INIT to each state, through legal transitions only
PATHS = {
    S.INIT: [],
    S.STANDBY: [S.STANDBY],
    S.SERVING: [S.SERVING],
    S.COLLECTING: [S.SERVING, S.COLLECTING],
    S.RECOVERING: [S.SERVING, S.COLLECTING, S.RECOVERING],
    S.SAVING: [S.SERVING, S.COLLECTING, S.SAVING],
    S.RENAMING: [S.SERVING, S.COLLECTING, S.SAVING, S.RENAMING],
    S.EXITING: [S.SERVING, S.COLLECTING, S.EXITING],
    S.STOPPED: [S.STOPPED],
}


def machine_in(state: ControllerState) -> StateMachine:
    sm = StateMachine("test")
    for s in PATHS[state]:
        sm.transition_to(s)
    assert sm.state is state
    return sm


@pytest.mark.parametrize("src,dst", LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_legal_transition(src, dst):
    sm = machine_in(src)
    assert sm.transition_to(dst, "why") is src
    assert sm.state is dst
    assert sm.history[-1] == (src, dst, "why")


@pytest.mark.parametrize("src,dst", ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_illegal_transition_raises_and_keeps_state(src, dst, caplog):
    sm = machine_in(src)
    with pytest.raises(InvalidTransition, match=f"{src.value} -> {dst.value}"):
        sm.transition_to(dst)
    assert sm.state is src
    assert any("illegal transition" in r.message for r in caplog.records)


def test_every_state_is_reachable_and_stopped_is_final():
    assert set(PATHS) == set(S)
    assert ALLOWED[S.STOPPED] == frozenset()
    # the flow can always end: every non-final state reaches STOPPED directly or via EXITING
    for s in S:
        if s is not S.STOPPED:
            assert S.STOPPED in ALLOWED[s] or S.EXITING in ALLOWED[s]


def test_rename_only_after_saving():
    assert [a for a, b in LEGAL if b is S.RENAMING] == [S.SAVING]
