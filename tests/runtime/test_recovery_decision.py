"""Recover in memory or save the dying checkpoint (control/controller/recovery_plan.py): every
rule, each with
the reason the flow logs."""

from __future__ import annotations

from typing import Dict, Optional, Set

import pytest

from mindio_ttp.control.controller.recovery_plan import plan_recovery
from mindio_ttp.control.controller.selection import Layout, RankState

DP4 = Layout.build([[0, 1, 2, 3]], 2)  # shard 0: ranks 0, 2; shard 1: ranks 1, 3
TP2_DP2 = Layout.build([[0, 2], [1, 3]], 1)
HOSTS = {r: "10.0.0.1" for r in range(4)}


def states(clean: Dict[int, int], lost: Set[int]) -> Dict[int, RankState]:
    out = {r: RankState(True, s, False) for r, s in clean.items()}
    out.update({r: RankState(False, None, False, "dead") for r in lost})
    return out


def plan(lost: Set[int], clean: Optional[Dict[int, int]] = None, *, layout: Layout = DP4,
         mode: str = "in-memory", capable=(True, ""), preempted: bool = False,
         hosts: Optional[Dict[int, str]] = None, world_size: int = 4,
         node_takeover: bool = False, claimed: bool = False):
    clean = {r: 4 for r in range(world_size) if r not in lost} if clean is None else clean
    return plan_recovery(mode=mode, capable=capable, preempted=preempted,
                         world_size=world_size, layout=layout, states=states(clean, lost),
                         lost=lost, hosts=HOSTS if hosts is None else hosts,
                         node_takeover=node_takeover, claimed=claimed)


def test_one_lost_rank_is_refilled_from_its_partner_relayed_on_its_host():
    p, why = plan({1})
    assert p is not None, why
    assert (p.step, p.lost, p.partners, p.relays, p.survivors) == (4, (1,), {1: 3}, {1: 0},
                                                                    (0, 2, 3))
    assert "clean at step 4" in why


def test_two_lost_ranks_of_different_shards_are_both_refilled():
    p, why = plan({1, 2}, world_size=4, clean={0: 4, 3: 4})
    assert p is None and "strict majority" in why  # 2 of 4 is not a majority
    p, why = plan({1, 2}, world_size=8, layout=Layout.build([[0, 1, 2, 3], [4, 5, 6, 7]], 2))
    assert p is not None and p.partners == {1: 3, 2: 0}, why


def test_tp2_dp2_partner_is_the_other_data_parallel_rank():
    p, why = plan({3}, layout=TP2_DP2)
    assert p is not None and p.partners == {3: 1}, why


@pytest.mark.parametrize("kwargs, reason", [
    (dict(mode="dying-checkpoint"), "TTP_RECOVERY=dying-checkpoint"),
    (dict(capable=(False, "Megatron runs without --load")), "without --load"),
    (dict(preempted=True), "preempted"),
])
def test_refused_by_configuration(kwargs, reason):
    p, why = plan({1}, **kwargs)
    assert p is None and reason in why


def test_nothing_lost_is_nothing_to_replace():
    p, why = plan(set())
    assert p is None and "nothing to replace" in why


def test_both_holders_of_a_shard_lost_is_refused():
    p, why = plan({1, 3}, world_size=4, clean={0: 4, 2: 4})
    assert p is None  # also no majority; on 8 ranks the holders rule speaks
    layout = Layout.build([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    p, why = plan({1, 3}, layout=layout, world_size=8)
    assert p is None and "every holder of lost rank 1's optimizer shard is lost" in why


def test_survivors_at_different_steps_or_updating_are_refused():
    p, why = plan({1}, clean={0: 4, 2: 5, 3: 4})
    assert p is None and "different steps" in why
    st = states({0: 4, 3: 4}, {1})
    st[2] = RankState(True, 4, True)
    p, why = plan_recovery(mode="in-memory", capable=(True, ""), preempted=False, world_size=4,
                           layout=DP4, states=st, lost={1}, hosts=HOSTS)
    assert p is None and "survivor rank 2 is not clean" in why


def test_no_step_finished_yet_is_refused():
    p, why = plan({1}, clean={0: 0, 2: 0, 3: 0})
    assert p is None and "not clean" in why


def test_a_lost_node_has_no_relay():
    hosts = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.1", 3: "10.0.0.1"}
    p, why = plan({1}, hosts=hosts)
    assert p is None and "no rank survives on lost rank 1's host 10.0.0.2" in why
    p, why = plan({1}, hosts={0: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.1"})
    assert p is None and "host of lost rank 1 is unknown" in why


def test_the_relay_is_the_lowest_survivor_on_the_lost_ranks_host():
    hosts = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.1", 3: "10.0.0.2"}
    p, why = plan({1}, hosts=hosts)
    assert p is not None and p.relays == {1: 3}, why


TWO_NODES = {0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"}


def test_a_lost_node_is_relayed_by_a_survivor_elsewhere_when_a_spare_node_can_take_it_over():
    """Node 10.0.0.2 (ranks 2, 3) lost: no launcher there. With node takeover (ttprun, c10d)
    a survivor on another host relays; exactly half survive, so only with the fault's claim."""
    p, why = plan({2, 3}, hosts=TWO_NODES)
    assert p is None and "strict majority, or exactly half and the fault's claim" in why
    p, why = plan({2, 3}, hosts=TWO_NODES, claimed=True)
    assert p is None and "no spare node can take it over" in why
    p, why = plan({2, 3}, hosts=TWO_NODES, claimed=True, node_takeover=True)
    assert p is not None, why
    assert (p.lost, p.partners, p.relays) == ((2, 3), {2: 0, 3: 1}, {2: 0, 3: 0})


def test_less_than_half_never_recovers_even_with_the_claim():
    p, why = plan({1, 2, 3}, hosts=TWO_NODES, claimed=True, node_takeover=True)
    assert p is None and "only 1 of 4 ranks survive" in why
