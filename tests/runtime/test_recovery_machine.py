"""One rank's recovery state machine (recovery/machine.py): every legal transition works, every
illegal one raises and keeps the state; abandon works from every active state only."""

from __future__ import annotations

import itertools

import pytest

from mindio_ttp.recovery.machine import (
    ALLOWED,
    InvalidRecoveryTransition,
    RecoveryMachine,
    RecoveryState,
)

S = RecoveryState
ALL_PAIRS = list(itertools.product(S, S))
LEGAL = [(a, b) for a, b in ALL_PAIRS if b in ALLOWED[a]]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if b not in ALLOWED[a]]
SURVIVOR = [S.ORDERED, S.STOPPING, S.REGROUPING, S.REFILLING, S.VERIFYING, S.READY]
PATHS = {  # a path from IDLE to each state, through legal transitions only
    S.IDLE: [],
    **{s: SURVIVOR[:i + 1] for i, s in enumerate(SURVIVOR)},
    S.JOINING: [S.JOINING],
    S.ABANDONED: [S.ORDERED, S.ABANDONED],
}


def machine_in(state: RecoveryState) -> RecoveryMachine:
    m = RecoveryMachine("test")
    for s in PATHS[state]:
        m.transition_to(s)
    assert m.state is state
    return m


@pytest.mark.parametrize("src,dst", LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_legal_transition(src, dst):
    m = machine_in(src)
    assert m.transition_to(dst, "why") is src
    assert m.state is dst and m.history[-1] == (src, dst, "why")


@pytest.mark.parametrize("src,dst", ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_illegal_transition_raises_and_keeps_state(src, dst, caplog):
    m = machine_in(src)
    with pytest.raises(InvalidRecoveryTransition, match=f"{src.value} -> {dst.value}"):
        m.transition_to(dst)
    assert m.state is src
    assert any("illegal transition" in r.message for r in caplog.records)


def test_every_state_is_reachable_and_a_recovery_always_ends():
    assert set(PATHS) == set(S)
    assert ALLOWED[S.ABANDONED] == frozenset()
    for s in S:  # from every state in a recovery: committed (IDLE) or abandoned
        if s not in (S.IDLE, S.ABANDONED):
            assert S.ABANDONED in ALLOWED[s]


@pytest.mark.parametrize("state", list(S), ids=lambda s: s.value)
def test_abandon_from_active_states_only(state):
    m = machine_in(state)
    assert m.abandon("fallback") is (state not in (S.IDLE, S.ABANDONED))
    assert m.state is (state if state is S.IDLE else S.ABANDONED)
    assert m.active is False
