"""Rank lists as blocks: exact for any list, one block for the lists real layouts produce, and
no expansion past MAX_RANKS."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindio_ttp.control.controller.selection import Layout, RankState, savers_for
from mindio_ttp.control.wire import ranksets as R


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=60))
def test_any_list_round_trips_in_order(ranks):
    blocks = R.encode(ranks)
    assert R.valid_wire(blocks)  # every block increasing, whatever the list does
    assert R.decode(blocks) == ranks


def test_a_descending_list_is_several_increasing_blocks():
    """Pairs placed across hosts can order a DP group with a descending stretch; the blocks
    that carry it are increasing (an inverted block is refused: issue 24)."""
    assert R.encode([0, 1, 3, 2]) == [[0, 1, 2, 0, 1], [3, 1, 1, 0, 1], [2, 1, 1, 0, 1]]
    assert R.encode([3, 2, 1, 0]) == [[r, 1, 1, 0, 1] for r in (3, 2, 1, 0)]


def megatron_dp_groups(world: int, tp: int, pp: int):
    """Megatron 285068c's DP groups: within each pipeline stage, ranks j, j+tp, j+2tp, ..."""
    stage = world // pp
    return [list(range(s * stage + j, (s + 1) * stage, tp)) for s in range(pp) for j in range(tp)]


@pytest.mark.parametrize("world,tp,pp", [(64, 1, 1), (1024, 8, 1), (16384, 8, 16),
                                         (100000, 8, 25), (65536, 4, 8)])
def test_real_layouts_are_a_few_blocks(world, tp, pp):
    groups = megatron_dp_groups(world, tp, pp)
    assert all(len(R.encode(g)) == 1 for g in groups)  # what each rank registers
    layout = Layout.build(groups, len(groups[0]) // 2)
    states = {r: RankState(True, 7, False) for r in range(world)}
    savers = savers_for(layout, states, 7)
    assert len(R.encode(savers)) <= pp
    # one dead saver per stage: its partner (half a group further) takes its place
    for s in range(pp):
        states[s * (world // pp)] = RankState(False, None, False, "dead")
    savers = savers_for(layout, states, 7)
    assert R.decode(R.encode(savers)) == savers
    assert len(R.encode(savers)) <= 6 * pp


def test_consecutive_groups_are_one_periodic_block():
    savers = [r for r in range(4096) if r % 8 < 4]  # DP groups of 8 consecutive ranks
    assert R.encode(savers) == [[0, 1, 4, 8, 512]]


@pytest.mark.parametrize("blocks", [
    [[0, 1, 0, 0, 1]],  # empty run
    [[0, 1, 1, 0, 0]],  # no repeat
    [[-1, 1, 1, 0, 1]],  # negative rank
    [[5, -1, 7, 0, 1]],  # runs below zero
    [[3, -1, 4, 0, 1]],  # inverted: [3, 2, 1, 0] (issue 24)
    [[0, 0, 2, 0, 1]],  # a repeat within a run
    [[4, 1, 2, -4, 2]],  # periods going back: [4, 5, 0, 1]
    [[0, 1, 2, 1, 2]],  # periods overlapping: [0, 1, 1, 2]
    [[0, 1, R.MAX_RANKS + 1, 0, 1]],  # too many
    [[0, 1, 1000, 1, 1000]],  # too many through the repeat
    [[R.MAX_RANKS - 1, 1, 2, 0, 1]],  # past the largest rank
    [[0, 1, 1, 0]],  # short block
    [[0, 1, True, 0, 1]],  # bool is not an int
    [[0.0, 1, 1, 0, 1]],
    "0-3",
])
def test_invalid_encodings_are_refused_before_expanding(blocks):
    assert not R.valid_wire(blocks)
    with pytest.raises(ValueError, match="not a rank list encoding"):
        R.decode(blocks)
