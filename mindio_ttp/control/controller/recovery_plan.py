"""Recover in memory, or save the dying checkpoint: one pure function of what the flow knows.

No clock, no I/O: the controller passes the ranks' phase-2 states, who is lost, where each rank
runs and whether this job can recover at all, and gets back a plan or the reason there is none
(said in the flow's log line, so a user learns which rule sent the job to the checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Set, Tuple

from mindio_ttp.config import RECOVERY_MODES
from mindio_ttp.control.controller.selection import Layout, RankState

IN_MEMORY, DYING_CHECKPOINT = RECOVERY_MODES


@dataclass(frozen=True)
class RecoveryPlan:
    step: int  # every survivor is clean here; the replacements are refilled to it
    lost: Tuple[int, ...]  # ranks replaced
    partners: Dict[int, int]  # lost rank -> the survivor that holds both its stripes
    relays: Dict[int, int]  # lost rank -> the survivor on its host that asks for the replacement
    survivors: Tuple[int, ...]
    groups: Dict[int, Tuple[int, ...]]  # lost rank -> its DP group (a replacement registers it)


def plan_recovery(*, mode: str, capable: Tuple[bool, str], preempted: bool, world_size: int,
                  layout: Layout, states: Mapping[int, RankState], lost: Set[int],
                  hosts: Mapping[int, str], node_takeover: bool = False,
                  claimed: bool = False) -> Tuple[Optional[RecoveryPlan], str]:
    """The recovery to run, or None and why not (see docs/recovery.md, "Who decides").
    `node_takeover`: the launchers can hand a lost node's ranks to a spare node
    (launch/takeover.py), so a lost rank with no survivor on its host is relayed by a survivor
    elsewhere. `claimed`: this controller won the fault's claim, so exactly half the ranks
    may recover (the other half of a split job cannot win it too)."""
    if mode != IN_MEMORY:
        return None, f"TTP_RECOVERY={mode}"
    ok, why = capable
    if not ok:
        return None, f"in-memory recovery is not available: {why}"
    if preempted:
        return None, "the job is being preempted (SIGTERM): saving, not recovering"
    if not lost:
        return None, "no rank is lost (a stall or a preemption): nothing to replace"
    survivors = tuple(r for r in range(world_size) if r not in lost)
    if 2 * len(survivors) < world_size or (2 * len(survivors) == world_size and not claimed):
        return None, (f"only {len(survivors)} of {world_size} ranks survive: in-memory recovery "
                      "needs a strict majority, or exactly half and the fault's claim (two "
                      "halves of a split job must not both go on)")
    steps: Dict[int, Set[int]] = {}
    for r in survivors:
        st = states.get(r)
        clean = st.clean_at() if st is not None else None
        if clean is None:
            what = "no answer" if st is None else (st.note or ("updating" if st.updating else
                                                                f"at step {st.step}"))
            return None, f"survivor rank {r} is not clean at any step ({what})"
        steps.setdefault(clean, set()).add(r)
    if len(steps) != 1:
        spread = "; ".join(f"step {s}: ranks {sorted(rs)[:8]}" for s, rs in sorted(steps.items()))
        return None, f"survivors stopped at different steps ({spread}): no step for all of them"
    step = next(iter(steps))
    partners, relays, groups = {}, {}, {}
    for r in sorted(lost):
        group = next((g for g in layout.groups if r in g), None)
        holders = _shard_holders(layout, r)
        if group is None or holders is None:
            return None, f"lost rank {r} is in no DP group this controller knows"
        groups[r] = tuple(group)
        alive = [h for h in holders if h != r and h not in lost]
        if not alive:
            return None, (f"every holder of lost rank {r}'s optimizer shard is lost "
                          f"({sorted(holders)}): nothing to refill it from")
        partners[r] = alive[0]
        host = hosts.get(r)
        if host is None:
            return None, f"the host of lost rank {r} is unknown: no launcher to ask"
        on_host = [s for s in survivors if hosts.get(s) == host]
        if not on_host and not node_takeover:
            return None, (f"no rank survives on lost rank {r}'s host {host} (a lost node): no "
                          "launcher there to start its replacement, and no spare node can "
                          "take it over (ttprun with c10d rendezvous can)")
        relays[r] = min(on_host or survivors)
    return (RecoveryPlan(step, tuple(sorted(lost)), partners, relays, survivors, groups),
            f"every survivor is clean at step {step}; lost {sorted(lost)} refilled from "
            f"{[partners[r] for r in sorted(lost)]}")


def _shard_holders(layout: Layout, rank: int) -> Optional[Sequence[int]]:
    for group in layout.groups:
        if rank in group:
            for holders in layout.shards(group):
                if rank in holders:
                    return holders
    return None
