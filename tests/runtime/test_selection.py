"""choose_step / savers_for: the consistency rule, checked against a brute-force oracle; and
replacement_savers: who saves a shard again when its saver failed."""

from __future__ import annotations

from typing import Dict, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindio_ttp.control.controller.selection import (
    Layout,
    RankState,
    agreed_layout,
    choose_step,
    replacement_savers,
    savers_for,
    states_from,
)

CLEAN = RankState(True, 5, False)


def oracle(layout: Layout, states: Dict[int, RankState]) -> Optional[int]:
    steps = {s.clean_at() for s in states.values()} - {None}
    for t in sorted(steps, reverse=True):
        if all(any(states[r].clean_at() == t for r in holders)
               for g in layout.groups for holders in layout.shards(g)):
            return t
    return None


@st.composite
def jobs(draw):
    n_groups = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 6))
    replica = draw(st.integers(1, dp))
    world = n_groups * dp
    ranks = draw(st.permutations(list(range(world))))
    groups = [ranks[i * dp:(i + 1) * dp] for i in range(n_groups)]
    states = {}
    for r in range(world):
        states[r] = RankState(draw(st.booleans()), draw(st.one_of(st.none(), st.integers(0, 4))),
                              draw(st.booleans()), "dead")
    return Layout.build(groups, replica), states, world


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_choice_matches_oracle_and_savers_cover_every_shard_once(job):
    layout, states, world = job
    step, reason = choose_step(layout, states, world)
    assert step == oracle(layout, states), reason
    assert reason
    if step is None:
        assert "no consistent step" in reason and "DP group" in reason
        return
    savers = savers_for(layout, states, step)
    assert savers == sorted(savers)
    assert len(savers) == len(layout.groups) * layout.replica
    for g in layout.groups:
        for holders in layout.shards(g):
            picked = [r for r in holders if r in savers]
            assert len(picked) == 1
            assert states[picked[0]].clean_at() == step


@settings(max_examples=80, deadline=None)
@given(jobs(), st.data())
def test_a_rank_dying_never_makes_a_newer_step_possible(job, data):
    layout, states, world = job
    before, _ = choose_step(layout, states, world)
    victim = data.draw(st.sampled_from(sorted(states)))
    states = {**states, victim: RankState(False, None, False, "dead")}
    after, _ = choose_step(layout, states, world)
    assert after is None or (before is not None and after <= before)


def test_guide_layout_shard_is_position_mod_replica():
    layout = Layout.build([[0, 1, 2, 3]], 2)
    assert layout.shards((0, 1, 2, 3)) == [[0, 2], [1, 3]]


def test_dead_rank_partner_saves_its_shard():
    layout = Layout.build([[0, 1, 2, 3]], 2)
    states = {0: CLEAN, 1: RankState(False, None, False, "dead"), 2: CLEAN, 3: CLEAN}
    step, _ = choose_step(layout, states, 4)
    assert step == 5
    assert savers_for(layout, states, step) == [0, 3]


def test_both_holders_dead_refuses_and_names_the_shard():
    layout = Layout.build([[0, 1, 2, 3]], 2)
    dead = RankState(False, None, False, "dead (connection dropped)")
    step, reason = choose_step(layout, {0: CLEAN, 1: dead, 2: CLEAN, 3: dead}, 4)
    assert step is None
    assert "shard 1" in reason and "rank 1 dead" in reason and "rank 3 dead" in reason


def test_updating_rank_is_not_a_clean_replica():
    layout = Layout.build([[0, 1, 2, 3]], 2)
    states = {0: CLEAN, 1: RankState(True, 4, True), 2: CLEAN,
              3: RankState(False, None, False, "hung")}
    step, reason = choose_step(layout, states, 4)
    assert step is None and "rank 1 updating after step 4" in reason


def test_older_common_step_wins_when_newest_is_not_everywhere():
    layout = Layout.build([[0, 1, 2, 3]], 2)
    states = {0: RankState(True, 6, False), 1: RankState(True, 5, False),
              2: RankState(True, 5, False), 3: RankState(False, None, False)}
    assert choose_step(layout, states, 4)[0] == 5


def test_disjoint_steps_refuse_with_the_lagging_shard():
    layout = Layout.build([[0, 1, 2, 3]], 2)
    states = {0: RankState(True, 6, False), 1: RankState(True, 5, False),
              2: RankState(False, None, False), 3: RankState(False, None, False)}
    step, reason = choose_step(layout, states, 4)
    assert step is None and "shard 1" in reason and "step 6" in reason


def test_step_zero_or_none_is_never_saved():
    layout = Layout.build([[0, 1]], 1)
    assert choose_step(layout, {0: RankState(True, None, False), 1: RankState(True, 0, False)},
                       2)[0] is None


def test_ranks_outside_every_group_refuse():
    layout = Layout.build([[0, 1]], 1)
    step, reason = choose_step(layout, {0: CLEAN, 1: CLEAN}, 4)
    assert step is None and "2, 3" in reason


def test_layout_rejects_overlapping_groups_and_bad_replica():
    with pytest.raises(ValueError, match="more than one DP group"):
        Layout.build([[0, 1], [1, 2]], 1)
    with pytest.raises(ValueError, match="replica=3"):
        Layout.build([[0, 1]], 3)


def test_states_from_marks_missing_ranks_with_their_note():
    states = states_from({0: (3, False)}, range(2), {1: "hung (no heartbeat)"})
    assert states[0] == RankState(True, 3, False)
    assert not states[1].alive and states[1].note == "hung (no heartbeat)"


# -- replacement of failed savers -------------------------------------------------------------

DP4 = Layout.build([[0, 1, 2, 3]], 2)  # shard 0: ranks 0, 2; shard 1: ranks 1, 3
ALL_CLEAN = {r: CLEAN for r in range(4)}


def test_a_failed_savers_shard_goes_to_its_other_clean_holder():
    assert replacement_savers(DP4, ALL_CLEAN, 5, [0, 1], {1}, {0, 2, 3}) == [0, 3]


def test_savers_that_failed_because_of_another_are_replaced_or_kept_alive():
    # both failed (0 waited for 1, which died): shard 0 moves to 2, shard 1 to 3
    assert replacement_savers(DP4, ALL_CLEAN, 5, [0, 1], {0, 1}, {0, 2, 3}) == [2, 3]
    # 2 is not clean at 5: 0, still alive, saves shard 0 again
    states = {**ALL_CLEAN, 2: RankState(True, 4, False)}
    assert replacement_savers(DP4, states, 5, [0, 1], {0, 1}, {0, 2, 3}) == [0, 3]


def test_no_replacement_when_a_shard_has_nobody_left_or_nothing_would_change():
    # shard 1: 1 failed and dead, 3 dead
    assert replacement_savers(DP4, ALL_CLEAN, 5, [0, 1], {1}, {0, 2}) is None
    # 1 failed but alive, 3 not clean: the same ranks again would fail the same way
    states = {**ALL_CLEAN, 3: RankState(False, None, False, "dead")}
    assert replacement_savers(DP4, states, 5, [0, 1], {1}, {0, 1, 2}) is None


@given(jobs(), st.data())
@settings(max_examples=200, deadline=None)
def test_replacements_cover_every_shard_with_a_holder_that_can_still_save(job, data):
    layout, states, world = job
    step, _ = choose_step(layout, states, world)
    if step is None:
        return
    savers = savers_for(layout, states, step)
    failed = set(data.draw(st.lists(st.sampled_from(savers), unique=True)))
    alive = {r for r in layout.ranks if data.draw(st.booleans()) or r not in failed}
    nxt = replacement_savers(layout, states, step, savers, failed, alive)
    if nxt is None:
        return
    assert nxt != sorted(savers)
    for group in layout.groups:
        for holders in layout.shards(group):
            mine = [r for r in nxt if r in holders]
            assert len(mine) == 1
            r = mine[0]
            assert r in alive or r not in failed
            assert r not in failed or r in savers  # a failed rank only saves its own shard again
            assert r in savers or states[r].clean_at() == step


# -- issue 24: the layout from the DP groups the members agree on --------------------------------
def claims_of(groups: Dict[int, tuple]) -> list:
    """rank -> the group it registered, as Roster.claims gives them."""
    by: Dict[tuple, list] = {}
    for r, g in groups.items():
        by.setdefault(tuple(g), []).append(r)
    return list(by.items())


def test_one_liar_is_outvoted_by_its_group():
    honest = (0, 1, 2, 3)
    layout, dropped = agreed_layout(claims_of({0: honest, 1: honest, 2: honest,
                                               3: (3, 2, 1, 0)}), 2)
    assert layout.groups == (honest,) and list(dropped) == [3]
    assert "registered DP group [3, 2, 1, 0], which its members do not confirm" in dropped[3]


def test_orders_that_give_every_rank_the_same_shard_are_one_group():
    """[2, 3, 0, 1] puts every rank on the shard [0, 1, 2, 3] does: not a lie."""
    layout, dropped = agreed_layout(claims_of({0: (0, 1, 2, 3), 1: (0, 1, 2, 3),
                                               2: (2, 3, 0, 1), 3: (2, 3, 0, 1)}), 2)
    assert dropped == {} and layout.groups == ((0, 1, 2, 3),)
    # in a pair with one shard, the order never matters
    layout, dropped = agreed_layout(claims_of({0: (0, 1), 1: (1, 0)}), 1)
    assert dropped == {} and len(layout.groups) == 1


def test_a_liar_in_a_pair_who_moves_into_another_group_is_refuted_by_it():
    """DP groups of two: rank 1 claims [1, 5]; rank 5's group [4, 5] is confirmed by both its
    members, so rank 1's claim goes, and rank 0's [0, 1] (rank 1 is faulty, nobody contradicts
    rank 0) stays: the layout is the honest one."""
    groups = {0: (0, 1), 1: (1, 5), 2: (2, 3), 3: (2, 3), 4: (4, 5), 5: (4, 5)}
    layout, dropped = agreed_layout(claims_of(groups), 1)
    assert list(dropped) == [1]
    assert layout.groups == ((0, 1), (2, 3), (4, 5))


def test_a_liar_claiming_a_smaller_group_loses_the_tie():
    layout, dropped = agreed_layout(claims_of({0: (0, 1), 1: (1,)}), 1)
    assert list(dropped) == [1] and layout.groups == ((0, 1),)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_honest_claims_give_the_layout_and_no_rank_is_dropped(data):
    """Megatron-like layouts, any subset of ranks registered: no honest rank is ever faulty."""
    tp = data.draw(st.sampled_from([1, 2, 4]))
    dp = data.draw(st.sampled_from([2, 4, 8]))
    world = tp * dp
    groups = [tuple(range(j, world, tp)) for j in range(tp)]
    present = data.draw(st.sets(st.integers(0, world - 1), min_size=1))
    layout, dropped = agreed_layout(claims_of({r: next(g for g in groups if r in g)
                                               for r in present}), dp // 2)
    assert dropped == {}
    assert set(layout.groups) == {g for g in groups if present & set(g)}
